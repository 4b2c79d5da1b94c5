"""Slab allocator: size classes sharing one arena, O(1) alloc/free, all-or-nothing eviction plans."""

from __future__ import annotations

import random

import pytest

from kvstore.tiers.slab import SLOT_ALIGN, SlabAllocator

KIB = 1024


def test_slots_are_aligned_disjoint_and_reused() -> None:
    slots = SlabAllocator(capacity=1024 * KIB, slab_bytes=256 * KIB)
    offsets = [slots.alloc(10 * KIB) for _ in range(slots.available(10 * KIB))]
    assert len(offsets) == 4 * (256 // 12)  # 10 KiB pages take 12 KiB strides, 21 per slab
    assert all(o % SLOT_ALIGN == 0 for o in offsets)
    spans = sorted((o, o + 10 * KIB) for o in offsets)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
    assert all(end <= slots.capacity for _, end in spans)
    with pytest.raises(MemoryError):
        slots.alloc(10 * KIB)
    slots.free(offsets[5])
    assert slots.alloc(10 * KIB) == offsets[5]
    assert slots.bytes_used == len(offsets) * 10 * KIB


def test_sizes_share_the_arena_through_slabs() -> None:
    slots = SlabAllocator(capacity=1024 * KIB, slab_bytes=256 * KIB)
    small = [slots.alloc(4 * KIB) for _ in range(64)]  # exactly one slab
    big = [slots.alloc(128 * KIB) for _ in range(6)]  # three slabs
    assert slots.available(128 * KIB) == 0 and slots.available(4 * KIB) == 0
    for offset in small:
        slots.free(offset)
    # The small class's slab went back to the pool: two more big pages fit.
    assert slots.available(128 * KIB) == 2
    assert slots.available(4 * KIB) == 64
    more = [slots.alloc(128 * KIB) for _ in range(2)]
    assert len(set(big + more)) == 8 and slots.bytes_used == 8 * 128 * KIB


def test_free_rejects_unknown_offsets() -> None:
    slots = SlabAllocator(capacity=512 * KIB, slab_bytes=256 * KIB)
    offset = slots.alloc(8 * KIB)
    for bad in (offset + 1, offset + 8 * KIB, 300 * KIB):
        with pytest.raises(ValueError, match="not an allocated slot"):
            slots.free(bad)
    slots.free(offset)
    with pytest.raises(ValueError, match="not an allocated slot"):
        slots.free(offset)


def test_page_larger_than_a_slab() -> None:
    slots = SlabAllocator(capacity=1024 * KIB, slab_bytes=256 * KIB)
    assert not slots.can_hold(257 * KIB)
    with pytest.raises(ValueError, match="does not fit"):
        slots.alloc(257 * KIB)


def test_plan_same_size_takes_candidates_in_order() -> None:
    slots = SlabAllocator(capacity=256 * KIB, slab_bytes=256 * KIB)
    offsets = [slots.alloc(64 * KIB) for _ in range(4)]
    plan = slots.plan_free(64 * KIB, 2, ((o, f"page{i}") for i, o in enumerate(offsets)))
    assert plan == ["page0", "page1"]
    assert slots.plan_free(64 * KIB, 5, ((o, i) for i, o in enumerate(offsets))) is None
    assert slots.bytes_used == 4 * 64 * KIB  # planning changed nothing


def test_plan_other_size_needs_a_whole_slab() -> None:
    slots = SlabAllocator(capacity=512 * KIB, slab_bytes=256 * KIB)
    a = [slots.alloc(64 * KIB) for _ in range(4)]  # slab 0
    b = [slots.alloc(64 * KIB) for _ in range(4)]  # slab 1
    # Evicting alternately from both slabs: a slab empties only after its 4th page.
    candidates = [(o, o) for pair in zip(a, b, strict=True) for o in pair]
    plan = slots.plan_free(128 * KIB, 2, iter(candidates))
    assert plan is not None and sorted(plan) == sorted(a)  # only slab 0's pages, not the half of slab 1
    for offset in plan:
        slots.free(offset)
    assert [slots.alloc(128 * KIB) for _ in range(2)] == [0, 128 * KIB]


def test_random_churn_keeps_accounting_exact() -> None:
    rng = random.Random(7)
    slots = SlabAllocator(capacity=4096 * KIB, slab_bytes=256 * KIB)
    sizes = [4 * KIB, 20 * KIB, 100 * KIB]
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and rng.random() < 0.45:
            offset = rng.choice(list(live))
            slots.free(offset)
            del live[offset]
        else:
            size = rng.choice(sizes)
            if slots.available(size):
                offset = slots.alloc(size)
                assert offset not in live
                live[offset] = size
            else:
                with pytest.raises(MemoryError):
                    slots.alloc(size)
        assert slots.bytes_used == sum(live.values())
    spans = sorted((o, o + s) for o, s in live.items())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))


def test_slabs_not_reserved_yet_are_not_handed_out() -> None:
    slots = SlabAllocator(capacity=1024 * KIB, slab_bytes=256 * KIB, reserved_slabs=1)
    assert slots.available(128 * KIB) == 2
    first = [slots.alloc(128 * KIB), slots.alloc(128 * KIB)]
    with pytest.raises(MemoryError):  # slabs 1-3 are not backed by memory yet
        slots.alloc(128 * KIB)
    slots.add_reserved(2)
    assert slots.available(128 * KIB) == 4
    other = slots.alloc(64 * KIB)  # another size class takes the next slab in order
    more = [slots.alloc(128 * KIB), slots.alloc(128 * KIB)]
    assert first == [0, 128 * KIB] and other == 256 * KIB and more == [512 * KIB, 640 * KIB]
    slots.free(other)  # slab 1 empties: it goes out before slab 3, reserved later
    slots.add_reserved(5)  # past the end: the arena's 4 slabs
    assert slots.num_reserved == 4
    assert [slots.alloc(256 * KIB), slots.alloc(256 * KIB)] == [256 * KIB, 768 * KIB]
    with pytest.raises(MemoryError):
        slots.alloc(256 * KIB)


def test_alloc_many_gives_what_as_many_allocs_give_or_nothing() -> None:
    """`alloc_many(size, n)` against `n` calls of `alloc` on a twin allocator, through random churn
    of three sizes (freed slots reused, slabs carved, handed back and taken by another size):
    the same offsets in the same order, the same accounting; and where fewer than `n` slots are
    left, MemoryError with nothing taken."""
    rng = random.Random(11)
    many = SlabAllocator(capacity=4096 * KIB, slab_bytes=256 * KIB)
    one = SlabAllocator(capacity=4096 * KIB, slab_bytes=256 * KIB)
    sizes = [4 * KIB, 20 * KIB, 100 * KIB]
    live: dict[int, int] = {}
    refused = 0
    for _ in range(3000):
        if live and rng.random() < 0.45:
            for offset in rng.sample(list(live), min(len(live), rng.randint(1, 8))):
                many.free(offset)
                one.free(offset)
                del live[offset]
            continue
        size, count = rng.choice(sizes), rng.randint(1, 40)
        if count > one.available(size):
            before = (many.bytes_used, many.available(size), many.available(4 * KIB))
            with pytest.raises(MemoryError):
                many.alloc_many(size, count)
            assert (many.bytes_used, many.available(size), many.available(4 * KIB)) == before
            refused += 1
            continue
        offsets = many.alloc_many(size, count)
        assert offsets == [one.alloc(size) for _ in range(count)]
        assert not set(offsets) & set(live)
        live.update(dict.fromkeys(offsets, size))
        assert many.bytes_used == one.bytes_used == sum(live.values())
        assert all(many.available(s) == one.available(s) for s in sizes)
    assert refused > 10  # the arena was full often enough to refuse
    spans = sorted((o, o + s) for o, s in live.items())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
