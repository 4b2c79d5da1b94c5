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
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import ClassVar, Protocol, TypeVar

from kvstore.history import FrequencyHistory


class Page(Protocol):
    """What a policy sees of a stored page: an identity (the object) and its chunk key."""

    @property
    def key(self) -> bytes: ...


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

    @abstractmethod
    def remove(self, page: Page) -> None:
        """`page` left the policy's care, not as a victim (cleared, pinned); unknown pages are ignored."""

    @abstractmethod
    def candidates(self) -> Iterator[Page]:
        """Every page the policy holds, in the order to evict them; read lazily, never while changing."""

    @abstractmethod
    def __len__(self) -> int: ...


P = TypeVar("P", bound=type[EvictionPolicy])

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


class _Bucket(OrderedDict[Page, int]):
    """The pages of one priority, least recent first, with their counts."""

    __slots__ = ("priority", "peak")

    def __init__(self, priority: int, pages: Iterable[tuple[Page, int]] = ()) -> None:
        super().__init__(pages)
        self.priority = priority  # the one int object every page of the bucket refers to
        self.peak = len(self)  # a dict never shrinks its table: the bucket is copied at a quarter of this


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
    """

    def __init__(self) -> None:
        self._priority: dict[Page, int] = {}
        self._buckets: dict[int, _Bucket] = {}
        self._floor = 0  # no page has a lower priority
        self._age = 0  # L
        self._history = FrequencyHistory()

    def _take(self, page: Page) -> tuple[int, int]:
        priority = self._priority.pop(page)
        bucket = self._buckets[priority]
        count = bucket.pop(page)
        if not bucket:
            del self._buckets[priority]
        elif len(bucket) < bucket.peak >> 2:
            self._buckets[priority] = _Bucket(priority, bucket.items())
        return priority, count

    def _place(self, page: Page, priority: int, count: int) -> None:
        bucket = self._buckets.get(priority)
        if bucket is None:
            bucket = self._buckets[priority] = _Bucket(priority)
            self._floor = min(self._floor, priority)
        bucket[page] = count
        bucket.peak = max(bucket.peak, len(bucket))
        self._priority[page] = bucket.priority

    def hit(self, chain: Sequence[Page]) -> None:
        next_priority = next_count = 0  # of the page after this one: a prefix is worth its extensions
        for page in reversed(chain):
            _, count = self._take(page)
            count = max(count + 1, next_count)
            next_priority = max(self._age + count, next_priority)
            self._place(page, next_priority, count)
            next_count = count

    def stored(self, chain: Sequence[Page]) -> None:
        next_priority = next_count = 0
        for page in reversed(chain):
            if page in self._priority:
                priority, count = self._take(page)
            else:
                priority, count = 0, self._history.pop(page.key) + 1
            count = max(count, next_count)
            next_priority = max(priority, self._age + count, next_priority)
            self._place(page, next_priority, count)
            next_count = count
        self._history.fit(len(self._priority))

    def evicted(self, page: Page) -> None:
        priority, count = self._take(page)
        self._age = max(self._age, priority)
        self._history.put(page.key, count)

    def remove(self, page: Page) -> None:
        if page in self._priority:
            self._take(page)

    def candidates(self) -> Iterator[Page]:
        buckets = self._buckets
        left = len(self._priority)
        while left and self._floor not in buckets:
            self._floor += 1
        priority = self._floor
        while left:
            bucket = buckets.get(priority)
            if bucket:
                yield from bucket
                left -= len(bucket)
            priority += 1

    def __len__(self) -> int:
        return len(self._priority)
