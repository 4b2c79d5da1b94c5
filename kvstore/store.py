"""The store: the page index, two-phase stores and loads under leases, pins, housekeeping.

Every call is a few dict operations on the daemon's event loop. The state: `store_state`;
the load path (Lookup, Acquire, Release, Get): `store_loads`; the store path (Reserve, Put,
Commit, Abort): `store_writes`; room in the CPU tier: `eviction`; the disk and remote tiers:
`lower`; the GPU tier: `gpu_placement`. Here:

- `connect(spec)`: registers a page spec, returning its namespace.
- `renew(ns, lease_ids)`: a live client's leases last another TTL.
- `pin(ns, keys, ttl)`: keeps the stored prefix of `keys` out of eviction until the TTL ends
  (and moves it up to the GPU tier, if there is one).
- `expire(now)`: leases past their deadline are released, dropped, or fenced (store leases
  written in place); pins and quarantines end.
- `clear(ns)`, `stats()`.

A page has an arena slot (`offset`), a GPU slot (`gpu`), or both while it moves or while a
lease that read one copy still holds it; `Eviction.settle` frees the copy it no longer needs
once no lease holds it and no copy is in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.domain import MAX_KEYS_PER_REQUEST, Tier
from kvstore.errors import InvalidArgument, ResourceExhausted
from kvstore.index import Entry, Namespace, NamespaceUsage, PinResult, StoreStats, TierUsage
from kvstore.keys import chunk_keys
from kvstore.leases import LeaseKind
from kvstore.pins import PinLimitExceeded
from kvstore.spec import PageSpec
from kvstore.store_loads import Loads
from kvstore.store_writes import Writes


class Store(Loads, Writes):
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
        now = self.clock()
        renewed = []
        for lease_id in lease_ids:
            lease = self.leases.get(lease_id)
            if lease is not None and lease.namespace == ns_id and self.leases.renew(lease, now):
                renewed.append(lease_id)
        self.counters["renewed_leases"] += len(renewed)
        return renewed

    # -- pins ---------------------------------------------------------------

    def chain_keys(self, ns_id: bytes, token_ids: Sequence[int]) -> list[bytes]:
        """The keys of the full chunks of `token_ids` in this namespace (for a Pin that sends tokens)."""
        ns = self.namespaces.registered(ns_id)
        return chunk_keys(ns.id, list(token_ids), ns.spec.chunk_tokens)

    def pin(self, ns_id: bytes, keys: Sequence[bytes], ttl_s: float, shorten: bool = True) -> PinResult:
        """Keeps the stored prefix of `keys` out of eviction for `ttl_s`; pinning again moves the
        end later, or (with `shorten`: an admin's pin) wherever it says."""
        ns = self.namespaces.registered(ns_id)
        self._check_keys(keys)
        if not 0 < ttl_s <= self.max_pin_ttl_s:
            raise InvalidArgument(
                f"ttl_ms: {ttl_s * 1000:.0f} ms is outside 1..{self.max_pin_ttl_s * 1000:.0f} "
                f"(eviction.max_pin_ttl_s)"
            )
        chain: list[Entry] = []
        for key in keys:
            entry = ns.entries.get(key)
            if entry is None or not entry.committed:
                break
            chain.append(entry)
        page_bytes = ns.spec.page_bytes
        try:
            fresh = self.pins.pin([(entry, page_bytes) for entry in chain], self.clock() + ttl_s, shorten)
        except PinLimitExceeded as exc:
            raise ResourceExhausted(
                f"pinning {len(chain)} page(s) would pin {self.pins.bytes + exc.new_bytes} bytes, over "
                f"eviction.pin_fraction ({self.pin_fraction:g}) of the CPU tier ({self.pins.limit_bytes} of "
                f"{self.cpu.capacity} bytes); pin fewer chunks, let other pins expire, or raise "
                f"eviction.pin_fraction"
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
        now = self.clock() if now is None else now
        expired = self.leases.pop_expired(now)
        for lease in expired:
            if lease.kind is LeaseKind.LOAD:
                self._unpin(lease)
            elif lease.writer is not None:
                self._fence(lease, now)
            else:
                self._drop_reservation(lease)
        self.counters["expired_leases"] += len(expired)
        if self.quarantines:
            self.counters["quarantines_ended"] += self.quarantines.end_due(now)
        unpinned = self.pins.pop_expired(now)
        if unpinned:
            self.eviction.tell_stored(unpinned)
            self.counters["expired_pins"] += len(unpinned)
        return len(expired)

    def clear(self, ns_id: bytes | None = None) -> int:
        targets = [self.namespaces.registered(ns_id)] if ns_id else list(self.namespaces.values())
        cleared = 0
        for ns in targets:
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
            pages -= self.gpu_placement.pages
        tiers.append(TierUsage(Tier.CPU.name.lower(), self.cpu.bytes_used, self.cpu.capacity, pages))
        namespaces = [
            NamespaceUsage(ns.id, ns.spec.model, ns.pages, ns.spec.page_bytes, self.tenant, ns.spec.contents)
            for ns in self.namespaces.values()
        ]
        counters: dict[str, float] = dict(self.counters)
        counters.update(self.leases.figures())
        counters.update(self.quarantines.figures())
        counters["pinned_pages"] = len(self.pins)
        counters["pinned_bytes"] = self.pins.bytes
        counters["namespaces"] = len(self.namespaces)
        counters["arena_reserved_bytes"] = self.cpu.reserved_bytes  # below capacity: still reserving
        if self.lower is not None:
            tiers += self.lower.usage(server_usage)
            counters.update(self.lower.figures())
        return StoreStats(tiers, namespaces, counters)
