"""Frequency history: how often pages the tier evicted had been used, kept in a few bytes a page.

A direct-mapped table of 64-bit key fingerprints and 8-bit counts, with at least
twice as many slots as `fit(pages)` was last told; an eviction overwrites
whatever older eviction shared its slot, so the history holds roughly the last
tier's worth of evictions. `put(key, count)` when a page is evicted,
`pop(key)` when one is stored (its old count, or 0). 9 bytes a slot.
"""

from __future__ import annotations

from array import array

_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads fingerprints over the slots
_MASK64 = (1 << 64) - 1
MAX_COUNT = 255


class FrequencyHistory:
    def __init__(self, slot_bits: int = 10) -> None:
        self._bits = slot_bits
        self._prints = array("Q", bytes(8 << slot_bits))  # 0: empty slot
        self._counts = bytearray(1 << slot_bits)

    @property
    def slots(self) -> int:
        return 1 << self._bits

    def _slot(self, fingerprint: int) -> int:
        return ((fingerprint * _MIX) & _MASK64) >> (64 - self._bits)

    def put(self, key: bytes, count: int) -> None:
        fingerprint = int.from_bytes(key[:8], "little") or 1
        slot = self._slot(fingerprint)
        self._prints[slot] = fingerprint
        self._counts[slot] = min(count, MAX_COUNT)

    def put_many(self, keys_counts: list[tuple[bytes, int]]) -> None:
        """`put` for each (key, count), in order."""
        prints, counts, shift = self._prints, self._counts, 64 - self._bits
        for key, count in keys_counts:
            fingerprint = int.from_bytes(key[:8], "little") or 1
            slot = ((fingerprint * _MIX) & _MASK64) >> shift
            prints[slot] = fingerprint
            counts[slot] = count if count < MAX_COUNT else MAX_COUNT

    def pop(self, key: bytes) -> int:
        fingerprint = int.from_bytes(key[:8], "little") or 1
        slot = self._slot(fingerprint)
        if self._prints[slot] != fingerprint:
            return 0
        self._prints[slot] = 0
        return self._counts[slot]

    def fit(self, pages: int) -> None:
        """Doubles the table (keeping its entries) until it has at least 2 slots per page."""
        if 2 * pages <= self.slots:
            return
        entries = [(p, c) for p, c in zip(self._prints, self._counts, strict=True) if p]
        while 2 * pages > self.slots:
            self._bits += 1
        self._prints = array("Q", bytes(8 << self._bits))
        self._counts = bytearray(1 << self._bits)
        for fingerprint, count in entries:
            slot = self._slot(fingerprint)
            self._prints[slot] = fingerprint
            self._counts[slot] = count
