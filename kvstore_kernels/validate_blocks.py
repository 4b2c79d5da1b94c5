"""The checks of a transfer's block table, shared by every backend through `validate`.

- `table_array(block_ids)`: the block table as a 1-D int64 array on the host, or the caller's
  tensor where it is on a CUDA device (not read back: see `validate`).
- `block_table(spec, page, block_ids, chunks, num_blocks, layer, device)`: the block ids of
  `chunks`, [chunks, blocks per chunk]: checked entry by entry on the host (each inside the
  cache), looked up on the device for a device table (the kernel skips one outside it); for
  the hf layout, the sequence slots themselves, checked against the cache's length.
- `check_unique(blocks)`: a host table's blocks each once (a scatter writes each block once).
- `copy_blocks`'s: `block_ids(name, values, num_blocks, cache)` (host ids, each inside the cache),
  `check_pairs(src_ids, dst_ids)` (one destination per source, each written once),
  `check_overlap(src_ids, dst_ids)` (within one cache, none both read and written).

Every problem is a `ValueError` that names the entry at fault and what was expected.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvstore.shared.spec import KVSpec, PageSpec

from .validate_args import int_array


def block_table(
    spec: KVSpec,
    page: PageSpec,
    block_ids: Any,
    chunks: np.ndarray,
    num_blocks: int,
    layer: int,
    device: torch.device,
) -> np.ndarray | torch.Tensor:
    per_chunk = page.page_tokens // spec.block_size
    # numpy, not torch: these arrays are small and torch's per-op cost dominates a call.
    slots = chunks.reshape(-1, 1) * per_chunk + np.arange(per_chunk)
    if spec.layout == "hf":
        if slots.size and int(slots.max()) >= num_blocks:
            chunk = int(chunks[int(slots.max(axis=1).argmax())])
            seq, chunk_tokens = spec.block_size * num_blocks, page.chunk_tokens
            raise ValueError(
                f"chunks: chunk {chunk} needs seq positions up to {(chunk + 1) * chunk_tokens - 1}, "
                f"but layer {layer}'s cache holds {seq} (whole blocks of {spec.block_size})"
            )
        return slots
    table = table_array(block_ids)
    entries = table.numel() if isinstance(table, torch.Tensor) else table.size
    if slots.size and int(slots.max()) >= entries:
        raise ValueError(
            f"block_ids: the block table has {entries} entries; chunk {int(chunks.max())} needs "
            f"{(int(chunks.max()) + 1) * per_chunk} ({per_chunk} blocks per chunk)"
        )
    if isinstance(table, torch.Tensor):  # on the device: looked up there, range-checked by the kernel
        from . import staging

        if table.device != device:
            raise ValueError(
                f"block_ids: on {table.device}; a device block table must be on the KV cache's device "
                f"{device} (or pass it on the host)"
            )
        return table.to(torch.int64)[staging.to_device(slots.ravel(), table.device)].view(slots.shape)
    blocks = table[slots]
    if blocks.size and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
        row, column = (int(i) for i in np.argwhere((blocks < 0) | (blocks >= num_blocks))[0])
        raise ValueError(
            f"block_ids[{int(slots[row, column])}]: block {int(blocks[row, column])} "
            f"(chunk {int(chunks[row])}) is outside 0..{num_blocks - 1}, the blocks of layer {layer}"
        )
    return blocks


def table_array(block_ids: Any) -> np.ndarray | torch.Tensor:
    if block_ids is None:
        return np.empty(0, dtype=np.int64)
    if isinstance(block_ids, torch.Tensor):
        dtype = block_ids.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise ValueError(
                f"block_ids: expected integer block ids, got {str(dtype).removeprefix('torch.')}"
            )
        if block_ids.dim() != 1:
            raise ValueError(f"block_ids: expected a 1-D block table, got shape {list(block_ids.shape)}")
        if block_ids.device.type == "cuda":
            return block_ids.detach()
        table = block_ids.detach().cpu().numpy()
    else:
        table = np.asarray(block_ids)
    if table.dtype.kind not in "iu":
        raise ValueError(f"block_ids: expected integer block ids, got {table.dtype.name}")
    if table.ndim != 1:
        raise ValueError(f"block_ids: expected a 1-D block table, got shape {list(table.shape)}")
    return table.astype(np.int64, copy=False)


def check_unique(blocks: np.ndarray | torch.Tensor) -> None:
    """Scatter writes each block once: refuse a block id that appears twice (host tables only;
    a device table is not read back, see the module docstring)."""
    if isinstance(blocks, np.ndarray) and blocks.size > 1:
        ordered = np.sort(blocks, axis=None)
        if (ordered[1:] == ordered[:-1]).any():
            values, counts = np.unique(blocks, return_counts=True)
            raise ValueError(
                f"block_ids: block {int(values[counts > 1][0])} appears twice among the chunks' blocks; "
                "scatter would write it twice"
            )


def block_ids(name: str, values: Any, num_blocks: int, cache: str) -> np.ndarray:
    """`values` as int64 block ids on the host, each inside a cache of `num_blocks` blocks."""
    usual = type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1 and values.size
    if usual and int(values.min()) >= 0 and int(values.max()) < num_blocks:  # checked at once
        return values
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        raise ValueError(
            f"{name}: on {values.device}; pass the block ids on the host (list, numpy, CPU tensor), "
            "where they are checked"
        )
    ids = int_array(name, values)
    if ids.size and int(ids.max()) >= num_blocks:
        index = int(np.flatnonzero(ids >= num_blocks)[0])
        raise ValueError(
            f"{name}[{index}]: block {int(ids[index])} is outside 0..{num_blocks - 1}, the blocks of {cache}"
        )
    return ids


def check_pairs(src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
    """One destination per source block, each destination block written once."""
    if src_ids.size != dst_ids.size:
        raise ValueError(
            f"src_blocks and dst_blocks: {src_ids.size} source blocks but {dst_ids.size} destination "
            "blocks; give one destination block per source block"
        )
    if dst_ids.size > 1 and not bool((dst_ids[1:] > dst_ids[:-1]).all()):  # rising: none twice
        ordered = np.sort(dst_ids)
        repeated = np.flatnonzero(ordered[1:] == ordered[:-1])
        if repeated.size:
            raise ValueError(
                f"dst_blocks: block {int(ordered[repeated[0]])} appears twice; each destination block "
                "is written once"
            )


def check_overlap(src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
    """A copy within one cache (a forked prefix, say): no block is both read and written."""
    both = np.intersect1d(src_ids, dst_ids)
    if both.size:
        raise ValueError(
            f"dst_blocks: block {int(both[0])} is also among src_blocks, in the same cache; a block "
            "cannot be read while it is written"
        )
