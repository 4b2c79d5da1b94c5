"""Room in the CPU tier: which pages leave it, and what becomes of a page that leaves the index.

The store, the lower tiers and the GPU placement call these on the daemon's event loop. What
becomes of a leaving page is given at construction: `demote`, where an evicted page goes (the
lower tiers' write-behind, `lower.WriteBehind.evicted`), and `gpu_pages`, the GPU tier's own
pages (`gpu_placement.GpuPages`: their policy, a page leaving the tier, its slots). The store
builds both before the eviction and neither holds it, so nothing is set on it afterwards.

- `make_cpu_room(page_bytes, count, protected)`: evicts committed, unpinned pages in policy
  order until `count` slots of `page_bytes` are free; all or nothing. It never takes a page the
  current operation needs (`protected`), nor one a lease holds or a copy is using, nor a page
  while a page after it in a committed chain is held (a tail without its head is never hit),
  unless the policy is a chain-blind baseline replayed as published (`chain_safe` false).
  An evicted page goes to `demote` (the lower tiers write it behind).
- `remove(entry)`: drops a committed page from the index; `settle(entry)` frees the slots it no
  longer needs once no lease holds it and no copy is in flight.
- `link(ns, keys, start, stop)`: links a stored chain's pages (of `keys[start:stop]`, a Commit's
  part) to their parents (what the chain guard reads).
- `tell_hit` / `tell_stored`: each tier's policy hears of its own pages (a page in the GPU tier
  is in the GPU tier's policy's care); a page pinned with `pin` is in no policy's care
  (`policy_pages`) until its pin ends.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from itertools import groupby, islice
from operator import attrgetter
from typing import TYPE_CHECKING, cast

from kvstore.shared.domain import Tier
from kvstore.shared.errors import ArenaWarmingUp, ResourceExhausted
from kvstore.store.events import EventKind, EventLog
from kvstore.store.index import CHILD, CHILDREN, COMMITTED, PIN, REMOVED, Entry, Namespace
from kvstore.store.pins import PinTable
from kvstore.store.policy import EvictionPolicy
from kvstore.tiers.cpu import CpuTier

if TYPE_CHECKING:
    from kvstore.store.gpu_placement import GpuPages

_NS_TIER = attrgetter("namespace", "on_gpu")


class Eviction:
    def __init__(
        self,
        cpu: CpuTier,
        policy: EvictionPolicy,
        pins: PinTable[Entry],
        counters: Counter[str],
        events: EventLog,
        demote: Callable[[Entry], None] | None = None,
        gpu_pages: GpuPages | None = None,
    ) -> None:
        self.cpu = cpu
        self.policy = policy  # the CPU tier's
        self.pins = pins
        self.counters = counters
        self.events = events
        self.demote = demote  # where an evicted page goes (None: no tier below the arena)
        self.gpu_pages = gpu_pages  # the GPU tier's own pages (None: no GPU tier)
        self.guard_chains = policy.chain_safe

    # -- the policies -------------------------------------------------------

    def policy_pages(self, entries: list[Entry]) -> list[Entry]:
        """The entries in the policies' care: all but those pinned with `pin`."""
        pins = self.pins
        return [entry for entry in entries if entry not in pins] if pins else entries

    def tell_hit(self, entries: list[Entry]) -> None:
        """Each tier's policy hears of a use of its own pages of `entries`."""
        for policy, pages in self._by_tier(entries):
            policy.hit(pages)

    def tell_stored(self, entries: list[Entry]) -> None:
        """Each tier's policy hears that its own pages of `entries` are stored."""
        for policy, pages in self._by_tier(entries):
            policy.stored(pages)

    def _by_tier(self, entries: list[Entry]) -> list[tuple[EvictionPolicy, list[Entry]]]:
        gpu_pages = self.gpu_pages
        if gpu_pages is None or not gpu_pages.count:
            return [(self.policy, entries)]
        return [
            (self.policy, [e for e in entries if not e.on_gpu]),
            (gpu_pages.policy, [e for e in entries if e.on_gpu]),
        ]

    def policy_of(self, entry: Entry) -> EvictionPolicy:
        gpu_pages = self.gpu_pages
        return gpu_pages.policy if gpu_pages is not None and entry.on_gpu else self.policy

    def link(
        self, ns: Namespace, keys: Sequence[bytes], start: int = 0, stop: int | None = None
    ) -> list[Entry]:
        """The committed entries of `keys[start:stop]`, in order; each is linked to the one before
        it in `keys` (the first to `keys[start - 1]`'s, which an earlier part linked), so that
        linking a chain in parts builds what linking it whole does."""
        chain: list[Entry] = []
        entries = ns.entries
        parent: Entry | None = None
        if start:
            parent = entries.get(keys[start - 1])
            if parent is not None and not parent.state & COMMITTED:
                parent = None
        for key in islice(keys, start, stop):
            entry = entries.get(key)
            if entry is None or not entry.state & COMMITTED:
                parent = None
                continue
            if entry.parent is None and parent is not None:
                entry.parent = parent
                parent.state += CHILD
            chain.append(entry)
            parent = entry
        return chain

    # -- room ---------------------------------------------------------------

    def make_cpu_room(self, page_bytes: int, count: int, protected: list[Entry]) -> None:
        """Evicts CPU-tier pages so that `count` slots of `page_bytes` are free; all or nothing."""
        offered: list[Entry] = []
        candidates = self._evictable({id(e) for e in protected}, offered)
        victims = self.cpu.slots.plan_free(page_bytes, count, candidates)
        if victims is None:
            slots = self.cpu.slots
            if slots.num_reserved < slots.num_slabs:  # the arena is still being reserved behind
                reserved = slots.num_reserved * slots.slab_bytes
                raise ArenaWarmingUp(
                    f"cannot reserve {count} page(s) of {page_bytes} bytes in the CPU tier yet: the "
                    f"arena is still being reserved ({reserved} of {self.cpu.capacity} bytes so far, "
                    f"{self.cpu.bytes_used} in use) and nothing that could make room may be evicted; "
                    f"try again once more of it is reserved (arena_reserved_bytes in Stats)"
                )
            raise ResourceExhausted(
                f"cannot reserve {count} page(s) of {page_bytes} bytes in the CPU tier "
                f"({self.cpu.capacity} bytes, {self.cpu.bytes_used} in use): every page that could make "
                f"room is pinned by a lease or being written; release leases, wait for them to expire, "
                f"or raise tiers.cpu.bytes"
            )
        if len(offered) > len(victims):  # slabs of another size: some pages offered stay
            victims += _orphans(victims, offered)
        self._evict(victims)
        self.counters["evicted_chunks"] += len(victims)

    def _evict(self, victims: list[Entry]) -> None:
        """What `remove(entry, evicted=True)` does for each of `victims`, in order, with one REMOVED
        event call for each run of them in one namespace and tier and the policy told once: a Reserve
        into a full arena evicts as many pages as it reserves."""
        events = self.events
        for (ns, on_gpu), run in groupby(victims, _NS_TIER):
            pages = [(entry.key, b"") for entry in run if entry.state & COMMITTED]
            events.add_many(EventKind.REMOVED, Tier.GPU if on_gpu else Tier.CPU, ns.id, pages, "evicted")
        for entry in victims:
            ns = entry.namespace
            del ns.entries[entry.key]
            ns.unplain.discard(entry.key)
            ns.pages -= 1
            if entry.parent is not None:
                entry.parent.state -= CHILD
        self.policy.evicted_many(victims)
        demote, gpu_pages, settle, free = self.demote, self.gpu_pages, self.settle, self.cpu.slots.free
        for entry in victims:
            if demote is not None and entry.state & COMMITTED:
                demote(entry)
            entry.state |= REMOVED
            if entry.tiering is None and entry.offset >= 0:  # the usual page: `settle` frees its slot
                free(entry.offset)
                entry.offset = -1
                continue
            if gpu_pages is not None and entry.on_gpu:
                gpu_pages.left(entry)
            settle(entry)

    def _evictable(self, protected: set[int], offered: list[Entry]) -> Iterator[tuple[int, Entry]]:
        """The pages that may leave, in policy order, each after every child it has in the index
        (tails go first). A page passed over for a child not yet offered is offered as soon as its
        last child is: a chain committed in parts is held in the policy as a run per part, its
        head's part oldest, so in policy order its head comes first; passed over and never offered
        again, every page of such a chain but its last part would be out of reach of one
        eviction, whose walk then crossed the whole policy for nothing. Each page offered is
        appended to `offered`."""
        guard = self.guard_chains
        planned: dict[int, int] = {}  # per parent: its children already offered in this plan
        waiting: dict[int, Entry] = {}  # passed over for a child not yet offered
        for item in self.policy.candidates():
            page = cast(Entry, item)
            state = page.state
            if state >= PIN or (page.tiering is not None and page.busy):
                continue
            if protected and id(page) in protected:
                continue
            if guard and state & CHILDREN and (state & CHILDREN) // CHILD > planned.get(id(page), 0):
                waiting[id(page)] = page  # a later page of its chain is held: tails go first
                continue
            entry: Entry | None = page
            while entry is not None:
                offered.append(entry)
                yield entry.offset, entry
                parent = entry.parent
                if parent is None:
                    break
                parent_id = id(parent)
                given = planned[parent_id] = planned.get(parent_id, 0) + 1
                last = (parent.state & CHILDREN) // CHILD <= given
                entry = waiting.pop(parent_id, None) if last else None

    # -- leaving ------------------------------------------------------------

    def remove(self, entry: Entry, evicted: bool = False, reason: str = "cleared") -> None:
        """Drops a committed entry from the index; its slots are freed now, or at its last release.
        `reason` (unless `evicted`) is what its REMOVED event says."""
        ns = entry.namespace
        if entry.state & COMMITTED:
            tier = Tier.GPU if entry.on_gpu else Tier.CPU
            self.events.add(EventKind.REMOVED, tier, ns.id, entry.key, b"", "evicted" if evicted else reason)
        del ns.entries[entry.key]
        ns.unplain.discard(entry.key)
        ns.pages -= 1
        if entry.parent is not None:
            entry.parent.state -= CHILD
        if evicted:
            self.policy.evicted(entry)
            if self.demote is not None and entry.state & COMMITTED:
                self.demote(entry)
        elif not self.pins.unpin(entry):
            self.policy_of(entry).remove(entry)
        entry.state |= REMOVED
        if entry.on_gpu and self.gpu_pages is not None:
            self.gpu_pages.left(entry)
        self.settle(entry)

    def settle(self, entry: Entry) -> None:
        """Frees the slots an entry no longer needs, once no lease holds it and no copy is in flight:
        both if it left the index, its arena slot if it belongs to the GPU tier."""
        state, tiering = entry.state, entry.tiering  # the usual page has no Tiering: read for every release
        if state >= PIN or (tiering is not None and entry.busy):
            return
        arena_copy_unneeded = state & REMOVED or (tiering is not None and tiering.on_gpu)
        if arena_copy_unneeded and entry.offset >= 0:
            self.cpu.slots.free(entry.offset)
            entry.offset = -1
        if state & REMOVED and tiering is not None and tiering.gpu >= 0 and self.gpu_pages is not None:
            self.gpu_pages.free_slot(entry)


def _orphans(victims: list[Entry], offered: list[Entry]) -> list[Entry]:
    """The pages offered but not taken whose parent is taken (and theirs, down the chain): freeing
    whole slabs for another page size may take a chain's head while some of its tail sits in a
    slab that does not empty, a tail that could never be hit again. They leave with the head."""
    taken = {id(entry) for entry in victims}
    orphans: list[Entry] = []
    for entry in reversed(offered):  # a parent is offered after its children: it is seen first here
        parent = entry.parent
        if parent is not None and id(parent) in taken and id(entry) not in taken:
            taken.add(id(entry))
            orphans.append(entry)
    return orphans
