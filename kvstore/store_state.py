"""The store's state, in one place, and the checks every call makes.

`Store` (`kvstore.store`) is this state with its calls: the load path (`store_loads.Loads`),
the store path (`store_writes.Writes`) and the rest (`kvstore.store`). What the fields hold:

- `namespaces`: the index, each namespace's entries by key (`kvstore.index`).
- `leases`: store and load leases by id; `quarantines`: the slots of expired store leases
  written in place, kept from reuse while their writer may still write (`kvstore.leases`).
- `pins`: pages kept out of eviction until a deadline (`kvstore.pins`).
- `eviction`: room in the CPU tier and what becomes of a page that leaves the index
  (`kvstore.eviction`); `lower`: the disk and remote tiers (`kvstore.lower`);
  `gpu_placement`: the GPU tier (`kvstore.gpu_placement`).
- `counters`: the figures `stats()` reports; `events`: every page that enters or leaves a tier
  (`kvstore.events`, one log shared by a daemon's tenants' stores).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvstore.domain import MAX_KEYS_PER_REQUEST, Tier
from kvstore.errors import InvalidArgument
from kvstore.events import EventKind, EventLog
from kvstore.eviction import Eviction
from kvstore.index import Entry, Namespaces
from kvstore.leases import Lease, LeaseKind, LeaseTable, Quarantines
from kvstore.lower import LowerTiers
from kvstore.pins import PinTable
from kvstore.policy import EvictionPolicy
from kvstore.tiers.cpu import CpuTier

if TYPE_CHECKING:
    from kvstore.gpu_placement import GpuPlacement
    from kvstore.tiers.disk import DiskTier
    from kvstore.tiers.gpu import GpuTier
    from kvstore.tiers.remote import RemoteTier

MAX_NAMESPACES = 4096


class StoreState:
    def __init__(
        self,
        cpu: CpuTier,
        policy: EvictionPolicy,
        lease_ttl_s: float,
        max_lease_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        pin_fraction: float = 0.1,
        max_pin_ttl_s: float = 86400.0,
        disk: DiskTier | None = None,
        gpu: GpuTier | None = None,
        gpu_policy: EvictionPolicy | None = None,
        promote_after_hits: int = 2,
        remote: RemoteTier | None = None,
        quarantine_s: float = 300.0,
        tenant: str = "",
        max_namespaces: int | None = None,
        events: EventLog | None = None,
    ) -> None:
        self.cpu = cpu
        self.policy = policy
        self.lease_ttl_s = lease_ttl_s
        self.max_lease_ttl_s = max_lease_ttl_s
        self.clock = clock
        self.pin_fraction = pin_fraction
        self.max_pin_ttl_s = max_pin_ttl_s
        self.pins: PinTable[Entry] = PinTable(int(pin_fraction * cpu.capacity))
        self.tenant = tenant  # whose pages these are ("": a daemon without tenants)
        self.namespaces = Namespaces(max_namespaces or MAX_NAMESPACES, tenant)
        self.leases = LeaseTable(max_age_s=max_lease_ttl_s)
        self.quarantines = Quarantines(quarantine_s, cpu.slots.free)  # expired store leases' slots
        self.counters: Counter[str] = Counter()
        self.events = events or EventLog()  # every page entering or leaving a tier (kvstore.events)
        self.eviction = Eviction(cpu, policy, self.pins, self.counters, events=self.events)
        self.lower: LowerTiers | None = None
        if disk is not None:
            disk.listen(self._disk_told)
        if disk is not None or remote is not None:
            self.lower = LowerTiers(cpu, disk, remote, self.eviction)
            self.eviction.demote = self.lower.evicted
        self.gpu_placement: GpuPlacement | None = None
        if gpu is not None:
            from kvstore.gpu_placement import GpuPlacement

            gpu_policy = gpu_policy or type(policy)()
            self.gpu_placement = GpuPlacement(self.eviction, gpu, gpu_policy, promote_after_hits)
            self.eviction.placement = self.gpu_placement

    def _disk_told(self, stored: bool, ident: tuple[bytes, bytes], reason: str) -> None:
        """A disk record indexed or dropped, as a KV event."""
        kind = EventKind.STORED if stored else EventKind.REMOVED
        self.events.add(kind, Tier.DISK, ident[0], ident[1], b"", reason)

    def _check_keys(self, keys: Sequence[bytes]) -> None:
        if len(keys) > MAX_KEYS_PER_REQUEST:
            raise InvalidArgument(f"keys: {len(keys)} keys in one request; at most {MAX_KEYS_PER_REQUEST}")

    def _ttl(self, ttl_s: float | None) -> float:
        if ttl_s is None or ttl_s == 0:
            ttl_s = self.lease_ttl_s
        if not 0 < ttl_s <= self.max_lease_ttl_s:
            raise InvalidArgument(
                f"lease_ttl_ms: {ttl_s * 1000:.0f} ms is outside 1..{self.max_lease_ttl_s * 1000:.0f} "
                f"(leases.max_ttl_s)"
            )
        return ttl_s

    def _lease(self, ns_id: bytes, lease_id: int, kind: LeaseKind) -> Lease:
        self.namespaces.registered(ns_id)
        return self.leases.held(ns_id, lease_id, kind)
