"""Slot allocator for one arena shared by pages of several sizes.

The arena is cut into equal slabs. A slab belongs to one size class (one page
size) while any of its slots is in use and returns to the pool when its last
slot is freed, so namespaces with different page sizes share the arena.

- `SlabAllocator(capacity, slab_bytes, reserved_slabs=None)`: only the first `reserved_slabs`
  slabs are handed out until `add_reserved(count)` adds the next ones (an arena whose memory is
  reserved in the background, `reserve`); slabs go out lowest first.
- `alloc(page_bytes)` / `free(offset)`: O(1) (slabs are carved lazily with a
  bump index; returning a slab costs what its allocations already paid).
  `alloc_many(page_bytes, count)`: what `count` calls of `alloc` give, or nothing.
- `available(page_bytes)`: slots that can be allocated without eviction.
- `plan_free(page_bytes, count, candidates)`: which of the candidates (in
  eviction order) to free so that `count` slots of that size become available,
  or None if even all of them would not suffice. Planning changes nothing, so
  eviction is all or nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")

SLOT_ALIGN = 4096  # page-aligned slots: whole OS pages for DMA and for mmap readers


class SizeClass:
    __slots__ = ("page_bytes", "stride", "slots_per_slab", "free", "carving")

    def __init__(self, page_bytes: int, slab_bytes: int) -> None:
        self.page_bytes = page_bytes
        self.stride = -(-page_bytes // SLOT_ALIGN) * SLOT_ALIGN
        self.slots_per_slab = slab_bytes // self.stride
        self.free: dict[int, None] = {}  # ordered set of free slot offsets
        self.carving: dict[int, None] = {}  # slabs not yet fully carved


class SlabAllocator:
    def __init__(self, capacity: int, slab_bytes: int, reserved_slabs: int | None = None) -> None:
        slab_bytes = min(slab_bytes, capacity) // SLOT_ALIGN * SLOT_ALIGN
        if slab_bytes <= 0:
            raise ValueError(f"arena of {capacity} bytes is smaller than one {SLOT_ALIGN}-byte slot")
        self.slab_bytes = slab_bytes
        self.num_slabs = capacity // slab_bytes
        self.capacity = self.num_slabs * slab_bytes
        self.num_reserved = self.num_slabs if reserved_slabs is None else min(reserved_slabs, self.num_slabs)
        self._free_slabs = list(range(self.num_reserved - 1, -1, -1))  # popped from the end: lowest first
        self._owner: list[SizeClass | None] = [None] * self.num_slabs
        self._used = [0] * self.num_slabs  # allocated slots per slab
        self._carved = [0] * self.num_slabs  # slots handed out so far by the bump index
        self._classes: dict[int, SizeClass] = {}
        self.bytes_used = 0

    def add_reserved(self, count: int) -> None:
        """The next `count` slabs (their memory now reserved) may be handed out, after the free
        slabs that may be now."""
        start = self.num_reserved
        self.num_reserved = min(self.num_slabs, start + count)
        self._free_slabs[:0] = range(self.num_reserved - 1, start - 1, -1)

    def can_hold(self, page_bytes: int) -> bool:
        return 0 < page_bytes <= self.slab_bytes

    def _class(self, page_bytes: int) -> SizeClass:
        cls = self._classes.get(page_bytes)
        if cls is None:
            if not self.can_hold(page_bytes):
                raise ValueError(f"a page of {page_bytes} bytes does not fit a {self.slab_bytes}-byte slab")
            cls = self._classes[page_bytes] = SizeClass(page_bytes, self.slab_bytes)
        return cls

    def available(self, page_bytes: int) -> int:
        cls = self._class(page_bytes)
        uncarved = sum(cls.slots_per_slab - self._carved[slab] for slab in cls.carving)
        return len(cls.free) + uncarved + len(self._free_slabs) * cls.slots_per_slab

    def alloc(self, page_bytes: int) -> int:
        """Offset of a free slot for a page of this size; MemoryError if none is left."""
        cls = self._class(page_bytes)
        if cls.free:
            offset, _ = cls.free.popitem()
        else:
            if not cls.carving:
                if not self._free_slabs:
                    raise MemoryError(f"no free slot for a {page_bytes}-byte page")
                slab = self._free_slabs.pop()
                self._owner[slab] = cls
                self._carved[slab] = 0
                cls.carving[slab] = None
            slab = next(iter(cls.carving))
            offset = slab * self.slab_bytes + self._carved[slab] * cls.stride
            self._carved[slab] += 1
            if self._carved[slab] == cls.slots_per_slab:
                del cls.carving[slab]
        self._used[offset // self.slab_bytes] += 1
        self.bytes_used += cls.page_bytes
        return offset

    def alloc_many(self, page_bytes: int, count: int) -> list[int]:
        """The offsets `count` calls of `alloc` would give, in that order; MemoryError, with none
        taken, where fewer are left. A run carved from one slab is taken at once (a Reserve's
        pages: the daemon's work per page is most of a Reserve's)."""
        cls = self._class(page_bytes)
        if count > self.available(page_bytes):
            raise MemoryError(f"no free slot for {count} pages of {page_bytes} bytes")
        offsets: list[int] = []
        used, slab_bytes, stride = self._used, self.slab_bytes, cls.stride
        while cls.free and len(offsets) < count:
            offset, _ = cls.free.popitem()
            used[offset // slab_bytes] += 1
            offsets.append(offset)
        while len(offsets) < count:
            if not cls.carving:
                slab = self._free_slabs.pop()
                self._owner[slab] = cls
                self._carved[slab] = 0
                cls.carving[slab] = None
            slab = next(iter(cls.carving))
            carved = self._carved[slab]
            take = min(count - len(offsets), cls.slots_per_slab - carved)
            start = slab * slab_bytes + carved * stride
            offsets.extend(range(start, start + take * stride, stride))
            self._carved[slab] = carved + take
            used[slab] += take
            if carved + take == cls.slots_per_slab:
                del cls.carving[slab]
        self.bytes_used += count * cls.page_bytes
        return offsets

    def free(self, offset: int) -> None:
        slab = offset // self.slab_bytes
        cls = self._owner[slab]
        index, misaligned = divmod(offset - slab * self.slab_bytes, cls.stride) if cls else (0, 1)
        if cls is None or misaligned or index >= self._carved[slab] or offset in cls.free:
            raise ValueError(f"offset {offset} is not an allocated slot")
        self._used[slab] -= 1
        self.bytes_used -= cls.page_bytes
        if self._used[slab]:
            cls.free[offset] = None
            return
        base = slab * self.slab_bytes
        for i in range(self._carved[slab]):
            cls.free.pop(base + i * cls.stride, None)
        cls.carving.pop(slab, None)
        self._owner[slab] = None
        self._carved[slab] = 0
        self._free_slabs.append(slab)

    def plan_free(self, page_bytes: int, count: int, candidates: Iterable[tuple[int, T]]) -> list[T] | None:
        """Items to free, in order, so that `count` slots of `page_bytes` become available."""
        cls = self._class(page_bytes)
        need = count - self.available(page_bytes)
        victims: list[T] = []
        if need <= 0:
            return victims
        # Freeing a slot of another size helps only once its whole slab is empty.
        used_after: dict[int, int] = {}
        pending: dict[int, list[T]] = {}
        for offset, item in candidates:
            slab = offset // self.slab_bytes
            if self._owner[slab] is cls:
                victims.append(item)
                need -= 1
            else:
                used_after[slab] = used_after.get(slab, self._used[slab]) - 1
                pending.setdefault(slab, []).append(item)
                if used_after[slab] == 0:
                    victims.extend(pending.pop(slab))
                    need -= cls.slots_per_slab
            if need <= 0:
                return victims
        return None
