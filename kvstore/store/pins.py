"""Pins: pages kept out of eviction until a deadline (a system prompt's chunks), within a byte cap.

- `pin(pages, deadline, shorten)`: pins each page until `deadline`; a page pinned again keeps
  the later of its two deadlines, or with `shorten` gets the new one. All or nothing: if the
  newly pinned bytes would pass `limit_bytes`, nothing changes.
- `pop_expired(now)`: the pages whose pin ran out, in the order they were pinned.
- `unpin(page)`: drops a pin early (the page is being cleared).

The store takes a pinned page out of its tier's policy, so eviction never sees it, and hands
it back when the pin expires. Pages are anything hashable with a size in bytes.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class PinLimitExceeded(Exception):
    def __init__(self, new_bytes: int) -> None:
        super().__init__(f"{new_bytes} more bytes would pass the pin limit")
        self.new_bytes = new_bytes


class PinTable(Generic[T]):
    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.bytes = 0
        self._pins: dict[T, tuple[float, int]] = {}  # page -> (deadline, size)
        self._deadlines: list[tuple[float, int, T]] = []  # lazy: stale rows are skipped
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._pins)

    def __bool__(self) -> bool:
        return bool(self._pins)

    def __contains__(self, page: object) -> bool:
        return page in self._pins

    def pin(self, pages: Sequence[tuple[T, int]], deadline: float, shorten: bool = True) -> list[T]:
        """Pins (page, size) pairs until `deadline` (an earlier one than a page has only with
        `shorten`); returns the pages that were not pinned before."""
        sizes = dict(pages)
        fresh = [page for page in sizes if page not in self._pins]
        new_bytes = sum(sizes[page] for page in fresh)
        if self.bytes + new_bytes > self.limit_bytes:
            raise PinLimitExceeded(new_bytes)
        for page, size in sizes.items():
            old = self._pins.get(page)
            if old is not None and not shorten and old[0] >= deadline:
                continue
            self._pins[page] = (deadline, size)
            if old is None or deadline < old[0]:  # a later deadline is re-queued when the old one comes up
                heapq.heappush(self._deadlines, (deadline, next(self._order), page))
        self.bytes += new_bytes
        return fresh

    def unpin(self, page: T) -> bool:
        pin = self._pins.pop(page, None)
        if pin is None:
            return False
        self.bytes -= pin[1]
        return True

    def pop_expired(self, now: float) -> list[T]:
        expired: list[T] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, order, page = heapq.heappop(heap)
            pin = self._pins.get(page)
            if pin is None:
                continue
            if pin[0] > now:  # pinned again since, until later
                heapq.heappush(heap, (pin[0], order, page))
                continue
            del self._pins[page]
            self.bytes -= pin[1]
            expired.append(page)
        return expired
