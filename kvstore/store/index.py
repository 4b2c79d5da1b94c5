"""The page index: what the store knows of each page and namespace, and what its calls return.

- `Entry`: one page of one namespace: its arena slot, whether it is committed, the leases and
  pins that hold it, its place in a committed chain and in its policy's order; its GPU slot and
  copies in flight in a `Tiering` of its own, only for the pages that have them.
- `Namespace`: a page spec's pages by key, in a dict kept at its least size (`make_room`), and
  the class of its pages (`new_entry`); `Namespaces`: those the daemon serves, bounded.
- The results of the store's calls (`LookupResult`, `ReserveResult`, `AcquireResult`,
  `PinResult`) and its figures (`TierUsage`, `NamespaceUsage`, `StoreStats`).

Plain data: the store (`kvstore.store.store`) and the GPU placement (`kvstore.store.gpu_placement`) change
these fields; nothing here calls either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

from kvstore.shared.domain import Tier
from kvstore.shared.errors import InvalidArgument, NotFound, ResourceExhausted
from kvstore.shared.keys import KEY_BYTES
from kvstore.shared.spec import PageSpec
from kvstore.tiers.remote_nodes import NodeUsage, server_totals  # noqa: F401 (the store and metrics take it from here)

_GPU, _CPU = Tier.GPU, Tier.CPU


class Tiering:
    """What few pages have: a GPU slot, a copy in flight, hits towards promotion. An `Entry` gets
    one the first time one of these fields is set to other than its default."""

    __slots__ = ("gpu", "pool", "gpu_pending", "on_gpu", "hits", "loaded", "source")

    def __init__(self) -> None:
        self.gpu = -1  # slot in GPU pool `pool`; -1: none
        self.pool = 0
        self.gpu_pending = False  # its GPU slot is being filled from the arena
        self.on_gpu = False  # it belongs to the GPU tier (its arena copy goes once nobody reads it)
        self.hits = 0  # leased hits while in the CPU tier, towards promote_after_hits
        self.loaded: asyncio.Future[bool] | None = None  # its arena slot is being filled: done when read
        self.source = Tier.CPU  # while its arena slot is filled (`loaded`): the tier it comes from


_PLAIN = Tiering()  # the defaults, read where an entry has no `Tiering`; never written

# `Entry.state`: a page's flags and counts in one int. A page no lease holds, with fewer than 64
# children, has a state under 257, an int CPython shares: the four cost one slot and no object.
COMMITTED = 1  # visible to lookups
REMOVED = 2  # dropped from the index while held: its slots are freed at the last release
CHILD = 4  # one committed page whose parent it is (bits 2-31: the guard's count)
PIN = 1 << 32  # one hold by a lease or a send from its slot (bits 32 up): never evicted or freed
CHILDREN = PIN - CHILD  # the bits of the children's count


class Entry:
    """One page of one namespace: 6 slots (issue #31: bytes per page). Its flags and counts are
    one int (`state`, read through `committed`, `removed`, `children` and `pins`); the GPU tier's
    fields and those of copies in flight (`Tiering`) read as their defaults until one is set; its
    namespace is its class's (`Namespace.new_entry`), so that it needs no slot of its own."""

    __slots__ = ("key", "offset", "state", "parent", "place", "tiering")

    namespace: ClassVar[Namespace]

    def __init__(self, key: bytes, offset: int) -> None:
        self.key = key
        self.offset = offset  # arena slot; -1: none (the page is in the GPU tier only)
        self.state = 0  # COMMITTED | REMOVED | children * CHILD | pins * PIN
        self.parent: Entry | None = None  # the page before it in a committed chain
        self.place: object = None  # the record of the policy that holds it (`kvstore.store.policy.Page`)
        self.tiering: Tiering | None = None

    # The flags and counts of `state`, read and written as if they were fields of their own. The
    # store's hot loops (lookup, release, linking, eviction) use `state` itself.

    @property
    def committed(self) -> bool:
        return bool(self.state & COMMITTED)

    @committed.setter
    def committed(self, committed: bool) -> None:
        self.state = self.state | COMMITTED if committed else self.state & ~COMMITTED

    @property
    def removed(self) -> bool:
        """Dropped from the index while held: its slots are freed at the last release."""
        return bool(self.state & REMOVED)

    @removed.setter
    def removed(self, removed: bool) -> None:
        self.state = self.state | REMOVED if removed else self.state & ~REMOVED

    @property
    def children(self) -> int:
        """Committed pages whose parent it is."""
        return (self.state & CHILDREN) // CHILD

    @children.setter
    def children(self, children: int) -> None:
        if not 0 <= children < PIN // CHILD:
            raise ValueError(f"children: {children} is outside 0..{PIN // CHILD - 1}")
        self.state = self.state & ~CHILDREN | children * CHILD

    @property
    def pins(self) -> int:
        """Leases (and sends from its slot) holding it: never evicted or freed while any does."""
        return self.state // PIN

    @pins.setter
    def pins(self, pins: int) -> None:
        if pins < 0:
            raise ValueError(f"pins: {pins} is negative")
        self.state = self.state % PIN + pins * PIN

    def _tiering(self) -> Tiering:
        tiering = self.tiering
        if tiering is None:
            tiering = self.tiering = Tiering()
            self.namespace.unplain.add(self.key)  # a Lookup looks at it from now on (`Namespace.unplain`)
        return tiering

    # The `Tiering` fields, read and written as if they were the entry's own.

    @property
    def gpu(self) -> int:
        return (self.tiering or _PLAIN).gpu

    @gpu.setter
    def gpu(self, slot: int) -> None:
        if self.tiering is not None or slot != -1:
            self._tiering().gpu = slot

    @property
    def pool(self) -> int:
        return (self.tiering or _PLAIN).pool

    @pool.setter
    def pool(self, index: int) -> None:
        if self.tiering is not None or index != 0:
            self._tiering().pool = index

    @property
    def gpu_pending(self) -> bool:
        return (self.tiering or _PLAIN).gpu_pending

    @gpu_pending.setter
    def gpu_pending(self, pending: bool) -> None:
        if self.tiering is not None or pending:
            self._tiering().gpu_pending = pending

    @property
    def on_gpu(self) -> bool:
        return (self.tiering or _PLAIN).on_gpu

    @on_gpu.setter
    def on_gpu(self, on_gpu: bool) -> None:
        if self.tiering is not None or on_gpu:
            self._tiering().on_gpu = on_gpu

    @property
    def hits(self) -> int:
        return (self.tiering or _PLAIN).hits

    @hits.setter
    def hits(self, hits: int) -> None:
        if self.tiering is not None or hits:
            self._tiering().hits = hits

    @property
    def loaded(self) -> asyncio.Future[bool] | None:
        return (self.tiering or _PLAIN).loaded

    @loaded.setter
    def loaded(self, loaded: asyncio.Future[bool] | None) -> None:
        if self.tiering is not None or loaded is not None:
            self._tiering().loaded = loaded

    @property
    def source(self) -> Tier:
        return (self.tiering or _PLAIN).source

    @source.setter
    def source(self, tier: Tier) -> None:
        if self.tiering is not None or tier is not _CPU:
            self._tiering().source = tier

    # What the store asks of a page.

    @property
    def cpu_ready(self) -> bool:
        """Its arena slot holds the page."""
        loaded = (self.tiering or _PLAIN).loaded
        return self.offset >= 0 and (loaded is None or (loaded.done() and loaded.result()))

    @property
    def gpu_ready(self) -> bool:
        """Its GPU slot holds the page."""
        tiering = self.tiering
        return tiering is not None and tiering.gpu >= 0 and not tiering.gpu_pending

    @property
    def busy(self) -> bool:
        """A copy into or out of one of its slots is in flight."""
        tiering = self.tiering
        if tiering is None:
            return False
        loaded = tiering.loaded
        return tiering.gpu_pending or (loaded is not None and not loaded.done())

    @property
    def hit_tier(self) -> Tier:
        """Where a hit is read from: the GPU tier, the arena, or the disk or remote tier (being
        read into the arena)."""
        # Read for every hit of every Lookup: the tiers bound once, the usual page (no Tiering) first.
        tiering = self.tiering
        if tiering is None:
            return _CPU
        if tiering.gpu >= 0 and not tiering.gpu_pending:
            return _GPU
        return _CPU if self.state & COMMITTED else tiering.source

    def in_pools(self, pools: frozenset[int]) -> bool:
        """Whether a reader that opened GPU pools `pools` reads this page in place in the GPU tier."""
        tiering = self.tiering
        return tiering is not None and tiering.gpu >= 0 and not tiering.gpu_pending and tiering.pool in pools


def _table_free(keys: int) -> int:
    """The keys a dict rebuilt from `keys` keys (`dict(d)`) takes before it grows: CPython 3.11-3.13
    sizes it to the least power of two of at least 1.5 slots a key, and fills 2/3 of the slots."""
    slots = 8
    while slots < (3 * keys + 1) // 2:
        slots *= 2
    return 2 * slots // 3 - keys


@dataclass(eq=False)
class Namespace:
    id: bytes
    spec: PageSpec
    # Its pages by key. `make_room` may replace the dict: never keep it across a call that adds pages.
    entries: dict[bytes, Entry] = field(default_factory=dict)
    # The keys of its pages in `entries` that are not plain: not committed yet, or with a `Tiering`
    # (a GPU slot, a copy in flight, promotion hits). Every other page there is committed and in the
    # arena alone, so a Lookup none of whose keys is here looks at no page one by one
    # (`store_loads._hits`). Added to where such a page enters `entries` and where a page gets a
    # `Tiering`, taken from where a page is committed without one and where one leaves `entries`.
    # A key kept here for longer than that only sends a Lookup the slower way.
    unplain: set[bytes] = field(default_factory=set)
    pages: int = 0  # committed pages
    gpu_pool: int = -1  # the GPU pool its pages go to (its workers' device); -1: the emptiest
    # The class of its pages: an `Entry` whose `namespace` is this one (`new_entry(key, offset)`).
    new_entry: type[Entry] = field(init=False, repr=False)
    _room: int = field(default=0, init=False, repr=False)  # keys `entries` takes before it grows

    def __post_init__(self) -> None:
        self.new_entry = type("Entry", (Entry,), {"__slots__": (), "namespace": self})

    @property
    def label(self) -> str:
        return f"{self.id.hex()[:12]} ({self.spec.model})"

    def make_room(self, count: int) -> None:
        """`count` new keys are about to go into `entries`. A dict never reuses the slot of a key
        deleted from it: once its slots run out it is rebuilt at 3 slots per key it holds (CPython's
        growth rate), so an index that evicts as much as it stores sits at twice the slots it needs
        (84 bytes a page at 1M pages, not 42). Rebuilt here instead, where that leaves room for a
        quarter of its keys or more, it keeps the least table: an O(n) copy at most every n/4 keys
        added, in place of the dict's own (n/4 and more apart)."""
        self._room -= count
        if self._room >= 0:
            return
        held = len(self.entries)
        free = _table_free(held)
        if free >= count + held // 4:
            self.entries = dict(self.entries)  # insertion order kept
            self._room = free - count
        else:  # too full to gain: let it grow, and look again after as many keys as it holds
            self._room = held


class Namespaces(dict[bytes, Namespace]):
    """The namespaces a daemon serves (a tenant's, when it has tenants), by id: at most `limit`."""

    def __init__(self, limit: int, tenant: str = "") -> None:
        super().__init__()
        self.limit = limit
        self.tenant = tenant

    def add(self, spec: PageSpec, in_use: Callable[[], set[bytes]]) -> Namespace:
        """The spec's namespace, registered if new. At the limit, the namespaces with no pages
        that are not `in_use` (leased) are forgotten first; their clients register them again."""
        ns_id = spec.namespace(self.tenant)
        ns = self.get(ns_id)
        if ns is None:
            if len(self) >= self.limit:
                leased = in_use()
                for empty in [n.id for n in self.values() if not n.entries and n.id not in leased]:
                    del self[empty]
            if len(self) >= self.limit:
                whose = f"tenant {self.tenant!r} already has" if self.tenant else "this daemon already serves"
                limit = "tenants[].max_namespaces" if self.tenant else "the daemon's limit"
                raise ResourceExhausted(
                    f"{whose} {self.limit} namespaces that hold pages ({limit}); `kvctl clear` some of them"
                )
            ns = self[ns_id] = Namespace(ns_id, spec)
        return ns

    def registered(self, ns_id: bytes) -> Namespace:
        ns = self.get(ns_id)
        if ns is None:
            if len(ns_id) != KEY_BYTES:
                raise InvalidArgument(f"namespace: expected {KEY_BYTES} bytes, got {len(ns_id)}")
            whose = ""
            if self.tenant:
                whose = f" for tenant {self.tenant!r} (no other tenant's namespace is reachable)"
            raise NotFound(
                f"namespace {ns_id.hex()} is not registered with this daemon{whose} "
                f"(it may have restarted): call Connect with its page spec first"
            )
        return ns


class LookupResult(NamedTuple):
    hit_chunks: int
    tiers: bytes  # one Tier per hit chunk
    lease_id: int


class ReserveResult(NamedTuple):
    lease_id: int
    offsets: list[int]  # -1: already stored or being stored, skip
    pool: int = -1  # the offsets are slots of this GPU pool (-1: of the arena)


class AcquireResult(NamedTuple):
    offsets: list[int]  # in the arena, or in GPU pool `pools[i]` where tiers[i] is Tier.GPU
    page_bytes: int
    tiers: bytes = b""  # one Tier per offset (empty: all in the arena)
    pools: tuple[int, ...] = ()


class PinResult(NamedTuple):
    pinned_chunks: int  # the stored prefix of the keys, now pinned
    pinned_pages: int  # every page pinned in the tier
    pinned_bytes: int


class TierUsage(NamedTuple):
    name: str
    bytes_used: int
    bytes_capacity: int
    pages: int
    extra: dict[str, float] | None = None
    nodes: tuple[NodeUsage, ...] = ()  # the remote tier's servers


class NamespaceUsage(NamedTuple):
    namespace: bytes
    model: str
    pages: int
    page_bytes: int
    tenant: str = ""
    contents: str = ""  # PageSpec.contents: empty for a whole model's KV


class StoreStats(NamedTuple):
    tiers: list[TierUsage]
    namespaces: list[NamespaceUsage]
    counters: dict[str, float]
