"""The store: the page index, two-phase stores and loads under leases, pins, housekeeping.

Every call is a few dict operations on the daemon's event loop. `Store` is the one class the
handlers talk to. It is built from a CPU tier, its policy and one `StoreSettings`
(`store_settings`), with the tiers below and beside the arena where the daemon has them, and
owns its parts, each given what it needs at construction:

- `state` (`store_state.StoreState`): the index, leases, quarantines, pins, counters, events;
- `eviction` (`kvstore.store.eviction`): room in the CPU tier. It hands the pages it evicts to the
  lower tiers' write-behind (`lower.WriteBehind`), and a page that leaves the GPU tier to that
  tier's own pages (`gpu_placement.GpuPages`): both built first and given to it;
- `lower` (`kvstore.store.lower`, the disk and remote tiers) and `gpu_placement` (the GPU tier),
  each given the eviction; None where the daemon has no such tier;
- `loads` (`store_loads.Loads`: Lookup, Acquire, Release, Get) and `writes`
  (`store_writes.Writes`: Reserve, Put, Commit, Abort), each given the state and the parts
  above; the store's calls of those paths are theirs;
- `lends` (`kvstore.store.lends.Lends`): workers' own KV-cache blocks lent to readers on other
  GPUs (Lend, a Lookup's `lent_devices`, Returned, Lends), apart from the index: no tier holds them.

The state's objects the handlers, the metrics and the daemon read are named on the store too
(`cpu`, `policy`, `tenant`, `namespaces`, `leases`, `pins`, `counters`, `events`). Here:

- `connect(spec)`: registers a page spec, returning its namespace.
- `renew(ns, lease_ids)`: a live client's leases last another TTL.
- `pin(ns, keys, ttl)`: keeps the stored prefix of `keys` out of eviction until the TTL ends
  (and moves it up to the GPU tier, if there is one).
- `expire(now)`: leases past their deadline are released, dropped, or fenced (store leases
  written in place); pins and quarantines end.
- `clear(ns)`, `stats()`.
- The load path (`Loads`): `lookup`, `lookup_acquire` (a Lookup that answers the Acquire too),
  `lookup_each`, `acquire`, `acquire_now`, `release`, `begin_get`, `read_leased`.
- The store path (`Writes`): `reserve`, `begin_put`, `write_leased`, `end_put`, `commit`,
  `abort`.

A page has an arena slot (`offset`), a GPU slot (`gpu`), or both while it moves or while a
lease that read one copy still holds it; `Eviction.settle` frees the copy it no longer needs
once no lease holds it and no copy is in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvstore.shared.domain import MAX_KEYS_PER_REQUEST, Tier
from kvstore.shared.errors import InvalidArgument, ResourceExhausted
from kvstore.shared.keys import chunk_keys
from kvstore.shared.peers import Peer
from kvstore.shared.spec import PageSpec
from kvstore.store.events import EventLog
from kvstore.store.eviction import Eviction
from kvstore.store.index import (
    AcquireResult,
    Entry,
    LookupResult,
    Namespace,
    NamespaceUsage,
    PinResult,
    ReserveResult,
    StoreStats,
    TierUsage,
)
from kvstore.store.leases import Lease, LeaseKind
from kvstore.store.lends import Lends
from kvstore.store.lower import LowerTiers, WriteBehind
from kvstore.store.pins import PinLimitExceeded
from kvstore.store.policy import EvictionPolicy
from kvstore.store.store_loads import Loads
from kvstore.store.store_settings import StoreSettings
from kvstore.store.store_state import StoreParts, StoreState
from kvstore.store.store_writes import Writes
from kvstore.tiers.cpu import CpuTier

if TYPE_CHECKING:
    from kvstore.store.gpu_placement import GpuPages, GpuPlacement
    from kvstore.tiers.disk import DiskTier
    from kvstore.tiers.gpu import GpuTier
    from kvstore.tiers.remote import RemoteTier


class Store:
    def __init__(
        self,
        cpu: CpuTier,
        policy: EvictionPolicy,
        settings: StoreSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        disk: DiskTier | None = None,
        remote: RemoteTier | None = None,
        gpu: GpuTier | None = None,
        gpu_policy: EvictionPolicy | None = None,
        events: EventLog | None = None,
    ) -> None:
        """`policy` orders the CPU tier's pages, `gpu_policy` the GPU tier's (by default one of
        the same kind); `events`: the log of the pages entering and leaving the tiers (a daemon's
        tenants' stores share one)."""
        self.settings = settings
        self.state = state = StoreState(cpu, settings, clock, events or EventLog())
        self.cpu, self.policy, self.tenant = cpu, policy, settings.tenant
        self.namespaces, self.leases, self.pins = state.namespaces, state.leases, state.pins
        self.counters, self.events = state.counters, state.events
        gpu_pages: GpuPages | None = None
        if gpu is not None:
            from kvstore.store.gpu_placement import GpuPages

            gpu_pages = GpuPages(gpu, gpu_policy or type(policy)(), state.events)
        lower_tiers = disk is not None or remote is not None
        demote = WriteBehind(cpu, disk, remote, state.counters).evicted if lower_tiers else None
        self.eviction = Eviction(cpu, policy, state.pins, state.counters, state.events, demote, gpu_pages)
        self.lower = LowerTiers(cpu, disk, remote, self.eviction) if lower_tiers else None
        self.gpu_placement: GpuPlacement | None = None
        if gpu_pages is not None:
            from kvstore.store.gpu_placement import GpuPlacement

            self.gpu_placement = GpuPlacement(self.eviction, gpu_pages, settings.promote_after_hits)
        parts = StoreParts(state, self.eviction, self.lower, self.gpu_placement)
        self.loads = Loads(parts)
        self.writes = Writes(parts)
        self.lends = Lends(settings.lease_ttl_s, clock=clock)  # workers' own blocks, lent (`lends`)

    def connect(self, spec: PageSpec, device_pci_bus_id: str = "") -> Namespace:
        if not self.cpu.slots.can_hold(spec.page_bytes):
            raise InvalidArgument(
                f"a page of this spec is {spec.page_bytes} bytes, larger than a CPU-tier slab "
                f"({self.cpu.slots.slab_bytes} bytes): raise tiers.cpu.slab_bytes (and tiers.cpu.bytes) "
                f"or use smaller chunk_tokens"
            )
        ns = self.namespaces.add(spec, lambda: {lease.namespace for lease in self.leases.all()})
        if device_pci_bus_id and self.gpu_placement is not None:
            ns.gpu_pool = self.gpu_placement.gpu.pool_for(device_pci_bus_id)
        return ns

    def renew(self, ns_id: bytes, lease_ids: Sequence[int]) -> list[int]:
        """Gives the live leases among `lease_ids` another TTL from now; returns those renewed."""
        self.namespaces.registered(ns_id)
        if len(lease_ids) > MAX_KEYS_PER_REQUEST:
            raise InvalidArgument(
                f"lease_ids: {len(lease_ids)} in one request; at most {MAX_KEYS_PER_REQUEST}"
            )
        now = self.state.clock()
        renewed = []
        for lease_id in lease_ids:
            lease = self.leases.get(lease_id)
            if lease is not None and lease.namespace == ns_id and self.leases.renew(lease, now):
                renewed.append(lease_id)
        self.counters["renewed_leases"] += len(renewed)
        return renewed

    # -- the load path (`store_loads`) ----------------------------------------

    def lookup(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        lease: bool = False,
        ttl_s: float | None = None,
        touch: bool = True,
        gpu_pools: Sequence[int] = (),
    ) -> LookupResult:
        """The longest stored prefix of `keys`; with `lease`, pins it (`Loads.lookup`)."""
        return self.loads.lookup(ns_id, keys, lease, ttl_s, touch, gpu_pools)

    def query(self, ns_id: bytes, keys: Sequence[bytes]) -> tuple[int, bytes]:
        """`lookup(ns_id, keys, touch=False)`'s hit count and tiers: a query, neither a use nor a lease."""
        return self.loads.query(ns_id, keys)

    def lookup_acquire(
        self, ns_id: bytes, keys: Sequence[bytes], ttl_s: float | None = None, gpu_pools: Sequence[int] = ()
    ) -> tuple[LookupResult, AcquireResult | None]:
        """A leased Lookup and, where nothing must be waited for, its Acquire's answer."""
        return self.loads.lookup_acquire(ns_id, keys, ttl_s, gpu_pools)

    def lookup_each(self, ns_id: bytes, keys: Sequence[bytes]) -> bytes:
        """The tier of each of `keys` on its own (`Tier.NONE` where it is not stored)."""
        return self.loads.lookup_each(ns_id, keys)

    async def acquire(self, ns_id: bytes, lease_id: int) -> AcquireResult:
        """The lease's ready pages, once those still read in have landed (or timed out)."""
        return await self.loads.acquire(ns_id, lease_id)

    def acquire_now(self, ns_id: bytes, lease_id: int) -> AcquireResult | None:
        """`acquire`'s answer if it needs no waiting, else None."""
        return self.loads.acquire_now(ns_id, lease_id)

    def release(self, ns_id: bytes, lease_id: int) -> int:
        return self.loads.release(ns_id, lease_id)

    async def begin_get(self, ns_id: bytes, lease_id: int) -> tuple[Lease, AcquireResult]:
        """A load lease and its pages (`acquire`), for one inline Get."""
        return await self.loads.begin_get(ns_id, lease_id)

    def read_leased(self, lease: Lease, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` in the arena, while `lease` holds them."""
        return self.loads.read_leased(lease, offset, length)

    # -- the store path (`store_writes`) --------------------------------------

    def reserve(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        ttl_s: float | None = None,
        writer: Peer | None = None,
        gpu_bus_id: str = "",
    ) -> ReserveResult:
        """Slots for the keys not stored yet, under one store lease (`Writes.reserve`)."""
        return self.writes.reserve(ns_id, keys, ttl_s, writer, gpu_bus_id)

    def begin_put(self, ns_id: bytes, lease_id: int) -> tuple[Lease, AcquireResult]:
        """Claims a store lease for one inline Put; a second concurrent Put is refused."""
        return self.writes.begin_put(ns_id, lease_id)

    def write_leased(self, lease: Lease, offset: int, data: memoryview, within: int) -> None:
        """Writes `data` at `within` bytes into the page at `offset`, while `lease` holds it."""
        self.writes.write_leased(lease, offset, data, within)

    def end_put(self, lease: Lease, error: str = "") -> None:
        self.writes.end_put(lease, error)

    def commit(self, ns_id: bytes, lease_id: int, count: int = 0) -> int:
        """Makes the lease's next `count` new pages visible (0: all it has left); returns how many."""
        return self.writes.commit(ns_id, lease_id, count)

    def abort(self, ns_id: bytes, lease_id: int) -> int:
        """Frees the slots of the pages the lease has not committed; returns how many."""
        return self.writes.abort(ns_id, lease_id)

    # -- pins ---------------------------------------------------------------

    def chain_keys(self, ns_id: bytes, token_ids: Sequence[int]) -> list[bytes]:
        """The keys of the full chunks of `token_ids` in this namespace (for a Pin that sends tokens)."""
        ns = self.namespaces.registered(ns_id)
        return chunk_keys(ns.id, list(token_ids), ns.spec.chunk_tokens)

    def pin(self, ns_id: bytes, keys: Sequence[bytes], ttl_s: float, shorten: bool = True) -> PinResult:
        """Keeps the stored prefix of `keys` out of eviction for `ttl_s`; pinning again moves the
        end later, or (with `shorten`: an admin's pin) wherever it says."""
        ns = self.namespaces.registered(ns_id)
        self.state.check_keys(keys)
        max_ttl_s = self.settings.max_pin_ttl_s
        if not 0 < ttl_s <= max_ttl_s:
            raise InvalidArgument(
                f"ttl_ms: {ttl_s * 1000:.0f} ms is outside 1..{max_ttl_s * 1000:.0f} (eviction.max_pin_ttl_s)"
            )
        chain: list[Entry] = []
        for key in keys:
            entry = ns.entries.get(key)
            if entry is None or not entry.committed:
                break
            chain.append(entry)
        page_bytes = ns.spec.page_bytes
        try:
            fresh = self.pins.pin(
                [(entry, page_bytes) for entry in chain], self.state.clock() + ttl_s, shorten
            )
        except PinLimitExceeded as exc:
            raise ResourceExhausted(
                f"pinning {len(chain)} page(s) would pin {self.pins.bytes + exc.new_bytes} bytes, over "
                f"eviction.pin_fraction ({self.settings.pin_fraction:g}) of the CPU tier "
                f"({self.pins.limit_bytes} of {self.cpu.capacity} bytes); pin fewer chunks, let other "
                f"pins expire, or raise eviction.pin_fraction"
            ) from None
        for entry in fresh:
            self.eviction.policy_of(entry).remove(entry)
        self.counters["pinned_chunks"] += len(fresh)
        if self.gpu_placement is not None:
            self.gpu_placement.promote(chain, protected=chain)
        return PinResult(len(chain), len(self.pins), self.pins.bytes)

    # -- housekeeping -------------------------------------------------------

    def expire(self, now: float | None = None) -> int:
        """Ends leases and pins past their deadline; returns the number of leases."""
        now = self.state.clock() if now is None else now
        expired = self.leases.pop_expired(now)
        for lease in expired:
            if lease.kind is LeaseKind.LOAD:
                self.loads.unpin(lease)
            elif lease.writer is not None:
                self.writes.fence(lease, now)
            else:
                self.writes.drop_reservation(lease)
        self.counters["expired_leases"] += len(expired)
        quarantines = self.state.quarantines
        if quarantines:
            self.counters["quarantines_ended"] += quarantines.end_due(now)
        unpinned = self.pins.pop_expired(now)
        if unpinned:
            self.eviction.tell_stored(unpinned)
            self.counters["expired_pins"] += len(unpinned)
        return len(expired)

    def clear(self, ns_id: bytes | None = None) -> int:
        targets = [self.namespaces.registered(ns_id)] if ns_id else list(self.namespaces.values())
        cleared = 0
        for ns in targets:
            self.lends.clear(ns.id)
            for entry in [e for e in ns.entries.values() if e.committed]:
                self.eviction.remove(entry)
                cleared += 1
        if self.lower is not None:
            cleared += self.lower.clear(ns_id)
        self.counters["cleared_chunks"] += cleared
        return cleared

    def stats(self, server_usage: bool = True) -> StoreStats:
        """The store's figures; `server_usage=False` leaves out the remote server's memory and keys
        (a round trip to it), which the metrics exporter asks for from its own thread."""
        pages = sum(ns.pages for ns in self.namespaces.values())
        tiers = []
        if self.gpu_placement is not None:
            tiers.append(self.gpu_placement.usage())
            pages -= self.gpu_placement.gpu_pages.count
        tiers.append(TierUsage(Tier.CPU.name.lower(), self.cpu.bytes_used, self.cpu.capacity, pages))
        namespaces = [
            NamespaceUsage(ns.id, ns.spec.model, ns.pages, ns.spec.page_bytes, self.tenant, ns.spec.contents)
            for ns in self.namespaces.values()
        ]
        counters: dict[str, float] = dict(self.counters)
        counters.update(self.leases.figures())
        counters.update(self.state.quarantines.figures())
        counters["pinned_pages"] = len(self.pins)
        counters["pinned_bytes"] = self.pins.bytes
        counters["namespaces"] = len(self.namespaces)
        counters.update(self.lends.counters)
        counters["lends_held"] = len(self.lends)
        counters["arena_reserved_bytes"] = self.cpu.reserved_bytes  # below capacity: still reserving
        if self.lower is not None:
            tiers += self.lower.usage(server_usage)
            counters.update(self.lower.figures())
        return StoreStats(tiers, namespaces, counters)
