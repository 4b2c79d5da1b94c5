"""Torch reference for page gather and scatter: the CPU path and the test oracle.

- `gather`: engine KV cache -> pages in a flat uint8 buffer.
- `scatter`: pages -> engine KV cache, the exact inverse.

Both take the arguments of `kvstore_kernels.gather`/`scatter`, validate them, and move
each layer with one `index_select` (or `index_copy_`) over the blocks of all chunks per
K/V view, plus one over the buffer's rows. A block table on a CUDA device is read back
and checked first (this path waits for the stream anyway). Data is handled as integers of the dtype's
width, so no float value (fp8, NaN payloads) is ever converted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvstore.spec import KVSpec

from . import staging
from .layouts import KVCaches
from .validate import Transfer, host_blocks, plan_transfer

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def gather(
    spec: KVSpec,
    kv_caches: KVCaches,
    block_ids: Any,
    chunks: Sequence[int],
    buffer: torch.Tensor,
    offsets: Sequence[int],
    layers: range | None = None,
    *,
    batch_index: int = 0,
) -> None:
    """Engine KV cache -> pages at `buffer[offsets[j]:]`, one per chunk `chunks[j]`."""
    plan = plan_transfer(
        spec, kv_caches, block_ids, chunks, buffer, offsets, layers, batch_index, writes_cache=False
    )
    gather_plan(plan)


def scatter(
    spec: KVSpec,
    kv_caches: KVCaches,
    block_ids: Any,
    chunks: Sequence[int],
    buffer: torch.Tensor,
    offsets: Sequence[int],
    layers: range | None = None,
    *,
    batch_index: int = 0,
) -> None:
    """Pages at `buffer[offsets[j]:]` -> the blocks of chunk `chunks[j]` in the engine KV cache."""
    plan = plan_transfer(
        spec, kv_caches, block_ids, chunks, buffer, offsets, layers, batch_index, writes_cache=True
    )
    scatter_plan(plan)


def gather_plan(plan: Transfer) -> None:
    """Run a validated gather."""
    num_pages = len(plan.offsets)
    if not num_pages or not plan.layers:
        return
    rows, unit = _buffer_rows(plan)
    blocks = _on(host_blocks(plan, writes_cache=False).ravel(), plan.device)
    for position, views in zip(plan.positions, plan.views, strict=True):
        parts = [_as_int(view).index_select(0, blocks).reshape(num_pages, -1) for view in views]
        span = torch.stack(parts, dim=1).view(torch.uint8)  # [num_pages, k|v, T * token_bytes]
        rows.index_copy_(0, _row_index(plan, position, unit), span.reshape(-1, unit).to(rows.device))


def scatter_plan(plan: Transfer) -> None:
    """Run a validated scatter."""
    num_pages = len(plan.offsets)
    if not num_pages or not plan.layers:
        return
    rows, unit = _buffer_rows(plan)
    blocks = _on(host_blocks(plan, writes_cache=True).ravel(), plan.device)
    for position, views in zip(plan.positions, plan.views, strict=True):
        span = rows.index_select(0, _row_index(plan, position, unit)).to(plan.device)
        elements = span.view(num_pages, len(views), -1).view(_int_dtype(views[0]))
        for kv, view in enumerate(views):
            _as_int(view).index_copy_(0, blocks, elements[:, kv].reshape(-1, *view.shape[1:]))


def _as_int(view: torch.Tensor) -> torch.Tensor:
    return view.view(_int_dtype(view))  # same width: allowed for any strides


def _int_dtype(view: torch.Tensor) -> torch.dtype:
    return _SAME_WIDTH_INT[view.element_size()]


def _buffer_rows(plan: Transfer) -> tuple[torch.Tensor, int]:
    """The buffer as rows of `unit` bytes, the widest unit every page span starts on."""
    unit = math.gcd(plan.page.layer_bytes, *plan.offsets)
    usable = plan.buffer.numel() // unit * unit
    return plan.buffer[:usable].view(-1, unit), unit


def _row_index(plan: Transfer, position: int, unit: int) -> torch.Tensor:
    """Row numbers of one stored layer's span in every page, page after page."""
    layer_bytes = plan.page.layer_bytes
    starts = (
        torch.tensor(plan.offsets, dtype=torch.int64)
        .add_(position * layer_bytes)
        .div_(unit, rounding_mode="floor")
    )
    index = starts.reshape(-1, 1) + torch.arange(layer_bytes // unit, dtype=torch.int64)
    return _on(index.flatten().numpy(), plan.buffer.device)


def _on(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64 indices on `device`; to CUDA through the pinned ring, so the host does not wait."""
    return staging.to_device(np.ascontiguousarray(values, dtype=np.int64), device)
