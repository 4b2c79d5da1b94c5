"""Daemon start, worker connect and the first transfers against the CPU tier's size (issue 20).

For each arena size (GiB): a kvstored is started (timed from launch to health SERVING, and until
its arena's memory is all reserved, which it does in the background); then one fresh worker
(`bench/connect_worker.py`: CUDA initialised before the clock, an 8B-geometry KV cache) times
`KVStoreClient.connect`, its first 8k-token store and load (and how long they waited for their
slabs to be registered, or whether they went unpinned), the time until every slab is registered,
a store and load of another prompt after that (the steady state), and a second connect in the same
process; then `--workers` fresh workers connect at once, each loading the first worker's prompt
(its first transfer) and storing one of its own. Every load is checked byte for byte.

    python bench/connect.py --sizes 8 32 64 100      # GiB, on the GPU machine
    python bench/connect.py --sizes 1 --workers 2 --tokens 512    # a smoke run anywhere

`--parts fill` (issue 31's warm-up): for each size, a kvstored whose arena is all reserved (a
system service started long before), then a fresh worker that stores prompts back to back from
connect on until the arena is full (`--fill` in `connect_worker.py`): the fill's time against
as many stores at the steady rate (`lost`: the share of the fill lost to slabs), then every
prompt loaded and compared byte for byte; then another fresh worker that connects, pauses
`--pause` seconds (an engine loading its weights) and fills the arena again: each of its stores'
rate over the steady rate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

from bench.common import print_table, running_daemon, write_results  # noqa: E402
from kvstore.hugepages import hugetlbfs_free_bytes, hugetlbfs_page_bytes  # noqa: E402
from kvstore.proto import kvstore_pb2 as pb  # noqa: E402
from tests.harness import Daemon, python_env  # noqa: E402

WORKER = Path(__file__).with_name("connect_worker.py")


def workers(address: str, arguments: list[list[str]]) -> list[dict[str, Any]]:
    """Fresh worker processes started at once, one per argument list; each one's figures."""
    started = [
        subprocess.Popen(
            [sys.executable, str(WORKER), address, *extra],
            stdout=subprocess.PIPE,
            text=True,
            env=python_env(),
        )
        for extra in arguments
    ]
    results = []
    for process in started:
        out, _ = process.communicate(timeout=900)
        if process.returncode != 0:
            for other in started:
                other.kill()
            raise RuntimeError(f"a worker failed (exit {process.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


class ReserveWatch:
    """Polls the daemon's stats from a thread until its arena is all reserved; `seconds` after
    `since` (None: not yet)."""

    def __init__(self, daemon: Daemon, since: float) -> None:
        self.seconds: float | None = None
        self._stub, self._since = daemon.stub(), since
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            reply = self._stub.Stats(pb.StatsRequest())
            capacity = next(t.bytes_capacity for t in reply.tiers if t.name == "cpu")
            if reply.counters["arena_reserved_bytes"] >= capacity:
                self.seconds = time.perf_counter() - self._since
                return
            time.sleep(0.05)

    def wait(self, timeout_s: float) -> float | None:
        self._thread.join(timeout_s)
        self._stop.set()
        return self.seconds


def measure(size_gib: int, count: int, shm_dir: str, tokens: int) -> dict[str, Any]:
    config = {
        "log_level": "warning",
        "tiers": {"cpu": {"bytes": f"{size_gib}GiB", "slab_bytes": "256MiB", "shm_dir": shm_dir}},
    }
    common = ["--tokens", str(tokens)]
    started = time.perf_counter()
    with running_daemon(config) as daemon:
        start_s = time.perf_counter() - started
        watch = ReserveWatch(daemon, started)
        one = workers(daemon.address, [[*common, "--seed", "0", "--steady", "--second-connect"]])[0]
        many = workers(
            daemon.address, [[*common, "--seed", str(i + 1), "--load-first", "0"] for i in range(count)]
        )
        reserved_s = watch.wait(600)
    return {"gib": size_gib, "daemon_start_s": start_s, "reserved_s": reserved_s, "one": one, "many": many}


def measure_fill(size_gib: int, shm_dir: str, tokens: int, pause_s: float) -> dict[str, Any]:
    config = {
        "log_level": "warning",
        "tiers": {"cpu": {"bytes": f"{size_gib}GiB", "slab_bytes": "256MiB", "shm_dir": shm_dir}},
    }
    prompts = (size_gib << 30) // (tokens * 128 * 1024)  # 8B geometry: 128 KiB a token
    common = ["--tokens", str(tokens), "--fill", str(prompts)]
    started = time.perf_counter()
    with running_daemon(config) as daemon:
        reserved_s = ReserveWatch(daemon, started).wait(600)
        at_once = workers(daemon.address, [[*common, "--seed", "0"]])[0]
        paused = workers(daemon.address, [[*common, "--seed", "1", "--pause", str(pause_s)]])[0]
    return {"gib": size_gib, "prompts": prompts, "reserved_s": reserved_s, "fill": at_once, "paused": paused}


def fill_summary(run: dict[str, Any]) -> dict[str, Any]:
    """The figures issue 31 asks for, from one worker's `--fill` run."""
    steady_s = sorted(store["s"] for store in run["steady_stores"])[len(run["steady_stores"]) // 2]
    stores = run["stores"]
    ideal_s = steady_s * len(stores)
    ratios = [steady_s / store["s"] for store in stores]
    return {
        "steady_store_s": steady_s,
        "fill_s": run["fill_s"],
        "lost_s": run["fill_s"] - ideal_s,
        "lost_fraction": (run["fill_s"] - ideal_s) / run["fill_s"],
        "waited_s": sum(store["waited_s"] for store in stores),
        "first_store_s": stores[0]["s"],
        "gap_s": run.get("gap_s"),  # connect to the first store
        "min_rate_ratio": min(ratios),
        "stores_below_0.8": sum(r < 0.8 for r in ratios),
        "unpinned": sum(store["unpinned"] for store in stores),
        "register_all_s": run["register_all_s"],
        "faulted_at_start": run["at_start"].get("slabs_faulted"),
        "registered_at_start": run["at_start"].get("slabs_registered"),
        "bytes_exact": run["bytes_exact"],
        "second_shares": run.get("second_shares_mapping"),
        "second_failed_slabs": run.get("second_stats", {}).get("slabs_failed"),
    }


def fill_rows(results: list[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for r in results:
        one, after = fill_summary(r["fill"]), fill_summary(r["paused"])
        rows.append(
            [
                r["gib"],
                r["prompts"],
                f"{one['steady_store_s'] * 1e3:.1f}",
                f"{one['fill_s']:.2f}",
                f"{one['lost_s']:.2f} ({100 * one['lost_fraction']:.0f}%)",
                f"{one['waited_s']:.2f}",
                f"{one['first_store_s']:.3f}",
                f"{after['min_rate_ratio']:.2f} ({after['stores_below_0.8']} below 0.8)",
                f"{after['registered_at_start']}",
                f"{one['unpinned']} / {after['unpinned']}",
                f"{one['second_shares']} ({one['second_failed_slabs']} failed)",
                "yes" if one["bytes_exact"] and after["bytes_exact"] else "NO",
            ]
        )
    return rows


def main_fill(args: argparse.Namespace, free: int) -> None:
    results: list[dict[str, Any]] = []
    payload: dict[str, Any] = {"label": args.label, "cpus": len(os.sched_getaffinity(0)), "results": results}
    for size in args.sizes:
        if size << 30 > free - (1 << 30):
            print(f"{size} GiB: skipped, {args.shm_dir} has {free >> 30} GiB free", flush=True)
            continue
        try:
            results.append(measure_fill(size, args.shm_dir, args.tokens, args.pause))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"{size} GiB: failed: {exc}", flush=True)
            continue
        print(f"{size} GiB: done", flush=True)
        write_results(args.name, payload)
    print(f"\n{args.label}: filling the arena from connect on ({args.tokens}-token prompts)")
    print_table(
        [
            "GiB",
            "prompts",
            "steady store (ms)",
            "fill (s)",
            "lost to slabs (s, share of fill)",
            "waited for slabs (s)",
            "first store (s)",
            f"after {args.pause:.0f} s pause: slowest store / steady",
            "slabs registered after the pause",
            "unpinned (fill / after pause)",
            "2nd client shares the mapping",
            "bytes exact",
        ],
        fill_rows(results),
    )
    print(f"wrote {write_results(args.name, payload)}")


def ratio(first: dict[str, Any], steady: dict[str, Any]) -> float:
    return first["gbps"] / steady["gbps"] if steady["gbps"] else 0.0


def rows_of(results: list[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for r in results:
        one, many = r["one"], r["many"]
        first_loads = [w["first_load"] for w in many]
        exact = all(w["load"]["bytes_exact"] for w in [one, *many]) and one["steady_load"]["bytes_exact"]
        exact = exact and all(load["bytes_exact"] for load in first_loads)
        rows.append(
            [
                r["gib"],
                r["daemon_start_s"],
                r["reserved_s"] if r["reserved_s"] is not None else "not yet",
                one["connect_s"],
                one.get("kernels_s", 0.0),
                f"{one['store']['s']:.3f} ({one['store']['waited_s']:.3f})",
                ratio(one["store"], one["steady_store"]),
                ratio(one["load"], one["steady_load"]),
                one["register_all_s"] if one["register_all_s"] is not None else "not yet",
                f"{one['second_connect_s']:.3f} ({one['second_slabs_failed']})",
                max(w["connect_s"] for w in many),
                f"{max(load['s'] for load in first_loads):.3f} "
                f"({max(load['waited_s'] for load in first_loads):.3f}; "
                f"{min(load['chunks'] for load in first_loads)} chunks)",
                max(w["store"]["s"] for w in many),
                f"{sum(w['slabs_failed'] for w in [one, *many])} / "
                f"{sum(w['store']['unpinned'] + w['load']['unpinned'] for w in [one, *many])}",
                "yes" if exact else "NO",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 64, 100], help="arena sizes, GiB")
    parser.add_argument("--workers", type=int, default=8, help="workers that connect at once")
    parser.add_argument(
        "--tokens", type=int, default=8192, help="a prompt's tokens (8B geometry: 128 KiB each)"
    )
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--name", default="connect")
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--parts", choices=["connect", "fill"], default="connect")
    parser.add_argument("--pause", type=float, default=10.0, help="fill: seconds the second worker pauses")
    args = parser.parse_args()
    free = shutil.disk_usage(args.shm_dir).free
    huge_page = hugetlbfs_page_bytes(args.shm_dir)
    if huge_page:  # a mount with no size limit counts no free blocks
        free = hugetlbfs_free_bytes(args.shm_dir, huge_page)
    if args.parts == "fill":
        main_fill(args, free)
        return
    results = []
    for size in args.sizes:
        if size << 30 > free - (1 << 30):
            print(f"{size} GiB: skipped, {args.shm_dir} has {free >> 30} GiB free", flush=True)
            continue
        try:
            results.append(measure(size, args.workers, args.shm_dir, args.tokens))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the sizes measured still count
            print(f"{size} GiB: failed: {exc}", flush=True)
            continue
        print(f"{size} GiB: done", flush=True)
        write_results(
            args.name, {"label": args.label, "cpus": len(os.sched_getaffinity(0)), "results": results}
        )
    n = args.workers
    print(f"\n{args.label}: daemon start, worker connect and first transfers ({args.tokens} tokens; s)")
    print_table(
        [
            "GiB",
            "start",
            "reserved",
            "connect",
            "kernels (before)",
            "store (waited)",
            "store/steady",
            "load/steady",
            "all slabs",
            "2nd connect (failed slabs)",
            f"{n}: connect",
            f"{n}: first load (waited; fewest chunks hit)",
            f"{n}: store",
            "failed slabs / unpinned",
            "bytes exact",
        ],
        rows_of(results),
    )
    print(f"({n}: the slowest of {n} workers connecting at once)")
    path = write_results(
        args.name, {"label": args.label, "cpus": len(os.sched_getaffinity(0)), "results": results}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
