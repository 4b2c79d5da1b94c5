"""`kvctl replay`: a Mooncake-format trace through the store and a policy, in-process, no daemon.

- `replay_trace(args)`: one host's CPU tier (and a disk tier behind it), beside Belady's optimum
  and an infinite cache (`kvstore.ctl.replay`); with `--hosts` or `--remote-pages`, a fleet of hosts
  sharing a remote tier (`kvstore.ctl.fleet`).
- `ProgressBar(label, total)`: `label [#####.....] done/total` on stderr, where it is a terminal.

Loaded when the command runs; it loads the store, the replay and the fleet then.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from kvstore.ctl.cli import table

if TYPE_CHECKING:
    from kvstore.ctl.fleet import FleetResult
    from kvstore.ctl.trace import Trace


class ProgressBar:
    """`label [#####.....] done/total` on stderr, redrawn in place; nothing unless stderr is a terminal."""

    def __init__(self, label: str, total: int, width: int = 40) -> None:
        self.label, self.total, self.width = label, total, width
        self.shown = sys.stderr.isatty()

    def __call__(self, done: int) -> None:
        if self.shown:
            filled = self.width * done // max(self.total, 1)
            bar = "#" * filled + "." * (self.width - filled)
            sys.stderr.write(f"\r{self.label} [{bar}] {done}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def replay_trace(args: argparse.Namespace) -> int:
    from kvstore.config.root import EvictionConfig
    from kvstore.ctl.replay import bounds, replay, report
    from kvstore.ctl.trace import load_trace

    args.policy = args.policy or EvictionConfig().policy
    trace = load_trace(args.trace)
    if args.hosts is not None or args.remote_pages is not None:
        return _replay_fleet(trace, args)
    progress = ProgressBar(f"replay {args.policy}", len(trace.requests))
    try:
        result = replay(trace, args.cpu_pages, args.policy, progress, disk_pages=args.disk_pages or 0)
    finally:
        progress.close()
    data = report(trace, result, bounds(trace, args.cpu_pages))
    if args.json:
        print(json.dumps(data))
    else:
        _print_replay(trace, args, data)
    return 0


def _print_replay(trace: Trace, args: argparse.Namespace, data: dict[str, Any]) -> None:
    """The replay's report as tables: each tier's hits, then the bounds at this capacity."""
    print(
        f"{trace.path}: {data['requests']} requests, {data['blocks']} blocks ({data['distinct_blocks']} "
        f"distinct); policy {args.policy}, CPU tier of {args.cpu_pages} pages"
        + (f", disk tier of {args.disk_pages} pages" if args.disk_pages else "")
        + "\n"
    )
    rows = [
        (tier, data["tier_hit_blocks"][tier], f"{100 * ratio:.2f}%") for tier, ratio in data["tiers"].items()
    ]
    rows.append(("total", data["hit_blocks"], f"{100 * data['hit_ratio']:.2f}%"))
    print(table(("tier", "hit blocks", "prefix hits"), rows))
    print()
    print(
        table(
            (f"bound at {args.cpu_pages} pages", "prefix hits"),
            [("belady", f"{100 * data['belady']:.2f}%"), ("infinite", f"{100 * data['infinite']:.2f}%")],
        )
    )
    unstored = (
        f", {data['unstored_requests']} requests not stored (no room)" if data["unstored_requests"] else ""
    )
    print(f"\nreplay {data['replay_s']:.1f} s, bounds {data['bounds_s']:.1f} s{unstored}")


def _replay_fleet(trace: Trace, args: argparse.Namespace) -> int:
    """`kvctl replay --hosts N --remote-pages R`: the fleet simulation (`kvstore.ctl.fleet`)."""
    from kvstore.ctl.fleet import fleet_replay
    from kvstore.shared.errors import KVStoreError

    if args.disk_pages:
        raise KVStoreError("--disk-pages: the fleet simulation has no disk tiers; leave it out with --hosts")
    hosts, remote = args.hosts or 1, args.remote_pages or 0
    progress = ProgressBar(f"fleet of {hosts}", len(trace.requests))
    try:
        result = fleet_replay(trace, hosts, args.cpu_pages, remote, args.assign, args.policy, progress)
    finally:
        progress.close()
    data = {"trace": trace.path, "requests": len(trace.requests), "policy": args.policy, **result.as_dict()}
    if args.json:
        print(json.dumps(data))
    else:
        _print_fleet(trace, args, result, remote)
    return 0


def _print_fleet(trace: Trace, args: argparse.Namespace, result: FleetResult, remote: int) -> None:
    """The fleet's report: each host's hits (the worst and best of more than 8), the fleet's, and
    the shared tier's share."""
    hosts = result.hosts
    print(
        f"{trace.path}: {len(trace.requests)} requests, {result.blocks} blocks over {hosts} hosts "
        f"({args.assign}), each a CPU tier of {args.cpu_pages} pages, sharing a remote tier of "
        f"{remote} pages; policy {args.policy}\n"
    )
    ratios = result.host_ratios()
    shown = range(hosts) if hosts <= 8 else (ratios.index(min(ratios)), ratios.index(max(ratios)))
    rows = [(f"host {h}", result.host_blocks[h], f"{100 * ratios[h]:.2f}%") for h in shown]
    rows.append(("fleet", result.blocks, f"{100 * result.hit_ratio:.2f}%"))
    print(table(("host", "blocks", "prefix hits"), rows))
    print(
        f"\nthe shared tier served {100 * result.remote_ratio:.2f}% of the blocks "
        f"({100 * result.remote_ratio / (result.hit_ratio or 1):.1f}% of the hits); "
        f"replay {result.elapsed_s:.1f} s"
    )
