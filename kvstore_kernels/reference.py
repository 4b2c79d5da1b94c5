"""Torch reference for page gather and scatter, and for block copies: the CPU path and the test oracle.

- `gather_plan(plan)`: engine KV cache -> pages in a flat uint8 buffer.
- `scatter_plan(plan)`: pages -> engine KV cache, the exact inverse.
- `copy_blocks(pairs, src_blocks, dst_blocks)`: blocks of one KV cache -> blocks of another
  (`blocks.copy_blocks` checks the call and makes the pairs of tensors).

The first two take a checked plan (`validate.plan_transfer`; `kvstore_kernels.gather`/`scatter` with
`TransferOptions(engine="torch")` make it and call them) and move each layer with one
`index_select` (or `index_copy_`) over the blocks of all chunks per K/V view, plus one over
the buffer's rows. A block table on a CUDA device is read back and checked first (this path
waits for the stream anyway). Data is handled as integers of the dtype's width, so no float
value (fp8, NaN payloads) is ever converted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext

import numpy as np
import torch

from . import staging
from .validate import Transfer, host_blocks

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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


def copy_blocks(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], src_blocks: np.ndarray, dst_blocks: np.ndarray
) -> None:
    """Block `src_blocks[i]` of each pair's source tensor into block `dst_blocks[i]` of its
    destination: one `index_select` and one `index_copy_` per pair. Each tensor is `[blocks, ...]`
    with the same shape per block in both, any strides; the source may be on another device. The
    caller checked the int64 ids (each inside its tensor, each destination block once)."""
    if not pairs or not len(src_blocks):
        return
    src_index = _on_current(src_blocks, pairs[0][0].device)
    dst_index = _on_current(dst_blocks, pairs[0][1].device)
    for source, destination in pairs:
        rows = _as_int(source).index_select(0, src_index).to(destination.device)
        _as_int(destination).index_copy_(0, dst_index, rows)


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


def _on_current(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """`_on`, with `device` current while it stages (the staging ring records on its streams)."""
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        return _on(values, device)


def _on(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64 indices on `device`; to CUDA through the pinned ring, so the host does not wait."""
    return staging.to_device(np.ascontiguousarray(values, dtype=np.int64), device)
