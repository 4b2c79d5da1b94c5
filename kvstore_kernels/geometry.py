"""Where every segment of a validated transfer lives: the addresses both copy paths share.

A segment is one (page, moved layer, k|v, block of the chunk) run of
`block_size * kv_heads * head_dim` elements: contiguous in the page, and contiguous in the
engine's cache when the views are packed within a block (`contiguous`).

- `Geometry(spec, plan)`: per (layer, k|v) base address, block stride and page offset,
  per page its address, and the widest word every address allows.
- `Geometry.segment_addresses(blocks)`: cache and page address of every segment, for the
  copy-engine path (`copy_engine`); the Triton kernel computes the same on the GPU.
- `geometry_of(spec, plan)`: the same as `Geometry(spec, plan)`, but what depends on the cache
  alone (the views' addresses and strides, the page offsets) is kept from an earlier transfer
  with the same remembered cache facts and layers: only the page addresses are new (what that
  saves a GPU-tier load: bench/NOTES-gpu-tier.md).
"""

from __future__ import annotations

import copy
import itertools
import math
import threading
from typing import Any

import numpy as np
import torch

from kvstore.shared.spec import KVSpec

from .cache_facts import is_packed_run
from .validate import Transfer


class Geometry:
    """Addresses, strides and the word width of one validated transfer."""

    def __init__(self, spec: KVSpec, plan: Transfer) -> None:
        page = plan.page
        views = [view for layer_views in plan.view_facts for view in layer_views]
        itemsize = page.itemsize
        self.num_layer_kv = len(views)
        self.blocks_per_chunk = page.page_tokens // spec.block_size
        self.contiguous = all(view.packed for view in views)
        self.layer_addrs = [view.address for view in views]
        self.block_strides = [view.strides[0] * itemsize for view in views]
        self.inner_strides = [list(view.strides[1:]) for view in views]
        self.segment_bytes = spec.block_size * page.token_bytes
        kv_bytes, layer_bytes = page.page_tokens * page.token_bytes, page.layer_bytes
        self.page_offsets = [
            position * layer_bytes + kv * kv_bytes
            for position, layer_views in zip(plan.positions, plan.view_facts, strict=True)
            for kv in range(len(layer_views))
        ]
        self._itemsize = itemsize
        self._static_alignment = math.gcd(
            self.segment_bytes, *self.layer_addrs, *self.block_strides, *self.page_offsets
        )
        strides = [
            value
            for block, inner in zip(self.block_strides, self.inner_strides, strict=True)
            for value in (block, *inner)
        ]
        static = [self.layer_addrs, strides, self.page_offsets]  # the tables' cache-only part
        self.static_values = np.concatenate([np.asarray(part, dtype=np.int64) for part in static])
        self.static_lengths = [len(part) for part in static]
        self._set_pages(plan)

    def _set_pages(self, plan: Transfer) -> None:
        base = plan.buffer.data_ptr()
        self.page_addrs = [base + offset for offset in plan.offsets]
        self._set_words(math.gcd(*self.page_addrs))

    def with_pages(self, count: int, page_alignment: int) -> Geometry:
        """This geometry for `count` pages whose addresses are all multiples of `page_alignment` (the
        widest such): what the kernel's arguments depend on, without the pages' addresses."""
        other = copy.copy(self)
        other.page_addrs = [page_alignment] * count
        other._set_words(page_alignment)
        return other

    def _set_words(self, page_alignment: int) -> None:
        # Every address and step is a multiple of `alignment`: words (and vector loads) of that width.
        alignment = math.gcd(self._static_alignment, page_alignment)
        widest = 8 if self.contiguous else self._itemsize
        self.word_bytes = next(w for w in (8, 4, 2, 1) if w <= widest and alignment % w == 0)
        self.align = 16 if self.contiguous and alignment % 16 == 0 else self.word_bytes
        self.segment_words = self.segment_bytes // self.word_bytes
        self.words_per_element = self._itemsize // self.word_bytes

    def for_pages(self, plan: Transfer) -> Geometry:
        """This geometry for `plan`, a transfer of the same views, layers and page spec: its pages."""
        other = copy.copy(self)
        other._set_pages(plan)
        return other

    @property
    def num_segments(self) -> int:
        return len(self.page_addrs) * self.num_layer_kv * self.blocks_per_chunk

    def table_values(self, blocks: np.ndarray | None) -> tuple[np.ndarray, list[int]]:
        """The kernel's int64 tables in one array (one copy to the device), and where each starts.

        Order: page addresses, block ids (absent when `blocks` is None: they live on the device),
        layer addresses, per-layer strides (block stride in bytes, then token, head, dim strides in
        elements), page offsets.
        """
        block_part = np.empty(0, dtype=np.int64) if blocks is None else blocks.ravel()
        lengths = [len(self.page_addrs), block_part.size, *self.static_lengths]
        starts = list(itertools.accumulate(lengths))[:-1]
        values = np.concatenate(
            [
                np.asarray(self.page_addrs, dtype=np.int64),
                block_part.astype(np.int64, copy=False),
                self.static_values,
            ]
        )
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


def geometry_of(spec: KVSpec, plan: Transfer) -> Geometry:
    """`Geometry(spec, plan)`, its cache-only part kept per remembered cache facts (`plan.view_facts`,
    the same object while they are remembered; the kept entry holds it, so its id is not reused)."""
    key = (id(plan.view_facts), plan.positions, spec.block_size)
    with _kept_lock:
        kept = _kept.get(key)
    if kept is not None and kept[0] is plan.view_facts and kept[1] == plan.page:
        return kept[2].for_pages(plan)
    geometry = Geometry(spec, plan)
    with _kept_lock:
        _kept[key] = (plan.view_facts, plan.page, geometry)
        while len(_kept) > _KEPT:
            del _kept[next(iter(_kept))]
    return geometry


_kept: dict[tuple[Any, ...], tuple[Any, Any, Geometry]] = {}
_KEPT = 32
_kept_lock = threading.Lock()


def is_packed(view: torch.Tensor) -> bool:
    """Whether one block of `view` ([blocks, block_size, heads, dim]) is one contiguous run."""
    return is_packed_run(view.shape, view.stride())
