"""The chunks whose loads failed lately, which the connector's scheduler side
(`kvstore_client.vllm.scheduler`) offers to no request for a while.

- `FailedChunks.add(keys)`: chunks (rank 0's keys) not offered again for FAILED_S; at most
  MAX_FAILED are remembered, the oldest dropped first.
- `FailedChunks.cut(keys, first, hit)`: a lookup's hit cut before the first such chunk.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

FAILED_S = 30.0  # how long a chunk whose load failed is not offered to other requests
MAX_FAILED = 4096  # such chunks remembered


class FailedChunks:
    """Rank 0's key of the first group of chunks whose load failed -> when it may be offered again."""

    def __init__(self) -> None:
        self._until: dict[bytes, float] = {}

    def add(self, keys: Iterable[bytes]) -> None:
        until = time.monotonic() + FAILED_S
        for key in keys:
            self._until[key] = until
        while len(self._until) > MAX_FAILED:
            del self._until[next(iter(self._until))]

    def cut(self, keys: Sequence[bytes], first: int, hit: int) -> int:
        """`hit` cut before any chunk of `[first, hit)` (`keys`: the prompt's, rank 0's) whose load
        failed lately (for any request)."""
        if not self._until or hit <= first:
            return hit
        now = time.monotonic()
        for key, until in list(self._until.items()):
            if until <= now:
                del self._until[key]
        for index in range(first, min(hit, len(keys))):
            if keys[index] in self._until:
                return index
        return hit
