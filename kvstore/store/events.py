"""The KV-event stream: every page that enters or leaves one of this daemon's tiers, in order.

A router that sends each request to the host already holding its prefix (Dynamo's, llm-d's)
follows these events to know what each host holds, as it follows vLLM's own KV events.

- `STORED`: the page is now held in `tier` (a Commit, a page read up from disk or the remote
  tier, a page moved to the GPU tier, a record written to disk).
- `REMOVED`: the page left `tier`; `reason` says why: `evicted` (room was made), `cleared`,
  `lost` (its bytes could not be read or copied), `moved` (it went to another tier, whose
  STORED follows).
- `RESYNC`: what the consumer built from earlier events is incomplete (it fell behind the
  buffer, asked for events it no longer holds, or resumes from another daemon start): it
  starts again from a full view (`kvctl ls`, Stats) and follows the events after this one.

Sequence numbers count one stream: the daemon's (every event: what admins follow) or one
tenant's (its pages' events only, numbered 1, 2, ... on their own: what its members follow, so
that nothing in them counts another tenant's activity). Each number is one more than the one
before it in its stream. The numbering restarts with each daemon start, whose `epoch` (random,
never 0) every event carries: a consumer that reconnects asks for the events after the last one
it saw (`since`, with that event's epoch) and loses nothing while the buffer
(`server.events_buffer` events, per stream) still holds them; a `since` from another epoch gets
a RESYNC. Memory is bounded by the buffers whatever consumers do. The remote tier is shared by
many hosts and evicts on its own: its pages are not reported here.

`add` (and `add_many`, a batch of one kind: a Commit's pages, under one lock and one wake-up)
may be called from any thread (the disk tier's workers call it); consumers wait on the
event loop (`wait`), woken only by events they may see: those of their own stream and, where
they follow one namespace, of that namespace. `Consumers` caps the streams followed at once, in
all and per tenant, so that idle consumers cost a bounded amount.

A namespace's name (its tenant and model) is kept while its store holds the namespace (`name`
at Connect, `prune` once the store forgot it), so the names never outgrow the namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from enum import IntEnum
from typing import Any, NamedTuple

from kvstore.shared.domain import Tier
from kvstore.shared.errors import ResourceExhausted

MAX_SCAN = 8192  # events looked at per read
MAX_EPOCH = (1 << 53) - 1  # exact as a double: JSON consumers (a router in JavaScript) read it whole
MAX_STREAMS = 256  # Events streams followed at once, in all
MAX_STREAMS_PER_TENANT = 64  # and per tenant (the admins' count as one more)


class EventKind(IntEnum):
    STORED = 1
    REMOVED = 2
    RESYNC = 3


class Event(NamedTuple):
    sequence: int  # in the stream it was read from
    kind: EventKind
    tier: Tier
    namespace: bytes
    key: bytes
    parent: bytes = b""  # the key of the chunk before it, where the daemon knows it
    reason: str = ""
    tenant: str = ""  # whose page it is ("": no tenants, or a namespace not yet named)


_as_event = tuple.__new__  # an Event of its fields, without NamedTuple's own __new__ in Python


class _Stream:
    """One numbering of events, in a ring of the last `capacity`; its consumers' waiting futures."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.ring: list[tuple[Any, ...] | None] = [None] * capacity  # event `s`'s fields at s % capacity
        self.sequence = 0  # the last event's
        self.waiting: set[asyncio.Future[None]] = set()  # consumers of every event
        self.watching: dict[bytes, set[asyncio.Future[None]]] = {}  # consumers of one namespace's

    def can_wake(self, namespace: bytes) -> bool:
        return bool(self.waiting) or namespace in self.watching

    def release(self, namespace: bytes | None) -> int:
        """Wakes the consumers of every event, and those of `namespace` (None: of any); returns
        how many it woke."""
        woken = [self.waiting]
        self.waiting = set()
        if namespace is None:
            woken += self.watching.values()
            self.watching = {}
        elif namespace in self.watching:
            woken.append(self.watching.pop(namespace))
        count = 0
        for futures in woken:
            for future in futures:
                if not future.done():
                    future.set_result(None)
                    count += 1
        return count

    def append(
        self,
        kind: EventKind,
        tier: Tier,
        namespace: bytes,
        pages: Sequence[tuple[bytes, bytes]],
        reason: str,
        tenant: str,
    ) -> None:
        """One event for each (key, parent) of `pages`, in order (held as plain tuples, made
        `Event`s when read: a Reserve into a full arena adds one for each page it evicts)."""
        ring, capacity, sequence = self.ring, self.capacity, self.sequence
        for key, parent in pages:
            sequence += 1
            ring[sequence % capacity] = (sequence, kind, tier, namespace, key, parent, reason, tenant)
        self.sequence = sequence

    def read(
        self, after: int, limit: int, keep: Callable[[Event], bool] | None, resync: str
    ) -> tuple[list[Event], int]:
        last = self.sequence
        if after > last and not resync:
            resync = "since is past this stream's last event"
        if after >= last and not resync:
            return [], last
        oldest = last - min(last, self.capacity) + 1
        out: list[Event] = []
        if after < oldest - 1 and not resync:
            resync = "fell behind"
        if resync:  # what the consumer holds is incomplete: a RESYNC, then the oldest event held
            out.append(Event(oldest - 1, EventKind.RESYNC, Tier.NONE, b"", b"", b"", resync))
            after = oldest - 1
        ring, capacity = self.ring, self.capacity
        sequence, stop = after, min(last, after + MAX_SCAN)
        while sequence < stop:
            sequence += 1
            held = ring[sequence % capacity]
            if held is None:
                continue
            event = _as_event(Event, held)
            if keep is None or keep(event):
                out.append(event)
                if len(out) >= limit:
                    break
        return out, sequence


class EventLog:
    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self.epoch = 1 + secrets.randbelow(MAX_EPOCH)  # this daemon start's
        self._all = _Stream(capacity)
        self._tenants: dict[str, _Stream] = {}  # a stream per tenant that has events
        self._lock = threading.Lock()
        self._names: dict[bytes, tuple[str, str]] = {}  # namespace -> (tenant, model)
        self._named: Counter[str] = Counter()  # names held per tenant
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self.closed = False
        self.num_woken = 0  # consumers' waits ended by an event (Stats: event_wakeups)

    @property
    def sequence(self) -> int:
        """The daemon's last event's sequence number."""
        return self._all.sequence

    def last(self, tenant: str | None) -> int:
        """The last event's sequence number in `tenant`'s stream (None: the daemon's)."""
        return self._stream(tenant).sequence

    def _stream(self, tenant: str | None) -> _Stream:
        if tenant is None:
            return self._all
        stream = self._tenants.get(tenant)
        if stream is None:
            with self._lock:
                stream = self._tenants.setdefault(tenant, _Stream(self.capacity))
        return stream

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop consumers wait on (the daemon's)."""
        self._loop, self._loop_thread = loop, threading.get_ident()

    def name(self, namespace: bytes, tenant: str, model: str) -> None:
        """What a namespace's events say of it, and whose stream they join (registered at Connect)."""
        if namespace not in self._names:
            self._named[tenant] += 1
        self._names[namespace] = (tenant, model)

    def names(self, namespace: bytes) -> tuple[str, str]:
        return self._names.get(namespace, ("", ""))

    @property
    def num_names(self) -> int:
        return len(self._names)

    def prune(self, tenant: str, live: Collection[bytes]) -> None:
        """Forgets the names of `tenant`'s namespaces that are not `live` (its store forgot them),
        when it holds more names than that store has namespaces. A later event of such a
        namespace (a disk record dropped) goes to the daemon's stream alone, as before any
        Connect named it."""
        if self._named[tenant] <= len(live):
            return
        for namespace in [ns for ns, (owner, _) in self._names.items() if owner == tenant and ns not in live]:
            del self._names[namespace]
            self._named[tenant] -= 1

    def add(
        self, kind: EventKind, tier: Tier, namespace: bytes, key: bytes, parent: bytes = b"", reason: str = ""
    ) -> None:
        self.add_many(kind, tier, namespace, ((key, parent),), reason)

    def add_many(
        self,
        kind: EventKind,
        tier: Tier,
        namespace: bytes,
        pages: Sequence[tuple[bytes, bytes]],
        reason: str = "",
    ) -> None:
        """One event of `kind` for each (key, parent) of `pages`, in order, under one lock; the
        consumers are woken once."""
        if not pages:
            return
        tenant = self._names.get(namespace, ("", ""))[0]
        with self._lock:
            self._all.append(kind, tier, namespace, pages, reason, tenant)
            own = None
            if tenant:  # a daemon without tenants has the one stream
                own = self._own_stream(tenant)
                own.append(kind, tier, namespace, pages, reason, tenant)
        if self._all.can_wake(namespace) or (own is not None and own.can_wake(namespace)):
            self._wake(own, namespace)

    def _own_stream(self, tenant: str) -> _Stream:
        """`tenant`'s stream, made at its first event (called with the lock held)."""
        own = self._tenants.get(tenant)
        if own is None:
            own = self._tenants[tenant] = _Stream(self.capacity)
        return own

    def _wake(self, own: _Stream | None, namespace: bytes) -> None:
        if threading.get_ident() == self._loop_thread:
            self._release(own, namespace)
        elif self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the daemon stopped
                self._loop.call_soon_threadsafe(self._release, own, namespace)

    def _release(self, own: _Stream | None, namespace: bytes | None) -> None:
        self.num_woken += self._all.release(namespace)
        if own is not None:
            self.num_woken += own.release(namespace)

    def read(
        self,
        after: int,
        limit: int,
        keep: Callable[[Event], bool] | None = None,
        tenant: str | None = None,
        resync: str = "",
    ) -> tuple[list[Event], int]:
        """Up to `limit` events of `tenant`'s stream (None: the daemon's) after sequence `after`
        that `keep` accepts, and the sequence read up to (at most MAX_SCAN events are looked at
        per call, so a consumer that filters most out holds the lock briefly). A RESYNC event
        comes first where events after `after` are gone from the buffer, where `after` is past
        the stream's last event, or where `resync` gives a reason (the events then follow from
        the oldest the buffer holds)."""
        stream = self._stream(tenant)
        with self._lock:
            return stream.read(after, limit, keep, resync)

    def close(self) -> None:
        """The daemon stops: consumers' streams end."""
        self.closed = True
        for stream in [self._all, *self._tenants.values()]:
            stream.release(None)

    async def wait(self, after: int, tenant: str | None = None, namespace: bytes = b"") -> None:
        """Returns once an event after `after` exists in `tenant`'s stream (of `namespace`, if
        given: events of other namespaces do not wake the caller), or the log is closed."""
        stream = self._stream(tenant)
        while stream.sequence <= after and not self.closed:
            future = asyncio.get_running_loop().create_future()
            waiters = stream.watching.setdefault(namespace, set()) if namespace else stream.waiting
            waiters.add(future)
            try:
                if stream.sequence > after or self.closed:
                    return
                await future
            finally:  # a consumer that went away leaves nothing behind (nor an empty set)
                waiters.discard(future)
                if namespace and not waiters and stream.watching.get(namespace) is waiters:
                    del stream.watching[namespace]


class Consumers:
    """The Events streams followed at once, by owner (a tenant; None: the admins): at most
    `max_streams` in all and `max_per_tenant` per owner. An idle stream costs the daemon
    little, but not nothing, and a tenant's must not keep another's out."""

    def __init__(self, max_streams: int = MAX_STREAMS, max_per_tenant: int = MAX_STREAMS_PER_TENANT) -> None:
        self.max_streams = max_streams
        self.max_per_tenant = max_per_tenant
        self._open: Counter[str | None] = Counter()
        self.refused = 0

    def __len__(self) -> int:
        return self._open.total()

    def open(self, owner: str | None) -> None:
        """Counts a new stream of `owner`'s; ResourceExhausted past a cap."""
        whose = "the admins" if owner is None else f"tenant {owner!r}" if owner else "this daemon's clients"
        if self._open[owner] >= self.max_per_tenant:
            self.refused += 1
            raise ResourceExhausted(
                f"Events: {whose} already follow {self._open[owner]} event streams, at most "
                f"{self.max_per_tenant} per tenant: close one (a consumer needs one stream; "
                f"filter by namespace on it)"
            )
        if len(self) >= self.max_streams:
            self.refused += 1
            raise ResourceExhausted(
                f"Events: the daemon already serves {len(self)} event streams, at most "
                f"{self.max_streams}: try again once one closes"
            )
        self._open[owner] += 1

    def close(self, owner: str | None) -> None:
        self._open[owner] -= 1
        if not self._open[owner]:
            del self._open[owner]
