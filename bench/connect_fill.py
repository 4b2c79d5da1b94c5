"""Issue 31's warm-up: a worker fills the arena from connect on, on each kind of page
(`bench/connect.py --parts fill`, whose docstring says what is measured).

- `measure_fill(size_gib, kind, shm_dir, tokens, pause_s, mode)`: one row: a kvstored whose arena
  is all reserved, the filling worker, then the worker that pauses first; which pages the arena
  got. `mode`: "bounce" (stores into slabs not registered yet go through the client's bounce
  ring) or "wait" (they wait for the registration, as before the ring). A row first waits for
  the host to take back the memory of the row before it (`settle_memory`).
- `fill_summary(run)`: the figures the issue asks for, from one worker's run.
- `main_fill(args)`: every size on every kind of page asked for, in that order, as time allows;
  the table, and `bench/results/<name>.json` after each row.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from typing import Any

from bench.common import RESULTS_DIR, print_table, running_daemon, write_results
from bench.connect_pages import PINNED_DIR, free_bytes, huge_bytes, kind_of, meminfo, unusable
from bench.connect_processes import ReserveWatch, workers
from kvstore.ctl.cli import arena_pages_line
from kvstore.proto import kvstore_pb2 as pb

ARENA_LOG = re.compile(r"arena .*(MiB of|slabs reserved)")  # kvstore.tiers.cpu, kvstore.tiers.reserve
# A row's seconds per GiB before one is measured: the H200 host's 4 KiB-page rows at 64 and 100 GiB
# (2026-11-27, main) took ~3 min together, the daemon's reservation and both workers.
ROW_S_PER_GIB = 1.1


def settle_memory(limit_s: float = 60.0) -> float:
    """Waits until the host's available memory stops growing (the last row's arena and workers
    freed: the H100 host was still freeing 64-100 GiB when the next row's stores dipped, NOTES);
    returns the seconds waited."""
    started = time.perf_counter()
    last = meminfo().get("MemAvailable", 0)
    while time.perf_counter() - started < limit_s:
        time.sleep(1.0)
        now = meminfo().get("MemAvailable", 0)
        if now - last < 256 << 20:
            break
        last = now
    return time.perf_counter() - started


def measure_fill(
    size_gib: int, kind: str, shm_dir: str, tokens: int, pause_s: float, mode: str = "bounce"
) -> dict[str, Any]:
    """One row of the fill: the daemon's arena of `size_gib` on pages of `kind` in `shm_dir`."""
    settled_s = settle_memory()
    config = {
        "log_level": "info",  # the arena's line: which pages it got
        "tiers": {"cpu": {"bytes": f"{size_gib}GiB", "slab_bytes": "256MiB", "shm_dir": shm_dir}},
    }
    if kind == "pinned":
        config["tiers"] = {"cpu": {"bytes": f"{size_gib}GiB", "slab_bytes": "256MiB", "pinned": True}}
    prompts = (size_gib << 30) // (tokens * 128 * 1024)  # 8B geometry: 128 KiB a token
    common = ["--tokens", str(tokens), "--fill", str(prompts), *(["--no-bounce"] if mode == "wait" else [])]
    memory = {"before": meminfo()}
    started = time.perf_counter()
    with running_daemon(config) as daemon:
        reserved_s = ReserveWatch(daemon, started).wait(600)
        memory["reserved"] = meminfo()
        counters = dict(daemon.stub().Stats(pb.StatsRequest()).counters)
        at_once = workers(daemon.address, [[*common, "--seed", "0"]])[0]
        memory["filled"] = meminfo()
        paused = workers(daemon.address, [[*common, "--seed", "1", "--pause", str(pause_s)]])[0]
        log_lines = [line for line in daemon.log().splitlines() if ARENA_LOG.search(line)]
    memory["after"] = meminfo()
    return {
        "gib": size_gib,
        "pages": kind,
        "mode": mode,
        "settled_s": settled_s,
        "shm_dir": shm_dir,
        "prompts": prompts,
        "reserved_s": reserved_s,
        "stats_pages": arena_pages_line(counters),
        "arena_page_bytes": int(counters.get("arena_page_bytes", 0)),
        "log_arena": log_lines,
        "meminfo": memory,
        "huge_bytes_reserved": huge_bytes(memory["before"], memory["reserved"]),
        "huge_bytes_filled": huge_bytes(memory["before"], memory["filled"]),
        "fill": at_once,
        "paused": paused,
        "row_s": time.perf_counter() - started,
    }


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
        "bounced": sum(store.get("bounced", 0) for store in stores),
        "register_all_s": run["register_all_s"],
        "faulted_at_start": run["at_start"].get("slabs_faulted"),
        "registered_at_start": run["at_start"].get("slabs_registered"),
        "bytes_exact": run["bytes_exact"],
        "second_shares": run.get("second_shares_mapping"),
        "second_failed_slabs": run.get("second_stats", {}).get("slabs_failed"),
    }


def huge_share(r: dict[str, Any]) -> str:
    """The arena's huge bytes by /proc/meminfo once reserved, and in the filling worker's mapping."""
    mapped = r["fill"].get("arena_mapping", {})
    in_worker = sum(mapped.get(key, 0) for key in ("ShmemPmdMapped", "Shared_Hugetlb", "Private_Hugetlb"))
    size = r["gib"] << 30
    return f"{r['huge_bytes_reserved'] / size:.2f} / {in_worker / size:.2f}"


def fill_rows(results: list[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for r in results:
        one, after = fill_summary(r["fill"]), fill_summary(r["paused"])
        rows.append(
            [
                r["gib"],
                r["pages"],
                r.get("mode", "wait"),
                huge_share(r),
                f"{r['reserved_s']:.1f}" if r["reserved_s"] is not None else "not yet",
                r["prompts"],
                f"{one['steady_store_s'] * 1e3:.1f}",
                f"{one['fill_s']:.2f}",
                f"{one['lost_s']:.2f} ({100 * one['lost_fraction']:.0f}%)",
                f"{one['waited_s']:.2f}",
                f"{one['bounced']}",
                f"{one['first_store_s']:.3f} ({one['gap_s']:.2f})",
                f"{one['register_all_s']:.1f}" if one["register_all_s"] is not None else "not yet",
                f"{after['min_rate_ratio']:.2f} ({after['stores_below_0.8']} below 0.8)",
                f"{after['registered_at_start']}",
                f"{one['unpinned']} / {after['unpinned']}",
                f"{one['second_shares']} ({one['second_failed_slabs']} failed)",
                "yes" if one["bytes_exact"] and after["bytes_exact"] else "NO",
            ]
        )
    return rows


def row_line(r: dict[str, Any]) -> str:
    one, after = fill_summary(r["fill"]), fill_summary(r["paused"])
    exact = one["bytes_exact"] and after["bytes_exact"]
    return (
        f"done in {r['row_s']:.0f} s; {r['stats_pages']}; huge {huge_share(r)}; "
        f"lost {100 * one['lost_fraction']:.0f}% of {one['fill_s']:.2f} s; after the pause "
        f"slowest {after['min_rate_ratio']:.2f} of steady; bytes {'exact' if exact else 'WRONG'}"
    )


def fill_plan(args: argparse.Namespace) -> dict[str, str]:
    """The kinds of page asked for whose directory gives them: kind -> directory; without
    `--pages`, what `--shm-dir` gives."""
    if not args.pages:
        return {kind_of(args.shm_dir): args.shm_dir}
    directories = {
        "small": args.shm_dir,
        "thp": args.thp_dir,
        "hugetlbfs": args.hugetlbfs_dir,
        "pinned": PINNED_DIR,
    }
    plan = {}
    for kind in args.pages:
        reason = unusable(kind, directories[kind])
        if reason:
            print(f"{kind}: skipped, {reason}", flush=True)
        else:
            plan[kind] = directories[kind]
    return plan


def row_estimate_s(results: list[dict[str, Any]], size_gib: int) -> float:
    """A row's expected seconds: the slowest per GiB so far, else ROW_S_PER_GIB."""
    per_gib = [r["row_s"] / r["gib"] for r in results]
    return size_gib * max(per_gib, default=ROW_S_PER_GIB)


def main_fill(args: argparse.Namespace) -> None:
    results: list[dict[str, Any]] = []
    previous = RESULTS_DIR / f"{args.name}.json"
    if args.append and previous.exists():
        results = json.loads(previous.read_text())["results"]
    payload: dict[str, Any] = {"label": args.label, "cpus": len(os.sched_getaffinity(0)), "results": results}
    plan = fill_plan(args)
    rows = [
        (size, kind, path, mode) for size in args.sizes for kind, path in plan.items() for mode in args.modes
    ]
    for size, kind, directory, mode in rows:
        row = f"{kind} {size} GiB {mode}"
        free = free_bytes(directory)
        if size << 30 > free - (1 << 30):
            print(f"{row}: skipped, {directory} has {free >> 30} GiB free", flush=True)
            continue
        left_s = args.until - time.time() if args.until else None
        if left_s is not None and row_estimate_s(results, size) > left_s:
            needed_s = row_estimate_s(results, size)
            print(f"{row}: skipped, ~{needed_s:.0f} s needed, {left_s:.0f} s left", flush=True)
            continue
        print(f"{row}: starting", flush=True)
        try:
            results.append(measure_fill(size, kind, directory, args.tokens, args.pause, mode))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"{row}: failed: {exc}", flush=True)
            continue
        print(f"{row}: {row_line(results[-1])}", flush=True)
        write_results(args.name, payload)
    print(f"\n{args.label}: filling the arena from connect on ({args.tokens}-token prompts)")
    print_table(
        [
            "GiB",
            "pages",
            "stores into slabs not registered",
            "huge: reserved / worker's mapping",
            "reserved (s)",
            "prompts",
            "steady store (ms)",
            "fill (s)",
            "lost to slabs (s, share of fill)",
            "waited for slabs (s)",
            "stores bounced",
            "first store (s; connect to it)",
            "all slabs (s)",
            f"after {args.pause:.0f} s pause: slowest store / steady",
            "slabs registered after the pause",
            "unpinned (fill / after pause)",
            "2nd client shares the mapping",
            "bytes exact",
        ],
        fill_rows(results),
    )
    print(f"wrote {write_results(args.name, payload)}")
