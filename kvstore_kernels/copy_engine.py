"""Page gather and scatter on the GPU's copy engines (DMA), which use no SM.

- `why_not(plan)`: None when the copy engines can move `plan`, else the reason.
- `plan_copies(spec, plan, to_page, shape)`: the copy list (`Copies`). Shape "2d": one 2-D
  copy per (page, block) whose rows are its (layer, k|v) segments, possible when those sit
  at one pitch on both sides (the cross_layer layout: 64 rows of 32 KiB for an 8B model).
  Shape "1d": one copy per segment, merged where contiguous on both sides.
- `launch(spec, plan, to_page, shape=None)`: enqueue the copies on the current stream:
  `cudaMemcpy2DAsync` per 2-D copy, or all 1-D copies in one `cudaMemcpyBatchAsync`. With
  CPU tensors the same list runs with `memmove`, which is how the CPU tests check it.

Sources are read in stream order, so work queued before the call is seen. A 2-D copy per
block keeps pace with the kernel, for a few microseconds of host time per call; the 1-D batch
of 32 KiB copies does not (bench/NOTES-transfer.md, items 5 and 6).
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import NamedTuple

import numpy as np
import torch

from kvstore.shared.spec import KVSpec

from .geometry import Geometry
from .validate import Transfer, host_blocks

SHAPES = ("2d", "1d")


class Copies(NamedTuple):
    """Copies of `rows` rows each: row r of copy i moves `sizes[i]` bytes at src + r * src_pitch."""

    dsts: np.ndarray  # uint64 addresses
    srcs: np.ndarray
    sizes: np.ndarray  # uint64 bytes per row
    rows: int = 1
    dst_pitch: int = 0
    src_pitch: int = 0


def why_not(plan: Transfer, geometry: Geometry | None = None) -> str | None:
    """Why the copy engines cannot move `plan` (None: they can)."""
    packed = geometry.contiguous if geometry else all(v.packed for views in plan.view_facts for v in views)
    if not packed:
        return "the KV cache's blocks are not contiguous runs (strided views); use the kernel"
    if plan.device.type == "cpu":
        return None if plan.buffer.device.type == "cpu" else "the buffer is not on the CPU"
    if plan.blocks_on_device:
        return "the block table is on the device; the copy engines need block ids on the host"
    if plan.buffer.device.type == "cpu" and not plan.buffer.is_pinned():
        return "the buffer is pageable host memory; the copy engines need pinned (registered) memory"
    return None


def can_copy_2d(spec: KVSpec, plan: Transfer, geometry: Geometry | None = None) -> bool:
    """Whether every (page, block) moves as one 2-D copy."""
    return _pitches(geometry or Geometry(spec, plan)) is not None


def plan_copies(
    spec: KVSpec,
    plan: Transfer,
    *,
    to_page: bool,
    shape: str | None = None,
    geometry: Geometry | None = None,
) -> Copies:
    """The copy list of a validated transfer; `shape` None: 2-D where possible."""
    geometry = geometry or Geometry(spec, plan)
    cache, page = geometry.segment_addresses(host_blocks(plan, writes_cache=not to_page))
    pitches = _pitches(geometry)
    if shape == "2d" and pitches is None:
        raise ValueError("the (layer, k|v) segments of a block are not at one pitch: no 2-D copy")
    width = geometry.segment_bytes
    if shape != "1d" and pitches is not None:
        cache_pitch, page_pitch = pitches
        cache_rows, page_rows = cache[:, 0, :].ravel(), page[:, 0, :].ravel()
        sizes = np.full(cache_rows.size, width, dtype=np.uint64)
        if to_page:
            return Copies(page_rows, cache_rows, sizes, geometry.num_layer_kv, page_pitch, cache_pitch)
        return Copies(cache_rows, page_rows, sizes, geometry.num_layer_kv, cache_pitch, page_pitch)
    dsts, srcs = (page.ravel(), cache.ravel()) if to_page else (cache.ravel(), page.ravel())
    return _merged(dsts, srcs, width)


def launch(
    spec: KVSpec,
    plan: Transfer,
    *,
    to_page: bool,
    shape: str | None = None,
    geometry: Geometry | None = None,
) -> None:
    """Enqueue a validated transfer's copies on the current stream (memmove for CPU tensors)."""
    reason = why_not(plan, geometry)
    if reason is not None:
        raise ValueError(f"engine='copy_engine': {reason}")
    if not plan.offsets or not plan.layers:
        return
    copies = plan_copies(spec, plan, to_page=to_page, shape=shape, geometry=geometry)
    if plan.device.type == "cpu":
        _memmove(copies)
        return
    from . import cudart

    runtime = cudart.runtime()
    with torch.cuda.device(plan.device):
        current = torch.cuda.current_stream(plan.device)
        stream = current.cuda_stream
        if copies.rows > 1:
            width = int(copies.sizes[0])
            for dst, src in zip(copies.dsts.tolist(), copies.srcs.tolist(), strict=True):
                runtime.memcpy_2d_async(
                    dst, copies.dst_pitch, src, copies.src_pitch, width, copies.rows, stream
                )
        elif runtime.can_batch and stream:
            runtime.memcpy_batch_async(copies.dsts, copies.srcs, copies.sizes, stream)
        elif runtime.can_batch:  # the legacy default stream: the batch runs on a side stream in its order
            side = _side_stream(plan.device)
            side.wait_stream(current)
            runtime.memcpy_batch_async(copies.dsts, copies.srcs, copies.sizes, side.cuda_stream)
            current.wait_stream(side)
        else:
            for dst, src, size in zip(
                copies.dsts.tolist(), copies.srcs.tolist(), copies.sizes.tolist(), strict=True
            ):
                runtime.memcpy_async(dst, src, size, stream)


@cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _pitches(geometry: Geometry) -> tuple[int, int] | None:
    """(cache pitch, page pitch) between consecutive (layer, k|v) segments, if both are constant."""
    if not geometry.contiguous or geometry.num_layer_kv < 2 or len(set(geometry.block_strides)) != 1:
        return None
    cache_steps = set(np.diff(geometry.layer_addrs).tolist())
    page_steps = set(np.diff(geometry.page_offsets).tolist())
    if len(cache_steps) != 1 or len(page_steps) != 1:
        return None
    cache_pitch, page_pitch = cache_steps.pop(), page_steps.pop()
    if min(cache_pitch, page_pitch) < geometry.segment_bytes:  # rows must not overlap or run backwards
        return None
    return cache_pitch, page_pitch


def _merged(dsts: np.ndarray, srcs: np.ndarray, width: int) -> Copies:
    """1-D copies of `width` bytes, each run contiguous on both sides merged into one copy."""
    if not dsts.size:
        return Copies(dsts, srcs, np.empty(0, dtype=np.uint64))
    step = np.uint64(width)
    follows = (dsts[1:] == dsts[:-1] + step) & (srcs[1:] == srcs[:-1] + step)
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    lengths = np.diff(np.append(starts, dsts.size)).astype(np.uint64)
    return Copies(dsts[starts], srcs[starts], lengths * step)


def _memmove(copies: Copies) -> None:
    for dst, src, size in zip(copies.dsts.tolist(), copies.srcs.tolist(), copies.sizes.tolist(), strict=True):
        for row in range(copies.rows):
            ctypes.memmove(dst + row * copies.dst_pitch, src + row * copies.src_pitch, size)
