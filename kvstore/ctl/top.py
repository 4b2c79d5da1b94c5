"""`kvctl top`: a live view of a running daemon, refreshed every `--interval` seconds.

Each frame compares two Stats a refresh apart: lookups per second and the hit ratio over that
interval, the hit ratio since the daemon started, pages stored, evicted and promoted per second,
how full each tier is, leases and pins held, and the namespaces holding the most pages. A ratio
with no lookups behind it is shown as none, never as 0%. `--once`, or a stdout that is not a
terminal (a pipe, a file, a CI log), prints one frame as plain text and exits. Names are shown
as text, control characters escaped (`kvstore.ctl.cli.printable`), never as markup.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kvstore.ctl.cli import capacity_and_use, human_bytes, printable

Stats = dict[str, Any]


def activity(before: Stats, after: Stats, seconds: float) -> dict[str, float | None]:
    """Per-second rates between two Stats, and the chunk hit ratio over that interval and since
    the daemon started (None where no chunk was looked up)."""
    old, new = before["counters"], after["counters"]

    def delta(name: str) -> float:
        return float(new.get(name, 0)) - float(old.get(name, 0))

    seconds = max(seconds, 1e-9)
    return {
        "lookups_per_s": delta("lookups") / seconds,
        "hit_ratio": _ratio(delta("hit_chunks"), delta("missed_chunks")),
        "hit_ratio_since_start": _ratio(float(new.get("hit_chunks", 0)), float(new.get("missed_chunks", 0))),
        "stored_per_s": delta("stored_chunks") / seconds,
        "evicted_per_s": delta("evicted_chunks") / seconds,
        "promoted_per_s": delta("promoted_chunks") / seconds,
    }


def _ratio(hits: float, misses: float) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def hit_ratio_line(rates: dict[str, float | None], seconds: float) -> str:
    """`hit ratio 80.0% over the last 1.0 s, 75.0% since start`; `-` and why, where nothing was looked up."""
    interval, since_start = rates["hit_ratio"], rates["hit_ratio_since_start"]
    if since_start is None:
        return "hit ratio - (no lookups since start)"
    last = f"over the last {seconds:.1f} s"
    recent = f"{interval:.1%} {last}" if interval is not None else f"- {last} (no lookups)"
    return f"hit ratio {recent}, {since_start:.1%} since start"


def frame(before: Stats, after: Stats, seconds: float) -> Group:
    rates = activity(before, after, seconds)
    counters = after["counters"]
    head = Text.from_markup(
        f"[bold]kvstored {escape(printable(after['version']))}[/]  up {after['uptime_s']:.0f} s\n"
        f"lookups {rates['lookups_per_s']:.1f}/s  {hit_ratio_line(rates, seconds)}\n"
        f"stored {rates['stored_per_s']:.1f}/s  evicted {rates['evicted_per_s']:.1f}/s  "
        f"promoted {rates['promoted_per_s']:.1f}/s"
    )
    tiers = Table("tier", "used", "capacity", "fill", "pages", title="tiers", title_justify="left")
    for name, tier in after["tiers"].items():
        tiers.add_row(
            _name(name), human_bytes(tier["bytes_used"]), *capacity_and_use(tier), str(tier["pages"])
        )
    leases = Table(
        "store leases",
        "load leases",
        "pinned pages",
        "pinned",
        "namespaces",
        title="leases and pins",
        title_justify="left",
    )
    leases.add_row(
        str(int(counters.get("active_store_leases", 0))),
        str(int(counters.get("active_load_leases", 0))),
        str(int(counters.get("pinned_pages", 0))),
        human_bytes(float(counters.get("pinned_bytes", 0))),
        str(len(after["namespaces"])),
    )
    busiest = sorted(after["namespaces"], key=lambda n: n["pages"], reverse=True)[:10]
    namespaces = Table(
        "namespace",
        "tenant",
        "model",
        "pages",
        "bytes",
        title="namespaces (most pages)",
        title_justify="left",
    )
    for ns in busiest:
        namespaces.add_row(
            ns["namespace"][:16],
            _name(ns.get("tenant", "")),
            _name(ns["model"]),
            str(ns["pages"]),
            human_bytes(ns["bytes"]),
        )
    return Group(head, tiers, leases, namespaces)


def _name(text: str) -> Text:
    """A client's name as a cell: control characters escaped, and no markup (`[bold]` is text)."""
    return Text(printable(text))


def run(stats: Callable[[], Stats], interval_s: float, once: bool, console: Console | None = None) -> int:
    console = console or Console()
    before, taken = stats(), time.monotonic()
    if once or not console.is_terminal:  # a live view redraws in place, which only a terminal shows
        time.sleep(interval_s)
        after = stats()
        console.print(frame(before, after, time.monotonic() - taken))
        return 0
    with Live(console=console, auto_refresh=False, screen=False) as live:
        try:
            while True:
                time.sleep(interval_s)
                after, now = stats(), time.monotonic()
                live.update(frame(before, after, now - taken), refresh=True)
                before, taken = after, now
        except KeyboardInterrupt:
            return 0
