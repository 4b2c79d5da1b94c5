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

`--parts fill` (issue 31's warm-up): for each size, and for each kind of page in `--pages` (small:
4 KiB pages in `--shm-dir`; thp: a tmpfs mounted `huge=always` at `--thp-dir`; hugetlbfs: a
hugetlbfs mount at `--hugetlbfs-dir`; `bench/connect_huge.sh` mounts them; without `--pages`,
the pages `--shm-dir` gives), a kvstored whose arena is all reserved (a system service started
long before), then a fresh worker that stores prompts back to back from connect on until the
arena is full (`--fill` in `connect_worker.py`; its prompts made before connect): the fill's time
against as many stores at the steady rate (`lost`: the share of the fill lost to slabs), then
every prompt loaded and compared byte for byte; then another fresh worker that connects, pauses
`--pause` seconds (an engine loading its weights) and fills the arena again: each of its stores'
rate over the steady rate. Each row says which pages the arena got: the daemon's Stats (`kvctl
stats`' line) and log, the huge page bytes taken in /proc/meminfo (ShmemHugePages,
HugePages_Free) and those of the worker's mapping (smaps). `--append` adds the rows to those
already in the results file (a script that sets up each kind of page in turn); `--until` skips
the rows not expected to end by then; `--modes bounce wait` runs each row with the client's bounce
ring (stores into slabs not registered yet go through it) and without (they wait for them).
`--pages pinned` puts the arena in memory the daemon pins through CUDA (`tiers.cpu.pinned`): the
workers map its slabs' descriptors and register nothing.

    python bench/connect.py --parts fill --sizes 64 100 --pages small thp --thp-dir /mnt/kvstore-thp
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

from bench.common import print_table, running_daemon, write_results  # noqa: E402
from bench.connect_fill import main_fill  # noqa: E402
from bench.connect_pages import PAGE_KINDS, free_bytes  # noqa: E402
from bench.connect_processes import ReserveWatch, workers  # noqa: E402


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
    parser.add_argument("--shm-dir", default="/dev/shm", help="the arena's directory (fill: small pages)")
    parser.add_argument("--name", default="connect")
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--parts", choices=["connect", "fill"], default="connect")
    parser.add_argument("--pause", type=float, default=10.0, help="fill: seconds the second worker pauses")
    parser.add_argument(
        "--pages",
        nargs="+",
        choices=list(PAGE_KINDS),
        help="fill: kinds of page, in turn (default: what --shm-dir gives)",
    )
    parser.add_argument("--thp-dir", default="/mnt/kvstore-thp", help="fill: a tmpfs mounted huge=always")
    parser.add_argument("--hugetlbfs-dir", default="/mnt/kvstore-hugetlbfs", help="fill: a hugetlbfs mount")
    parser.add_argument("--append", action="store_true", help="fill: keep the rows in the results file")
    parser.add_argument("--until", type=float, default=None, help="fill: skip rows not done by (Unix time)")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["bounce", "wait"],
        default=["bounce"],
        help="fill: stores into slabs not registered yet go through the bounce ring, or wait (each a row)",
    )
    args = parser.parse_args()
    if args.parts == "fill":
        main_fill(args)
        return
    free = free_bytes(args.shm_dir)
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
