"""Which engine moves a transfer, and with what: KVSTORE_KERNELS, TransferOptions, the auto
rule, copy lists and kernel tunings, each checked against the oracle (`tests.kernel_cases`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvstore_kernels
from kvstore_kernels import reference
from tests.kernel_cases import (
    CUDA,
    buffer_of,
    build,
    check_gather,
    check_scatter,
    device_of,
    expected_buffer,
    expected_with_skipped,
    launch_kernel,
    make_spec,
    run,
    scenario,
    small_call,
    staged_options,
    triton_module,
)

# -- dispatch ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("setting", "expected"), [("torch", "torch"), ("triton", "triton"), ("", "torch")])
def test_backend_choice(monkeypatch: pytest.MonkeyPatch, setting: str, expected: str) -> None:
    monkeypatch.setenv("KVSTORE_KERNELS", setting)
    calls: list[str] = []
    triton_copy = triton_module()
    monkeypatch.setattr(triton_copy, "launch", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(reference, "gather_plan", lambda *a, **k: calls.append("torch"))
    spec, caches, table, buffer = small_call()
    kvstore_kernels.gather(spec, caches, table, [0], buffer, [0])
    assert calls == [expected]


def test_unknown_backend_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_KERNELS", "cuda")
    spec, caches, table, buffer = small_call()
    with pytest.raises(ValueError, match="KVSTORE_KERNELS: expected one of auto, triton, torch, got 'cuda'"):
        kvstore_kernels.gather(spec, caches, table, [0], buffer, [0])


@pytest.mark.skipif(CUDA, reason="CPU tensors reach Triton only through the interpreter")
def test_forced_triton_on_cpu_runs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_KERNELS", "triton")
    from kvstore_kernels import triton_kernel

    triton_module()
    assert triton_kernel.is_interpreted()
    spec, caches, table, buffer = small_call()
    kvstore_kernels.gather(spec, caches, table, [0], buffer, [0])
    assert torch.equal(buffer.to(torch.int16), expected_buffer(spec, caches, table, [0], [0], buffer.numel()))


# -- options, the auto rule, copy lists and kernel tunings -----------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"engine": "dma"}, "engine: expected one of auto, kernel, copy_engine, staged, torch, got 'dma'"),
        ({"max_programs": 0}, "max_programs: expected a positive integer or None, got 0"),
        ({"max_programs": 2.5}, "max_programs: expected a positive integer or None, got 2.5"),
        ({"staging_bytes": 0}, "staging_bytes: expected a positive integer, got 0"),
        ({"staging_bytes": True}, "staging_bytes: expected a positive integer, got True"),
    ],
)
def test_bad_options_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kvstore_kernels.TransferOptions(**fields)


def test_options_must_be_transfer_options() -> None:
    spec, caches, table, buffer = small_call()
    with pytest.raises(ValueError, match="options: expected a TransferOptions, got dict"):
        kvstore_kernels.gather(spec, caches, table, [0], buffer, [0], options={"engine": "kernel"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("engine", "expected"),
    [("auto", "torch"), ("kernel", "triton"), ("copy_engine", "ce"), ("staged", "staged")],
)
def test_explicit_engine_wins_over_auto(monkeypatch: pytest.MonkeyPatch, engine: str, expected: str) -> None:
    from kvstore_kernels import copy_engine, staged

    calls: list[str] = []
    monkeypatch.setattr(triton_module(), "launch", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(copy_engine, "launch", lambda *a, **k: calls.append("ce"))
    monkeypatch.setattr(staged, "launch", lambda *a, **k: calls.append("staged"))
    monkeypatch.setattr(reference, "gather_plan", lambda *a, **k: calls.append("torch"))
    monkeypatch.setenv("KVSTORE_KERNELS", "torch")  # applies to engine="auto" only
    spec, caches, table, buffer = small_call()
    options = kvstore_kernels.TransferOptions(engine=engine)
    kvstore_kernels.gather(spec, caches, table, [0], buffer, [0], options=options)
    assert calls == [expected]


@pytest.mark.parametrize(
    ("layout", "sharing", "rows"),
    [("cross_layer", {}, 6), ("cross_layer", {1: 0}, 1), ("flash_attn", {}, 1), ("flashinfer", {}, 1)],
)
def test_copy_lists(layout: str, sharing: dict[int, int], rows: int) -> None:
    """cross_layer blocks move as one 2-D copy of all their (layer, k|v) rows; the rest as 1-D runs."""
    from kvstore_kernels import copy_engine
    from kvstore_kernels.validate import plan_transfer

    spec = make_spec(layout, "float16", sharing=sharing)
    table, chunks, offsets, size = scenario(spec)
    _, caches = build(spec, "cpu")
    buffer = torch.zeros(size, dtype=torch.uint8)
    plan = plan_transfer(spec, caches, table, chunks, buffer, offsets, None, 0, writes_cache=False)
    copies = copy_engine.plan_copies(spec, plan, to_page=True)
    segment = spec.block_size * spec.page.token_bytes
    assert copies.rows == rows
    assert int(copies.sizes.sum()) * rows == len(chunks) * len(spec.page.stored_layers) * 2 * 2 * segment
    if rows > 1:
        assert len(copies.dsts) == len(chunks) * spec.blocks_per_chunk
        assert copies.dst_pitch == spec.page.chunk_tokens * spec.page.token_bytes  # K span to V span
        assert copies.src_pitch == segment
    one_d = copy_engine.plan_copies(spec, plan, to_page=True, shape="1d")
    assert one_d.rows == 1 and int(one_d.sizes.sum()) == int(copies.sizes.sum()) * rows
    _, caches = build(spec, device_of("copy_engine"))
    check_gather("copy_engine", spec, caches, table, chunks, offsets, size)
    check_scatter("copy_engine", spec, table, chunks, offsets, size)


def test_copy_list_merges_runs_contiguous_on_both_sides() -> None:
    from kvstore_kernels import copy_engine
    from kvstore_kernels.validate import plan_transfer

    spec = make_spec("flash_attn", "float16", num_layers=1)
    _, caches = build(spec, "cpu")
    table = [4, 5, 9, 2]  # chunk 0: blocks 4, 5 adjacent; chunk 1: 9, 2 apart
    buffer = torch.zeros(2 * spec.page.page_bytes, dtype=torch.uint8)
    offsets = [0, spec.page.page_bytes]
    plan = plan_transfer(spec, caches, table, [0, 1], buffer, offsets, None, 0, writes_cache=False)
    copies = copy_engine.plan_copies(spec, plan, to_page=True, shape="1d")
    segment = spec.block_size * spec.page.token_bytes
    # chunk 0: K (2 blocks) and V (2 blocks) each one run; chunk 1: four single blocks.
    assert copies.sizes.tolist() == [2 * segment, 2 * segment] + [segment] * 4


@pytest.mark.parametrize(
    "tuning",
    [
        {"segments_per_step": 2},
        {"segments_per_step": 4, "tile_bytes": 16},
        {"tile_bytes": 32, "eviction": "evict_first"},
        {"segments_per_step": 8, "num_warps": 2, "load_cache": ".cg", "store_cache": ".cs"},
    ],
)
@pytest.mark.parametrize("strided", [False, True])
def test_kernel_tunings_move_the_same_bytes(tuning: dict[str, Any], strided: bool) -> None:
    """Segments per step that do not divide the segment count, tiles that do not divide a segment."""
    from kvstore_kernels.triton_copy import Tuning

    spec = make_spec("flash_attn", "float16", block_size=5, chunk_tokens=10, sharing={1: 0})
    table, chunks, offsets, size = scenario(spec)
    device = device_of("triton")
    _, caches = build(spec, device, strided=strided)
    expected = expected_buffer(spec, caches, table, chunks, offsets, size)
    buffer = torch.full((size,), 0xA5, dtype=torch.uint8, device=device)
    launch = {"max_programs": 3, "tuning": Tuning(**tuning)}
    launch_kernel(spec, caches, table, chunks, buffer, offsets, to_page=True, **launch)
    assert torch.equal(buffer.cpu(), torch.where(expected < 0, 0xA5, expected).to(torch.uint8))
    bases, restored = build(spec, device, fill=0x5A, strided=strided)
    launch_kernel(spec, restored, table, chunks, buffer, offsets, to_page=False, **launch)
    again = torch.full((size,), 0xA5, dtype=torch.uint8, device=device)
    run("triton", "gather", spec, restored, table, chunks, again, offsets)
    assert torch.equal(again.cpu(), buffer.cpu())


@pytest.mark.parametrize(("head_dim", "segments", "programs"), [(256, 4, 2), (128, 4, 4), (64, 8, 8)])
def test_host_transfers_of_small_segments_keep_more_bytes_in_flight(
    head_dim: int, segments: int, programs: int
) -> None:
    """16, 8 and 4 KiB segments (a TP rank's share of the heads): the shape and program count
    the kernel takes for a host buffer when the caller names none."""
    from kvstore_kernels import triton_copy
    from kvstore_kernels.geometry import geometry_of
    from kvstore_kernels.validate import plan_transfer

    spec = make_spec("flash_attn", num_layers=1, block_size=16, chunk_tokens=32, head_dim=head_dim)
    _, caches = build(spec, "cpu", num_blocks=4)
    buffer = torch.zeros(spec.page.page_bytes, dtype=torch.uint8)
    plan = plan_transfer(spec, caches, [2, 0, 3, 1], [1], buffer, [0], None, 0, writes_cache=False)
    geometry = geometry_of(spec, plan)
    assert geometry.segment_bytes == 16 * 2 * head_dim * 2
    assert triton_copy.default_tuning(plan, geometry).segments_per_step == segments
    assert triton_copy.default_programs(plan, to_page=True, geometry=geometry) == programs
    assert triton_copy.default_programs(plan, to_page=False, geometry=geometry) == programs


def test_cache_modifiers_refuse_an_eviction_policy() -> None:
    from kvstore_kernels.triton_copy import Tuning

    spec, caches, table, buffer = small_call()
    with pytest.raises(ValueError, match="tuning: a cache modifier .* cannot be combined with an eviction"):
        tuning = Tuning(store_cache=".cs", eviction="evict_first")
        launch_kernel(spec, caches, table, [0], buffer, [0], to_page=True, tuning=tuning)


@pytest.mark.parametrize("impl", ["triton", "staged"])
def test_kernel_skips_block_ids_outside_the_cache(impl: str) -> None:
    """A device block table is not checked on the host: the kernel moves nothing for a bad id; the
    staged gather writes zeros there (never a slot's stale bytes, which belong to another page)."""
    from kvstore_kernels import staged
    from kvstore_kernels.validate import plan_transfer

    spec = make_spec("flash_attn", "float16", sharing={1: 0})
    table, chunks, offsets, size = scenario(spec)
    device = device_of("triton")
    _, caches = build(spec, device)
    buffer = buffer_of(impl, torch.full((size,), 0xA5, dtype=torch.uint8))
    plan = plan_transfer(spec, caches, table, chunks, buffer, offsets, None, 0, writes_cache=False)
    blocks = torch.as_tensor(plan.blocks).to(device)
    blocks[1, 0], blocks[2, 1] = 12, -3  # chunk 0's first block, chunk 2's second block
    if impl == "staged":
        # Stale bytes in every slot first: a full gather of other pages through the same ring.
        staged.launch(spec, plan, to_page=True, staging_bytes=staged_options(spec).staging_bytes)
        if CUDA:
            torch.cuda.synchronize()
        buffer.fill_(0xA5)
        staged.launch(
            spec, plan._replace(blocks=blocks), to_page=True, staging_bytes=staged_options(spec).staging_bytes
        )
    else:
        triton_module().launch(spec, plan._replace(blocks=blocks), to_page=True)
    if CUDA:
        torch.cuda.synchronize()
    expected = expected_with_skipped(spec, caches, table, chunks, offsets, size, [(1, 0), (2, 1)])
    skipped = 0xA5 if impl == "triton" else 0
    want = torch.where(expected == -2, skipped, torch.where(expected < 0, 0xA5, expected)).to(torch.uint8)
    assert torch.equal(buffer.cpu(), want)
