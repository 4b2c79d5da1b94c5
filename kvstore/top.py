"""`kvctl top`: a live view of a running daemon, refreshed every `--interval` seconds.

Each frame compares two Stats a refresh apart: lookups and hit ratio over the interval
(the ratio since start when nothing was looked up in it), pages stored, evicted and promoted
per second, how full each tier is, leases and pins held, and the namespaces holding the most
pages. `--once` prints one frame and exits (for scripts and tests). Names are shown as text,
control characters escaped (`kvstore.cli.printable`), never as markup.
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

from kvstore.cli import human_bytes, printable

Stats = dict[str, Any]


def activity(before: Stats, after: Stats, seconds: float) -> dict[str, float]:
    """Per-second rates and the hit ratio between two Stats."""
    old, new = before["counters"], after["counters"]

    def delta(name: str) -> float:
        return float(new.get(name, 0)) - float(old.get(name, 0))

    hits, misses = delta("hit_chunks"), delta("missed_chunks")
    if hits + misses == 0:  # nothing looked up in the interval: the ratio since start
        hits, misses = float(new.get("hit_chunks", 0)), float(new.get("missed_chunks", 0))
    seconds = max(seconds, 1e-9)
    return {
        "lookups_per_s": delta("lookups") / seconds,
        "hit_ratio": hits / (hits + misses) if hits + misses else 0.0,
        "stored_per_s": delta("stored_chunks") / seconds,
        "evicted_per_s": delta("evicted_chunks") / seconds,
        "promoted_per_s": delta("promoted_chunks") / seconds,
    }


def frame(before: Stats, after: Stats, seconds: float) -> Group:
    rates = activity(before, after, seconds)
    counters = after["counters"]
    head = Text.from_markup(
        f"[bold]kvstored {escape(printable(after['version']))}[/]  up {after['uptime_s']:.0f} s\n"
        f"lookups {rates['lookups_per_s']:.1f}/s  hit ratio {rates['hit_ratio']:.1%}  "
        f"stored {rates['stored_per_s']:.1f}/s  evicted {rates['evicted_per_s']:.1f}/s  "
        f"promoted {rates['promoted_per_s']:.1f}/s"
    )
    tiers = Table("tier", "used", "capacity", "fill", "pages", title="tiers", title_justify="left")
    for name, tier in after["tiers"].items():
        capacity = tier["bytes_capacity"]
        fill = f"{tier['bytes_used'] / capacity:.1%}" if capacity else "-"
        tiers.add_row(
            _name(name),
            human_bytes(tier["bytes_used"]),
            human_bytes(capacity) if capacity else "-",
            fill,
            str(tier["pages"]),
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
    if once:
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
