"""Eviction policies: which pages a full tier gives up first.

A policy orders pages and nothing else: it never touches bytes, slots or leases.
The store tells it what happened, always in chain order (a chain's head first):

- `hit(chain)`: a lookup read these pages.
- `stored(chain)`: a commit left these pages stored: the new ones and those of
  the chain the tier already held.
- `evicted(page)`: the store took the page as a victim (a policy may remember
  its key); `remove(page)`: it left for another reason (cleared, pinned).

and walks `candidates()` (first = evict first), skipping what it may not take:
leased or pinned pages, pages being written, pages the current operation needs.
The store plans the whole eviction before it removes anything, so eviction is
all or nothing. Each call costs O(1) per page it names, amortised.

Chains: a tail without its head is never hit, so a policy ranks a head at least
as high as its tail (the chain-safe ones touch a chain tail first). The store
backs this with a guard: it never evicts a page whose successor in a chain is
still held, so a policy that ranks badly costs scans, never stranded tails.
`lru-plain`, the textbook LRU of published prefix-cache simulations, ranks heads
first; it is kept to reproduce their figures, unguarded, and refused for serving.

Tiers: each tier has its own policy. What a tier evicts is what it demotes to
the tier below (the CPU tier is the last today, so its victims are dropped);
a hit below is promoted by storing it in the tier above, whose policy then sees
it in `stored`.

Policies register by name; `eviction.policy` in the config picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from itertools import groupby
from operator import attrgetter
from typing import ClassVar, Protocol, TypeVar

from kvstore.store.history import FrequencyHistory


class Page(Protocol):
    """What a policy sees of a stored page: an identity (the object), its chunk key, and a place
    the policy that holds it may keep its own record of the page in (`LFUDA`: its run), so that
    it needs no table of its own per page. None while no policy holds the page that uses it."""

    @property
    def key(self) -> bytes: ...

    place: object


class EvictionPolicy(ABC):
    chain_safe: ClassVar[bool] = True  # evicts a chain's tail before its head

    @abstractmethod
    def hit(self, chain: Sequence[Page]) -> None:
        """A lookup read these pages (all held by the policy), head first."""

    @abstractmethod
    def stored(self, chain: Sequence[Page]) -> None:
        """A commit left these pages stored, head first; those the policy does not hold are new."""

    @abstractmethod
    def evicted(self, page: Page) -> None:
        """The store evicted `page`, one of `candidates()`."""

    def evicted_many(self, pages: Sequence[Page]) -> None:
        """`evicted` for each of `pages`, in order."""
        for page in pages:
            self.evicted(page)

    @abstractmethod
    def remove(self, page: Page) -> None:
        """`page` left the policy's care, not as a victim (cleared, pinned); unknown pages are ignored."""

    @abstractmethod
    def candidates(self) -> Iterator[Page]:
        """Every page the policy holds, in the order to evict them; read lazily, never while changing."""

    @abstractmethod
    def __len__(self) -> int: ...


P = TypeVar("P", bound=type[EvictionPolicy])
_PLACE = attrgetter("place")

POLICIES: dict[str, type[EvictionPolicy]] = {}


def register(name: str) -> Callable[[P], P]:
    def wrap(cls: P) -> P:
        POLICIES[name] = cls
        return cls

    return wrap


def policy_names(serving: bool = True) -> list[str]:
    return sorted(name for name, cls in POLICIES.items() if cls.chain_safe or not serving)


def make_policy(name: str, serving: bool = True) -> EvictionPolicy:
    """A new policy by registry name; `serving=False` also allows the replay-only baselines."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"eviction.policy: unknown policy {name!r}; choose one of {policy_names(serving)}")
    if serving and not cls.chain_safe:
        raise ValueError(
            f"eviction.policy: {name!r} may evict a chain's head before its tail, which strands the tail; "
            f"it is a baseline for `kvctl replay` only; choose one of {policy_names()}"
        )
    return cls()


@register("lru")
class LRU(EvictionPolicy):
    """Least recently used first; a chain is touched tail first, so its head stays the more recent."""

    def __init__(self) -> None:
        self._order: OrderedDict[Page, None] = OrderedDict()

    def hit(self, chain: Sequence[Page]) -> None:
        move = self._order.move_to_end
        for page in reversed(chain):
            move(page)

    def stored(self, chain: Sequence[Page]) -> None:
        order = self._order
        for page in reversed(chain):
            order[page] = None
            order.move_to_end(page)

    def evicted(self, page: Page) -> None:
        del self._order[page]

    def remove(self, page: Page) -> None:
        self._order.pop(page, None)

    def candidates(self) -> Iterator[Page]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


@register("lru-plain")
class PlainLRU(LRU):
    """Textbook LRU over pages in the order a request uses them: a chain's tail ends up the most recent.

    The baseline of published prefix-cache figures, kept to reproduce them; it evicts heads first.
    """

    chain_safe = False

    def hit(self, chain: Sequence[Page]) -> None:
        move = self._order.move_to_end
        for page in chain:
            move(page)

    def stored(self, chain: Sequence[Page]) -> None:
        order = self._order
        for page in chain:
            order[page] = None
            order.move_to_end(page)


class _Run:
    """Pages placed by one call at one priority and count, in placement order.

    A page belongs to the last run it was placed in (its `place`); the copies it left behind
    in older runs are skipped, and a run is compacted once fewer than half its pages belong to it.
    """

    __slots__ = ("priority", "count", "pages", "live")

    def __init__(self, priority: int, count: int) -> None:
        self.priority = priority
        self.count = count
        self.pages: list[Page] = []
        self.live = 0  # pages that belong to it


@register("lfuda")
class LFUDA(EvictionPolicy):
    """LFU with dynamic ageing (Arlitt et al., 2000: GDSF with pages of one size), with a history.

    A page's priority is L + f, where f counts the lookups that read it (1 when stored) and L is
    the priority of the last page evicted: as evictions raise L, a page read often long ago sinks
    below new ones (ageing, no parameter). Lowest priority goes first; ties go least recent first,
    chains touched tail first. A page's count and priority are at least those of the page after
    it in a chain (every use of a tail uses its head), so heads outlast tails. The counts of
    evicted pages live on in a `FrequencyHistory` with two slots per page held, so a page stored
    again soon after its eviction resumes its count.

    A page's run is its `place` (`Page.place`): the policy keeps no table of its own per page.

    Pages are kept in runs (`_Run`): the pages one call placed at one priority and count, in
    order. Each priority's bucket holds its runs in placement order, so the eviction order is
    (priority, run, place in run). A hit on a chain moves whole runs: the pages that shared a run
    share their new count and priority, so it costs a few C-level passes over the chain and
    Python work per run, not per page.
    """

    def __init__(self) -> None:
        self._held = 0  # pages whose place is one of this policy's runs
        self._buckets: dict[int, dict[_Run, None]] = {}  # priority -> its runs, oldest first
        # runs deleted from each bucket since it was last copied: a dict deleted from at the front
        # keeps the deleted slots, which every iteration from its front steps over
        self._holes: dict[int, int] = {}
        self._floor = 0  # no page has a lower priority
        self._age = 0  # L
        self._history = FrequencyHistory()

    def _new_run(self, priority: int, count: int) -> _Run:
        run = _Run(priority, count)
        bucket = self._buckets.get(priority)
        if bucket is None:
            bucket = self._buckets[priority] = {}
            if priority < self._floor:
                self._floor = priority
        bucket[run] = None
        return run

    def _left(self, run: _Run, pages: int) -> None:
        """`pages` of `run`'s pages now belong elsewhere (or nowhere)."""
        run.live -= pages
        if run.live * 2 >= len(run.pages):
            return
        if run.live:
            run.pages = [page for page in run.pages if page.place is run]
            return
        priority = run.priority
        bucket = self._buckets[priority]
        del bucket[run]
        if not bucket:
            del self._buckets[priority]
            self._holes.pop(priority, None)
            return
        holes = self._holes.get(priority, 0) + 1
        if holes > len(bucket):  # a compact copy, in the same order: amortised O(1) a deletion
            self._buckets[priority] = dict(bucket)
            holes = 0
        self._holes[priority] = holes

    def hit(self, chain: Sequence[Page]) -> None:
        pages = chain[::-1]  # tail first
        olds: list[_Run] = [page.place for page in pages]  # type: ignore[misc]
        if not olds:
            return
        if len(set(pages)) < len(pages):  # a page read twice: its second use sees its first
            self._hit_each(pages)
            return
        age = self._age
        next_priority = next_count = 0  # of the page after this one: a prefix is worth its extensions
        run: _Run | None = None
        if olds.count(olds[0]) == len(olds):  # the usual case: the chain came from one run
            groups = [(olds[0], len(olds))]
        else:
            groups = [(old, len(list(members))) for old, members in groupby(olds)]
        start = 0
        for old, size in groups:
            # Every page of `old` had its count: each gets the same new count and priority.
            count = max(old.count + 1, next_count)
            next_priority = max(age + count, next_priority)
            if run is None or run.count != count or run.priority != next_priority:
                run = self._new_run(next_priority, count)
            group = pages[start : start + size]
            run.pages += group
            run.live += size
            for page in group:
                page.place = run
            self._left(old, size)
            next_count = count
            start += size

    def _hit_each(self, pages: Sequence[Page]) -> None:
        """`hit` one page at a time (tail first), for a chain that names a page twice."""
        next_priority = next_count = 0
        run: _Run | None = None
        for page in pages:
            old: _Run = page.place  # type: ignore[assignment]
            count = max(old.count + 1, next_count)
            next_priority = max(self._age + count, next_priority)
            if run is None or run is old or run.count != count or run.priority != next_priority:
                run = self._new_run(next_priority, count)
            self._place(page, run)
            self._left(old, 1)
            next_count = count

    def _place(self, page: Page, run: _Run) -> None:
        run.pages.append(page)
        run.live += 1
        page.place = run

    def stored(self, chain: Sequence[Page]) -> None:
        next_priority = next_count = 0
        run: _Run | None = None
        for page in reversed(chain):
            old: _Run | None = page.place  # type: ignore[assignment]
            if old is not None:
                priority, count = old.priority, old.count
            else:
                priority, count = 0, self._history.pop(page.key) + 1
                self._held += 1
            count = max(count, next_count)
            next_priority = max(priority, self._age + count, next_priority)
            if run is None or run is old or run.count != count or run.priority != next_priority:
                run = self._new_run(next_priority, count)
            self._place(page, run)
            if old is not None:
                self._left(old, 1)
            next_count = count
        self._history.fit(self._held)

    def evicted(self, page: Page) -> None:
        run: _Run = page.place  # type: ignore[assignment]
        page.place = None
        self._held -= 1
        self._age = max(self._age, run.priority)
        self._history.put(page.key, run.count)
        self._left(run, 1)

    def evicted_many(self, pages: Sequence[Page]) -> None:
        """`evicted` for each of `pages`, with each run's pages left at once (the same order of
        candidates after)."""
        age = self._age
        evicted: list[tuple[bytes, int]] = []  # each page's key and count, for the history
        for run, members in groupby(pages, _PLACE):
            before = len(evicted)
            for page in members:
                page.place = None
                evicted.append((page.key, run.count))
            if run.priority > age:
                age = run.priority
            self._held -= len(evicted) - before
            self._left(run, len(evicted) - before)
        self._age = age
        self._history.put_many(evicted)

    def remove(self, page: Page) -> None:
        run = page.place
        if isinstance(run, _Run) and run in self._buckets.get(run.priority, ()):  # one of this policy's
            page.place = None
            self._held -= 1
            self._left(run, 1)

    def candidates(self) -> Iterator[Page]:
        buckets = self._buckets
        left = self._held
        while left and self._floor not in buckets:
            self._floor += 1
        priority = self._floor
        while left:
            bucket = buckets.get(priority)
            if bucket:
                for run in bucket:
                    for page in run.pages:
                        if page.place is run:
                            yield page
                    left -= run.live
            priority += 1

    def __len__(self) -> int:
        return self._held
