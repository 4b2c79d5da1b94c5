"""Leases: what a client holds between the two phases of a store or a load.

- A store lease owns the slots reserved for pages being written; Commit makes
  them visible, Abort or expiry frees them.
- A load lease pins committed pages so they cannot be evicted while a client
  reads them; Release or expiry unpins them.

Every lease has a deadline, so a client that dies leaks nothing. Ids are random
63-bit numbers: an id from before a daemon restart never names a new lease.
"""

from __future__ import annotations

import enum
import heapq
import secrets
from dataclasses import dataclass, field
from typing import Any


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
    keys: list[bytes] = field(default_factory=list)  # store: every key of the request, in chain order
    writer_active: bool = False  # an inline Put is writing the pages
    broken: str = ""  # why the pages cannot be committed (a Put that failed part-way)
    gpu_pools: frozenset[int] = frozenset()  # load: the GPU pools its reader opened


class LeaseTable:
    def __init__(self) -> None:
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
        keys: list[bytes] | None = None,
    ) -> Lease:
        lease_id = secrets.randbits(63) or 1
        while lease_id in self._leases:
            lease_id = secrets.randbits(63) or 1
        lease = Lease(lease_id, namespace, kind, entries, expires_at, keys or [])
        self._leases[lease_id] = lease
        heapq.heappush(self._deadlines, (expires_at, lease_id))
        return lease

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
