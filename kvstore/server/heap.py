"""The daemon's cyclic garbage collection, kept off the calls' path.

CPython's collector scans the objects of the generations it collects, and holds the event loop
meanwhile: no call is answered. A daemon that stores steadily meets it twice. Its index keeps
about as many objects as it stores and frees (a page stored, the oldest evicted), so the
collector's count of new objects stays low and its young generation grows to hundreds of
thousands of objects before a young collection scans them all; and a full collection scans the
whole index, ~1.1M objects at a million pages, ~180 ms on a GPU host's CPU. With 1M pages and
20,000 pages stored a second the dev VM's loop stopped 15 times in 30 s, for up to 218 ms
(`bench/gc_pauses.py`, bench/NOTES-control-plane.md).

A page's objects form no reference cycles (its entry, lease and policy records are freed by
their counts as the page leaves), so the index need not be scanned at all:

- `Heap.start()`: freezes what the daemon built at start (`gc.freeze`) and turns CPython's own
  full collections off (its third threshold at the maximum); its young collections go on.
- `Heap.turn()`, every `server.gc_freeze_s` (e.g. 0.25 s): collects the objects not frozen yet (what
  survived since the turn before: the pages stored meanwhile, ~1.5 µs each on the VM) and
  freezes what is left, so no later collection scans it again. A frozen object is still freed
  by its count. The same run: 118 turns, two over 10 ms, the longest 33 ms.
- Every `server.gc_full_s` (0: never) the turn is a full one: the frozen heap is thawed and
  collected whole, for cycles among objects that died after they were frozen (a request's
  objects frozen while in flight), then frozen again: one full collection's stall each period.

`server.gc_freeze_s: 0`, the default, leaves the collector as CPython runs it: a daemon tends its
heap where asked (a large index that stores steadily), until the turns are measured again on the
GPU hosts: a first version's Stats counted the frozen objects (`gc.get_freeze_count()`, a walk of
them all, 14 ms a million), which slowed the 4-GPU host's Lookups while its workers polled Stats.
`figures()`: the turns, the full ones, the last and longest pause (ms), for Stats.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger("kvstored")

NO_FULL_COLLECTIONS = (1 << 31) - 1  # CPython's third threshold: gen-1 collections before a full one


class Heap:
    def __init__(self, freeze_s: float, full_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.freeze_s, self.full_s = freeze_s, full_s
        self._clock = clock
        self._last_full = 0.0
        self._thresholds: tuple[int, int, int] | None = None
        self.turns = 0
        self.full_turns = 0
        self.last_pause_ms = 0.0
        self.max_pause_ms = 0.0

    @property
    def tended(self) -> bool:
        return self.freeze_s > 0

    def start(self) -> None:
        """Freezes what exists now; where tended, CPython's full collections stop."""
        gc.freeze()  # the objects built at start never die: keep them out of every collection
        if self.tended:
            self._thresholds = gc.get_threshold()
            young, middle, _ = self._thresholds
            gc.set_threshold(young, middle, NO_FULL_COLLECTIONS)
            self._last_full = self._now()

    def stop(self) -> None:
        """CPython's thresholds as they were (the daemon's process is ending, or a test's goes on)."""
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            self._thresholds = None

    def turn(self) -> int:
        """One collection of what is not frozen (of everything, once every `full_s`), then a
        freeze of what is left; the objects found unreachable."""
        started = time.perf_counter()
        full = bool(self.full_s) and self._now() - self._last_full >= self.full_s
        if full:
            gc.unfreeze()
            self._last_full = self._now()
        found = gc.collect()
        gc.freeze()
        pause_ms = (time.perf_counter() - started) * 1e3
        self.turns += 1
        self.full_turns += full
        self.last_pause_ms = pause_ms
        self.max_pause_ms = max(self.max_pause_ms, pause_ms)
        if full:
            log.info("full garbage collection: %d unreachable objects, %.1f ms", found, pause_ms)
        return found

    async def tend(self) -> None:
        """`turn()` every `freeze_s` until cancelled."""
        while True:
            await asyncio.sleep(self.freeze_s)
            self.turn()

    def figures(self) -> dict[str, float]:
        if not self.tended:
            return {}
        return {
            "gc_turns": self.turns,
            "gc_full_turns": self.full_turns,
            "gc_last_pause_ms": round(self.last_pause_ms, 3),
            "gc_max_pause_ms": round(self.max_pause_ms, 3),
        }

    def _now(self) -> float:
        return self._clock()
