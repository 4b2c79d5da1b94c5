"""`Prepared.run(pages, offsets, marks)`: a store committed in parts moves its pages in one transfer
and learns where each part's pages are in place (the staged path marks the copy streams as it
goes; the other paths run each part in turn). Against the token-by-token oracle with the
destination poisoned; on a GPU the copy stream is held back first, so a mark that came before
its pages' copies would find them still poisoned."""

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
    write_expected,
)
from tests.test_prepared import IMPLS, options_for, settle

CHUNKS = [5, 1, 2, 3, 4, 0, 6, 7]  # what `prepare` takes
PAGES = [0, 1, 2, 3, 4, 5, 6, 7]  # the run names every prepared chunk, in order
MARKS = [2, 3, 6]  # parts of 2, 1 and 3 pages before a last of 2


def offsets_of(page_bytes: int, apart: int = 40) -> tuple[list[int], int]:
    """Every page at its own offset, in reverse order, `apart` bytes between two."""
    offsets = [(len(PAGES) - 1 - i) * (page_bytes + apart) + 8 for i in range(len(PAGES))]
    return offsets, len(PAGES) * (page_bytes + apart) + 64


def hold_the_copies(device: torch.device) -> None:
    """Queues ~30 ms of GPU sleep on the staged gather's copy stream: its copies start after it."""
    from kvstore_kernels import staged

    with torch.cuda.stream(staged._copy_stream(device, True, 0)):
        torch.cuda._sleep(60_000_000)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("layout", "layers_per_slot"), [("flash_attn", 2), ("flash_attn", 12), ("mla", 1)])
def test_each_mark_follows_its_pages_into_the_buffer(impl: str, layout: str, layers_per_slot: int) -> None:
    """Gathers of 8 pages marked after 2, 3 and 6, in slots smaller than a page and of several
    pages: one mark per count, each of which, once synchronized, finds its pages' bytes in the
    buffer (on a GPU with the copy stream held back); the whole buffer right at the end, and
    nothing written outside the pages."""
    spec = make_spec(layout, "bfloat16", num_layers=4)
    table = block_table(8 * spec.blocks_per_chunk, 8 * spec.blocks_per_chunk, seed=5)
    _, caches = build(spec, device_of(impl), num_blocks=len(table))
    offsets, size = offsets_of(spec.page.page_bytes)
    wanted = [CHUNKS[page] for page in PAGES]
    expected = expected_buffer(spec, caches, table, wanted, offsets, size)
    for poison in POISONS:
        want = torch.where(expected < 0, poison, expected).to(torch.uint8)
        buffer = buffer_of(impl, torch.full((size,), poison, dtype=torch.uint8))
        prepared = kvstore_kernels.prepare(
            spec,
            caches,
            table,
            CHUNKS,
            buffer,
            to_page=True,
            options=options_for(impl, spec, layers_per_slot),
        )
        if CUDA and impl == "staged":
            settle(impl)
            hold_the_copies(caches[0].device if isinstance(caches, list) else caches.device)
        done = prepared.run(PAGES, offsets, MARKS)
        assert len(done) == len(MARKS)
        for mark, count in zip(done, MARKS, strict=True):
            if mark is not None:
                mark.synchronize()
            got = buffer.cpu()
            for page in range(count):
                at = offsets[page]
                span = slice(at, at + spec.page.page_bytes)
                assert torch.equal(got[span], want[span]), f"mark {count}: page {page} not in place"
        settle(impl)
        assert torch.equal(buffer.cpu(), want), (
            f"poison {poison:#x}: {int((buffer.cpu() != want).sum())} differ"
        )


@pytest.mark.parametrize("impl", IMPLS)
def test_marked_scatter_fills_the_cache(impl: str) -> None:
    """A scatter marked after 2, 3 and 6 pages: one mark per count; once synchronized, each
    finds its pages' blocks in the cache; the whole cache right at the end."""
    spec = make_spec("flash_attn", "float16", num_layers=3)
    table = block_table(8 * spec.blocks_per_chunk, 8 * spec.blocks_per_chunk, seed=6)
    offsets, size = offsets_of(spec.page.page_bytes)
    pages = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    chunks = [CHUNKS[page] for page in PAGES]
    for poison in POISONS:
        bases, caches = build(spec, device_of(impl), num_blocks=len(table), fill=poison)
        buffer = buffer_of(impl, pages)
        prepared = kvstore_kernels.prepare(
            spec, caches, table, CHUNKS, buffer, to_page=False, options=options_for(impl, spec, 1)
        )
        done = prepared.run(PAGES, offsets, MARKS)
        assert len(done) == len(MARKS)
        for mark, count in zip(done, MARKS, strict=True):
            if mark is not None:
                mark.synchronize()
            want_bases, want = build(spec, "cpu", num_blocks=len(table), fill=poison)
            write_expected(spec, want, table, chunks[:count], pages, offsets[:count])
            blocks = torch.cat(
                [table[c * spec.blocks_per_chunk : (c + 1) * spec.blocks_per_chunk] for c in chunks[:count]]
            )
            for index, (got, exp) in enumerate(zip(as_bytes(bases), as_bytes(want_bases), strict=True)):
                assert torch.equal(got[:, blocks], exp[:, blocks]), f"mark {count}: tensor {index} differs"
        settle(impl)
        want_bases, want = build(spec, "cpu", num_blocks=len(table), fill=poison)
        write_expected(spec, want, table, chunks, pages, offsets)
        for index, (got, exp) in enumerate(zip(as_bytes(bases), as_bytes(want_bases), strict=True)):
            assert torch.equal(got, exp), f"poison {poison:#x}, tensor {index} differs"


@pytest.mark.parametrize("impl", ["staged", "torch"])
@pytest.mark.parametrize("marks", [[0], [8], [3, 2], [2, 2], [-1]])
def test_marks_out_of_order_or_range_are_refused(impl: str, marks: list[int]) -> None:
    spec = make_spec("flash_attn", "bfloat16", num_layers=2)
    table = block_table(8 * spec.blocks_per_chunk, 8 * spec.blocks_per_chunk)
    _, caches = build(spec, device_of(impl), num_blocks=len(table))
    offsets, size = offsets_of(spec.page.page_bytes)
    buffer = buffer_of(impl, torch.zeros(size, dtype=torch.uint8))
    prepared = kvstore_kernels.prepare(
        spec, caches, table, CHUNKS, buffer, to_page=True, options=options_for(impl, spec, 2)
    )
    with pytest.raises(ValueError, match=r"marks: expected increasing counts in 1\.\.7"):
        prepared.run(PAGES, offsets, marks)


def test_a_slot_of_several_pages_ends_at_a_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slots of 3 whole pages: unmarked, 8 pages in order move in 3 launches (0-2, 3-5, 6-7);
    marked after 2 and 4, in 4 (0-1, 2-3, 4-6, 7), so that each mark follows a slot's copy."""
    from kvstore_kernels import staged, triton_copy

    spec = make_spec("flash_attn", "bfloat16", num_layers=4)
    table = block_table(8 * spec.blocks_per_chunk, 8 * spec.blocks_per_chunk, seed=8)
    _, caches = build(spec, device_of("staged"), num_blocks=len(table))
    offsets = [i * spec.page.page_bytes for i in range(len(PAGES))]  # one after another: one copy a slot
    size = len(PAGES) * spec.page.page_bytes
    monkeypatch.setattr(staged, "_rings", {})
    launches: list[int] = []
    real_run = triton_copy.Launch.run

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append(1)
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(triton_copy.Launch, "run", counted)
    expected = expected_buffer(spec, caches, table, [CHUNKS[p] for p in PAGES], offsets, size)
    for marks, count in (([], 3), ([2, 4], 4)):
        buffer = buffer_of("staged", torch.full((size,), 0xA5, dtype=torch.uint8))
        prepared = kvstore_kernels.prepare(
            spec, caches, table, CHUNKS, buffer, to_page=True, options=staged_options(spec, 3 * 4)
        )
        launches.clear()
        assert len(prepared.run(PAGES, offsets, marks)) == len(marks)
        settle("staged")
        assert len(launches) == count
        assert torch.equal(buffer.cpu(), expected.to(torch.uint8))
