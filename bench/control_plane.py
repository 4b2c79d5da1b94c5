"""Control-plane benchmark: Lookup latency, and store/load throughput through shared memory vs Put/Get.

Starts its own kvstored (temporary directory and config), then measures:

1. Lookup latency (p50/p99/mean, µs) for 1, 64 and 512 keys over the unix socket, through the
   client's sync stub exactly as `KVStoreClient.lookup` calls it (keys packed in one bytes field),
   every key present; also `client.lookup` end to end (key hashing included), Lookup(lease) +
   Release and Lookup(lease) + Acquire + Release for 512 keys, a health check (the gRPC floor),
   the CPU time both processes spend per call, and the daemon's own work per call measured
   in this process (where the time goes).
2. Store and load throughput (GB/s of page bytes per client call) through the shared-memory
   arena vs inline Put/Get bytes, loads verified byte for byte against the original KV cache.

Prints tables and writes `bench/results/control_plane.json` (and a timestamped copy).

    python bench/control_plane.py            # 32 layers, 4096 tokens per request (512 MiB)
    python bench/control_plane.py --quick    # seconds: CI-sized
    python bench/control_plane.py --parts against --against ../before  # this tree against another

3. Lookup latency of a daemon on uvloop against one on asyncio's own event loop
   (`server.event_loop`), both running, timed in turns: the local channel, gRPC, and the
   client's `lookup_chunks`, with the ratio of their p50s.
7. Scrape turns (`--parts scrape_turns`): one daemon serving /metrics, its Lookups timed in
   `--windows` pairs of 1 s windows, one with a scraper process fetching /metrics every
   `--scrape-interval`, one with it idle, in random order: the scrape's cost without two
   daemons' scatter, with a bootstrap interval of the p99 ratio, the calls that overlapped a
   scrape, and the daemon's own work per scrape.
6. Metrics (`--parts metrics`): Lookup latency of a daemon serving /metrics, scraped every
   second meanwhile, against one without, side by side in the same way (target: p50 and p99
   within 5%).
5. Tenants (`--parts tenants`): Lookup latency of a daemon with tenants against one without,
   side by side and timed in turns: the local channel (1, 64, 512 keys, the caller known by its
   uid), gRPC (1 and 64 keys, the caller known by its tenant's token), the client's
   `lookup_chunks`; the ratio of their p50s (target: at most 1.05).
8. Host (`--parts host`, issue #31 part 3): the daemon's own work per Lookup (the policy's hit
   accounting for 512 pages, a leased and a plain 512-key Lookup, the local channel's answer to
   a 64-key one) and, with `--index-pages N`, the index's bytes per page at N pages, this tree
   and `--baseline TREE` each in processes of their own, in turns (`bench/control_plane_host.py`).
9. Storm (`--parts storm`): `--storm-processes` processes calling 64-key Lookups back to back
   over the local channel for `--storm-seconds`: calls per second and p50/p99, this tree's daemon
   and `--baseline TREE`'s in turns (`bench/lookup_storm.py`).
4. With `--against TREE` (another checkout, e.g. `git worktree add ../before REV`): Lookup, load
   and store latency of this tree's daemon and client against TREE's, both running side by side
   and timed in alternating batches (`bench/latency_probe.py`), in `--rounds` rounds of fresh
   processes: each p50 and p99 over all calls, and their ratio (target: at most 1.05 for
   Lookup and load).

This module holds the command line and the order of the parts; each part is a module of its own:
`control_plane_lookup` (1), `control_plane_throughput` (2) and `control_plane_targets`,
`control_plane_event_loop` (3), `control_plane_trees` (4, 8, 9), `control_plane_tenants` (5),
`control_plane_metrics` (6, 7); `control_plane_setup` and `control_plane_sides` hold what they
share (specs, daemon configs, stored pages, timing; two daemons side by side).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

from bench.common import running_daemon, write_results  # noqa: E402
from bench.control_plane_event_loop import bench_event_loops, report_event_loops  # noqa: E402
from bench.control_plane_lookup import bench_lookup, report_lookup  # noqa: E402
from bench.control_plane_metrics import (  # noqa: E402
    bench_metrics,
    bench_scrape_turns,
    report_metrics,
    report_scrape_turns,
)
from bench.control_plane_setup import BLOCK_SIZE, CHUNK_TOKENS, daemon_config  # noqa: E402
from bench.control_plane_targets import report_targets, targets  # noqa: E402
from bench.control_plane_tenants import bench_tenants, report_tenants  # noqa: E402
from bench.control_plane_throughput import bench_throughput, report_throughput  # noqa: E402
from bench.control_plane_trees import (  # noqa: E402
    report_against,
    report_host,
    report_storm,
    run_against,
    run_host,
    run_storm,
)
from kvstore.config.root import parse_size  # noqa: E402

FULL = {"tokens": 4096, "layers": 32, "arena": "2GiB", "repeats": 5, "lookup_calls": 3000, "warmup": 300}
QUICK = {"tokens": 512, "layers": 2, "arena": "64MiB", "repeats": 2, "lookup_calls": 200, "warmup": 20}
PARTS = (
    "lookup",
    "throughput",
    "event_loop",
    "tenants",
    "metrics",
    "scrape_turns",
    "against",
    "host",
    "storm",
)
PARAMETERS = (  # what the results keep of the command line, besides the daemon's config
    "quick",
    "tokens",
    "layers",
    "kv_heads",
    "head_dim",
    "arena",
    "repeats",
    "lookup_calls",
    "warmup",
    "parts",
)
# The results' parts, in the order the JSON lists them.
RESULTS = (
    "lookup",
    "throughput",
    "event_loops",
    "tenants",
    "metrics",
    "scrape_turns",
    "targets",
    "against",
    "host",
    "storm",
)
Part = tuple[str, str, Callable[[argparse.Namespace], dict[str, Any]], Callable[[dict[str, Any]], None]]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few calls (CI smoke run)")
    parser.add_argument("--tokens", type=int, help=f"tokens per store/load request (full: {FULL['tokens']})")
    parser.add_argument("--layers", type=int, help=f"model layers (full: {FULL['layers']})")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--arena", help=f"the daemon's CPU tier size (full: {FULL['arena']})")
    parser.add_argument("--repeats", type=int, help=f"timed stores/loads per path (full: {FULL['repeats']})")
    parser.add_argument(
        "--lookup-calls", type=int, help=f"timed Lookups per size (full: {FULL['lookup_calls']})"
    )
    parser.add_argument("--warmup", type=int, help="untimed calls before each latency series")
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=["lookup", "throughput", "event_loop", "tenants", "metrics"],
    )
    parser.add_argument("--against", type=Path, help="another kvstore source tree to compare latency with")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of fresh processes for --against")
    parser.add_argument("--baseline", type=Path, help="host and storm parts: another tree, timed in turns")
    parser.add_argument(
        "--index-pages", type=int, default=0, help="host part: pages for the index size (0: none)"
    )
    parser.add_argument("--storm-processes", type=int, default=16, help="storm part: Lookup processes")
    parser.add_argument("--storm-seconds", type=float, default=5.0, help="storm part: seconds per round")
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=1.0,
        help="metrics part: seconds between scrapes (Prometheus: 15-60)",
    )
    parser.add_argument(
        "--windows", type=int, default=150, help="scrape_turns part: pairs of 1 s windows (scraping, quiet)"
    )
    parser.add_argument(
        "--quiet-probe",
        action="store_true",
        help="scrape_turns part: in the quiet windows the scraper fetches /healthz (the helper answers "
        "it alone) as often as it fetches /metrics in the others, so the scraper's own work is on "
        "both sides and what differs is the daemon's part of a scrape",
    )
    parser.add_argument("--name", help="results name (default: control_plane, or control_plane-quick)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.arena = parse_size(args.arena)
    args.name = args.name or ("control_plane-quick" if args.quick else "control_plane")
    if args.against is not None and "against" not in args.parts:
        args.parts.append("against")
    if "against" in args.parts and (args.against is None or not (args.against / "kvstore").is_dir()):
        parser.error("--parts against needs --against TREE, a kvstore source tree")
    if args.tokens <= 0 or args.tokens % CHUNK_TOKENS:
        parser.error(f"--tokens: expected a positive multiple of chunk_tokens {CHUNK_TOKENS}")
    if min(args.layers, args.kv_heads, args.head_dim, args.repeats, args.lookup_calls) <= 0:
        parser.error("--layers, --kv-heads, --head-dim, --repeats and --lookup-calls must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _check_kernels()
    config = daemon_config(args)
    started = time.perf_counter()
    got = run_parts(args, config)
    parameters = {key: getattr(args, key) for key in PARAMETERS}
    parameters |= {
        "chunk_tokens": CHUNK_TOKENS,
        "block_size": BLOCK_SIZE,
        "dtype": "bfloat16",
        "layout": "flash_attn",
        "daemon_config": config,
    }
    path = write_results(
        args.name,
        {
            "benchmark": "control_plane",
            "parameters": parameters,
            **{key: got.get(key) for key in RESULTS},
            "elapsed_s": time.perf_counter() - started,
            "note": "KV caches on the CPU: pages move with kvstore_kernels' torch reference, not Triton",
        },
    )
    print(f"\nwrote {path} ({time.perf_counter() - started:.1f} s)")
    return 0


def _check_kernels() -> None:
    import kvstore_kernels  # both parts store pages through the client, which copies with it

    if not hasattr(kvstore_kernels, "gather"):
        raise SystemExit(
            "kvstore_kernels has no gather(): the client cannot copy pages. If "
            "kvstore_kernels/__init__.py exists, reinstall the package (pip install -e .): an "
            "editable install made before it existed maps kvstore_kernels to a namespace"
        )


def run_parts(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    """The parts asked for, each reported as it ends: Lookup and throughput on one daemon (and
    their targets, always), then each of the others. Returns each part's results by key."""
    got: dict[str, Any] = {"lookup": None, "throughput": None}
    if "lookup" in args.parts or "throughput" in args.parts:
        with running_daemon(config) as daemon:
            got["lookup"] = bench_lookup(daemon, args) if "lookup" in args.parts else None
            got["throughput"] = bench_throughput(daemon, args) if "throughput" in args.parts else None
    got["targets"] = targets(got["lookup"], got["throughput"])
    if got["lookup"]:
        report_lookup(got["lookup"])
    if got["throughput"]:
        report_throughput(got["throughput"])
    report_targets(got["targets"])
    later: list[Part] = [
        ("event_loop", "event_loops", functools.partial(bench_event_loops, config), report_event_loops),
        ("tenants", "tenants", bench_tenants, report_tenants),
        ("metrics", "metrics", bench_metrics, report_metrics),
        ("scrape_turns", "scrape_turns", bench_scrape_turns, report_scrape_turns),
        ("host", "host", run_host, report_host),
        ("storm", "storm", run_storm, report_storm),
        ("against", "against", run_against, report_against),
    ]
    for part, key, run, report in later:
        if part in args.parts:
            got[key] = run(args)
            report(got[key])
    return got


if __name__ == "__main__":
    sys.exit(main())
