"""`copy_blocks` between two GPUs by the copy engines, where the blocks come in long runs.

A prompt's blocks in a paged cache are often consecutive ids (where the engine's free list hands
them out in order, as a fresh vLLM engine's does), and in most layouts a run's consecutive blocks
lie one after the other (its block stride is its bytes: flash_attn's K and V, MLA's latent, vLLM's
LBHNC block; not flashinfer's or cross_layer's, whose K and V interleave by block, which stay with
the kernel). A stretch of ids consecutive on both sides is then one contiguous piece per run: a
handful of large copies, for the copy engines, which move a flat peer copy at the link's full rate
where the kernel's SM loads reach 0.86-0.95 of it (bench/NOTES-handover.md), with no kernel launch
and no table of block ids uploaded first. All the pieces go in one `cudaMemcpyBatchAsync` on the
copy's stream, in stream order, asking to leave the SMs to the decode instance's compute.

- `copy_by_engines(src_runs, dst_runs, src_ids, dst_ids, device, stream)`: True where it enqueued
  the copy; False where the kernel should move it instead (the same GPU, pieces too small or too
  many, blocks with gaps between them, no batch call in this CUDA, `KVSTORE_BLOCK_COPY=kernel`,
  or `KVSTORE_KERNELS` set). On the legacy default stream, which the batch call refuses, the
  batch runs on a side stream in its order.

`KVSTORE_BLOCK_COPY`: `auto` (unset) as above, or `kernel`: always the kernel.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import numpy as np
import torch

from kvstore.shared.cudart import CudaError, CudaUnavailable

from . import cudart
from .routing import backend_name

log = logging.getLogger(__name__)

MODES = ("auto", "kernel")
MIN_PIECE_BYTES = 1 << 20  # the mean piece at least this (a layer's K for 32+ blocks of 32 KiB)
MAX_PIECES = 4096  # one batch call's arrays, 96 KiB
_failed: list[str] = []  # a batch call the runtime refused once: the kernel from then on


def mode() -> str:
    name = os.environ.get("KVSTORE_BLOCK_COPY", "").strip().lower() or "auto"
    if name not in MODES:
        raise ValueError(f"KVSTORE_BLOCK_COPY: expected one of {', '.join(MODES)}, got {name!r}")
    return name


def copy_by_engines(
    src_runs: Any, dst_runs: Any, src_ids: np.ndarray, dst_ids: np.ndarray, device: torch.device, stream: Any
) -> bool:
    """Enqueues the copy of blocks `src_ids` into `dst_ids` of every run as contiguous pieces on
    `stream` (or `device`'s current one); False where it is not for the copy engines (see the
    module). The runs are `blocks.Runs`: `addresses`, `strides` and `run_bytes`."""
    if _failed or mode() != "auto" or backend_name() != "auto" or not _consecutive_blocks(src_runs, dst_runs):
        return False
    size = src_runs.run_bytes
    breaks = np.flatnonzero((np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    num_runs = len(src_runs.addresses)
    pieces = starts.size * num_runs
    if pieces > MAX_PIECES or src_ids.size * size < starts.size * MIN_PIECE_BYTES:
        return False
    try:
        runtime = cudart.runtime()
    except CudaUnavailable:
        return False
    if not runtime.can_batch:
        return False
    lengths = np.diff(np.append(starts, src_ids.size)) * size
    srcs = np.add.outer(np.asarray(src_runs.addresses, np.int64), src_ids[starts] * size).ravel()
    dsts = np.add.outer(np.asarray(dst_runs.addresses, np.int64), dst_ids[starts] * size).ravel()
    try:
        with torch.cuda.device(device):
            _batch(
                runtime, dsts, srcs, np.tile(lengths, num_runs), stream or torch.cuda.current_stream(device)
            )
    except CudaError as exc:  # refused: the kernel moves this copy (after any piece enqueued), and later ones
        _failed.append(str(exc))
        log.warning("block copies between GPUs go by the kernel from now on: %s", exc)
        return False
    return True


def _batch(runtime: Any, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: Any) -> None:
    """One batch call on `stream`; on the legacy default stream (which the call refuses), on a side
    stream in its order."""
    if stream.cuda_stream:
        runtime.memcpy_batch_async(dsts, srcs, sizes, stream.cuda_stream)
        return
    side = _side_stream(stream.device)
    side.wait_stream(stream)
    try:
        runtime.memcpy_batch_async(dsts, srcs, sizes, side.cuda_stream)
    finally:  # a refused call may have enqueued some pieces: the caller's stream is after them too
        stream.wait_stream(side)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@functools.lru_cache(maxsize=64)
def _consecutive_blocks(src_runs: Any, dst_runs: Any) -> bool:
    """Whether a run's block i + 1 starts where its block i ends, in both caches."""
    size = src_runs.run_bytes
    return (
        size > 0
        and dst_runs.run_bytes == size
        and all(stride == size for stride in src_runs.strides)
        and all(stride == size for stride in dst_runs.strides)
    )
