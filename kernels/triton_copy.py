"""Triton page gather and scatter: one persistent launch moves every layer of every page.

- `gather` / `scatter`: the public signatures plus `max_programs`.
- `_copy_pages`: the kernel. Its unit of work is a segment: one (page, layer, k|v,
  block) pair of runs, `block_size * kv_heads * head_dim` elements contiguous in the
  page and, for ordinary caches, contiguous in the engine's cache too. At most
  `max_programs` programs stride over all segments, moving each in tiles of up to
  16 KiB (host reads need many bytes in flight; few programs leave the SMs to the model).

Addresses travel as int64 tables (layer base pointers, page addresses), so the cache's
layers and a pinned host buffer need no single base tensor; the kernel casts them with
`.to(tl.pointer_type(...))`. Data moves as integer words of 1-8 bytes, the widest that
every address and stride allows, so no dtype (fp8, bf16) needs special casing. A cache
whose views are not contiguous within a block is honoured through its strides.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from kvstore.spec import KVSpec

from . import staging
from .layouts import KVCaches
from .validate import Transfer, plan_transfer

# Measured on an H100 (PCIe Gen5), 32 KiB segments: 8 programs move 51 GB/s GPU->host and
# 50 GB/s host->GPU (4 programs: 51 and 35; 2: 43 and 18), so more only take SMs from the model.
HOST_MAX_PROGRAMS = 8
DEVICE_MAX_PROGRAMS = 64  # buffer in device memory: ~0.7 TB/s each way, half the SMs left free
TILE_BYTES = 16384  # per load: host reads need many bytes in flight
_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


@triton.jit
def _copy_pages(
    tables,  # int64: page addresses, then the parts that start at the *_at offsets
    blocks_at,
    layer_addrs_at,
    layer_strides_at,  # per (layer, k|v): block stride in bytes; token, head, dim strides in elements
    layer_page_offsets_at,
    num_segments,
    num_layer_kv,  # runtime, not constexpr: a new layer range must not recompile
    blocks_per_chunk,
    SEGMENT_WORDS: tl.constexpr,
    TILE: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WORDS_PER_ELEMENT: tl.constexpr,
    WORD: tl.constexpr,
    WORD_BYTES: tl.constexpr,
    ALIGN: tl.constexpr,
    TO_PAGE: tl.constexpr,
):
    blocks = tables + blocks_at
    layer_addrs = tables + layer_addrs_at
    layer_strides = tables + layer_strides_at
    layer_page_offsets = tables + layer_page_offsets_at
    # A while loop, not range(program_id, ...): the interpreter cannot index with a traced scalar.
    segment = tl.program_id(0)
    while segment < num_segments:
        block_in_chunk = segment % blocks_per_chunk
        layer_kv = (segment // blocks_per_chunk) % num_layer_kv
        page = segment // (blocks_per_chunk * num_layer_kv)
        block = tl.load(blocks + page * blocks_per_chunk + block_in_chunk)
        cache_addr = tl.load(layer_addrs + layer_kv) + block * tl.load(layer_strides + layer_kv * 4)
        page_addr = (
            tl.load(tables + page)
            + tl.load(layer_page_offsets + layer_kv)
            + block_in_chunk.to(tl.int64) * (SEGMENT_WORDS * WORD_BYTES)
        )
        # Loaded addresses carry no alignment facts; the host checked ALIGN, so say it (vector loads).
        cache_ptr = tl.multiple_of(cache_addr, ALIGN).to(tl.pointer_type(WORD))
        page_ptr = tl.multiple_of(page_addr, ALIGN).to(tl.pointer_type(WORD))
        for start in range(0, SEGMENT_WORDS, TILE):
            words = start + tl.arange(0, TILE)
            mask = words < SEGMENT_WORDS if SEGMENT_WORDS % TILE else None
            if CONTIGUOUS:
                cache_words = words.to(tl.int64)
            else:  # strides in elements: token, head, dim
                element = words // WORDS_PER_ELEMENT
                token = element // (HEADS * HEAD_DIM)
                head = (element // HEAD_DIM) % HEADS
                dim = element % HEAD_DIM
                cache_elements = (
                    token * tl.load(layer_strides + layer_kv * 4 + 1)
                    + head * tl.load(layer_strides + layer_kv * 4 + 2)
                    + dim * tl.load(layer_strides + layer_kv * 4 + 3)
                )
                cache_words = cache_elements * WORDS_PER_ELEMENT + words % WORDS_PER_ELEMENT
            if TO_PAGE:
                tl.store(page_ptr + words, tl.load(cache_ptr + cache_words, mask=mask), mask=mask)
            else:
                tl.store(cache_ptr + cache_words, tl.load(page_ptr + words, mask=mask), mask=mask)
        segment += tl.num_programs(0)


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
    max_programs: int | None = None,
) -> None:
    """Engine KV cache -> pages at `buffer[offsets[j]:]`, one launch for all layers and pages."""
    plan = plan_transfer(
        spec, kv_caches, block_ids, chunks, buffer, offsets, layers, batch_index, writes_cache=False
    )
    launch(spec, plan, to_page=True, max_programs=max_programs)


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
    max_programs: int | None = None,
) -> None:
    """Pages at `buffer[offsets[j]:]` -> the engine KV cache, one launch for all layers and pages."""
    plan = plan_transfer(
        spec, kv_caches, block_ids, chunks, buffer, offsets, layers, batch_index, writes_cache=True
    )
    launch(spec, plan, to_page=False, max_programs=max_programs)


def is_interpreted() -> bool:
    """Whether this module's kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_copy_pages, triton.runtime.JITFunction)


def can_reach(plan: Transfer) -> bool:
    """Whether the kernel can address both the cache and the buffer of `plan`."""
    if is_interpreted():
        return plan.device.type == "cpu" and plan.buffer.device.type == "cpu"
    if plan.device.type != "cuda":
        return False
    return plan.buffer.device == plan.device or plan.buffer.is_pinned()


def launch(spec: KVSpec, plan: Transfer, *, to_page: bool, max_programs: int | None = None) -> None:
    """Run a validated transfer in one kernel launch."""
    if not can_reach(plan):
        raise ValueError(
            f"buffer: the Triton kernels need the KV cache on CUDA and the buffer on that device or in "
            f"pinned (registered) host memory, or CPU tensors with TRITON_INTERPRET=1 set before import "
            f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r}); got the cache on "
            f"{plan.device}, the buffer on {plan.buffer.device}"
        )
    num_layer_kv = sum(len(views) for views in plan.views)
    blocks_per_chunk = plan.blocks.shape[1]
    num_segments = len(plan.offsets) * num_layer_kv * blocks_per_chunk
    if not num_segments:
        return
    if max_programs is None:
        max_programs = DEVICE_MAX_PROGRAMS if plan.buffer.device.type == "cuda" else HOST_MAX_PROGRAMS
    if max_programs < 1:
        raise ValueError(f"max_programs: expected a positive integer, got {max_programs}")
    geometry = _Geometry(spec, plan)
    tile = min(triton.next_power_of_2(geometry.segment_words), TILE_BYTES // geometry.word_bytes)
    tile_bytes = tile * geometry.word_bytes
    num_warps = 8 if tile_bytes >= 8192 else 4 if tile_bytes >= 2048 else 1
    grid = (min(num_segments, max_programs),)
    with torch.cuda.device(plan.device) if plan.device.type == "cuda" else nullcontext():
        tables = staging.to_device(geometry.table_values(plan), plan.device)
        _copy_pages[grid](
            tables,
            *geometry.table_starts,
            num_segments,
            num_layer_kv=num_layer_kv,
            blocks_per_chunk=blocks_per_chunk,
            SEGMENT_WORDS=geometry.segment_words,
            TILE=tile,
            CONTIGUOUS=geometry.contiguous,
            HEADS=spec.num_kv_heads,
            HEAD_DIM=spec.head_dim,
            WORDS_PER_ELEMENT=plan.page.itemsize // geometry.word_bytes,
            WORD=_WORDS[geometry.word_bytes],
            WORD_BYTES=geometry.word_bytes,
            ALIGN=geometry.align,
            TO_PAGE=to_page,
            num_warps=num_warps,
        )


class _Geometry:
    """Addresses, strides and the word width of one validated transfer."""

    def __init__(self, spec: KVSpec, plan: Transfer) -> None:
        page = plan.page
        views = [view for layer_views in plan.views for view in layer_views]
        itemsize = page.itemsize
        self.contiguous = all(_is_packed(view) for view in views)
        self.layer_addrs = [view.data_ptr() for view in views]
        self.block_strides = [view.stride(0) * itemsize for view in views]
        self.inner_strides = [list(view.stride()[1:]) for view in views]
        segment_bytes = spec.block_size * page.token_bytes
        kv_bytes, layer_bytes = page.chunk_tokens * page.token_bytes, page.layer_bytes
        self.page_offsets = [
            position * layer_bytes + kv * kv_bytes
            for position, layer_views in zip(plan.positions, plan.views, strict=True)
            for kv in range(len(layer_views))
        ]
        self.page_addrs = [plan.buffer.data_ptr() + offset for offset in plan.offsets]
        # Every address and step is a multiple of `alignment`: words (and vector loads) of that width.
        alignment = math.gcd(
            segment_bytes, *self.layer_addrs, *self.block_strides, *self.page_offsets, *self.page_addrs
        )
        widest = 8 if self.contiguous else itemsize
        self.word_bytes = next(w for w in (8, 4, 2, 1) if w <= widest and alignment % w == 0)
        self.align = 16 if self.contiguous and alignment % 16 == 0 else self.word_bytes
        self.segment_words = segment_bytes // self.word_bytes
        sizes = [len(self.page_addrs), plan.blocks.size, len(views), 4 * len(views)]
        self.table_starts = list(itertools.accumulate(sizes))  # of blocks, layer addrs, strides, offsets

    def table_values(self, plan: Transfer) -> np.ndarray:
        """All int64 tables, one after the other, so they reach the device in one copy."""
        strides = [
            value
            for block, inner in zip(self.block_strides, self.inner_strides, strict=True)
            for value in (block, *inner)
        ]
        parts = [self.page_addrs, plan.blocks.ravel(), self.layer_addrs, strides, self.page_offsets]
        return np.concatenate([np.asarray(part, dtype=np.int64) for part in parts])


def _is_packed(view: torch.Tensor) -> bool:
    """Whether one block of `view` ([blocks, block_size, heads, dim]) is one contiguous run."""
    expected = 1
    for size, stride in zip(reversed(view.shape[1:]), reversed(view.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
