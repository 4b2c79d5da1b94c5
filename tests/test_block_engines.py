"""Blocks copied between two GPUs by the copy engines (`kvstore_kernels.block_engines`): where the
block ids come in long stretches, consecutive on both sides, `copy_blocks` moves each run's
stretch as one piece in one batch call; elsewhere the kernel moves them.

Each GPU case poisons the destination (0xA5, then 0x5A), checks every byte of it against the
oracle of `tests.test_kernels_blocks` (the named blocks hold the source's bytes, every other byte
the poison), and records which way the copy went.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import kvstore_kernels
from kvstore_kernels import block_engines  # not `blocks`: its Triton kernel is imported after kernel_cases
from tests.kernel_cases import CUDA, POISONS, as_bytes, build, gpu, make_spec
from tests.test_kernels_blocks import expected_copy

PEERS = CUDA and torch.cuda.device_count() >= 2 and torch.cuda.can_device_access_peer(0, 1)
needs_peers = pytest.mark.skipif(not PEERS, reason="needs two CUDA devices with peer access")
SRC_BLOCKS, DST_BLOCKS = 1000, 1100
ONE_STRETCH = (np.arange(10, 522), np.arange(100, 612))
# Three stretches of 300, 300 and 260 blocks, the second's source before the first's: at least 1 MiB
# a piece on average for runs of 4 KiB (MLA's latent, fp8 K or V; `block_engines.MIN_PIECE_BYTES`).
STRETCHES = (
    np.concatenate([np.arange(400, 700), np.arange(0, 300), np.arange(720, 980)]),
    np.concatenate([np.arange(0, 300), np.arange(350, 650), np.arange(800, 1060)]),
)
SCATTERED = (
    np.random.default_rng(5).permutation(SRC_BLOCKS)[:300],
    np.random.default_rng(6).permutation(DST_BLOCKS)[:300],
)


def test_a_bad_setting_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_BLOCK_COPY", "engines")
    with pytest.raises(ValueError, match="KVSTORE_BLOCK_COPY: expected one of auto, kernel, got 'engines'"):
        block_engines.mode()
    monkeypatch.setenv("KVSTORE_BLOCK_COPY", " Kernel ")
    assert block_engines.mode() == "kernel"
    monkeypatch.delenv("KVSTORE_BLOCK_COPY")
    assert block_engines.mode() == "auto"


def copy_and_check(
    monkeypatch: pytest.MonkeyPatch,
    spec: Any,
    ids: tuple[np.ndarray, np.ndarray],
    src_on: str,
    dst_on: str,
    register: bool = False,
) -> list[bool]:
    """`ids` copied from `src_on` into a poisoned cache on `dst_on`, every byte checked; whether
    each copy went by the engines."""
    from kvstore_kernels import blocks

    ways: list[bool] = []
    engines = blocks.copy_by_engines

    def recorded(*args: Any) -> bool:
        ways.append(engines(*args))
        return ways[-1]

    monkeypatch.setattr(blocks, "copy_by_engines", recorded)
    _, src = build(spec, src_on, num_blocks=SRC_BLOCKS, seed=3)
    _, src_cpu = build(spec, "cpu", num_blocks=SRC_BLOCKS, seed=3)
    for poison in POISONS:
        bases, dst = build(spec, dst_on, num_blocks=DST_BLOCKS, fill=poison)
        want_bases, want = build(spec, "cpu", num_blocks=DST_BLOCKS, fill=poison)
        target = kvstore_kernels.register(spec, dst) if register else dst
        torch.cuda.synchronize(src_on)
        kvstore_kernels.copy_blocks(spec, src, ids[0], target, ids[1])
        torch.cuda.synchronize(dst_on)
        expected_copy(spec, src_cpu, ids[0], want, ids[1])
        for index, (got, wanted) in enumerate(zip(as_bytes(bases), as_bytes(want_bases), strict=True)):
            assert torch.equal(got, wanted), (
                f"poison {poison:#x}, tensor {index}: {int((got != wanted).sum())} differ"
            )
    return ways


@gpu
@needs_peers
@pytest.mark.parametrize(("src_on", "dst_on"), [("cuda:1", "cuda:0"), ("cuda:0", "cuda:1")])
@pytest.mark.parametrize(
    ("layout", "dtype"), [("vllm_rows", "bfloat16"), ("flash_attn", "float8_e5m2"), ("mla", "bfloat16")]
)
def test_long_stretches_go_by_the_engines_byte_for_byte(
    monkeypatch: pytest.MonkeyPatch, layout: str, dtype: str, src_on: str, dst_on: str
) -> None:
    monkeypatch.delenv("KVSTORE_BLOCK_COPY", raising=False)
    monkeypatch.delenv("KVSTORE_KERNELS", raising=False)
    spec = make_spec(layout, dtype, num_layers=4, block_size=16, head_dim=128, sharing={3: 1})
    calls: list[int] = []  # the pieces of each call: a batch's, or 0 for one cudaMemcpyAsync
    runtime = block_engines.cudart.runtime()
    batch, single = runtime.memcpy_batch_async, runtime.memcpy_async
    monkeypatch.setattr(
        runtime, "memcpy_batch_async", lambda d, *rest: calls.append(d.size) or batch(d, *rest)
    )
    monkeypatch.setattr(runtime, "memcpy_async", lambda *args: calls.append(0) or single(*args))
    monkeypatch.setattr(block_engines, "LEAD_BYTES", 0)  # every piece in the batch
    assert copy_and_check(monkeypatch, spec, ONE_STRETCH, src_on, dst_on) == [True, True]
    runs = calls[0]
    assert calls == [runs, runs]
    calls.clear()
    monkeypatch.setattr(block_engines, "LEAD_BYTES", 1)  # the first piece in a call of its own
    assert copy_and_check(monkeypatch, spec, STRETCHES, src_on, dst_on, register=True) == [True, True]
    assert calls == [0, 3 * runs - 1] * 2  # three stretches a run


@gpu
@needs_peers
def test_scattered_blocks_the_same_gpu_and_kernel_setting_go_by_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVSTORE_KERNELS", raising=False)
    spec = make_spec("vllm_rows", "bfloat16", num_layers=4, block_size=16, head_dim=128)
    assert copy_and_check(monkeypatch, spec, SCATTERED, "cuda:1", "cuda:0") == [False, False]
    assert copy_and_check(monkeypatch, spec, ONE_STRETCH, "cuda:0", "cuda:0") == []  # not asked
    monkeypatch.setenv("KVSTORE_BLOCK_COPY", "kernel")
    assert copy_and_check(monkeypatch, spec, ONE_STRETCH, "cuda:1", "cuda:0") == [False, False]


@gpu
@needs_peers
def test_the_engines_copy_is_queued_on_the_given_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a side stream behind a long sleep: the destination's default stream does not see the copy
    until the side stream has run it."""
    monkeypatch.delenv("KVSTORE_BLOCK_COPY", raising=False)
    monkeypatch.delenv("KVSTORE_KERNELS", raising=False)
    spec = make_spec("vllm_rows", "bfloat16", num_layers=4, block_size=16, head_dim=128)
    _, src = build(spec, "cuda:1", num_blocks=SRC_BLOCKS, seed=3)
    bases, dst = build(spec, "cuda:0", num_blocks=DST_BLOCKS, fill=0xA5)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    stream = torch.cuda.Stream("cuda:0")
    with torch.cuda.stream(stream):
        torch.cuda._sleep(500_000_000)
    kvstore_kernels.copy_blocks(spec, src, ONE_STRETCH[0], dst, ONE_STRETCH[1], stream=stream)
    assert all(bool((base == 0xA5).all()) for base in as_bytes(bases))  # read on the default stream
    stream.synchronize()
    _, src_cpu = build(spec, "cpu", num_blocks=SRC_BLOCKS, seed=3)
    want_bases, want = build(spec, "cpu", num_blocks=DST_BLOCKS, fill=0xA5)
    expected_copy(spec, src_cpu, ONE_STRETCH[0], want, ONE_STRETCH[1])
    assert all(torch.equal(a, b) for a, b in zip(as_bytes(bases), as_bytes(want_bases), strict=True))


@pytest.mark.parametrize(
    "ids",
    [
        ONE_STRETCH,
        STRETCHES,
        (np.arange(300, 0, -1), np.arange(300)),  # descending on one side: a piece a block
        (np.array([7]), np.array([900])),
        (np.arange(300, 600), np.concatenate([np.arange(0, 150), np.arange(151, 301)])),
    ],
)
def test_the_pieces_cover_each_block_of_each_run_exactly(ids: tuple[np.ndarray, np.ndarray]) -> None:
    """The batch's pieces, block by block, against the mapping they stand for: every run's source
    block `src[i]` lands on its destination block `dst[i]`, nothing else (CPU: no copy made)."""
    size = 1 << 20  # at least MIN_PIECE_BYTES a piece, however the ids break
    src_runs = (0x7F00_0000_0000 + np.arange(6, dtype=np.uint64) * (1 << 36)).tolist()
    dst_runs = (0x7E00_0000_0000 + np.arange(6, dtype=np.uint64) * (1 << 36)).tolist()
    src_ids, dst_ids = (np.asarray(i, dtype=np.int64) for i in ids)
    pair = (np.array(src_runs, np.uint64), np.array(dst_runs, np.uint64), size)
    pieces = block_engines._pieces(pair, src_ids, dst_ids)
    assert pieces is not None
    dsts, srcs, sizes = pieces
    assert dsts.dtype == srcs.dtype == sizes.dtype == np.uint64
    moved = {
        (int(s) + k * size, int(d) + k * size)
        for d, s, n in zip(dsts, srcs, sizes, strict=True)
        for k in range(int(n) // size)
    }
    wanted = {
        (s_run + int(s) * size, d_run + int(d) * size)
        for s_run, d_run in zip(src_runs, dst_runs, strict=True)
        for s, d in zip(src_ids, dst_ids, strict=True)
    }
    assert moved == wanted
    assert int(sizes.sum()) == len(src_runs) * src_ids.size * size  # no block twice


def test_pieces_too_small_or_too_many_are_left_to_the_kernel() -> None:
    pair = (np.array([1 << 40], np.uint64), np.array([1 << 41], np.uint64), 32768)
    assert block_engines._pieces(pair, np.arange(16), np.arange(16)) is None  # 512 KiB
    assert block_engines._pieces(pair, np.arange(32), np.arange(32)) is not None  # 1 MiB
    scattered = np.arange(0, 2 * (block_engines.MAX_PIECES + 1), 2)
    big = (pair[0], pair[1], 1 << 20)
    assert block_engines._pieces(big, scattered, scattered) is None
