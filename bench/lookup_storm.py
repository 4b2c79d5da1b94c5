"""Lookups from many processes at once: one daemon's throughput and latency under a closed loop.

    python bench/lookup_storm.py --processes 16 --seconds 5              # this tree
    python bench/lookup_storm.py --processes 16 --against TREE           # and TREE's, in turns

Starts a tree's kvstored (`latency_probe.start_daemon`: default configuration, a temporary
socket), stores `--keys` chunks of a tiny one-layer spec through the client, then starts
`--processes` worker processes of the same tree. Each connects (`KVStoreClient`, the local
channel unless `--grpc`), waits for a common start time, and calls `lookup_chunks` of those keys
back to back for `--seconds`, every call checked to hit all of them; it prints its call times.
The figures: calls per second over all workers (calls that started in the window), and the p50,
p99 and max of every call. `--against TREE` runs TREE's daemon and workers the same way, the
trees taking turns for `--rounds` rounds. A worker imports `kvstore` and `kvstore_client` from
PYTHONPATH, which `Tree` points at one tree's packages (as `latency_probe.Probe` does).

    PYTHONPATH=<names> python bench/lookup_storm.py --worker ADDRESS KEYS_HEX START SECONDS GRPC
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORKER_START_S = 60.0  # time given to the workers to import torch and connect


def worker(address: str, keys_hex: str, seconds: float, grpc_only: bool) -> None:
    from kvstore_client import KVStoreClient

    keys = [bytes.fromhex(key) for key in keys_hex.split(",")]
    with KVStoreClient.connect(address, storm_spec(), local_channel=not grpc_only) as client:
        if not grpc_only and client._local is None:
            raise RuntimeError("the worker did not open the daemon's local channel")
        if client.lookup_chunks(keys) != len(keys):
            raise RuntimeError("the stored keys did not all hit")
        print("ready", flush=True)
        start = float(sys.stdin.readline())  # the same moment for every worker
        while time.time() < start:
            time.sleep(min(0.01, max(0.0, start - time.time())))
        lookup = client.lookup_chunks
        end = time.perf_counter() + seconds
        times: list[float] = []
        misses = 0
        now = time.perf_counter()
        while now < end:
            hit = lookup(keys)
            after = time.perf_counter()
            times.append(after - now)
            misses += hit != len(keys)
            now = after
    print(json.dumps({"times_us": [round(t * 1e6, 1) for t in times], "misses": misses}))


def storm_spec() -> Any:
    import torch

    from kvstore_client import KVSpec

    return KVSpec(
        model="bench/storm",
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        dtype=torch.bfloat16,
        block_size=16,
        layout="flash_attn",
        chunk_tokens=256,
    )


class Tree:
    """One tree's packages under their import names, in a folder of their own."""

    def __init__(self, tree: Path, work_dir: Path) -> None:
        self.tree = tree
        self.names = work_dir / "path"
        self.names.mkdir(parents=True)
        for name, folder in (
            ("kvstore", "kvstore"),
            ("kvstore_client", "client"),  # an older tree's folder, where the tree has no kvstore_client/
            ("kvstore_kernels", "kernels"),
        ):
            folder = name if (tree / name).is_dir() else folder
            (self.names / name).symlink_to(tree.resolve() / folder, target_is_directory=True)
        path = os.pathsep.join(filter(None, [str(self.names), os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, "PYTHONPATH": path}  # the tree's packages ahead of any other

    def run(
        self, args: list[str], cwd: Path, script: Path | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """`script` (this module by default) run with the tree's packages (and `env` added)."""
        return subprocess.Popen(
            [sys.executable, str(script or Path(__file__).resolve()), *args],
            env={**self.env, **(env or {})},
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )


def storm(
    tree: Path,
    work_dir: Path,
    processes: int,
    seconds: float,
    num_keys: int,
    grpc_only: bool,
    spin_us: float | None = None,
) -> dict[str, Any]:
    """One round: the tree's daemon, `processes` workers for `seconds` (each spinning up to
    `spin_us` for a reply: `$KVSTORE_LOCAL_SPIN_US`; None: the environment's)."""
    work_dir.mkdir(parents=True)
    names = Tree(tree, work_dir)
    setup = names.run(["--setup", str(work_dir), str(num_keys)], work_dir)
    assert setup.stdout is not None
    ready = json.loads(setup.stdout.readline())
    try:
        args = ["--worker", ready["address"], ready["keys"], repr(seconds), str(int(grpc_only))]
        spin = {} if spin_us is None else {"KVSTORE_LOCAL_SPIN_US": repr(spin_us)}
        workers = [names.run(args, work_dir, env=spin) for _ in range(processes)]
        for w in workers:  # each has imported its client and connected
            assert w.stdout is not None and w.stdin is not None
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a worker of {tree} did not start")
        start = time.time() + 0.2
        for w in workers:  # the same moment for every worker
            assert w.stdin is not None
            w.stdin.write(f"{start!r}\n")
            w.stdin.flush()
        while time.time() < start:
            time.sleep(0.005)
        user_before, system_before = _cpu_seconds(ready["pid"])
        time.sleep(seconds)
        user_after, system_after = _cpu_seconds(ready["pid"])
        user_s, system_s = user_after - user_before, system_after - system_before
        daemon_cpu_s = user_s + system_s
        outputs = [json.loads(w.communicate(timeout=WORKER_START_S + seconds + 60)[0]) for w in workers]
        if any(w.returncode for w in workers):
            raise RuntimeError(f"a worker of {tree} failed")
    finally:
        setup.terminate()
        setup.wait(60)
    times = sorted(t for out in outputs for t in out["times_us"])
    misses = sum(out["misses"] for out in outputs)
    if misses:
        raise RuntimeError(f"{misses} Lookups of {tree} missed stored keys")
    return {
        "processes": processes,
        "seconds": seconds,
        "keys": num_keys,
        "transport": "grpc" if grpc_only else "local",
        "spin_us": spin_us,
        "calls": len(times),
        "calls_per_s": len(times) / seconds,
        "p50_us": _percentile(times, 0.50),
        "p99_us": _percentile(times, 0.99),
        "max_us": times[-1],
        "daemon_cpu_us_per_call": daemon_cpu_s / max(1, len(times)) * 1e6,
        # Of which in the daemon's own code (user) and in the kernel (system: its socket reads and
        # writes, the wake-ups of the workers, epoll).
        "daemon_user_us_per_call": user_s / max(1, len(times)) * 1e6,
        "daemon_system_us_per_call": system_s / max(1, len(times)) * 1e6,
        "daemon_cpu_share": daemon_cpu_s / seconds,
        "per_worker_calls": [len(out["times_us"]) for out in outputs],
    }


def setup(work_dir: Path, num_keys: int) -> None:
    """Runs the tree's daemon with `num_keys` stored chunks until terminated; prints its address
    and the keys (hex) first."""
    import signal

    import torch

    from kvstore_client import KVStoreClient

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, not the repository: PYTHONPATH's tree
    from latency_probe import start_daemon

    daemon, address = start_daemon(work_dir)
    # The SIGTERM that ends the round stops the daemon too (the finally below). Waited for with
    # sigwait and not blocked, it took its default action: the process died and its daemon ran on.
    signal.signal(signal.SIGTERM, _exit)
    try:
        spec = storm_spec()
        tokens = torch.randint(0, 128_000, (num_keys * 256,), generator=torch.Generator().manual_seed(5))
        blocks = len(tokens) // 16
        caches = [torch.zeros((2, blocks, 16, 1, 8), dtype=torch.bfloat16)]
        with KVStoreClient.connect(address, spec) as client:
            if client.store(tokens, caches, torch.arange(blocks)) != num_keys:
                raise RuntimeError("the setup did not store every chunk")
            keys = ",".join(key.hex() for key in client.keys(tokens))
        print(json.dumps({"address": address, "keys": keys, "pid": daemon.pid}), flush=True)
        while True:
            signal.pause()
    finally:
        daemon.terminate()
        daemon.wait(60)


def _exit(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _cpu_seconds(pid: int) -> tuple[float, float]:
    """The process's CPU time so far: (user, system) seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick  # utime, stime


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def compare(
    this: Path,
    other: Path | None,
    processes: int,
    seconds: float,
    num_keys: int,
    rounds: int,
    grpc_only: bool,
    spins: list[float] | None = None,
) -> dict[str, Any]:
    """Each tree (and with `spins`, this tree at each spin) in turns, `rounds` times."""
    variants: dict[str, tuple[Path, float | None]] = {"this": (this, None)}
    if spins:
        variants = {f"this spin {spin:g} us": (this, spin) for spin in spins}
    if other is not None:
        variants["baseline"] = (other, None)
    trees = {name: tree for name, (tree, _) in variants.items()}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="kvstore-storm-") as tmp:
        for round_ in range(rounds):
            order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
            for name in order:
                tree, spin = variants[name]
                folder = Path(tmp) / f"{name.replace(' ', '-')}-{round_}"
                result = storm(tree, folder, processes, seconds, num_keys, grpc_only, spin)
                runs[name].append(result)
                figures = (
                    f"{result['calls_per_s']:,.0f} Lookups/s, p50 {result['p50_us']:.0f} µs, "
                    f"p99 {result['p99_us']:.0f} µs, max {result['max_us']:.0f} µs, daemon "
                    f"{result['daemon_cpu_us_per_call']:.1f} CPU µs/call "
                    f"({result['daemon_user_us_per_call']:.1f} user, "
                    f"{result['daemon_system_us_per_call']:.1f} system; "
                    f"{result['daemon_cpu_share']:.2f} of a core)"
                )
                print(
                    f"round {round_} {name}: {figures}",
                    flush=True,
                )
    return {"trees": {name: str(path) for name, path in trees.items()}, "runs": runs}


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        address, keys, seconds, grpc_only = sys.argv[2:6]
        worker(address, keys, float(seconds), bool(int(grpc_only)))
        return
    if sys.argv[1:2] == ["--setup"]:
        setup(Path(sys.argv[2]), int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--grpc", action="store_true", help="the workers call over gRPC, not the local channel"
    )
    parser.add_argument(
        "--against", type=Path, help="another kvstore source tree, run in turns with this one"
    )
    parser.add_argument(
        "--spin-us",
        type=float,
        nargs="+",
        help="this tree once per value, its workers spinning that long for a reply, in turns",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    results = compare(
        Path(__file__).resolve().parents[1],
        args.against,
        args.processes,
        args.seconds,
        args.keys,
        args.rounds,
        args.grpc,
        args.spin_us,
    )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
