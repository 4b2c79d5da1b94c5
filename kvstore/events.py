"""The KV-event stream: every page that enters or leaves one of this daemon's tiers, in order.

A router that sends each request to the host already holding its prefix (Dynamo's, llm-d's)
follows these events to know what each host holds, as it follows vLLM's own KV events.

- `STORED`: the page is now held in `tier` (a Commit, a page read up from disk or the remote
  tier, a page moved to the GPU tier, a record written to disk).
- `REMOVED`: the page left `tier`; `reason` says why: `evicted` (room was made), `cleared`,
  `lost` (its bytes could not be read or copied), `moved` (it went to another tier, whose
  STORED follows).
- `RESYNC`: the consumer fell behind the buffer (or asked for events it no longer holds):
  what it built from earlier events is incomplete; it starts again from a full view
  (`kvctl ls`, Stats) and follows the events after this one.

Each event has a sequence number, one more than the event before it. A consumer that reconnects
asks for the events after the last one it saw (`since`) and loses nothing while the buffer
(`server.events_buffer` events) still holds them; memory is bounded by that buffer whatever
consumers do. The remote tier is shared by many hosts and evicts on its own: its pages are
not reported here.

`add` may be called from any thread (the disk tier's workers call it); consumers wait on the
event loop (`wait`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from enum import IntEnum
from typing import NamedTuple

from kvstore.tiers import Tier

MAX_SCAN = 8192  # events looked at per read


class EventKind(IntEnum):
    STORED = 1
    REMOVED = 2
    RESYNC = 3


class Event(NamedTuple):
    sequence: int
    kind: EventKind
    tier: Tier
    namespace: bytes
    key: bytes
    parent: bytes = b""  # the key of the chunk before it, where the daemon knows it
    reason: str = ""


class EventLog:
    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._ring: list[Event | None] = [None] * capacity  # event `s` at s % capacity
        self._lock = threading.Lock()
        self.sequence = 0  # the last event's
        self._names: dict[bytes, tuple[str, str]] = {}  # namespace -> (tenant, model)
        self._waiting: set[asyncio.Future[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self.closed = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop consumers wait on (the daemon's)."""
        self._loop, self._loop_thread = loop, threading.get_ident()

    def name(self, namespace: bytes, tenant: str, model: str) -> None:
        """What a namespace's events say of it (registered at Connect)."""
        self._names[namespace] = (tenant, model)

    def names(self, namespace: bytes) -> tuple[str, str]:
        return self._names.get(namespace, ("", ""))

    def add(
        self, kind: EventKind, tier: Tier, namespace: bytes, key: bytes, parent: bytes = b"", reason: str = ""
    ) -> None:
        with self._lock:
            self.sequence += 1
            self._ring[self.sequence % self.capacity] = Event(
                self.sequence, kind, tier, namespace, key, parent, reason
            )
        if self._waiting:
            self._wake()

    def _wake(self) -> None:
        if threading.get_ident() == self._loop_thread:
            self._release()
        elif self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the daemon stopped
                self._loop.call_soon_threadsafe(self._release)

    def _release(self) -> None:
        waiting, self._waiting = self._waiting, set()
        for future in waiting:
            if not future.done():
                future.set_result(None)

    def read(
        self, after: int, limit: int, keep: Callable[[Event], bool] | None = None
    ) -> tuple[list[Event], int]:
        """Up to `limit` events after sequence `after` that `keep` accepts, and the sequence read
        up to (at most MAX_SCAN events are looked at per call, so a consumer that filters most
        out holds the lock briefly). A RESYNC event comes first where events after `after` are
        gone from the buffer."""
        with self._lock:
            last = self.sequence
            if after >= last:
                return [], last
            oldest = last - min(last, self.capacity) + 1
            out: list[Event] = []
            if after < oldest - 1:  # some of what the consumer asked for is gone
                out.append(Event(oldest - 1, EventKind.RESYNC, Tier.NONE, b"", b"", b"", "fell behind"))
                after = oldest - 1
            ring, capacity = self._ring, self.capacity
            sequence, stop = after, min(last, after + MAX_SCAN)
            while sequence < stop:
                sequence += 1
                event = ring[sequence % capacity]
                if event is not None and (keep is None or keep(event)):
                    out.append(event)
                    if len(out) >= limit:
                        break
            return out, sequence

    def close(self) -> None:
        """The daemon stops: consumers' streams end."""
        self.closed = True
        self._release()

    async def wait(self, after: int) -> None:
        """Returns once an event after `after` exists, or the log is closed."""
        while self.sequence <= after and not self.closed:
            future = asyncio.get_running_loop().create_future()
            self._waiting.add(future)
            if self.sequence > after:
                self._waiting.discard(future)
                return
            await future
