"""Where every segment of a validated transfer lives: the addresses both copy paths share.

A segment is one (page, moved layer, k|v, block of the chunk) run of
`block_size * kv_heads * head_dim` elements: contiguous in the page, and contiguous in the
engine's cache when the views are packed within a block (`contiguous`).

- `Geometry(spec, plan)`: per (layer, k|v) base address, block stride and page offset,
  per page its address, and the widest word every address allows.
- `Geometry.segment_addresses(blocks)`: cache and page address of every segment, for the
  copy-engine path (`copy_engine`); the Triton kernel computes the same on the GPU.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from kvstore.spec import KVSpec

from .cache_facts import is_packed_run
from .validate import Transfer


class Geometry:
    """Addresses, strides and the word width of one validated transfer."""

    def __init__(self, spec: KVSpec, plan: Transfer) -> None:
        page = plan.page
        views = [view for layer_views in plan.view_facts for view in layer_views]
        itemsize = page.itemsize
        self.num_layer_kv = len(views)
        self.blocks_per_chunk = page.chunk_tokens // spec.block_size
        self.contiguous = all(view.packed for view in views)
        self.layer_addrs = [view.address for view in views]
        self.block_strides = [view.strides[0] * itemsize for view in views]
        self.inner_strides = [list(view.strides[1:]) for view in views]
        self.segment_bytes = spec.block_size * page.token_bytes
        kv_bytes, layer_bytes = page.chunk_tokens * page.token_bytes, page.layer_bytes
        self.page_offsets = [
            position * layer_bytes + kv * kv_bytes
            for position, layer_views in zip(plan.positions, plan.view_facts, strict=True)
            for kv in range(len(layer_views))
        ]
        self.page_addrs = [plan.buffer.data_ptr() + offset for offset in plan.offsets]
        # Every address and step is a multiple of `alignment`: words (and vector loads) of that width.
        alignment = math.gcd(
            self.segment_bytes, *self.layer_addrs, *self.block_strides, *self.page_offsets, *self.page_addrs
        )
        widest = 8 if self.contiguous else itemsize
        self.word_bytes = next(w for w in (8, 4, 2, 1) if w <= widest and alignment % w == 0)
        self.align = 16 if self.contiguous and alignment % 16 == 0 else self.word_bytes
        self.segment_words = self.segment_bytes // self.word_bytes
        self.words_per_element = itemsize // self.word_bytes

    @property
    def num_segments(self) -> int:
        return len(self.page_addrs) * self.num_layer_kv * self.blocks_per_chunk

    def table_values(self, blocks: np.ndarray | None) -> tuple[np.ndarray, list[int]]:
        """The kernel's int64 tables in one array (one copy to the device), and where each starts.

        Order: page addresses, block ids (absent when `blocks` is None: they live on the device),
        layer addresses, per-layer strides (block stride in bytes, then token, head, dim strides in
        elements), page offsets.
        """
        strides = [
            value
            for block, inner in zip(self.block_strides, self.inner_strides, strict=True)
            for value in (block, *inner)
        ]
        block_part: np.ndarray | list[int] = [] if blocks is None else blocks.ravel()
        parts = [self.page_addrs, block_part, self.layer_addrs, strides, self.page_offsets]
        starts = list(itertools.accumulate(len(part) for part in parts))[:-1]
        values = np.concatenate([np.asarray(part, dtype=np.int64) for part in parts])
        return values, starts

    def segment_addresses(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(cache, page) address of every segment, shape [pages, layer_kv, blocks_per_chunk], uint64."""
        layer_addrs = np.asarray(self.layer_addrs, dtype=np.uint64).reshape(1, -1, 1)
        block_strides = np.asarray(self.block_strides, dtype=np.uint64).reshape(1, -1, 1)
        cache = layer_addrs + blocks.astype(np.uint64)[:, None, :] * block_strides
        page = (
            np.asarray(self.page_addrs, dtype=np.uint64).reshape(-1, 1, 1)
            + np.asarray(self.page_offsets, dtype=np.uint64).reshape(1, -1, 1)
            + np.arange(self.blocks_per_chunk, dtype=np.uint64).reshape(1, 1, -1)
            * np.uint64(self.segment_bytes)
        )
        return cache, page


def is_packed(view: torch.Tensor) -> bool:
    """Whether one block of `view` ([blocks, block_size, heads, dim]) is one contiguous run."""
    return is_packed_run(view.shape, view.stride())
