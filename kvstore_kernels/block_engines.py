"""`copy_blocks` between two GPUs by the copy engines, where the blocks come in long runs.

A prompt's blocks in a paged cache are often consecutive ids (where the engine's free list hands
them out in order, as a fresh vLLM engine's does), and in most layouts a run's consecutive blocks
lie one after the other (its block stride is its bytes: flash_attn's K and V, MLA's latent, vLLM's
LBHNC block; not flashinfer's or cross_layer's, whose K and V interleave by block, which stay with
the kernel). A stretch of ids consecutive on both sides is then one contiguous piece per run: a
handful of large copies, for the copy engines, which move a flat peer copy at the link's full rate
where the kernel's SM loads reach 0.86-0.95 of it (bench/NOTES-handover.md), with no kernel launch
and no table of block ids uploaded first. The pieces go on the copy's stream, in stream order: the
first ones (`LEAD_BYTES`) a `cudaMemcpyAsync` each, so that the engines start on them at once, the
rest in one `cudaMemcpyBatchAsync` (asking to leave the SMs to the decode instance's compute),
enqueued while the first move.

- `copy_by_engines(src_runs, dst_runs, src_ids, dst_ids, device, stream)`: True where it enqueued
  the copy; False where the kernel should move it instead (the same GPU, pieces too small or too
  many, blocks with gaps between them, no batch call in this CUDA, `KVSTORE_BLOCK_COPY=kernel`,
  or `KVSTORE_KERNELS` set). On the legacy default stream, which the batch call refuses, the
  pieces go on a side stream in its order.

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
# The first pieces, up to this many bytes, go in calls of their own (`cudaMemcpyAsync`, a few us of
# host time each) and the rest in one batch call: the engines start on the first while the host
# enqueues the rest. A batch call costs 0.12-0.28 ms of host time for 64 pieces (2x H200, a worker
# woken by a message), which before the first byte moves was a tenth of an 8k-token hand-over; 64 MiB
# is ~170 us of copy over an NVLink of ~390 GB/s. Pieces copied one call each run at ~0.8 of the
# batch's rate, so only the lead goes so, and at most `LEAD_CALLS` of them (many short stretches).
LEAD_BYTES = 64 << 20
LEAD_CALLS = 8
_failed: list[str] = []  # a copy call the runtime refused once: the kernel from then on


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
    if _failed or mode() != "auto" or backend_name() != "auto":
        return False
    pair = _addresses(src_runs, dst_runs)
    if pair is None:
        return False
    pieces = _pieces(pair, src_ids, dst_ids)
    if pieces is None:
        return False
    try:
        runtime = cudart.runtime()
    except CudaUnavailable:
        return False
    if not runtime.can_batch:
        return False
    stream = stream or torch.cuda.current_stream(device)
    try:
        if torch.cuda.current_device() == device.index:
            _batch(runtime, *pieces, stream)
        else:
            with torch.cuda.device(device):
                _batch(runtime, *pieces, stream)
    except CudaError as exc:  # refused: the kernel moves this copy (after any piece enqueued), and later ones
        _failed.append(str(exc))
        log.warning("block copies between GPUs go by the copy engines no more: %s", exc)
        return False
    return True


def _pieces(
    pair: tuple[np.ndarray, np.ndarray, int], src_ids: np.ndarray, dst_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(destinations, sources, sizes) of the pieces, uint64, run by run, for block ids on the host
    (each within its cache, as `copy_blocks` checks them); None where there would be too many or
    too small ones."""
    src_addresses, dst_addresses, size = pair
    count, runs = src_ids.size, src_addresses.size
    breaks = np.flatnonzero((np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)) + 1
    if breaks.size * runs + runs > MAX_PIECES or count * size < (breaks.size + 1) * MIN_PIECE_BYTES:
        return None
    if not breaks.size:  # one stretch, the usual prompt: a piece per run, a few numpy calls
        return (
            dst_addresses + int(dst_ids[0]) * size,
            src_addresses + int(src_ids[0]) * size,
            np.full(runs, count * size, dtype=np.uint64),
        )
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.append(starts, count)).astype(np.uint64) * np.uint64(size)
    srcs = np.add.outer(src_addresses, src_ids[starts].astype(np.uint64) * np.uint64(size)).ravel()
    dsts = np.add.outer(dst_addresses, dst_ids[starts].astype(np.uint64) * np.uint64(size)).ravel()
    return dsts, srcs, np.tile(lengths, runs)


def _batch(runtime: Any, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: Any) -> None:
    """The copy's calls on `stream`; on the legacy default stream (which the batch call refuses), on
    a side stream in its order."""
    if stream.cuda_stream:
        _enqueue(runtime, dsts, srcs, sizes, stream.cuda_stream)
        return
    side = _side_stream(stream.device)
    side.wait_stream(stream)
    try:
        _enqueue(runtime, dsts, srcs, sizes, side.cuda_stream)
    finally:  # a refused call may have enqueued some pieces: the caller's stream is after them too
        stream.wait_stream(side)


def _enqueue(runtime: Any, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, handle: int) -> None:
    """The first pieces up to `LEAD_BYTES` (the piece that reaches it whole, at most `LEAD_CALLS`)
    a call each, the rest in one batch call (see there)."""
    moved, lead, last = 0, 0, min(sizes.size - 1, LEAD_CALLS)
    while lead < last and moved < LEAD_BYTES:
        runtime.memcpy_async(int(dsts[lead]), int(srcs[lead]), int(sizes[lead]), handle)
        moved += int(sizes[lead])
        lead += 1
    runtime.memcpy_batch_async(dsts[lead:], srcs[lead:], sizes[lead:], handle)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@functools.lru_cache(maxsize=64)
def _addresses(src_runs: Any, dst_runs: Any) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Each run's first byte in both caches (uint64) and a block's bytes, where a run's block i + 1
    starts where its block i ends in both; else None."""
    size = int(src_runs.run_bytes)
    if not (
        size > 0
        and dst_runs.run_bytes == size
        and all(stride == size for stride in src_runs.strides)
        and all(stride == size for stride in dst_runs.strides)
    ):
        return None
    src, dst = np.asarray(src_runs.addresses, np.uint64), np.asarray(dst_runs.addresses, np.uint64)
    src.flags.writeable = dst.flags.writeable = False  # shared by every copy between the two caches
    return src, dst, size
