"""The store path: Reserve gives slots for the keys not stored yet under a store lease; the
writer fills them (in place through the arena, or inline through Put) and Commits, which
makes them visible to lookups at once, or Aborts. An entry being written is never visible.

- `reserve(ns, keys, writer, gpu_bus_id)`: all or nothing: without room for every new page,
  none. With the writer's GPU named, the new pages land in the GPU tier's pool on it where it
  has room (the writer writes them there device to device; readers on other GPUs read them
  over peer access, or the daemon copies them down for a reader without the pool).
- `begin_put` / `write_leased` / `end_put`: one inline Put at a time per lease, each write
  checked against the lease; a Put that fails part-way breaks the lease (Commit refused).
- `commit(ns, lease, count)`: the pages are stored, linked into their chain, written through
  to the lower tiers that ask for it. With `count`, only the lease's next `count` new pages
  (in the order of its keys), and the lease stays open for the rest: a writer commits the
  pages whose copies ended while the last ones are still copying. Linked in parts, the chain
  is the one a whole Commit builds. A Commit after the lease expired is refused: what it
  had not committed is not stored.
- Expiry (`Store.expire`) and Abort end only what the lease has not committed: a committed
  page is an ordinary page at once. Expired, a lease written inline only is dropped
  (`drop_reservation`); one written in place is fenced (`fence`): those keys leave the index,
  their slots stay quarantined until its writer is gone, its client ends it, or
  `leases.quarantine_s` passes.

`Writes` is a part the store owns (`kvstore.store.store`), given the store's state, its eviction, and
the lower tiers and GPU placement where it has them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.shared.domain import Tier
from kvstore.shared.errors import FailedPrecondition, InvalidArgument, NotFound
from kvstore.shared.peers import Peer
from kvstore.store.events import EventKind
from kvstore.store.index import COMMITTED, AcquireResult, Entry, Namespace, ReserveResult
from kvstore.store.leases import Lease, LeaseKind
from kvstore.store.store_state import StoreParts

if TYPE_CHECKING:
    pass


class Writes:
    def __init__(self, parts: StoreParts) -> None:
        self.state, self.eviction, self.lower, self.placement = parts

    def reserve(
        self,
        ns_id: bytes,
        keys: Sequence[bytes],
        ttl_s: float | None = None,
        writer: Peer | None = None,
        gpu_bus_id: str = "",
    ) -> ReserveResult:
        """Slots for the keys not stored yet, under one store lease. `writer`: the process that
        writes them in place (the arena, or a GPU pool), whose slots are fenced if the lease
        expires; None for a client that writes through Put only. `gpu_bus_id`: the writer's GPU;
        the new pages land in the GPU tier's pool there where it has room (`GpuPlacement.reserve`),
        else in the arena."""
        state = self.state
        ns = state.namespaces.registered(ns_id)
        state.check_keys(keys)
        ttl_s = state.ttl(ttl_s)
        present: list[Entry] = []
        new_keys: list[bytes] = []
        seen: set[bytes] = set()
        offsets: list[int] = []
        for i, key in enumerate(keys):
            if key in seen:
                raise InvalidArgument(f"keys[{i}] repeats an earlier key of the same request")
            seen.add(key)
            entry = ns.entries.get(key)
            if entry is None:
                new_keys.append(key)
                offsets.append(0)
            else:
                present.append(entry)
                offsets.append(-1)
        pool, slots = self._pool_slots(gpu_bus_id, writer, ns.spec.page_bytes, len(new_keys), present)
        if new_keys and slots is None:
            self.eviction.make_cpu_room(ns.spec.page_bytes, len(new_keys), protected=present)
        state.counters["reserves"] += 1
        state.counters["skipped_chunks"] += len(present)
        # Present pages stay recent while the new ones are written; the commit touches them again.
        self.eviction.tell_stored(self.eviction.policy_pages([e for e in present if e.committed]))
        if not new_keys:
            return ReserveResult(0, offsets)
        ns.make_room(len(new_keys))
        entries = self._new_entries(ns, new_keys, pool, slots)
        places = iter([entry.offset for entry in entries] if slots is None else slots)
        offsets = [offset if offset < 0 else next(places) for offset in offsets]
        lease = state.leases.add(
            ns_id, LeaseKind.STORE, entries, state.clock() + ttl_s, ttl_s, list(keys), writer
        )
        return ReserveResult(lease.id, offsets, pool)

    def _new_entries(
        self, ns: Namespace, keys: list[bytes], pool: int, slots: list[int] | None
    ) -> list[Entry]:
        """The index entries of a Reserve's new keys: in new arena slots, or (`slots`) in pool
        `pool` only, with no arena slot until the page moves down."""
        entries = []
        if slots is None:
            for key, offset in zip(
                keys, self.state.cpu.slots.alloc_many(ns.spec.page_bytes, len(keys)), strict=True
            ):
                entry = ns.new_entry(key, offset)
                ns.entries[key] = entry
                entries.append(entry)
        else:
            for key, slot in zip(keys, slots, strict=True):
                entry = ns.new_entry(key, -1)
                entry.gpu, entry.pool = slot, pool
                ns.entries[key] = entry
                entries.append(entry)
        ns.unplain.update(keys)  # not committed yet
        return entries

    def _pool_slots(
        self, gpu_bus_id: str, writer: Peer | None, page_bytes: int, count: int, present: list[Entry]
    ) -> tuple[int, list[int] | None]:
        """The pool on the writer's GPU and slots there for `count` new pages; (-1, None): the
        arena's."""
        placement = self.placement
        if not gpu_bus_id or not count or placement is None or writer is None:
            return -1, None
        pool = placement.gpu.pool_for(gpu_bus_id)
        if pool < 0:
            self.state.counters["gpu_reserves_to_arena"] += 1
            return -1, None
        slots = placement.reserve(pool, page_bytes, count, present)
        return (pool, slots) if slots is not None else (-1, None)

    def begin_put(self, ns_id: bytes, lease_id: int) -> tuple[Lease, AcquireResult]:
        """Claims a store lease for one inline Put; a second concurrent Put is refused."""
        lease = self.state.lease(ns_id, lease_id, LeaseKind.STORE)
        if lease.writer_active:
            raise FailedPrecondition(f"lease {lease_id}: another Put is already writing its pages")
        if lease.committed:  # a Put writes every page of the lease: it would rewrite visible pages
            raise FailedPrecondition(
                f"lease {lease_id}: {lease.committed} of its pages are committed already; a Put writes "
                f"every page of a lease, so it must come before the lease's first Commit"
            )
        lease.writer_active = True
        return lease, AcquireResult(
            [entry.offset for entry in lease.entries], self.state.namespaces[ns_id].spec.page_bytes
        )

    def end_put(self, lease: Lease, error: str = "") -> None:
        lease.writer_active = False
        if error:
            lease.broken = error

    def write_leased(self, lease: Lease, offset: int, data: memoryview, within: int) -> None:
        """Writes `data` at `within` bytes into the page at `offset`, while `lease` holds it."""
        if self.state.leases.get(lease.id) is not lease:
            raise NotFound(f"lease {lease.id} expired while its pages were being written")
        self.state.cpu.write(offset, data, within)

    def commit(self, ns_id: bytes, lease_id: int, count: int = 0) -> int:
        """Makes the lease's next `count` new pages visible (0: all it has left); returns how many.
        The lease ends with its last page and stays open until then."""
        state = self.state
        fenced = state.quarantines.end(ns_id, lease_id)
        if fenced is not None:  # its writer has finished: it commits after writing
            kept = fenced.lease.committed
            stored = (
                f"only the {kept} page(s) it committed before stay stored" if kept else "nothing was stored"
            )
            raise FailedPrecondition(
                f"lease {lease_id} expired before its Commit (the writer did not renew it within its "
                f"TTL, leases.ttl_s): {stored}; store the pages again"
            )
        lease = state.lease(ns_id, lease_id, LeaseKind.STORE)
        if lease.broken or lease.writer_active:
            why = lease.broken or "a Put is still writing its pages"
            raise FailedPrecondition(f"lease {lease_id} cannot be committed: {why}; Abort it and store again")
        part, stop = self._next_part(lease, count)
        ns = state.namespaces[ns_id]
        unplain = ns.unplain
        for entry in part:
            entry.state |= COMMITTED
            if entry.tiering is None:
                unplain.discard(entry.key)
        ns.pages += len(part)
        in_pool = bool(part) and part[0].offset < 0  # a lease's new pages: all in one pool, or in the arena
        if in_pool:
            assert self.placement is not None
            self.placement.landed(part)
        chain = self.eviction.link(ns, lease.keys, lease.linked, stop)
        lease.linked = stop
        self.eviction.tell_stored(self.eviction.policy_pages(chain))
        pages = [(entry.key, entry.parent.key if entry.parent is not None else b"") for entry in part]
        state.events.add_many(EventKind.STORED, Tier.GPU if in_pool else Tier.CPU, ns_id, pages, "committed")
        state.counters["stored_chunks"] += len(part)
        if self.lower is not None and not in_pool:  # a page in a pool reaches them once it moves down
            self.lower.committed(ns, part)
        return len(part)

    def _next_part(self, lease: Lease, count: int) -> tuple[list[Entry], int]:
        """The entries a Commit of `count` pages makes visible, and where their keys end in
        `lease.keys` (the keys after the lease's last new page, present ones, go with it). The
        lease ends when they are the last it holds."""
        pending = lease.pending
        if count == 0 or count >= len(pending):
            self.state.leases.pop(lease.id)
            return pending, len(lease.keys)
        part = pending[:count]
        self.state.leases.commit_part(lease, count)
        return part, lease.keys.index(part[-1].key, lease.linked) + 1

    def abort(self, ns_id: bytes, lease_id: int) -> int:
        """Frees the slots of the pages the lease has not committed; returns how many."""
        state = self.state
        fenced = state.quarantines.end(ns_id, lease_id)
        if fenced is not None:
            return len(fenced.offsets)
        lease = state.lease(ns_id, lease_id, LeaseKind.STORE)
        state.leases.pop(lease_id)
        dropped = self.drop_reservation(lease)
        state.counters["aborted_chunks"] += dropped
        return dropped

    def drop_reservation(self, lease: Lease) -> int:
        """Drops the pages the lease has not committed from the index and frees their slots."""
        ns = self.state.namespaces[lease.namespace]
        pending = lease.pending
        for entry in pending:
            del ns.entries[entry.key]
            ns.unplain.discard(entry.key)
            if entry.offset >= 0:
                self.state.cpu.slots.free(entry.offset)
            else:  # reserved in a GPU pool
                assert self.placement is not None
                self.placement.gpu_pages.free_slot(entry)
        return len(pending)

    def fence(self, lease: Lease, now: float) -> None:
        """An expired store lease written in place: its pages not committed leave the index (their
        keys can be stored again, into other slots) but their slots stay allocated until its writer
        is gone, its client ends the lease, or leases.quarantine_s passes. Those it committed stay."""
        state = self.state
        ns = state.namespaces[lease.namespace]
        pending = lease.pending
        for entry in pending:
            del ns.entries[entry.key]
            ns.unplain.discard(entry.key)
        in_pool = [entry for entry in pending if entry.offset < 0]
        if in_pool:  # a lease's new pages are all in one pool, or all in the arena
            assert self.placement is not None
            slots = self.placement.gpu.pools[in_pool[0].pool].slots
            state.quarantines.fence(lease, [e.gpu for e in in_pool], ns.spec.page_bytes, now, slots.free)
        else:
            state.quarantines.fence(lease, [e.offset for e in pending], ns.spec.page_bytes, now)
        state.counters["fenced_leases"] += 1
