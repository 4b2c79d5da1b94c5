"""What lives in the GPU tier: pages move up on repeated hits or a pin, and back down for room.

The store calls these on its event loop; the copies run in the GPU tier's worker threads and
end here, on the loop again (`loop.call_soon_threadsafe`). Nothing here waits for a copy.

- `hit(entries)`: counts a leased hit of each CPU-tier page; one at `promote_after_hits`
  moves up.
- `promote(entries, protected)`: moves CPU-tier pages into a GPU pool. Room is made by
  demoting the GPU tier's policy's first unleased pages into the arena (which may evict
  CPU-tier pages in turn); without room for the whole batch nothing moves.
- `readable(entries, pools)`: the pages a load lease can read: those in a pool its reader
  has not opened are copied into the arena first (Acquire waits for them); without arena
  room, the lease ends before the first of them.
- `reserve(pool, page_bytes, count, protected)`: slots for a store that lands in a pool (a
  worker writes its pages there device to device: `ReserveRequest.gpu_bus_id`), or None where
  it goes to the arena; `landed(entries)` when such pages are committed.
- `usage()`: the GPU tier's figures.

`GpuPages` holds the GPU tier's own pages: its policy, their count, and what becomes of one that
leaves the tier (`left(entry)`, `free_slot(entry)`). The eviction is given it at construction (a
page it drops may be in the GPU tier); the placement is given it and the eviction (`CpuSide`).

While a page moves up it is read from the arena; once it is up, its arena slot is freed as
soon as no lease holds it (`Eviction.settle`). A page moving down is read from the arena once
its copy lands (its `loaded` future); its GPU slot is reused at once, which is safe because
every copy into and out of a pool runs in order on that pool's one stream.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, cast

from kvstore.shared.domain import Tier
from kvstore.shared.errors import InvalidArgument, ResourceExhausted
from kvstore.store.events import EventKind, EventLog
from kvstore.store.index import COMMITTED, PIN, Entry, TierUsage
from kvstore.store.pins import PinTable
from kvstore.store.policy import EvictionPolicy
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.gpu import Copy, GpuPool, GpuTier


class CpuSide(Protocol):
    """What the placement uses of the CPU tier's eviction (`kvstore.store.eviction.Eviction`): the
    tier, its policy and pins, the store's counters and events, and three calls."""

    cpu: CpuTier
    policy: EvictionPolicy
    pins: PinTable[Entry]
    counters: Counter[str]
    events: EventLog

    def make_cpu_room(self, page_bytes: int, count: int, protected: list[Entry]) -> None: ...

    def remove(self, entry: Entry, evicted: bool = False, reason: str = "cleared") -> None: ...

    def settle(self, entry: Entry) -> None: ...


class GpuPages:
    """The pages that belong to the GPU tier: their policy and count, and the bookkeeping of one
    that leaves the tier (demoted, or dropped from the index)."""

    def __init__(self, gpu: GpuTier, policy: EvictionPolicy, events: EventLog) -> None:
        self.gpu = gpu
        self.policy = policy  # the GPU tier's own: it orders the pages in the GPU tier only
        self.events = events
        self.count = 0  # pages that belong to the GPU tier

    def left(self, entry: Entry) -> None:
        """A page leaves the GPU tier (demoted, or dropped from the index)."""
        if entry.on_gpu:
            entry.on_gpu = False
            entry.hits = 0
            self.count -= 1
            if not entry.removed:  # demoted: it stays in the index, in the CPU tier
                events, ns_id = self.events, entry.namespace.id
                events.add(EventKind.REMOVED, Tier.GPU, ns_id, entry.key, b"", "moved")
                events.add(EventKind.STORED, Tier.CPU, ns_id, entry.key, b"", "demoted")

    def free_slot(self, entry: Entry) -> None:
        self.gpu.pools[entry.pool].slots.free(entry.gpu)
        entry.gpu = -1


class GpuPlacement:
    def __init__(self, eviction: CpuSide, gpu_pages: GpuPages, promote_after_hits: int) -> None:
        self.eviction = eviction
        self.gpu_pages = gpu_pages
        self.gpu = gpu_pages.gpu
        self.policy = gpu_pages.policy  # the GPU tier's own: it orders the pages in the GPU tier only
        self.promote_after_hits = promote_after_hits
        self.counters = eviction.counters

    # -- up -----------------------------------------------------------------

    def hit(self, entries: Sequence[Entry]) -> None:
        ready: list[Entry] = []
        for entry in entries:
            if entry.gpu < 0 and entry.state & COMMITTED:
                entry.hits += 1
                if entry.hits >= self.promote_after_hits:
                    ready.append(entry)
        if ready:
            self.promote(ready, protected=list(entries))

    def promote(self, entries: Sequence[Entry], protected: Sequence[Entry]) -> None:
        batches: dict[tuple[int, int], list[Entry]] = {}
        for entry in entries:
            if not _movable_up(entry):
                continue
            pool = self._pool_for(entry)
            page_bytes = entry.namespace.spec.page_bytes
            if pool.slots.can_hold(page_bytes):
                batches.setdefault((pool.index, page_bytes), []).append(entry)
        for (index, page_bytes), batch in batches.items():
            self._promote(self.gpu.pools[index], page_bytes, batch, [*protected, *batch])

    def _pool_for(self, entry: Entry) -> GpuPool:
        preferred = entry.namespace.gpu_pool
        if preferred >= 0:
            return self.gpu.pools[preferred]
        page_bytes = entry.namespace.spec.page_bytes
        return max(self.gpu.pools, key=lambda pool: pool.slots.available(page_bytes))

    def _promote(self, pool: GpuPool, page_bytes: int, batch: list[Entry], protected: list[Entry]) -> None:
        victims = pool.slots.plan_free(page_bytes, len(batch), self._evictable(pool))
        if victims is None or not self._arena_room(victims, protected):
            self.counters["gpu_promotions_refused"] += len(batch)
            return
        loop = asyncio.get_running_loop()
        arena = self.gpu.arena_base
        copies: list[Copy] = []
        for victim in victims:  # first out, so that their slots can be filled after them in order
            size = victim.namespace.spec.page_bytes
            victim.offset = self.eviction.cpu.slots.alloc(size)
            victim.loaded = loop.create_future()
            copies.append((arena + victim.offset, pool.base + victim.gpu, size))
            self.policy.evicted(victim)
            self.gpu_pages.left(victim)
            self.gpu_pages.free_slot(victim)
            if victim not in self.eviction.pins:
                self.eviction.policy.stored([victim])
        for entry in batch:
            entry.gpu = pool.slots.alloc(page_bytes)
            entry.pool = pool.index
            entry.gpu_pending = True
            copies.append((pool.base + entry.gpu, arena + entry.offset, page_bytes))
        self.counters["gpu_demoted_chunks"] += len(victims)

        def done(ok: bool) -> None:
            _on_loop(loop, self._moved, victims, batch, ok)

        self.gpu.copy(pool, copies, done)

    def _evictable(self, pool: GpuPool) -> Iterator[tuple[int, Entry]]:
        for item in self.policy.candidates():
            entry = cast("Entry", item)
            if entry.pool == pool.index and entry.state < PIN and not entry.busy:
                yield entry.gpu, entry

    def _arena_room(self, victims: list[Entry], protected: list[Entry]) -> bool:
        """Frees arena slots for the pages moving down; False if the CPU tier cannot make room."""
        counts: dict[int, int] = {}
        for victim in victims:
            size = victim.namespace.spec.page_bytes
            counts[size] = counts.get(size, 0) + 1
        try:
            for size, count in counts.items():
                self.eviction.make_cpu_room(size, count, protected)
        except ResourceExhausted:
            return False
        return True

    def _moved(self, victims: list[Entry], batch: list[Entry], ok: bool) -> None:
        """A promotion's copies finished (on the event loop)."""
        eviction = self.eviction
        for victim in victims:
            assert victim.loaded is not None
            victim.loaded.set_result(ok)
            if not ok:
                self.counters["gpu_copy_failures"] += 1
                if not victim.removed:
                    eviction.remove(victim, reason="lost")  # its bytes are lost: a miss from now on
            eviction.settle(victim)
        for entry in batch:
            entry.gpu_pending = False
            if ok and not entry.removed:
                entry.on_gpu = True
                self.gpu_pages.count += 1
                ns_id = entry.namespace.id
                eviction.events.add(EventKind.REMOVED, Tier.CPU, ns_id, entry.key, b"", "moved")
                eviction.events.add(EventKind.STORED, Tier.GPU, ns_id, entry.key, b"", "promoted")
                if entry not in eviction.pins:
                    eviction.policy.remove(entry)
                    self.policy.stored([entry])
                self.counters["gpu_promoted_chunks"] += 1
            elif not ok:
                self.counters["gpu_copy_failures"] += 1
                self.gpu_pages.free_slot(entry)
            eviction.settle(entry)

    # -- stores that land in a pool -----------------------------------------

    def reserve(
        self, pool_index: int, page_bytes: int, count: int, protected: Sequence[Entry]
    ) -> list[int] | None:
        """Slots of pool `pool_index` for `count` new pages a worker writes there in place (device
        to device), or None: that store goes to the arena. Room is made by evicting the GPU tier's
        policy's first unleased pages of the pool from the index (no copy down: the slots are
        free at once, and a store into a pool is a hand-over, read soon or not at all). None
        while a copy of the daemon's is in flight in the pool: a slot that a copy reads out of
        is reused by the daemon's own copies in their order, but a worker's writes are not
        ordered after it."""
        pool = self.gpu.pools[pool_index]
        if self.gpu.copies_in_flight(pool) or not pool.slots.can_hold(page_bytes):
            self.counters["gpu_reserves_to_arena"] += 1
            return None
        kept = {id(entry) for entry in protected}
        candidates = ((slot, e) for slot, e in self._evictable(pool) if id(e) not in kept)
        victims = pool.slots.plan_free(page_bytes, count, candidates)
        if victims is None:
            self.counters["gpu_reserves_to_arena"] += 1
            return None
        for victim in victims:
            self._make_room(victim)
        return [pool.slots.alloc(page_bytes) for _ in range(count)]

    def _make_room(self, victim: Entry) -> None:
        """A GPU-tier page leaves the index for a store into its pool (a GPU-tier eviction: no
        copy, so its slot is free at once; no lease holds it and no copy is in flight)."""
        self.eviction.remove(victim, reason="evicted")
        self.counters["gpu_evicted_chunks"] += 1

    def landed(self, entries: Sequence[Entry]) -> None:
        """Pages a worker wrote into a pool are committed: they belong to the GPU tier (the store
        then tells the GPU tier's policy, as it tells the CPU tier's of the others)."""
        for entry in entries:
            entry.on_gpu = True
        self.gpu_pages.count += len(entries)
        self.counters["gpu_stored_chunks"] += len(entries)

    # -- down, for a reader without the pool --------------------------------

    def readable(self, entries: list[Entry], pools: Sequence[int]) -> list[Entry]:
        for index in pools:
            if not 0 <= index < len(self.gpu.pools):
                count = len(self.gpu.pools)
                raise InvalidArgument(f"gpu_pools: pool {index} does not exist; this daemon has {count}")
        need = [e for e in entries if e.gpu_ready and e.pool not in pools and e.offset < 0]
        if not need:
            return entries
        if not self._arena_room(need, entries):
            self.counters["gpu_copies_down_refused"] += len(need)
            return entries[: entries.index(need[0])]
        loop = asyncio.get_running_loop()
        arena = self.gpu.arena_base
        by_pool: dict[int, list[Copy]] = {}
        for entry in need:
            size = entry.namespace.spec.page_bytes
            entry.offset = self.eviction.cpu.slots.alloc(size)
            entry.loaded = loop.create_future()
            pool = self.gpu.pools[entry.pool]
            by_pool.setdefault(pool.index, []).append((arena + entry.offset, pool.base + entry.gpu, size))
        for index, copies in by_pool.items():
            moved = [e for e in need if e.pool == index]

            def done(ok: bool, moved: list[Entry] = moved) -> None:
                _on_loop(loop, self._copied_down, moved, ok)

            self.gpu.copy(self.gpu.pools[index], copies, done)
        self.counters["gpu_copied_down_chunks"] += len(need)
        return entries

    def _copied_down(self, entries: list[Entry], ok: bool) -> None:
        for entry in entries:
            assert entry.loaded is not None
            entry.loaded.set_result(ok)
            if not ok:
                self.counters["gpu_copy_failures"] += 1
            self.eviction.settle(entry)

    # -- figures ------------------------------------------------------------

    def usage(self) -> TierUsage:
        extra: dict[str, float] = {
            "devices": len(self.gpu.pools),
            "copies_in_flight": self.gpu.pending_copies,
            "arena_registered": float(self.gpu.arena_registered),
        }
        for name in (
            "promoted_chunks",
            "demoted_chunks",
            "copied_down_chunks",
            "promotions_refused",
            "stored_chunks",
            "evicted_chunks",
            "reserves_to_arena",
        ):
            extra[name] = self.counters[f"gpu_{name}"]
        pages = self.gpu_pages.count
        return TierUsage(Tier.GPU.name.lower(), self.gpu.bytes_used, self.gpu.capacity, pages, extra)


def _on_loop(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: object) -> None:
    """Hands a finished copy to the event loop; a copy that ends after the loop closed (the daemon
    stopped meanwhile) has nothing left to update."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise


def _movable_up(entry: Entry) -> bool:
    return entry.committed and not entry.removed and entry.gpu < 0 and entry.cpu_ready and not entry.busy
