"""Reserving a large arena's memory slab by slab while the daemon already serves.

One `fallocate` of a 64 GiB tmpfs file takes the daemon ~10 s, and faulting it in from many
threads is slower still (tmpfs allocates a file's pages under locks they contend for;
bench/NOTES-connect.md). So the daemon reserves the first slab before it serves, which keeps a
full shm directory an error at start (with the free-space check before it), and an
`ArenaReserver` thread reserves the rest in the order the allocator hands slabs out, handing
each to the allocator once its memory is reserved: a slab is never handed out unreserved, so no
worker writes a page that is not backed (which would be a SIGBUS in the worker).

- `ArenaReserver(reserve, slab_bytes, num_slabs, first, on_reserved, label)`: reserves slabs
  `first..num_slabs-1` with `reserve(start, length)`, calls `on_reserved(count)` from its thread
  after each run of slabs (the caller hops to its event loop), logs progress every 10 s.
- `failure`: None, or the message of the reservation that failed (logged as an error; the arena
  then serves with the slabs reserved before it).
- `stop()`: ends the thread after the slab in progress.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 10.0
BATCH_S = 0.05  # hand reserved slabs to the allocator at least this often, not after each one


class ArenaReserver:
    def __init__(
        self,
        reserve: Callable[[int, int], None],
        slab_bytes: int,
        num_slabs: int,
        first: int,
        on_reserved: Callable[[int], object],
        label: str,
    ) -> None:
        self._reserve = reserve
        self.slab_bytes = slab_bytes
        self.num_slabs = num_slabs
        self.num_reserved = first
        self._on_reserved = on_reserved
        self.label = label
        self.failure: str | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-reserve", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self.num_reserved == self.num_slabs or self.failure is not None

    def _run(self) -> None:
        started = reported = handed = time.perf_counter()
        unhanded = 0
        while self.num_reserved < self.num_slabs and not self._stopping.is_set():
            try:
                self._reserve(self.num_reserved * self.slab_bytes, self.slab_bytes)
            except OSError as exc:
                self.failure = str(exc)
                log.error(
                    "%s: only %d of %d slabs could be reserved (%s); the arena serves with those",
                    self.label,
                    self.num_reserved,
                    self.num_slabs,
                    exc,
                )
                break
            self.num_reserved += 1
            unhanded += 1
            now = time.perf_counter()
            if now - handed >= BATCH_S or self.num_reserved == self.num_slabs:
                self._on_reserved(unhanded)
                unhanded, handed = 0, now
            if now - reported >= PROGRESS_EVERY_S:
                reported = now
                log.info(
                    "%s: %d of %d slabs reserved (%.0f%%) in %.1f s",
                    self.label,
                    self.num_reserved,
                    self.num_slabs,
                    100 * self.num_reserved / self.num_slabs,
                    now - started,
                )
        if unhanded:
            self._on_reserved(unhanded)
        if self.num_reserved == self.num_slabs:
            log.info(
                "%s: all %d slabs reserved in %.2f s",
                self.label,
                self.num_slabs,
                time.perf_counter() - started,
            )

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()
