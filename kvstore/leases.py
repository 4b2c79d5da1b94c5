"""Leases: what a client holds between the two phases of a store or a load.

- A store lease owns the slots reserved for pages being written; Commit makes
  them visible, Abort or expiry frees them.
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
import secrets
from dataclasses import dataclass, field
from typing import Any

from kvstore.peers import Peer


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


class LeaseTable:
    def __init__(self, max_age_s: float = float("inf")) -> None:
        self.max_age_s = max_age_s  # renewals end this long after a lease began
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

    def pop(self, lease_id: int) -> Lease | None:
        return self._leases.pop(lease_id, None)

    def pop_expired(self, now: float) -> list[Lease]:
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_at <= now:
                expired.append(self._leases.pop(lease_id))
        return expired

    def count(self, kind: LeaseKind) -> int:
        return sum(1 for lease in self._leases.values() if lease.kind is kind)

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
