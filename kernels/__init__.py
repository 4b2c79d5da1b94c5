"""Page transfer between an engine's KV cache and pages in a flat uint8 buffer.

- `gather(spec, kv_caches, block_ids, chunks, buffer, offsets, layers=None, *, batch_index=0)`:
  engine KV cache -> one page per chunk at `buffer[offsets[j]:]`.
- `scatter(...)`: pages -> engine KV cache, the exact inverse.
- `reference` (`reference_gather`, `reference_scatter`): the torch implementation.

A page is layer-major, `[stored_layer][k|v][token][kv_head][head_dim]` (MLA:
`[stored_layer][token][latent]`), whatever the engine's layout (`spec.layout`).

Backend: the Triton kernels when the KV cache is on CUDA and the buffer is on that
device or in pinned host memory; the torch reference otherwise (a pageable host buffer
included: correct, but at pageable-memory speed). `KVSTORE_KERNELS=triton` or `=torch`
forces one; forced Triton on CPU tensors needs `TRITON_INTERPRET=1` set before import.

Triton launches are asynchronous on the current CUDA stream. Validation reads the block
table on the host (a CUDA `block_ids` is copied back, which waits for the stream), and
costs a few microseconds of Python per moved layer: move many chunks per call.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from kvstore.spec import KVSpec

from . import reference
from .layouts import KVCaches
from .validate import Transfer, plan_transfer

__all__ = ["gather", "scatter", "reference", "reference_gather", "reference_scatter", "backend_name"]

reference_gather = reference.gather
reference_scatter = reference.scatter

BACKENDS = ("auto", "triton", "torch")


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
    """Engine KV cache -> pages: chunk `chunks[j]` becomes the page at `buffer[offsets[j]:]`.

    With `layers`, only the spans of those engine layers are written; layers that reuse
    another's KV (`spec.kv_sharing`) are not stored and are skipped.
    """
    plan = plan_transfer(
        spec, kv_caches, block_ids, chunks, buffer, offsets, layers, batch_index, writes_cache=False
    )
    if _use_triton(plan):
        from . import triton_copy

        triton_copy.launch(spec, plan, to_page=True)
    else:
        reference.gather_plan(plan)


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
    """Pages -> engine KV cache: the page at `buffer[offsets[j]:]` fills chunk `chunks[j]`'s blocks.

    With `layers`, only those engine layers are written; shared layers are never written.
    """
    plan = plan_transfer(
        spec, kv_caches, block_ids, chunks, buffer, offsets, layers, batch_index, writes_cache=True
    )
    if _use_triton(plan):
        from . import triton_copy

        triton_copy.launch(spec, plan, to_page=False)
    else:
        reference.scatter_plan(plan)


def backend_name() -> str:
    """The backend `KVSTORE_KERNELS` asks for: 'auto' (unset), 'triton' or 'torch'."""
    name = os.environ.get("KVSTORE_KERNELS", "").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"KVSTORE_KERNELS: expected one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def _use_triton(plan: Transfer) -> bool:
    name = backend_name()
    if name != "auto":
        return name == "triton"
    on_cuda = plan.device.type == "cuda"
    return on_cuda and (plan.buffer.device == plan.device or plan.buffer.is_pinned())
