"""The store's state, in one place, and the checks every call makes.

`Store` (`kvstore.store.store`) owns one `StoreState` and hands it to its parts: the load path
(`store_loads.Loads`) and the store path (`store_writes.Writes`). What the fields hold:

- `cpu`: the CPU tier (the arena, in slabs); `settings`: the store's `StoreSettings`;
  `clock`: the time leases and pins are measured in.
- `namespaces`: the index, each namespace's entries by key (`kvstore.store.index`).
- `leases`: store and load leases by id; `quarantines`: the slots of expired store leases
  written in place, kept from reuse while their writer may still write (`kvstore.store.leases`).
- `pins`: pages kept out of eviction until a deadline (`kvstore.store.pins`).
- `counters`: the figures `stats()` reports; `events`: every page that enters or leaves a tier
  (`kvstore.store.events`, one log shared by a daemon's tenants' stores).

The checks: `check_keys(keys)` (at most MAX_KEYS_PER_REQUEST), `ttl(ttl_s)` (a request's lease
TTL, or the default), `lease(ns, lease_id, kind)` (a live lease of that namespace and kind).

`StoreParts`: what the loads and the writes are given (the state, the eviction, the lower tiers,
the GPU placement), one tuple for both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvstore.shared.domain import MAX_KEYS_PER_REQUEST
from kvstore.shared.errors import InvalidArgument
from kvstore.store.events import EventLog
from kvstore.store.index import Entry, Namespaces
from kvstore.store.leases import Lease, LeaseKind, LeaseTable, Quarantines
from kvstore.store.pins import PinTable
from kvstore.store.store_settings import StoreSettings
from kvstore.tiers.cpu import CpuTier

if TYPE_CHECKING:
    from kvstore.store.eviction import Eviction
    from kvstore.store.gpu_placement import GpuPlacement
    from kvstore.store.lower import LowerTiers

MAX_NAMESPACES = 4096


class StoreState:
    def __init__(
        self, cpu: CpuTier, settings: StoreSettings, clock: Callable[[], float], events: EventLog
    ) -> None:
        self.cpu = cpu
        self.settings = settings
        self.clock = clock
        self.tenant = settings.tenant
        self.namespaces = Namespaces(settings.max_namespaces or MAX_NAMESPACES, settings.tenant)
        self.leases = LeaseTable(max_age_s=settings.max_lease_ttl_s)
        self.quarantines = Quarantines(settings.quarantine_s, cpu.slots.free)  # expired store leases' slots
        self.pins: PinTable[Entry] = PinTable(int(settings.pin_fraction * cpu.capacity))
        self.counters: Counter[str] = Counter()
        self.events = events

    def check_keys(self, keys: Sequence[bytes]) -> None:
        if len(keys) > MAX_KEYS_PER_REQUEST:
            raise InvalidArgument(f"keys: {len(keys)} keys in one request; at most {MAX_KEYS_PER_REQUEST}")

    def ttl(self, ttl_s: float | None) -> float:
        settings = self.settings
        if ttl_s is None or ttl_s == 0:
            ttl_s = settings.lease_ttl_s
        if not 0 < ttl_s <= settings.max_lease_ttl_s:
            raise InvalidArgument(
                f"lease_ttl_ms: {ttl_s * 1000:.0f} ms is outside 1..{settings.max_lease_ttl_s * 1000:.0f} "
                f"(leases.max_ttl_s)"
            )
        return ttl_s

    def lease(self, ns_id: bytes, lease_id: int, kind: LeaseKind) -> Lease:
        self.namespaces.registered(ns_id)
        return self.leases.held(ns_id, lease_id, kind)


class StoreParts(NamedTuple):
    """What the store's loads and writes are given: its state, and the parts that move pages
    (the eviction, the lower tiers, the GPU placement)."""

    state: StoreState
    eviction: Eviction
    lower: LowerTiers | None
    placement: GpuPlacement | None
