"""Page gather/scatter on a CUDA device: real kernels, pinned host pages, the auto rule's
choices, side streams, device block tables, and the staged path's ring under load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import kvstore_kernels
from kvstore.shared.spec import KVSpec
from tests.kernel_cases import (
    POISONS,
    as_bytes,
    block_table,
    buffer_of,
    build,
    check_gather,
    check_scatter,
    device_of,
    expected_buffer,
    expected_with_skipped,
    gpu,
    make_spec,
    model_call,
    needs_cuda,
    scenario,
    small_call,
    staged_options,
    triton_module,
    write_expected,
)

# -- CUDA: real kernels, pinned host pages, wide tiles -------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("buffer_on", ["pinned", "cuda", "pageable"])
def test_cuda_cache_with_each_buffer(monkeypatch: pytest.MonkeyPatch, buffer_on: str) -> None:
    """Auto dispatch: a GPU path for a pinned or device buffer, the reference for pageable memory."""
    spec = KVSpec(
        model="m",
        num_layers=4,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        block_size=16,
        layout="flash_attn",
        chunk_tokens=64,
        kv_sharing={3: 1},
    )
    table = block_table(40, 32)
    chunks, offsets = (
        [5, 1, 7, 0],
        [0, 3 * spec.page.page_bytes, spec.page.page_bytes, 6 * spec.page.page_bytes],
    )
    _, caches = build(spec, "cuda", num_blocks=40)
    size = 7 * spec.page.page_bytes
    from kvstore_kernels import copy_engine, staged

    launches: list[int] = []
    for module in (triton_module(), copy_engine, staged):  # a GPU path: kernel, copy engines, staged
        real_launch = module.launch

        def counting_launch(*args: Any, _real: Any = real_launch, **kwargs: Any) -> None:
            launches.append(1)
            _real(*args, **kwargs)

        monkeypatch.setattr(module, "launch", counting_launch)
    expected = expected_buffer(spec, caches, table, chunks, offsets, size)
    for poison in POISONS:
        buffer = torch.full(
            (size,), poison, dtype=torch.uint8, device="cuda" if buffer_on == "cuda" else "cpu"
        )
        buffer = buffer.pin_memory() if buffer_on == "pinned" else buffer
        kvstore_kernels.gather(spec, caches, table, chunks, buffer, offsets)
        torch.cuda.synchronize()
        assert torch.equal(buffer.cpu(), torch.where(expected < 0, poison, expected).to(torch.uint8))
        _, restored = build(spec, "cuda", num_blocks=40, fill=poison)
        kvstore_kernels.scatter(spec, restored, table, chunks, buffer, offsets)
        again = torch.full_like(buffer, poison)
        again = again.pin_memory() if buffer_on == "pinned" else again
        kvstore_kernels.gather(spec, restored, table, chunks, again, offsets)
        torch.cuda.synchronize()
        assert torch.equal(again.cpu(), buffer.cpu())
    assert len(launches) == (0 if buffer_on == "pageable" else 6)


@gpu
@needs_cuda
@pytest.mark.parametrize("max_programs", [1, 3, 1000])
def test_cuda_program_cap_covers_every_segment(max_programs: int) -> None:
    spec = make_spec("cross_layer", "float8_e4m3fn", num_layers=5, block_size=16, chunk_tokens=64)
    table, chunks, offsets, size = scenario(spec)
    table = block_table(40, 16)
    _, caches = build(spec, "cuda", num_blocks=40)
    buffer = torch.full((size,), 0xA5, dtype=torch.uint8, device="cuda")
    options = kvstore_kernels.TransferOptions(engine="kernel", max_programs=max_programs)
    kvstore_kernels.gather(spec, caches, table, chunks, buffer, offsets, options=options)
    expected = expected_buffer(spec, caches, table, chunks, offsets, size)
    assert torch.equal(buffer.cpu(), torch.where(expected < 0, 0xA5, expected).to(torch.uint8))


@gpu
@needs_cuda
def test_cuda_many_calls_in_flight_reuse_the_table_slots() -> None:
    """More queued launches than pinned table slots: each launch still reads its own tables."""
    spec = make_spec("flash_attn", "float16", num_layers=2, block_size=16, chunk_tokens=16)
    table = block_table(200, 200)
    _, caches = build(spec, "cuda", num_blocks=200)
    chunks = list(range(150))
    offsets = [(149 - chunk) * spec.page.page_bytes for chunk in chunks]
    size = 150 * spec.page.page_bytes
    buffer = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    busy = torch.randn(4096, 4096, device="cuda")
    busy @ busy  # keep the stream busy so the launches queue up behind it
    for chunk, offset in zip(chunks, offsets, strict=True):
        kvstore_kernels.gather(spec, caches, table, [chunk], buffer, [offset])
    torch.cuda.synchronize()
    expected = expected_buffer(spec, caches, table, chunks, offsets, size)
    assert torch.equal(buffer, torch.where(expected < 0, 0xA5, expected).to(torch.uint8))


@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("buffer_on", "engine"),
    [("pinned", "auto"), ("pinned", "kernel"), ("pinned", "staged"), ("cuda", "auto"), ("cuda", "kernel")],
)
@pytest.mark.parametrize(
    ("layout", "dtype"),
    [
        ("vllm_rows", "bfloat16"),
        ("vllm_rows", "float8_e5m2"),
        ("flash_attn", "float8_e5m2"),
        ("mla", "bfloat16"),
        ("mla", "float8_e4m3fn"),
        ("mla", "float8_e5m2"),
    ],
)
def test_cuda_newer_page_kinds(layout: str, dtype: str, buffer_on: str, engine: str) -> None:
    """vllm_rows caches, float8_e5m2 pages and DeepSeek's 576-wide MLA latent at vLLM's sizes, on
    each GPU path: gathered pages match the torch reference (every byte, poisoned first), and a
    scatter of random pages writes exactly what the reference writes."""
    spec, caches, table, chunks, offsets, size = model_call(layout, dtype)
    options = kvstore_kernels.TransferOptions(engine=engine)
    expected = expected_buffer(spec, caches, table, chunks, offsets, size)

    def place(buffer: torch.Tensor) -> torch.Tensor:
        return buffer.pin_memory() if buffer_on == "pinned" else buffer.cuda()

    for poison in POISONS:
        buffer = place(torch.full((size,), poison, dtype=torch.uint8))
        kvstore_kernels.gather(spec, caches, table, chunks, buffer, offsets, options=options)
        torch.cuda.synchronize()
        assert torch.equal(buffer.cpu(), torch.where(expected < 0, poison, expected).to(torch.uint8))
    pages = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    for poison in POISONS:
        bases, restored = build(spec, "cuda", num_blocks=40, fill=poison)
        want_bases, want = build(spec, "cpu", num_blocks=40, fill=poison)
        kvstore_kernels.scatter(spec, restored, table, chunks, place(pages), offsets, options=options)
        torch.cuda.synchronize()
        write_expected(spec, want, table, chunks, pages, offsets)
        for got, wanted in zip(as_bytes(bases), as_bytes(want_bases), strict=True):
            assert torch.equal(got, wanted)


# -- the staged path: pieces, ring slots, refusals ------------------------------------------------


@pytest.mark.parametrize("layers_per_slot", [1, 2, 100])
@pytest.mark.parametrize("layers", [None, range(1, 4), range(3, 5), range(2, 2)])
@pytest.mark.parametrize("layout", ["flashinfer", "cross_layer"])
def test_staged_pieces_outnumber_the_ring_slots(
    layout: str, layers: range | None, layers_per_slot: int
) -> None:
    """Pages cut into runs of layers, more pieces than slots; layer subsets; both directions."""
    from kvstore_kernels import staged
    from kvstore_kernels.validate import plan_transfer

    spec = make_spec(layout, "float16", num_layers=5, sharing={1: 0})  # 4 stored layers
    table, chunks, offsets, size = scenario(spec)
    options = staged_options(spec, layers_per_slot)
    _, caches = build(spec, device_of("staged"))
    buffer = torch.zeros(size, dtype=torch.uint8)
    plan = plan_transfer(spec, caches, table, chunks, buffer, offsets, layers, 0, writes_cache=False)
    moved = len(plan.layers)
    per_piece = min(moved, layers_per_slot)
    pieces = staged.pieces(spec, plan, options.staging_bytes)
    assert len(pieces) == (len(chunks) * -(-moved // per_piece) if moved else 0)
    assert all(0 < piece.stop_layer - piece.first_layer <= per_piece for piece in pieces)
    check_gather("staged", spec, caches, table, chunks, offsets, size, layers, options=options)
    check_scatter("staged", spec, table, chunks, offsets, size, layers, options=options)


def test_staged_refuses_slots_smaller_than_a_layer() -> None:
    from kvstore_kernels import staged

    spec, caches, table, buffer = small_call()
    buffer = buffer_of("staged", buffer)
    too_small = staged.NUM_SLOTS * spec.page.layer_bytes - 1
    options = kvstore_kernels.TransferOptions(engine="staged", staging_bytes=too_small)
    with pytest.raises(ValueError, match="engine='staged': staging_bytes=.* less than one stored layer"):
        kvstore_kernels.gather(
            spec, [c.to(device_of("staged")) for c in caches], table, [0], buffer, [0], options=options
        )


def counted(calls: list[str], name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, noting `name` in `calls` at each call."""

    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return function(*args, **kwargs)

    return call


def _gpu_call(layout: str) -> tuple[KVSpec, Any, torch.Tensor, list[int], list[int], int]:
    spec = KVSpec(
        model="m",
        num_layers=4,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        block_size=16,
        layout=layout,
        chunk_tokens=64,
    )
    _, caches = build(spec, "cuda", num_blocks=40)
    page_bytes = spec.page.page_bytes
    chunks, offsets = [5, 1, 7, 0], [0, 3 * page_bytes, page_bytes, 6 * page_bytes]
    return spec, caches, block_table(40, 32), chunks, offsets, 7 * page_bytes


@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("layout", "table_on", "staging", "expected"),
    [
        ("cross_layer", "host", "default", "staged"),
        ("flash_attn", "host", "default", "staged"),
        ("flash_attn", "cuda", "default", "staged"),
        ("cross_layer", "host", "too small", "copy_engine"),
        ("flash_attn", "host", "too small", "kernel"),
        ("cross_layer", "cuda", "too small", "kernel"),
    ],
)
def test_cuda_auto_rule(
    monkeypatch: pytest.MonkeyPatch, layout: str, table_on: str, staging: str, expected: str
) -> None:
    """Pinned buffers go through the staging ring; where its slots cannot hold one stored layer,
    2-D copies where the blocks allow them, else the kernel."""
    from kvstore_kernels import copy_engine, staged
    from kvstore_kernels.validate import plan_transfer

    spec, caches, table, chunks, offsets, size = _gpu_call(layout)
    table = table.cuda() if table_on == "cuda" else table
    calls: list[str] = []
    for name, module in (("kernel", triton_module()), ("copy_engine", copy_engine), ("staged", staged)):
        monkeypatch.setattr(module, "launch", counted(calls, name, module.launch))
    buffer = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    options = kvstore_kernels.TransferOptions()
    if staging == "too small":
        options = kvstore_kernels.TransferOptions(staging_bytes=staged.NUM_SLOTS * spec.page.layer_bytes - 1)
        plan = plan_transfer(spec, caches, table, chunks, buffer, offsets, None, 0, writes_cache=False)
        if table_on == "host" and copy_engine.can_copy_2d(spec, plan):
            expected = "copy_engine"  # flash_attn layers that happen to sit at one pitch: 2-D copies too
    kvstore_kernels.gather(spec, caches, table, chunks, buffer, offsets, options=options)
    torch.cuda.synchronize()
    expected_bytes = expected_buffer(spec, caches, table.cpu(), chunks, offsets, size)
    assert torch.equal(buffer, torch.where(expected_bytes < 0, 0xA5, expected_bytes).to(torch.uint8))
    assert calls == [expected]


@gpu
@needs_cuda
@pytest.mark.parametrize("engine", ["kernel", "copy_engine", "staged"])
def test_cuda_side_stream(engine: str) -> None:
    """The copy is enqueued on `stream` behind its earlier work; an event after the call orders it."""
    spec, caches, table, chunks, offsets, size = _gpu_call("cross_layer")
    expected = expected_buffer(spec, caches, table, chunks, offsets, size)
    buffer = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    side = torch.cuda.Stream()
    busy = torch.randn(4096, 4096, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(8):
            busy = busy @ busy / 64  # keep the side stream busy
    options = kvstore_kernels.TransferOptions(engine=engine)
    kvstore_kernels.gather(spec, caches, table, chunks, buffer, offsets, stream=side, options=options)
    done = torch.cuda.Event()
    done.record(side)
    done.synchronize()
    assert torch.equal(buffer, torch.where(expected < 0, 0xA5, expected).to(torch.uint8))


@gpu
@needs_cuda
def test_cuda_device_block_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA block table is never read back: looked up on the GPU, bad ids move nothing."""
    spec, caches, table, chunks, offsets, size = _gpu_call("flash_attn")
    reads: list[str] = []
    monkeypatch.setattr(torch.Tensor, "cpu", counted(reads, "cpu", torch.Tensor.cpu))
    buffer = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    kvstore_kernels.gather(spec, caches, table.cuda(), chunks, buffer, offsets)
    _, restored = build(spec, "cuda", num_blocks=40, fill=0x5A)
    kvstore_kernels.scatter(spec, restored, table.cuda(), chunks, buffer, offsets)
    assert not reads
    monkeypatch.undo()
    torch.cuda.synchronize()
    expected = expected_buffer(spec, caches, table, chunks, offsets, size)
    assert torch.equal(buffer, torch.where(expected < 0, 0xA5, expected).to(torch.uint8))
    again = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    kvstore_kernels.gather(spec, restored, table, chunks, again, offsets)
    torch.cuda.synchronize()
    assert torch.equal(again, buffer)
    bad = table.cuda()
    bad[chunks[0] * spec.blocks_per_chunk + 1] = 40  # outside the cache: the kernel moves nothing
    expected = expected_with_skipped(spec, caches, table, chunks, offsets, size, [(0, 1)])
    for engine, skipped in (("kernel", 0xA5), ("auto", 0)):  # auto: staged, zeros for that block
        again.fill_(0xA5)
        options = kvstore_kernels.TransferOptions(engine=engine)
        kvstore_kernels.gather(spec, caches, bad, chunks, again, offsets, options=options)
        torch.cuda.synchronize()
        want = torch.where(expected == -2, skipped, torch.where(expected < 0, 0xA5, expected))
        assert torch.equal(again, want.to(torch.uint8))


@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("cuda table", "the block table is on the device"),
        ("pageable", "the buffer is pageable host memory"),
    ],
)
def test_cuda_copy_engine_refusals(change: str, message: str) -> None:
    spec, caches, table, chunks, offsets, size = _gpu_call("cross_layer")
    buffer = torch.zeros(size, dtype=torch.uint8)
    if change == "cuda table":
        table, buffer = table.cuda(), buffer.pin_memory()
    options = kvstore_kernels.TransferOptions(engine="copy_engine")
    with pytest.raises(ValueError, match=f"engine='copy_engine': {message}"):
        kvstore_kernels.gather(spec, caches, table, chunks, buffer, offsets, options=options)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("change", "message"), [("pageable", "pageable host memory"), ("cuda", "device memory")]
)
def test_cuda_staged_refusals(change: str, message: str) -> None:
    spec, caches, table, chunks, offsets, size = _gpu_call("flash_attn")
    buffer = torch.zeros(size, dtype=torch.uint8, device="cuda" if change == "cuda" else "cpu")
    options = kvstore_kernels.TransferOptions(engine="staged")
    with pytest.raises(ValueError, match=f"engine='staged': the buffer is (in )?{message}"):
        kvstore_kernels.gather(spec, caches, table, chunks, buffer, offsets, options=options)


def _many_pages(num_pages: int) -> tuple[KVSpec, Any, list[int], list[int], list[int], int]:
    """1 MiB pages (4 layers of 256 KiB), more of them than ring slots, out of order in the buffer."""
    spec = KVSpec(
        model="m",
        num_layers=4,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        block_size=16,
        layout="flash_attn",
        chunk_tokens=64,
    )
    num_blocks = num_pages * spec.blocks_per_chunk
    _, caches = build(spec, "cuda", num_blocks=num_blocks, seed=5)
    table = block_table(num_blocks, num_blocks, seed=6).tolist()
    chunks = list(range(num_pages))
    offsets = [(num_pages - 1 - chunk) * spec.page.page_bytes for chunk in chunks]
    return spec, caches, table, chunks, offsets, num_pages * spec.page.page_bytes


@gpu
@needs_cuda
@pytest.mark.parametrize(("overlap", "copy_streams"), [(True, 1), (True, 2), (False, 1)])
@pytest.mark.parametrize("layers_per_slot", [1, 4, 16])
def test_cuda_staged_ring_is_not_overwritten_in_flight(
    monkeypatch: pytest.MonkeyPatch, overlap: bool, copy_streams: int, layers_per_slot: int
) -> None:
    """24 pages through 4 slots (of a layer, a page, or 4 whole pages of 4 layers), queued behind
    a busy stream: each slot's copy (or unpack) runs before the slot is refilled, or pages would
    hold other pages' bytes (copies on one side stream, on two in turn, or on the caller's
    stream)."""
    from kvstore_kernels import staged
    from kvstore_kernels.validate import plan_transfer

    monkeypatch.setattr(staged, "_rings", {})  # fresh rings, sized by this test's calls
    spec, caches, table, chunks, offsets, size = _many_pages(24)
    staging_bytes = staged_options(spec, layers_per_slot).staging_bytes
    expected = expected_buffer(spec, caches, table, chunks, offsets, size)
    buffer = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):
        busy = busy @ busy / 64  # the host queues every piece before the GPU starts
    plan = plan_transfer(spec, caches, table, chunks, buffer, offsets, None, 0, writes_cache=False)
    staged.launch(
        spec, plan, to_page=True, staging_bytes=staging_bytes, overlap=overlap, copy_streams=copy_streams
    )
    bases, restored = build(spec, "cuda", num_blocks=len(table), fill=0x5A)
    for _ in range(4):
        busy = busy @ busy / 64
    back = plan_transfer(spec, restored, table, chunks, buffer, offsets, None, 0, writes_cache=True)
    staged.launch(
        spec, back, to_page=False, staging_bytes=staging_bytes, overlap=overlap, copy_streams=copy_streams
    )
    torch.cuda.synchronize()
    for to_page in (True, False):
        ring = staged.ring_for(torch.device("cuda", 0), to_page)
        assert (ring.slots, ring.slot_bytes) == (4, layers_per_slot * spec.page.layer_bytes)
    assert torch.equal(buffer, torch.where(expected < 0, 0xA5, expected).to(torch.uint8))
    again = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    kvstore_kernels.gather(
        spec,
        restored,
        table,
        chunks,
        again,
        offsets,
        options=kvstore_kernels.TransferOptions(engine="kernel"),
    )
    torch.cuda.synchronize()
    assert torch.equal(again, buffer)


@gpu
@needs_cuda
def test_cuda_staged_both_directions_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gather and a scatter on two streams, each through its own ring and copy stream, and a
    gather whose slots outgrow the ring while the first transfers are still queued."""
    from kvstore_kernels import staged

    monkeypatch.setattr(staged, "_rings", {})  # fresh rings, sized by this test's first calls
    spec, caches, table, chunks, offsets, size = _many_pages(16)
    half = len(table) // 2
    pages = chunks[:8]
    stores, loads = table[:half], table[half:]  # disjoint blocks
    expected = expected_buffer(spec, caches, stores, pages, offsets[:8], size)
    incoming = torch.randint(0, 256, (size,), dtype=torch.uint8).pin_memory()
    outgoing = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    small = staged_options(spec, 1)
    with torch.cuda.stream(first):
        kvstore_kernels.gather(spec, caches, stores, pages, outgoing, offsets[:8], options=small)
    with torch.cuda.stream(second):
        kvstore_kernels.scatter(spec, caches, loads, pages, incoming, offsets[:8], options=small)
    grown = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    with torch.cuda.stream(first):  # slots of 4 layers: the ring is replaced once its slots are free
        kvstore_kernels.gather(
            spec, caches, stores, pages, grown, offsets[:8], options=staged_options(spec, 4)
        )
    torch.cuda.synchronize()
    assert torch.equal(outgoing, torch.where(expected < 0, 0xA5, expected).to(torch.uint8))
    assert torch.equal(grown, outgoing)
    loaded = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    kvstore_kernels.gather(
        spec,
        caches,
        loads,
        pages,
        loaded,
        offsets[:8],
        options=kvstore_kernels.TransferOptions(engine="kernel"),
    )
    torch.cuda.synchronize()
    written = expected_buffer(spec, caches, loads, pages, offsets[:8], size) >= 0
    assert torch.equal(loaded[written], incoming[written])
