"""Leases: what a client holds between the two phases of a store or a load.

- A store lease owns the slots reserved for pages being written; Commit makes
  them visible, Abort or expiry frees them. A Commit may make only the next few
  visible (`commit_count`): the lease then holds the rest, and ends with its last.
- A load lease pins committed pages so they cannot be evicted while a client
  reads them; Release or expiry unpins them.

Every lease has a deadline, so a client that dies leaks nothing; a live client
renews its leases (`renew`) to keep them past their TTL. Ids are random 63-bit
numbers: an id from before a daemon restart never names a new lease.

A store lease whose client writes in place (`writer` set) and that expires is
fenced: its slots stay allocated, out of the index, until its writer is gone,
its client ends it (Commit or Abort: it has stopped writing), or
`leases.quarantine_s` passes, so a writer that stalled can never write into a
slot that holds someone else's page (`Quarantine`).
"""

from __future__ import annotations

import enum
import heapq
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.shared.errors import FailedPrecondition, NotFound, ResourceExhausted
from kvstore.shared.peers import Peer

# Pages all of a store's leases may hold at once (a list entry each): a lease may name one page
# many times, so this, not the arena, bounds what leases cost.
MAX_LEASED_ENTRIES = 1 << 20

log = logging.getLogger(__name__)

WRITER_CHECK_S = 1.0  # how often a quarantine looks whether its writer is gone


class LeaseKind(enum.Enum):
    STORE = "store"
    LOAD = "load"


@dataclass(eq=False)
class Lease:
    id: int
    namespace: bytes
    kind: LeaseKind
    entries: list[Any]  # store: the reserved entries; load: the pinned hit entries, in chain order
    expires_at: float
    ttl_s: float  # a renewal moves the deadline to now + this
    keys: list[bytes] = field(default_factory=list)  # store: every key of the request, in chain order
    writer: Peer | None = None  # store: the process writing the slots in place (None: inline Put only)
    writer_active: bool = False  # an inline Put is writing the pages
    broken: str = ""  # why the pages cannot be committed (a Put that failed part-way)
    gpu_pools: frozenset[int] = frozenset()  # load: the GPU pools its reader opened
    renew_until: float = 0.0  # no renewal takes the deadline past this (leases.max_ttl_s after it began)
    committed: int = 0  # store: how many of `entries` (the first ones) earlier Commits made visible
    linked: int = 0  # store: how many of `keys` (the first ones) those Commits linked into the chain

    @property
    def pending(self) -> list[Any]:
        """Store: the entries not committed yet, which the lease still owns."""
        return self.entries[self.committed :] if self.committed else self.entries


class LeaseTable:
    def __init__(self, max_age_s: float = float("inf"), max_entries: int = MAX_LEASED_ENTRIES) -> None:
        self.max_age_s = max_age_s  # renewals end this long after a lease began
        self.max_entries = max_entries  # pages all leases may hold together (a lease may name one often)
        self.entries = 0
        self._leases: dict[int, Lease] = {}
        self._deadlines: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self._leases)

    def add(
        self,
        namespace: bytes,
        kind: LeaseKind,
        entries: list[Any],
        expires_at: float,
        ttl_s: float,
        keys: list[bytes] | None = None,
        writer: Peer | None = None,
    ) -> Lease:
        if self.entries + len(entries) > self.max_entries:
            raise ResourceExhausted(
                f"leases hold {self.entries} pages; {len(entries)} more would pass {self.max_entries}: "
                f"release leases (or let them expire) first"
            )
        self.entries += len(entries)
        lease_id = secrets.randbits(63) or 1
        while lease_id in self._leases:
            lease_id = secrets.randbits(63) or 1
        lease = Lease(lease_id, namespace, kind, entries, expires_at, ttl_s, keys or [], writer)
        lease.renew_until = expires_at - ttl_s + max(ttl_s, self.max_age_s)
        self._leases[lease_id] = lease
        heapq.heappush(self._deadlines, (expires_at, lease_id))
        return lease

    def renew(self, lease: Lease, now: float) -> bool:
        """Moves the lease's deadline to `now + ttl_s`, but not past `renew_until` (a client that
        forgot a lease cannot keep it for ever); whether it moved. Its old heap entry is skipped
        when due."""
        if lease.expires_at >= lease.renew_until:
            return False
        deadline = min(now + lease.ttl_s, lease.renew_until)
        if deadline > lease.expires_at:
            lease.expires_at = deadline
            heapq.heappush(self._deadlines, (deadline, lease.id))
        return True

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def commit_part(self, lease: Lease, count: int) -> None:
        """`count` more of a store lease's entries are committed: it keeps the rest only."""
        lease.committed += count
        self.entries -= count

    def pop(self, lease_id: int) -> Lease | None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self.entries -= len(lease.entries) - lease.committed
        return lease

    def pop_expired(self, now: float) -> list[Lease]:
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_at <= now:
                expired.append(self._leases.pop(lease_id))
                self.entries -= len(lease.entries) - lease.committed
        return expired

    def held(self, namespace: bytes, lease_id: int, kind: LeaseKind) -> Lease:
        """The live lease `lease_id` of `namespace`, of `kind`; else a NotFound or
        FailedPrecondition that says why."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.namespace != namespace:
            raise NotFound(
                f"lease {lease_id} not found in namespace {namespace.hex()[:12]}: it expired, was already "
                f"released, or belongs to another namespace"
            )
        if lease.kind is not kind:
            verb = "Commit/Abort/Put" if lease.kind is LeaseKind.STORE else "Acquire/Release/Get"
            raise FailedPrecondition(f"lease {lease_id} is a {lease.kind.value} lease: use {verb} with it")
        return lease

    def count(self, kind: LeaseKind) -> int:
        return sum(1 for lease in self._leases.values() if lease.kind is kind)

    def figures(self) -> dict[str, float]:
        leases = self._leases.values()
        return {
            "active_store_leases": self.count(LeaseKind.STORE),
            "active_load_leases": self.count(LeaseKind.LOAD),
            "active_leases": len(leases),
            "active_puts": sum(1 for lease in leases if lease.writer_active),
        }

    def all(self) -> list[Lease]:
        return list(self._leases.values())


@dataclass(eq=False)
class Quarantine:
    """The slots of an expired store lease, kept from reuse while its writer may still write."""

    lease: Lease
    offsets: list[int]
    page_bytes: int
    until: float  # leases.quarantine_s after the expiry: freed then whatever the writer does
    next_check: float = 0.0  # when to look again whether the writer is gone
    free: Callable[[int], None] | None = None  # gives a slot back (None: the arena's); a GPU pool's


class Quarantines:
    """Fenced store leases by id; `free(offset)` gives a slot back to the arena."""

    def __init__(self, quarantine_s: float, free: Callable[[int], None]) -> None:
        self.quarantine_s = quarantine_s
        self._free = free
        self._fenced: dict[int, Quarantine] = {}

    def __bool__(self) -> bool:
        return bool(self._fenced)

    def fence(
        self,
        lease: Lease,
        offsets: list[int],
        page_bytes: int,
        now: float,
        free: Callable[[int], None] | None = None,
    ) -> None:
        """Keeps `offsets` (arena slots, or those of the pool `free` gives back to) from reuse."""
        until = now + self.quarantine_s
        self._fenced[lease.id] = Quarantine(lease, offsets, page_bytes, until, free=free)

    def end(self, namespace: bytes, lease_id: int) -> Quarantine | None:
        """Frees the slots of a fenced lease of `namespace`, if `lease_id` is one; it, or None."""
        fenced = self._fenced.get(lease_id)
        if fenced is None or fenced.lease.namespace != namespace:
            return None
        del self._fenced[lease_id]
        free = fenced.free or self._free
        for offset in fenced.offsets:
            free(offset)
        return fenced

    def end_due(self, now: float) -> int:
        """Frees the quarantines whose writer is gone (looked at every WRITER_CHECK_S) or whose
        time is up; returns how many."""
        ended = 0
        for lease_id, fenced in list(self._fenced.items()):
            writer = fenced.lease.writer
            if now < fenced.until:
                if now < fenced.next_check:
                    continue
                fenced.next_check = now + WRITER_CHECK_S
                if writer is None or not writer.gone():
                    continue
            elif writer is not None and writer.pid and not writer.gone():
                log.warning(
                    "lease %d: its writer (pid %d) is alive but stalled for leases.quarantine_s; its %d "
                    "fenced slots are reused now",
                    lease_id,
                    writer.pid,
                    len(fenced.offsets),
                )
            self.end(fenced.lease.namespace, lease_id)
            ended += 1
        return ended

    def figures(self) -> dict[str, float]:
        fenced = self._fenced.values()
        return {
            "quarantined_pages": sum(len(q.offsets) for q in fenced),
            "quarantined_bytes": sum(len(q.offsets) * q.page_bytes for q in fenced),
        }
