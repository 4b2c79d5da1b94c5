"""The load path: a Lookup finds the longest stored prefix and may lease it; Acquire gives the
lease's page offsets once every page is in the arena (or a GPU pool the reader reads); the
reader copies them out and Releases the lease (or Get streams them inline).

- `lookup(ns, keys, lease)`: the prefix in the arena (or the GPU tier), then in the disk tier,
  then in the remote tier; with `lease`, the pages found below the arena are read into it and
  the lease holds them all.
- `lookup_acquire(ns, keys)`: a leased Lookup that answers the Acquire too, when none of its
  pages must be waited for (a Lookup with `acquire`: one call).
- `query(ns, keys)`: a Lookup's hit count and tiers alone (no lease, not a use).
- `lookup_each(ns, keys)`: the tier of each key on its own (a query, not a use).
- `acquire(ns, lease)`: waits (up to PROMOTION_TIMEOUT_S) for the pages still read into the
  arena; `acquire_now` answers at once when none is, else None.
- `release(ns, lease)`; `unpin(lease)` (a load lease ends: released or expired); `begin_get` /
  `read_leased`: a lease's bytes sent inline, each read checked against the lease, so a lease
  that expired mid-stream never reads a reused slot.

`Loads` is a part the store owns (`kvstore.store.store`), given the store's state, its eviction, and
the lower tiers and GPU placement where it has them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING

from kvstore.shared.domain import Tier
from kvstore.shared.errors import NotFound
from kvstore.store.index import COMMITTED, PIN, AcquireResult, Entry, LookupResult
from kvstore.store.leases import Lease, LeaseKind
from kvstore.store.store_state import StoreParts

if TYPE_CHECKING:
    from kvstore.store.lower import Run

PROMOTION_TIMEOUT_S = 10.0
_TIERING = attrgetter("tiering")
_CPU_TIER = bytes([Tier.CPU])


class Loads:
    def __init__(self, parts: StoreParts) -> None:
        self.state, self.eviction, self.lower, self.placement = parts

    def lookup(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        lease: bool = False,
        ttl_s: float | None = None,
        touch: bool = True,
        gpu_pools: Sequence[int] = (),
    ) -> LookupResult:
        """The longest committed prefix of `keys`; with `lease`, pins it.

        `touch`: the lookup counts as a use of the hit pages for the eviction policy. The daemon
        counts the leased lookup of a load (and the store), not the query before it, so a page
        that is looked up and then loaded counts once.
        `gpu_pools`: the GPU pools the lease's reader has opened; its pages in other pools are
        copied into the arena for it.
        """
        state = self.state
        ns = state.namespaces.registered(ns_id)
        state.check_keys(keys)
        ttl_s = state.ttl(ttl_s)
        hits, plain = _hits(_present(ns.entries, keys), ns.unplain, keys)
        lower = self.lower
        runs = lower.find(ns, keys[len(hits) :]) if lower is not None and len(hits) < len(keys) else []
        if lease and runs and lower is not None:
            lower.promote(ns, runs, hits)
            runs = []  # promoted ones joined `hits`; the rest are no longer in the answer
            plain = not any(map(_TIERING, hits))
        found, tiers = self._counted(keys, hits, plain, runs)
        if touch:
            committed = hits if plain else [e for e in hits if e.state & COMMITTED]
            self.eviction.tell_hit(self.eviction.policy_pages(committed))
            if lower is not None and found:
                lower.touch(ns, keys[:found])
        lease_id = self._lease_hits(ns_id, hits, ttl_s, touch, gpu_pools) if lease and hits else 0
        return LookupResult(found, tiers, lease_id)

    def query(self, ns_id: bytes, keys: Sequence[bytes]) -> tuple[int, bytes]:
        """`lookup(ns_id, keys, touch=False)`'s hit count and tiers, with nothing else to do: the
        local channel's Query, the call the daemon answers most."""
        state = self.state
        ns = state.namespaces.registered(ns_id)
        state.check_keys(keys)
        hits, plain = _hits(_present(ns.entries, keys), ns.unplain, keys)
        lower = self.lower
        runs = lower.find(ns, keys[len(hits) :]) if lower is not None and len(hits) < len(keys) else ()
        return self._counted(keys, hits, plain, runs)

    def _counted(
        self, keys: Sequence[bytes], hits: list[Entry], plain: bool, runs: Sequence[Run]
    ) -> tuple[int, bytes]:
        """A Lookup's hit count and tiers (the arena's or GPU pools' `hits`, then the lower tiers'
        `runs`), counted in the store's figures."""
        found = len(hits)
        tiers = _CPU_TIER * found if plain else bytes(e.hit_tier for e in hits)
        if runs:
            found += sum(len(run) for _, run in runs)
            tiers += b"".join(bytes([s.medium]) * len(run) for s, run in runs)
        counters = self.state.counters
        counters["lookups"] += 1
        counters["hit_chunks"] += found
        counters["missed_chunks"] += len(keys) - found
        return found, tiers

    def lookup_acquire(
        self, ns_id: bytes, keys: Sequence[bytes], ttl_s: float | None = None, gpu_pools: Sequence[int] = ()
    ) -> tuple[LookupResult, AcquireResult | None]:
        """A leased Lookup (a use of its hits) and, where none of its pages must be waited for,
        the Acquire's answer too (None: the reader calls `acquire`)."""
        result = self.lookup(ns_id, keys, True, ttl_s, True, gpu_pools)
        if not result.lease_id:
            return result, None
        lease = self.state.leases.held(ns_id, result.lease_id, LeaseKind.LOAD)
        return result, None if _pending(lease) else self._ready(lease)

    def _lease_hits(
        self, ns_id: bytes, hits: list[Entry], ttl_s: float, touch: bool, gpu_pools: Sequence[int]
    ) -> int:
        """A load lease on the hit pages its reader can read (those in GPU pools it has not
        opened are copied into the arena for it), pinning them; 0 where none is left."""
        placement = self.placement
        if placement is not None:
            hits = placement.readable(hits, gpu_pools)
        if not hits:
            return 0
        for entry in hits:
            entry.state += PIN
        state = self.state
        load = state.leases.add(ns_id, LeaseKind.LOAD, hits, state.clock() + ttl_s, ttl_s)
        load.gpu_pools = frozenset(gpu_pools)
        if touch and placement is not None:
            placement.hit(hits)
        return load.id

    def lookup_each(self, ns_id: bytes, keys: Sequence[bytes]) -> bytes:
        """The tier of each of `keys` on its own (`Tier.NONE` where it is not stored): a query, not
        a use (the load that follows counts). For chunk boundaries that need not be a prefix
        (those whose recurrent state is stored)."""
        state = self.state
        ns = state.namespaces.registered(ns_id)
        state.check_keys(keys)
        tiers = bytearray(len(keys))
        lower = self.lower
        for index, key in enumerate(keys):
            entry = ns.entries.get(key)
            if entry is not None and (entry.state & COMMITTED or entry.loaded is not None):
                tiers[index] = entry.hit_tier
            elif lower is not None and entry is None:
                tiers[index] = lower.tier_of(ns, key)
        counters = state.counters
        counters["lookups"] += 1
        found = len(keys) - tiers.count(0)
        counters["hit_chunks"] += found
        counters["missed_chunks"] += len(keys) - found
        return bytes(tiers)

    async def acquire(self, ns_id: bytes, lease_id: int) -> AcquireResult:
        """Offsets of the lease's leading pages that are in the CPU tier (or a GPU pool its reader
        reads), once the pages still being promoted from disk are in (waited for up to
        PROMOTION_TIMEOUT_S); a page that could not be read ends the ready prefix."""
        lease = self.state.lease(ns_id, lease_id, LeaseKind.LOAD)
        pending = _pending(lease)
        if pending:
            await asyncio.wait(pending, timeout=PROMOTION_TIMEOUT_S)
            if self.state.leases.get(lease.id) is not lease:
                raise NotFound(f"lease {lease.id} expired while its pages were read from disk")
        return self._ready(lease)

    def acquire_now(self, ns_id: bytes, lease_id: int) -> AcquireResult | None:
        """`acquire`'s answer if it needs no waiting (no page of the lease is still being read from
        disk or copied into the arena), else None: the reader then calls `acquire`."""
        lease = self.state.lease(ns_id, lease_id, LeaseKind.LOAD)
        return None if _pending(lease) else self._ready(lease)

    def _ready(self, lease: Lease) -> AcquireResult:
        offsets: list[int] = []
        tiers = bytearray()
        pools: list[int] = []
        readable = lease.gpu_pools
        for entry in lease.entries:
            if entry.in_pools(readable):
                offsets.append(entry.gpu)
                tiers.append(Tier.GPU)
                pools.append(entry.pool)
            elif entry.state & COMMITTED and entry.cpu_ready:
                offsets.append(entry.offset)
                tiers.append(Tier.CPU)
                pools.append(0)
            else:
                break
        page_bytes = self.state.namespaces[lease.namespace].spec.page_bytes
        return AcquireResult(offsets, page_bytes, bytes(tiers), tuple(pools))

    def release(self, ns_id: bytes, lease_id: int) -> int:
        lease = self.state.lease(ns_id, lease_id, LeaseKind.LOAD)
        self.state.leases.pop(lease_id)
        return self.unpin(lease)

    def unpin(self, lease: Lease) -> int:
        """A load lease ended (released, or expired): its pages are no longer held for it."""
        settle = self.eviction.settle
        for entry in lease.entries:
            entry.state -= PIN
            settle(entry)
        return len(lease.entries)

    async def begin_get(self, ns_id: bytes, lease_id: int) -> tuple[Lease, AcquireResult]:
        """A load lease and its pages (`acquire`), for one inline Get."""
        result = await self.acquire(ns_id, lease_id)
        return self.state.lease(ns_id, lease_id, LeaseKind.LOAD), result

    def read_leased(self, lease: Lease, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` in the arena, while `lease` holds them."""
        if self.state.leases.get(lease.id) is not lease:
            raise NotFound(f"lease {lease.id} expired while its pages were being read")
        return bytes(self.state.cpu.read(offset, length))


def _present(entries: dict[bytes, Entry], keys: Sequence[bytes]) -> Sequence[Entry]:
    """The entries of the longest prefix of `keys` that `entries` holds. The usual Lookup finds every
    key: one C call (`itemgetter`) finds them all, without a Python turn per key; a missing key
    names where the prefix ends, and the keys before it are all there."""
    while len(keys) > 1:
        try:
            return itemgetter(*keys)(entries)  # type: ignore[no-any-return]
        except KeyError as missing:
            keys = keys[: keys.index(missing.args[0])]
    entry = entries.get(keys[0]) if keys else None  # (itemgetter of one key is not a tuple)
    return () if entry is None else (entry,)


def _hits(present: Sequence[Entry], unplain: set[bytes], keys: Sequence[bytes]) -> tuple[list[Entry], bool]:
    """The pages a Lookup hits (`_hit_prefix`), and whether they are all plain: committed, with no
    `Tiering` (in the arena alone, no copy in flight). The usual hits are: their tiers, and which
    of them the policy hears of, then need no look at each one. Where none of `keys` is one of
    the namespace's pages that are not plain (`Namespace.unplain`), the pages `present` are all
    plain: one C call tells, not a look at each."""
    if not unplain or unplain.isdisjoint(keys):
        return list(present), True
    for entry in present:
        if not entry.state & COMMITTED or entry.tiering is not None:
            hits = _hit_prefix(present)
            return hits, not any(map(_TIERING, hits))
    return list(present), True


def _hit_prefix(present: Sequence[Entry]) -> list[Entry]:
    """The pages a Lookup hits, of those found in order: committed, or being read into the arena
    from a lower tier (`loaded`); the first that is neither (a page being stored) ends them."""
    hits: list[Entry] = []
    for entry in present:
        if not (entry.state & COMMITTED or entry.loaded is not None):
            break
        hits.append(entry)
    return hits


def _pending(lease: Lease) -> list[asyncio.Future[bool]]:
    """The copies a load lease's reader must wait for: pages on their way into the arena."""
    pools = lease.gpu_pools
    loading = [e for e in lease.entries if e.loaded is not None and not e.loaded.done()]
    return [e.loaded for e in loading if not e.in_pools(pools)]
