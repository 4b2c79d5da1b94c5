"""Latency of one source tree's daemon and client, for `bench/control_plane.py --against TREE`.

    PYTHONPATH=TREE python bench/latency_probe.py [--device cpu|cuda]

Imports `kvstore` and `kvstore_client` from whatever PYTHONPATH names (it never adds its own
repository to the path; `Probe` points it at one tree's packages) and uses only the public
client API, which every version has: `connect`, `store`, `keys`, `lookup`, `load`. It starts
that tree's kvstored on a temporary socket, stores two prompts, prints "ready", then answers
commands on stdin, one a line: `SERIES N` times N calls of a series and prints their times
(µs) as a JSON list; `quit` checks the loads' bytes and exits. The series:

- `lookup_512`: `lookup` of 512 stored chunk keys (8 KiB pages of a one-layer spec; the keys
  passed in, so no hashing is timed);
- `load_4`: `load` of 4 chunks (16 MiB) into the KV cache;
- `store_present_4`: `store` of 4 chunks that are already stored (a Reserve that finds them
  all: the round trip alone).

`compare_trees` runs one such process per tree side by side and alternates batches of calls
between them (the order swapped every batch), so a noisy moment of the machine falls on both
alike; it compares each series' p50 and p99 over all calls.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import torch
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore_client import KVSpec, KVStoreClient

CHUNK_TOKENS = 256
LOOKUP_CHUNKS = 512
LOAD_CHUNKS = 4


# kvstored's entry point in the tree on PYTHONPATH: kvstore.daemon in a tree from before the
# layer folders.
DAEMON_MAIN = (
    "import sys\ntry:\n    from kvstore.server.daemon import main\n"
    "except ModuleNotFoundError:\n    from kvstore.daemon import main\nsys.exit(main())\n"
)


def start_daemon(run_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    socket_path = run_dir / "kvstored.sock"
    config = {
        "log_level": "warning",
        "chunk_tokens": CHUNK_TOKENS,
        "server": {"unix_socket": str(socket_path)},
        "tiers": {"cpu": {"bytes": "512MiB", "slab_bytes": "64MiB"}},
    }
    (run_dir / "kvstored.yaml").write_text(yaml.safe_dump(config))
    daemon = subprocess.Popen(
        [sys.executable, "-c", DAEMON_MAIN, "--config", str(run_dir / "kvstored.yaml")],
        stderr=subprocess.DEVNULL,
    )
    address = f"unix://{socket_path}"
    deadline = time.monotonic() + 60
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return daemon, address
            except grpc.RpcError:
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("kvstored did not start") from None
                time.sleep(0.05)


def timed(calls: int, warmup: int, call: object) -> list[float]:
    assert callable(call)
    for _ in range(warmup):
        call()
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        out.append((time.perf_counter() - start) * 1e6)
    return out


SERIES = ("lookup_512", "load_4", "store_present_4")
MAX_RATIO = 1.05  # this tree's p50 and p99 against the other's


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Probe:
    """A probe process running `tree`'s daemon and client."""

    def __init__(self, tree: Path, work_dir: Path) -> None:
        names = work_dir / "path"  # the tree's packages under their import names, ahead of any other
        names.mkdir(parents=True)
        for name, folder in (
            ("kvstore", "kvstore"),
            ("kvstore_client", "client"),  # an older tree's folder, where the tree has no kvstore_client/
            ("kvstore_kernels", "kernels"),
        ):
            folder = name if (tree / name).is_dir() else folder
            (names / name).symlink_to(tree.resolve() / folder, target_is_directory=True)
        path = os.pathsep.join(filter(None, [str(names), os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            env={**os.environ, "PYTHONPATH": path},
            cwd=work_dir,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self._line() != "ready":
            raise RuntimeError(f"the probe of {tree} did not start")

    def _line(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def run(self, series: str, calls: int) -> list[float]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{series} {calls}\n")
        self.process.stdin.flush()
        times: list[float] = json.loads(self._line())
        return times

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("quit\n")
        self.process.stdin.flush()
        verdict = self._line()
        self.process.wait(60)
        if verdict != "bytes ok":
            raise RuntimeError(f"the probe's loads: {verdict}")


def compare_trees(this: Path, other: Path, rounds: int, calls: int, batch: int = 100) -> dict[str, Any]:
    """p50 and p99 (us) of each series for both trees over `calls` calls each, made in batches
    alternating between the trees; `ratio`: this tree's over the other's."""
    trees = {"this": this, "against": other}
    pooled: dict[str, dict[str, list[float]]] = {name: {s: [] for s in SERIES} for name in trees}
    per_round: dict[str, dict[str, list[dict[str, float]]]] = {
        name: {s: [] for s in SERIES} for name in trees
    }
    for r in range(rounds):  # each round: fresh processes for both trees
        with tempfile.TemporaryDirectory(prefix="kvstore-probe-") as work:
            probes = {name: Probe(tree, Path(work) / name) for name, tree in trees.items()}
            try:
                for series in SERIES:
                    for name in probes:
                        probes[name].run(series, 50)  # warm-up
                    got: dict[str, list[float]] = {name: [] for name in trees}
                    for b in range(max(1, calls // batch)):
                        for name in ("this", "against") if (b + r) % 2 == 0 else ("against", "this"):
                            got[name] += probes[name].run(series, batch)
                    for name, values in got.items():
                        pooled[name][series] += values
                        per_round[name][series].append(
                            {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99)}
                        )
            finally:
                for probe in probes.values():
                    probe.close()
    summary: dict[str, Any] = {
        "rounds": rounds,
        "calls": calls,
        "batch": batch,
        "trees": {k: str(v) for k, v in trees.items()},
    }
    for series in SERIES:
        row: dict[str, Any] = {}
        for q, at in (("p50", 0.5), ("p99", 0.99)):
            quantile = {name: percentile(pooled[name][series], at) for name in trees}
            by_round = {name: statistics.median(x[q] for x in per_round[name][series]) for name in trees}
            row[q] = {
                **quantile,
                "ratio": quantile["this"] / quantile["against"],
                "round_medians": by_round,
                "round_median_ratio": by_round["this"] / by_round["against"],
            }
        row["per_round"] = {name: per_round[name][series] for name in trees}
        summary[series] = row
    summary["holds"] = all(
        summary[series][q]["ratio"] <= MAX_RATIO
        for series in ("lookup_512", "load_4")
        for q in ("p50", "p99")
    )
    return summary


def probe_spec(model: str, layers: int, kv_heads: int, head_dim: int) -> KVSpec:
    return KVSpec(
        model=model,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        block_size=16,
        layout="flash_attn",
        chunk_tokens=CHUNK_TOKENS,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    spec = probe_spec("bench/latency-probe", 4, 8, 128)  # 4 MiB pages
    blocks_per_chunk = CHUNK_TOKENS // 16
    num_blocks = LOAD_CHUNKS * blocks_per_chunk
    gen = torch.Generator().manual_seed(0)
    source = [
        torch.randn(2, num_blocks, 16, 8, 128, generator=gen).to(torch.bfloat16).to(device) for _ in range(4)
    ]
    target = [torch.empty_like(t) for t in source]
    block_ids = torch.arange(num_blocks)
    load_tokens = list(range(LOAD_CHUNKS * CHUNK_TOKENS))
    lookup_tokens = list(range(10**6, 10**6 + LOOKUP_CHUNKS * CHUNK_TOKENS))
    with tempfile.TemporaryDirectory(prefix="kvstore-probe-") as run:
        daemon, address = start_daemon(Path(run))
        try:
            with (
                KVStoreClient.connect(address, spec) as client,
                KVStoreClient.connect(address, probe_spec("bench/latency-probe-lookup", 1, 1, 8)) as indexer,
            ):
                if client.store(load_tokens, source, block_ids) != LOAD_CHUNKS:
                    raise RuntimeError("the probe's prompt was not stored")
                tiny = [torch.zeros(2, LOOKUP_CHUNKS * blocks_per_chunk, 16, 1, 8, dtype=torch.bfloat16)]
                tiny_blocks = torch.arange(LOOKUP_CHUNKS * blocks_per_chunk)
                if indexer.store(lookup_tokens, tiny, tiny_blocks) != LOOKUP_CHUNKS:
                    raise RuntimeError("the probe's lookup prompt was not stored")
                lookup_keys = indexer.keys(lookup_tokens)
                if indexer.lookup(lookup_tokens, keys=lookup_keys) != len(lookup_tokens):
                    raise RuntimeError("the probe's Lookup does not hit every key")
                load_keys = client.keys(load_tokens)
                calls = {
                    "lookup_512": lambda: indexer.lookup(lookup_tokens, keys=lookup_keys),
                    "load_4": lambda: client.load(load_tokens, target, block_ids, keys=load_keys),
                    "store_present_4": lambda: client.store(load_tokens, source, block_ids, keys=load_keys),
                }
                timed_calls = dict.fromkeys(calls, 0)
                print("ready", flush=True)
                for line in sys.stdin:
                    command = line.split()
                    if command[0] == "quit":
                        break
                    timed_calls[command[0]] += int(command[1])
                    print(json.dumps(timed(int(command[1]), 0, calls[command[0]])), flush=True)
                loaded = bool(timed_calls["load_4"])
                same = not loaded or all(torch.equal(a, b) for a, b in zip(source, target, strict=True))
                print("bytes ok" if same else "a timed load brought back other bytes", flush=True)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(30)
    os._exit(0)  # skip interpreter teardown of CUDA state


if __name__ == "__main__":
    main()
