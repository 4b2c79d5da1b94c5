"""Daemon start and worker connect against the CPU tier's size (issue 20's table).

For each arena size: a kvstored is started (timed from launch to health SERVING), then fresh
worker processes (CUDA initialised before the clock starts, as an engine's worker is) time
`KVStoreClient.connect` (mapping the arena and, with a GPU, registering it with CUDA) and a
second connect in the same process; then `--workers` fresh workers connect at once and the
slowest is reported. Whether each connect pinned the arena is reported beside its time: a
registration that fails is quick and leaves the transfers at pageable speed. Run it from two
trees to compare them (this tree and a baseline checkout, in one device call).

    python bench/connect.py --sizes 8 32 64          # GiB
    python bench/connect.py --sizes 1 --workers 2    # a smoke run anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

from bench.common import print_table, running_daemon, write_results  # noqa: E402
from tests.harness import python_env  # noqa: E402

WORKER = r"""
import json, sys, time
import torch
if torch.cuda.is_available():
    torch.cuda.init(); torch.empty(1, device="cuda")  # the CUDA context, before the clock
from kvstore_client import KVSpec, KVStoreClient
spec = KVSpec(model="connect-bench", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
started = time.perf_counter()
first = KVStoreClient.connect(sys.argv[1], spec)
first_s = time.perf_counter() - started
registered = first._registered
started = time.perf_counter()
second = KVStoreClient.connect(sys.argv[1], spec)
second_s = time.perf_counter() - started
print(json.dumps({"first_s": first_s, "second_s": second_s, "registered": registered,
                  "second_registered": second._registered}))
second.close(); first.close()
"""


def workers(address: str, count: int) -> list[dict[str, Any]]:
    """`count` fresh worker processes connecting at once; each one's timings."""
    started = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, address], stdout=subprocess.PIPE, text=True, env=python_env()
        )
        for _ in range(count)
    ]
    results = []
    for process in started:
        out, _ = process.communicate(timeout=600)
        if process.returncode != 0:
            raise RuntimeError(f"a worker failed (exit {process.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def measure(size_gib: int, count: int, shm_dir: str) -> dict[str, Any]:
    config = {
        "log_level": "warning",
        "tiers": {"cpu": {"bytes": f"{size_gib}GiB", "slab_bytes": "256MiB", "shm_dir": shm_dir}},
    }
    started = time.perf_counter()
    with running_daemon(config) as daemon:
        start_s = time.perf_counter() - started
        one = workers(daemon.address, 1)[0]
        many = workers(daemon.address, count) if count > 1 else [one]
    return {
        "gib": size_gib,
        "daemon_start_s": start_s,
        "first_connect_s": one["first_s"],
        "second_connect_s": one["second_s"],
        "registered": one["registered"],
        "second_registered": one["second_registered"],
        "workers": count,
        "slowest_of_workers_s": max(result["first_s"] for result in many),
        "workers_registered": sum(result["registered"] for result in many),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 64], help="arena sizes, GiB")
    parser.add_argument("--workers", type=int, default=8, help="workers that connect at once")
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--name", default="connect")
    parser.add_argument("--label", default="this tree")
    args = parser.parse_args()
    free = shutil.disk_usage(args.shm_dir).free
    rows = []
    for size in args.sizes:
        if size << 30 > free - (1 << 30):
            print(f"{size} GiB: skipped, {args.shm_dir} has {free >> 30} GiB free", flush=True)
            continue
        rows.append(measure(size, args.workers, args.shm_dir))
        print(f"{size} GiB: done", flush=True)
    print(f"\n{args.label}: daemon start and worker connect (s)")
    print_table(
        [
            "GiB",
            "daemon start",
            "first connect",
            "second connect",
            f"slowest of {args.workers} at once",
            "pinned: first / second / workers",
        ],
        [
            [
                r["gib"],
                r["daemon_start_s"],
                r["first_connect_s"],
                r["second_connect_s"],
                r["slowest_of_workers_s"],
            ]
            + [f"{r['registered']} / {r['second_registered']} / {r['workers_registered']} of {r['workers']}"]
            for r in rows
        ],
    )
    path = write_results(args.name, {"label": args.label, "cpus": len(os.sched_getaffinity(0)), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
