"""Parts 4, 8 and 9 of the control-plane benchmark: this tree against another, each in processes
of its own, the trees taking turns.

- `run_against(args)`: Lookup, load and store latency of both trees' daemons and clients
  (`bench/latency_probe.py`); `report_against`.
- `run_host(args)`: the daemon's own work per Lookup and the index's bytes per page
  (`bench/control_plane_host.py`); `report_host`.
- `run_storm(args)`: 64-key Lookups from many processes at once (`bench/lookup_storm.py`);
  `report_storm`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.common import print_table
from bench.control_plane_host import compare as compare_host
from bench.latency_probe import MAX_RATIO, SERIES, compare_trees
from bench.lookup_storm import compare as compare_storm

THIS_TREE = Path(__file__).resolve().parents[1]
TARGET_POLICY_HIT_512_US = 50.0
TARGET_STORM_PER_S = 40_000
TARGET_STORM_P99_US = 1000.0
TARGET_INDEX_BYTES = 256


def run_against(args: argparse.Namespace) -> dict[str, Any]:
    calls = 200 if args.quick else 3000
    return compare_trees(THIS_TREE, args.against, args.rounds, calls)


def run_host(args: argparse.Namespace) -> dict[str, Any]:
    return compare_host(THIS_TREE, args.baseline, args.rounds, args.lookup_calls, args.index_pages)


def run_storm(args: argparse.Namespace) -> dict[str, Any]:
    return compare_storm(
        THIS_TREE, args.baseline, args.storm_processes, args.storm_seconds, 64, args.rounds, False
    )


def report_against(against: dict[str, Any]) -> None:
    rounds, calls = against["rounds"], against["calls"]
    print(f"\nThis tree against {against['trees']['against']} ({rounds} rounds of {calls} calls, µs)")
    rows = []
    for series in SERIES:
        for q in ("p50", "p99"):
            cell = against[series][q]
            this, other, ratio = round(cell["this"], 1), round(cell["against"], 1), round(cell["ratio"], 3)
            rows.append([series, q, this, other, ratio, round(cell["round_median_ratio"], 3)])
    print_table(["series", "q", "this", "against", "ratio", "ratio of round medians"], rows)
    verdict = "holds" if against["holds"] else "FAILS"
    print(f"Lookup and load p50/p99 within {MAX_RATIO:.2f}x of the other tree: {verdict}")


def report_host(host: dict[str, Any]) -> None:
    keys = [
        ("policy_hit_512", f"policy hit accounting, 512 pages (<= {TARGET_POLICY_HIT_512_US:.0f})"),
        ("leased_lookup_512", "leased Lookup + Release, 512 keys"),
        ("plain_lookup_512", "plain Lookup, 512 keys"),
        ("respond_lookup_64", "local channel answer, 64-key Lookup"),
        ("respond_query_64", "local channel answer, the same as a Query"),
        ("reserve_32", "Reserve, a TP 4 prompt's 32 pages"),
        ("commit_8", "Commit of 8 of them"),
        ("leased_lookup_32", "leased Lookup + Release, the 32"),
        ("index_bytes_per_page", f"index bytes per page (<= {TARGET_INDEX_BYTES})"),
    ]
    medians = host["medians"]
    names = list(medians)
    rows = [[label] + [_figure(medians[name].get(key)) for name in names] for key, label in keys]
    print("\nthe daemon's own work (p50 µs, median of the rounds) and index size")
    print_table(["figure"] + names, rows)


def report_storm(storm: dict[str, Any]) -> None:
    figures = ("calls_per_s", "p50_us", "p99_us")
    rows = [
        [
            f"{name} {index}",
            *(round(run[figure]) for figure in figures),
            round(run["daemon_cpu_us_per_call"], 1),
            round(run["daemon_user_us_per_call"], 1),
        ]
        for name, runs in storm["runs"].items()
        for index, run in enumerate(runs)
    ]
    processes = storm["runs"][next(iter(storm["runs"]))][0]["processes"]
    print(f"\n64-key Lookups (`lookup_chunks`: a Query where the tree has it) from {processes} processes")
    print_table(
        [
            "tree, round",
            f"calls/s (>= {TARGET_STORM_PER_S})",
            "p50 µs",
            f"p99 µs (<= {TARGET_STORM_P99_US:.0f})",
            "daemon CPU µs/call",
            "of which user",
        ],
        rows,
    )


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"
