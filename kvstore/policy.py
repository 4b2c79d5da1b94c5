"""Eviction policies: which committed page to give up first.

A policy orders pages and nothing else: it never touches bytes, slots or leases.
The store tells it what was inserted, used and removed, and walks
`candidates()` (first = evict first), skipping pages it may not take (pinned,
being written, needed by the current operation).

Chains: the store touches a prefix tail-first, so a chain's head is always at
least as recent as its tail, and a recency policy evicts tails before heads.

Policies register by name; `eviction.policy` in the config picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TypeVar

P = TypeVar("P", bound=type["EvictionPolicy"])

POLICIES: dict[str, type[EvictionPolicy]] = {}


def register(name: str) -> Callable[[P], P]:
    def wrap(cls: P) -> P:
        POLICIES[name] = cls
        return cls

    return wrap


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction.policy: unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None


class EvictionPolicy(ABC):
    @abstractmethod
    def insert(self, item: Hashable) -> None:
        """A page became evictable (committed)."""

    @abstractmethod
    def touch(self, items: Iterable[Hashable]) -> None:
        """Pages were used, given in order of increasing importance (a chain's head last)."""

    @abstractmethod
    def remove(self, item: Hashable) -> None:
        """A page left the tier (evicted, cleared); unknown items are ignored."""

    @abstractmethod
    def candidates(self) -> Iterator[Hashable]:
        """Every page, in the order to evict them."""

    @abstractmethod
    def __len__(self) -> int: ...


@register("lru")
class LRU(EvictionPolicy):
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, item: Hashable) -> None:
        self._order[item] = None
        self._order.move_to_end(item)

    def touch(self, items: Iterable[Hashable]) -> None:
        order = self._order
        for item in items:
            if item in order:
                order.move_to_end(item)

    def remove(self, item: Hashable) -> None:
        self._order.pop(item, None)

    def candidates(self) -> Iterator[Hashable]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)
