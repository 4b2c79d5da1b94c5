"""What a shared remote tier is worth to a fleet: the conversation trace over 1 to 64 hosts.

For each fleet size N, each way of sending requests to hosts (round-robin, random, affinity: a
cache-aware router) and each shared tier (none, or `--remote-pages`): `kvstore.ctl.fleet` replays
the trace (every host its own CPU tier of `--cpu-pages`, the real store and policy) and reports
the fleet's prefix-hit ratio, the share the shared tier served, and the spread over hosts.
Prints a table, writes `bench/results/fleet.json` and, where matplotlib is installed
(`pip install '.[bench]'`), `bench/results/fleet.png` beside it.

    python bench/fleet.py                               # N = 1, 2, 4, ... 64
    python bench/fleet.py --hosts 1 2 4 --trace T.jsonl # a quick look at another trace
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

from bench.common import RESULTS_DIR, print_table, write_results  # noqa: E402
from kvstore.ctl.fleet import ASSIGNMENTS, fleet_replay  # noqa: E402
from kvstore.ctl.trace import load_trace  # noqa: E402

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"


def plot(rows: list[dict[str, Any]], path: Path, cpu_pages: int, remote_pages: int) -> bool:
    """The fleet's hit ratio against its size, one line per assignment, solid with the shared tier
    and dashed without; False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axis = plt.subplots(figsize=(8, 5))
    for index, assign in enumerate(ASSIGNMENTS):
        color = f"C{index}"
        for remote, style in ((remote_pages, "-"), (0, "--")):
            chosen = [r for r in rows if r["assign"] == assign and r["remote_pages"] == remote]
            label = f"{assign}, " + (f"shared tier of {remote} pages" if remote else "no shared tier")
            axis.plot(
                [r["hosts"] for r in chosen],
                [100 * r["hit_ratio"] for r in chosen],
                style,
                color=color,
                marker="o",
                label=label,
            )
    axis.set_xscale("log", base=2)
    axis.set_xlabel("hosts in the fleet")
    axis.set_ylabel("prefix-hit ratio of the fleet (%)")
    axis.set_title(f"Mooncake conversation trace, {cpu_pages} pages of CPU tier per host")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--cpu-pages", type=int, default=2000, help="each host's CPU tier, in pages")
    parser.add_argument("--remote-pages", type=int, default=20000, help="the shared tier, in pages")
    parser.add_argument("--name", default="fleet")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    started = time.perf_counter()
    rows = []
    for hosts in args.hosts:
        for assign in ASSIGNMENTS:
            for remote in (args.remote_pages, 0):
                result = fleet_replay(trace, hosts, args.cpu_pages, remote, assign)
                rows.append(result.as_dict())
        print(f"{hosts} hosts: done ({time.perf_counter() - started:.0f} s)", flush=True)
    print(
        f"\n{trace.path}: {len(trace.requests)} requests, {trace.num_blocks} blocks "
        f"({trace.num_distinct_blocks} distinct); each host {args.cpu_pages} pages of CPU tier; "
        f"prefix hits of the fleet, shared tier of {args.remote_pages} pages / none"
    )
    table = []
    for hosts in args.hosts:
        row: list[Any] = [hosts]
        for assign in ASSIGNMENTS:
            shared, alone = (
                next(
                    r for r in rows if (r["hosts"], r["assign"], r["remote_pages"]) == (hosts, assign, remote)
                )
                for remote in (args.remote_pages, 0)
            )
            row.append(
                f"{100 * shared['hit_ratio']:.1f}% / {100 * alone['hit_ratio']:.1f}% "
                f"(shared {100 * shared['remote_ratio']:.1f}%)"
            )
        table.append(row)
    print_table(["hosts", *(f"{a}: with / without (served by shared)" for a in ASSIGNMENTS)], table)
    path = write_results(
        args.name,
        {
            "trace": str(trace.path),
            "requests": len(trace.requests),
            "blocks": trace.num_blocks,
            "distinct_blocks": trace.num_distinct_blocks,
            "cpu_pages": args.cpu_pages,
            "remote_pages": args.remote_pages,
            "rows": rows,
        },
    )
    picture = RESULTS_DIR / f"{args.name}.png"
    if plot(rows, picture, args.cpu_pages, args.remote_pages):
        print(f"wrote {path} and {picture}")
    else:
        print(f"wrote {path} (no plot: pip install '.[bench]' for matplotlib)")


if __name__ == "__main__":
    main()
