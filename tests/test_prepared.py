"""`kvstore_kernels.prepare`: a transfer checked and set up before its page offsets are known,
then run for the pages a reply names (some of the chunks, in parts, in any order), against the
token-by-token oracle with the destination poisoned twice. The staged path runs in Triton's
interpreter on CPU tensors here, and on the GPU into pinned pages where there is one."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvstore_kernels
from tests.kernel_cases import (
    CUDA,
    POISONS,
    as_bytes,
    block_table,
    buffer_of,
    build,
    device_of,
    expected_buffer,
    make_spec,
    staged_options,
    triton_module,
    write_expected,
)

IMPLS = ["staged", "torch", "triton"]
CHUNKS = [3, 0, 2, 1]  # what `prepare` takes; a run names pages: indices into these


def options_for(impl: str, spec: Any, layers_per_slot: int = 2) -> kvstore_kernels.TransferOptions:
    if impl == "staged":
        return staged_options(spec, layers_per_slot)
    if impl == "triton":
        triton_module()
    return kvstore_kernels.TransferOptions(engine="kernel" if impl == "triton" else impl)


def settle(impl: str) -> None:
    if CUDA and impl != "torch":
        torch.cuda.synchronize()


def parts_and_offsets(page_bytes: int) -> tuple[list[list[int]], list[list[int]], int]:
    """Pages 2 and 0, then 3 (1 is not wanted), at offsets apart and out of order."""
    parts = [[2, 0], [3]]
    offsets = [[4 * page_bytes + 8, 16], [2 * page_bytes + 24]]
    return parts, offsets, 6 * page_bytes + 64


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["flash_attn", "mla", "cross_layer"])
@pytest.mark.parametrize("layers", [None, range(1, 3)])
def test_prepared_gather_writes_the_named_pages_only(impl: str, layout: str, layers: range | None) -> None:
    spec = make_spec(layout, "bfloat16", num_layers=4)
    table = block_table(12, 4 * spec.blocks_per_chunk)
    _, caches = build(spec, device_of(impl))
    parts, offsets, size = parts_and_offsets(spec.page.page_bytes)
    wanted = [CHUNKS[page] for part in parts for page in part]
    expected = expected_buffer(spec, caches, table, wanted, sum(offsets, []), size, layers)
    for poison in POISONS:
        buffer = buffer_of(impl, torch.full((size,), poison, dtype=torch.uint8))
        prepared = kvstore_kernels.prepare(
            spec, caches, table, CHUNKS, buffer, layers, to_page=True, options=options_for(impl, spec)
        )
        assert prepared.chunks == len(CHUNKS)
        for part, at in zip(parts, offsets, strict=True):
            prepared.run(part, at)
        settle(impl)
        want = torch.where(expected < 0, poison, expected).to(torch.uint8)
        assert torch.equal(buffer.cpu(), want), (
            f"poison {poison:#x}: {int((buffer.cpu() != want).sum())} differ"
        )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["flash_attn", "mla"])
def test_prepared_scatter_fills_the_named_chunks_only(impl: str, layout: str) -> None:
    spec = make_spec(layout, "float8_e4m3fn" if layout == "mla" else "float16", num_layers=3)
    table = block_table(12, 4 * spec.blocks_per_chunk)
    parts, offsets, size = parts_and_offsets(spec.page.page_bytes)
    pages = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    for poison in POISONS:
        bases, caches = build(spec, device_of(impl), fill=poison)
        want_bases, want = build(spec, "cpu", fill=poison)
        buffer = buffer_of(impl, pages)
        prepared = kvstore_kernels.prepare(
            spec, caches, table, CHUNKS, buffer, to_page=False, options=options_for(impl, spec, 1)
        )
        for part, at in zip(parts, offsets, strict=True):
            prepared.run(part, at)
            write_expected(spec, want, table, [CHUNKS[page] for page in part], pages, at)
        settle(impl)
        for index, (got, expected) in enumerate(zip(as_bytes(bases), as_bytes(want_bases), strict=True)):
            assert torch.equal(got.cpu(), expected), f"poison {poison:#x}, tensor {index} differs"


def test_prepared_staged_survives_the_ring_growing_in_between(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another transfer grows the staging ring between prepare and run: the run sets itself up
    again on the new ring (the old one is gone), and the bytes are right."""
    spec = make_spec("flash_attn", "bfloat16", num_layers=4, head_dim=512)  # layers past a slot's alignment
    table = block_table(12, 4 * spec.blocks_per_chunk)
    _, caches = build(spec, device_of("staged"))
    parts, offsets, size = parts_and_offsets(spec.page.page_bytes)
    from kvstore_kernels import staged

    monkeypatch.setattr(staged, "_rings", {})  # a ring of this test's sizes only
    small = staged_options(spec, 1)
    buffer = buffer_of("staged", torch.full((size,), 0xA5, dtype=torch.uint8))
    prepared = kvstore_kernels.prepare(spec, caches, table, CHUNKS, buffer, to_page=True, options=small)
    device = caches[0].device  # the ring's key: the cache's device as the plan names it (cuda:0)
    before = staged.ring_for(device, True).memory
    other = buffer_of("staged", torch.zeros(size, dtype=torch.uint8))
    larger = staged_options(spec, 8)  # a slot of a whole page and more: the ring is replaced
    kvstore_kernels.gather(spec, caches, table, [1], other, [0], options=larger)
    assert staged.ring_for(device, True).memory is not before
    for part, at in zip(parts, offsets, strict=True):
        prepared.run(part, at)
    settle("staged")
    wanted = [CHUNKS[page] for part in parts for page in part]
    expected = expected_buffer(spec, caches, table, wanted, sum(offsets, []), size)
    want = torch.where(expected < 0, 0xA5, expected).to(torch.uint8)
    assert torch.equal(buffer.cpu(), want)


@pytest.mark.parametrize(
    ("to_page", "pages", "offsets", "message"),
    [
        (True, [4], [0], r"pages\[0\]: 4 is not one of the plan's 4 chunks"),
        (True, [0, 1], [0], "pages and offsets: 2 pages but 1 offsets"),
        (True, [0, 1], [0, 8], r"offsets\[0\] and offsets\[1\]: pages at 0 and 8 overlap"),
        (True, [0], [10**9], r"offsets\[0\]: page .* runs past the end"),
        (False, [1, 1], [0, 0], "pages: a page appears twice"),
        (True, [-1], [0], r"pages\[0\]: -1 is negative"),
    ],
)
def test_prepared_run_refuses_bad_pages_and_offsets(
    to_page: bool, pages: list[int], offsets: list[int], message: str
) -> None:
    """Every page and offset a run names is checked before any byte moves; nothing is written."""
    spec = make_spec("flash_attn", "bfloat16", num_layers=2)
    table = block_table(12, 4 * spec.blocks_per_chunk)
    bases, caches = build(spec, "cpu")
    size = 4 * spec.page.page_bytes
    buffer = torch.full((size,), 0x5A, dtype=torch.uint8)
    options = kvstore_kernels.TransferOptions(engine="torch")
    prepared = kvstore_kernels.prepare(spec, caches, table, CHUNKS, buffer, to_page=to_page, options=options)
    before = [tensor.clone() for tensor in as_bytes(bases)]
    with pytest.raises(ValueError, match=message):
        prepared.run(pages, offsets)
    assert bool((buffer == 0x5A).all())
    assert all(torch.equal(a, b) for a, b in zip(as_bytes(bases), before, strict=True))


def test_prepare_checks_the_call_as_gather_does() -> None:
    """What `gather` refuses, `prepare` refuses with the same message (a block outside the cache)."""
    spec = make_spec("flash_attn", "bfloat16", num_layers=2)
    _, caches = build(spec, "cpu", num_blocks=12)
    table = block_table(12, 4 * spec.blocks_per_chunk)
    table[0] = 99
    buffer = torch.zeros(spec.page.page_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"block_ids\[0\]: block 99 .* is outside 0..11"):
        kvstore_kernels.prepare(spec, caches, table, [0], buffer, to_page=True)
    with pytest.raises(ValueError, match=r"block_ids\[0\]: block 99 .* is outside 0..11"):
        kvstore_kernels.gather(spec, caches, table, [0], buffer, [0])


def test_prepared_scatter_hands_its_checked_blocks_on() -> None:
    """A scatter prepared for chunks 0..n-1 of a host table gives the same `CheckedBlocks` as
    `check_blocks`; any other chunks, or a gather, give the table back as it was."""
    from kvstore_kernels import CheckedBlocks

    spec = make_spec("flash_attn", "bfloat16", num_layers=2)
    _, caches = build(spec, "cpu")
    table = block_table(12, 4 * spec.blocks_per_chunk)
    buffer = torch.zeros(4 * spec.page.page_bytes, dtype=torch.uint8)
    prepared = kvstore_kernels.prepare(spec, caches, table, range(4), buffer, to_page=False)
    checked = prepared.checked_blocks(table)
    expected = kvstore_kernels.check_blocks(spec, caches, table, 4, writes_cache=True)
    assert isinstance(checked, CheckedBlocks) and isinstance(expected, CheckedBlocks)
    assert checked.table is table and checked.unique and checked.num_blocks == expected.num_blocks
    assert checked.blocks.tolist() == expected.blocks.tolist()
    assert (
        kvstore_kernels.prepare(spec, caches, table, CHUNKS, buffer, to_page=False).checked_blocks(table)
        is table
    )
    assert (
        kvstore_kernels.prepare(spec, caches, table, range(4), buffer, to_page=True)
        .checked_blocks(table)
        .unique
        is False
    )


@pytest.mark.parametrize("impl", ["staged", "torch"])
def test_prepared_registered_caches_keep_their_setup_for_the_next_table(impl: str) -> None:
    """With registered caches the second and later prepares of the same shape reuse what does not
    depend on the block table (the staged setup renewed with the new block ids): a gather of
    another table and another page count, then a scatter, every byte against the oracle."""
    spec = make_spec("flash_attn", "bfloat16", num_layers=3)
    _, caches = build(spec, device_of(impl))
    registered = kvstore_kernels.register(spec, caches)
    options = options_for(impl, spec)
    size = 6 * spec.page.page_bytes
    buffer = buffer_of(impl, torch.full((size,), 0xA5, dtype=torch.uint8))  # one buffer, as an arena
    for seed, chunks in ((1, [3, 0, 2, 1]), (2, [1, 2, 0, 3]), (3, [2, 0, 1]), (4, [0, 3, 1, 2])):
        table = block_table(12, 4 * spec.blocks_per_chunk, seed=seed)
        offsets = [(5 - j) * spec.page.page_bytes for j in range(len(chunks))]
        expected = expected_buffer(spec, caches, table, chunks, offsets, size)
        buffer.fill_(0xA5)
        prepared = kvstore_kernels.prepare(
            spec, registered, table, chunks, buffer, to_page=True, options=options
        )
        prepared.run(range(len(chunks)), offsets)
        settle(impl)
        want = torch.where(expected < 0, 0xA5, expected).to(torch.uint8)
        assert torch.equal(buffer.cpu(), want), f"table {seed}"
    kept = registered.__dict__["_prepared"]
    assert len(kept) == 1  # one spec, layers, direction, options and buffer
    entry = next(iter(kept.values()))
    assert entry.plan is not None and entry.plan.buffer is None and entry.plan.kv_caches is None
    if impl == "staged":
        assert sorted(entry.setups) == [3, 4]  # a setup per page count


def test_prepared_kept_entries_hold_no_buffer_alive() -> None:
    """The kept entry refers to its buffer weakly: a buffer dropped is gone, and a new buffer
    (even at the same address) gets an entry of its own."""
    import gc
    import weakref

    spec = make_spec("mla", "bfloat16", num_layers=2)
    _, caches = build(spec, "cpu")
    registered = kvstore_kernels.register(spec, caches)
    table = block_table(12, 4 * spec.blocks_per_chunk)
    options = kvstore_kernels.TransferOptions(engine="torch")
    buffer = torch.zeros(4 * spec.page.page_bytes, dtype=torch.uint8)
    kvstore_kernels.prepare(spec, registered, table, [0, 1], buffer, to_page=True, options=options)
    alive = weakref.ref(buffer)
    del buffer
    gc.collect()
    assert alive() is None
    other = torch.zeros(4 * spec.page.page_bytes, dtype=torch.uint8)
    prepared = kvstore_kernels.prepare(spec, registered, table, [0, 1], other, to_page=True, options=options)
    prepared.run([0, 1], [0, spec.page.page_bytes])
    expected = expected_buffer(spec, caches, table, [0, 1], [0, spec.page.page_bytes], other.numel())
    assert torch.equal(other, torch.where(expected < 0, 0, expected).to(torch.uint8))


def test_prepared_registered_caches_check_every_table() -> None:
    """A kept setup does not keep a table's checks: a later table with a block outside the cache
    is refused by name, as the first call's would be."""
    spec = make_spec("flash_attn", "bfloat16", num_layers=2)
    _, caches = build(spec, "cpu", num_blocks=12)
    registered = kvstore_kernels.register(spec, caches)
    buffer = torch.zeros(4 * spec.page.page_bytes, dtype=torch.uint8)
    table = block_table(12, 4 * spec.blocks_per_chunk)
    kvstore_kernels.prepare(spec, registered, table, [0, 1], buffer, to_page=True)
    bad = table.clone()
    bad[spec.blocks_per_chunk] = 40
    with pytest.raises(ValueError, match=r"block_ids\[2\]: block 40 .* is outside 0..11"):
        kvstore_kernels.prepare(spec, registered, bad, [0, 1], buffer, to_page=True)
    with pytest.raises(ValueError, match="a block id that appears twice|appears twice"):
        twice = table.clone()
        twice[0] = twice[1]
        kvstore_kernels.prepare(spec, registered, twice, [0, 1], buffer, to_page=False)


@pytest.mark.parametrize("to_page", [True, False])
@pytest.mark.parametrize("layers", [None, range(1, 3)])
@pytest.mark.parametrize("apart", [0, 24])
@pytest.mark.parametrize("layout", ["flash_attn", "mla", "cross_layer", "hf"])
def test_staged_slots_of_several_whole_pages(
    monkeypatch: pytest.MonkeyPatch, to_page: bool, layers: range | None, apart: int, layout: str
) -> None:
    """Where a page's moved layers take at most half a staging slot, one slot and one launch move
    several whole pages that follow one another in the plan (runs of them at offsets one after
    another in the buffer in one copy): pages named in a run longer than a slot, singly, and in
    an order that does not follow the plan; at offsets adjacent and `apart`; poisoned twice."""
    from kvstore_kernels import staged, triton_copy

    spec = make_spec(layout, "float8_e4m3fn" if layout == "mla" else "bfloat16", num_layers=4)
    chunks = [5, 1, 2, 3, 4, 0, 6, 7]
    table = block_table(8 * spec.blocks_per_chunk, 8 * spec.blocks_per_chunk, seed=4)
    moved = len(layers or range(4))
    options = staged_options(spec, 3 * moved)  # a slot holds 3 pages' moved layers
    parts = [[1, 2, 3, 4, 5], [7], [6, 0]]  # slots: 1-3, 4-5; 7; 6; 0
    page, at, offsets = spec.page.page_bytes, 8, []
    for part in parts:
        offsets.append([])
        for _ in part:
            offsets[-1].append(at)
            at += page + apart
    size = at + 64
    monkeypatch.setattr(staged, "_rings", {})  # a ring of this test's slots
    launches: list[tuple[int, int]] = []
    real_run = triton_copy.Launch.run

    def counted(self: Any, first: int, end: int, *args: Any, **kwargs: Any) -> Any:
        launches.append((first, end))
        return real_run(self, first, end, *args, **kwargs)

    monkeypatch.setattr(triton_copy.Launch, "run", counted)
    wanted = [chunks[p] for part in parts for p in part]
    source = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    for poison in POISONS:
        bases, caches = build(
            spec, device_of("staged"), num_blocks=len(table), fill=None if to_page else poison
        )
        buffer = buffer_of("staged", torch.full((size,), poison, dtype=torch.uint8) if to_page else source)
        prepared = kvstore_kernels.prepare(
            spec, caches, table, chunks, buffer, layers, to_page=to_page, options=options
        )
        launches.clear()
        for part, part_offsets in zip(parts, offsets, strict=True):
            prepared.run(part, part_offsets)
        settle("staged")
        assert len(launches) == 5, launches  # 1-3, 4-5, 7, 6, 0
        if to_page:
            expected = expected_buffer(spec, caches, table, wanted, sum(offsets, []), size, layers)
            want = torch.where(expected < 0, poison, expected).to(torch.uint8)
            assert torch.equal(buffer.cpu(), want), (
                f"poison {poison:#x}: {int((buffer.cpu() != want).sum())} differ"
            )
        else:
            want_bases, want = build(spec, "cpu", num_blocks=len(table), fill=poison)
            write_expected(spec, want, table, wanted, source, sum(offsets, []), layers)
            for index, (got, exp) in enumerate(zip(as_bytes(bases), as_bytes(want_bases), strict=True)):
                assert torch.equal(got.cpu(), exp), f"poison {poison:#x}, tensor {index} differs"


def test_staging_ring_slots_follow_the_largest_slot_and_the_ring_bytes() -> None:
    """A ring's slots: at least `NUM_SLOTS`, as many as its bytes hold of the largest slot asked
    for so far, at most `MAX_SLOTS`; a new ring (memory) whenever the slots change, handed out in
    turn from the first."""
    from kvstore_kernels.staged_ring import MAX_SLOTS, NUM_SLOTS, StagingRing

    mib = 1 << 20
    ring = StagingRing(torch.device("cpu"))
    ring.reserve(3 * mib, 16 * mib)
    assert (ring.slots, ring.slot_bytes, ring.memory.numel()) == (5, 3 * mib, 15 * mib)
    assert [ring.take() for _ in range(7)] == [0, 1, 2, 3, 4, 0, 1]
    first = ring.memory
    ring.reserve(2 * mib, 16 * mib)  # smaller slots asked for: the ring stays
    assert ring.memory is first and ring.slots == 5
    ring.reserve(8 * mib, 16 * mib)  # larger: fewer of them, never under NUM_SLOTS
    assert (ring.slots, ring.slot_bytes) == (NUM_SLOTS, 8 * mib) and ring.memory is not first
    assert ring.take() == 0
    ring.reserve(1 * mib, 1 << 30)  # the largest slot so far, as many as the bytes hold, capped
    assert (ring.slots, ring.slot_bytes, ring.memory.numel()) == (MAX_SLOTS, 8 * mib, MAX_SLOTS * 8 * mib)
    assert ring.address(3) == ring.memory.data_ptr() + 3 * 8 * mib
