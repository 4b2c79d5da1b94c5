"""Input checks shared by every backend, and the validated plan they execute.

`plan_transfer` checks a gather or scatter call completely before any byte moves and
returns a `Transfer`: the engine layers to move with their page positions, their
canonical views (see `layouts`), the block ids of every page and the page offsets.
Every problem is a `ValueError` that names the argument, the layer or the index at
fault, and what was expected.

A block table on the host (list, numpy array, CPU tensor) is checked entry by entry. A
block table on a CUDA device is not read back (that would wait for the stream): its
entries are looked up on the device, the kernel skips (moves nothing for) a block id
outside the cache, and scatter cannot refuse a block id that appears twice.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kvstore.spec import KVSpec, PageSpec

from .layouts import KVCaches, expected_shape, kv_views, layer_tensors, num_blocks_of, shape_text


class Transfer(NamedTuple):
    """A checked transfer, ready for a backend."""

    page: PageSpec
    layers: tuple[int, ...]  # engine layers moved: the stored ones among `layers`
    positions: tuple[int, ...]  # their stored-layer index within a page
    views: tuple[tuple[torch.Tensor, ...], ...]  # per moved layer: K, V (or latent) views
    blocks: np.ndarray | torch.Tensor  # int64 [num_pages, blocks_per_chunk]; a tensor: on the device
    offsets: tuple[int, ...]  # byte offset of each page in the buffer
    buffer: torch.Tensor
    device: torch.device  # where the KV cache lives
    num_blocks: int  # blocks in the smallest moved cache tensor: valid ids are 0..num_blocks-1

    @property
    def blocks_on_device(self) -> bool:
        """Whether the block ids are a device tensor, unchecked on the host."""
        return isinstance(self.blocks, torch.Tensor)


def plan_transfer(
    spec: KVSpec,
    kv_caches: KVCaches,
    block_ids: Any,
    chunks: Sequence[int],
    buffer: torch.Tensor,
    offsets: Sequence[int],
    layers: range | None,
    batch_index: int,
    *,
    writes_cache: bool,
) -> Transfer:
    """Check a gather (`writes_cache=False`) or scatter call; return what to move."""
    page = spec.page
    position = {layer: index for index, layer in enumerate(page.stored_layers)}
    moved = [layer for layer in _check_layers(spec, layers) if layer in position]
    # Only the layers that move are read or written; with none, check them all anyway.
    device, num_blocks, smallest = _check_caches(spec, kv_caches, moved or page.stored_layers, batch_index)
    chunk_list = _int_list("chunks", chunks)
    offset_list = _int_list("offsets", offsets)
    if len(chunk_list) != len(offset_list):
        raise ValueError(
            f"chunks and offsets: {len(chunk_list)} chunks but {len(offset_list)} offsets; "
            "give one page offset per chunk"
        )
    _check_buffer(buffer, device, offset_list, page.page_bytes, overlap_ok=writes_cache)
    views = {layer: kv_views(spec, kv_caches, layer, batch_index) for layer in moved}
    blocks = _block_table(spec, page, block_ids, chunk_list, num_blocks, smallest, device)
    if writes_cache:
        _check_writable(blocks, views)
    return Transfer(
        page=page,
        layers=tuple(moved),
        positions=tuple(position[layer] for layer in moved),
        views=tuple(views.values()),
        blocks=blocks,
        offsets=tuple(offset_list),
        buffer=buffer,
        device=device,
        num_blocks=num_blocks,
    )


def host_blocks(plan: Transfer, *, writes_cache: bool) -> np.ndarray:
    """The plan's block ids on the host, checked: a device table is read back (the stream waits)."""
    if isinstance(plan.blocks, np.ndarray):
        return plan.blocks
    blocks = plan.blocks.cpu().numpy()
    bad = np.argwhere((blocks < 0) | (blocks >= plan.num_blocks))
    if bad.size:
        row, column = (int(i) for i in bad[0])
        raise ValueError(
            f"block_ids: block {int(blocks[row, column])} (page {row}, block {column} of its chunk) "
            f"is outside 0..{plan.num_blocks - 1}"
        )
    if writes_cache:
        _check_writable(blocks, {})
    return blocks


def _check_layers(spec: KVSpec, layers: range | None) -> range:
    if layers is None:
        return range(spec.num_layers)
    if not isinstance(layers, range) or layers.step != 1:
        raise ValueError(f"layers: expected a range with step 1, got {layers!r}")
    if not 0 <= layers.start <= layers.stop <= spec.num_layers:
        raise ValueError(f"layers: {layers!r} is outside 0..{spec.num_layers} engine layers")
    return layers


def _check_caches(
    spec: KVSpec, kv_caches: KVCaches, layers: Sequence[int], batch_index: int
) -> tuple[torch.device, int, int]:
    """Check the tensors of `layers`; return their device and (blocks, layer) of the smallest."""
    if spec.layout == "cross_layer":
        if not isinstance(kv_caches, torch.Tensor):
            raise ValueError(
                f"kv_caches: the cross_layer layout takes one tensor, got {type(kv_caches).__name__}"
            )
    elif not isinstance(kv_caches, (list, tuple)) or len(kv_caches) != spec.num_layers:
        got = len(kv_caches) if isinstance(kv_caches, (list, tuple)) else type(kv_caches).__name__
        raise ValueError(
            f"kv_caches: expected a list of {spec.num_layers} layers (one per engine layer), got {got}"
        )
    named = [
        (layer, name, tensor) for layer in layers for name, tensor in layer_tensors(spec, kv_caches, layer)
    ]
    first = named[0][2]
    device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
    smallest = (-1, -1)
    shape = expected_shape(spec)
    dtype = getattr(torch, spec.dtype)
    for layer, name, tensor in named:
        _check_tensor(spec, shape, dtype, name, tensor, device)
        if spec.layout == "hf" and not 0 <= batch_index < tensor.shape[0]:
            raise ValueError(f"batch_index: {batch_index} is outside 0..{tensor.shape[0] - 1} for {name}")
        blocks = num_blocks_of(spec, tensor)
        if smallest[0] < 0 or blocks < smallest[0]:
            smallest = (blocks, layer)
    return device, *smallest


def _check_tensor(
    spec: KVSpec,
    shape: tuple[tuple[str, int | None], ...],
    dtype: torch.dtype,
    name: str,
    tensor: Any,
    device: torch.device,
) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        got = str(tensor.dtype).removeprefix("torch.")
        raise ValueError(f"{name}: dtype {got} does not match the spec's {spec.dtype}")
    if tensor.dim() != len(shape) or any(
        size is not None and got != size for got, (_, size) in zip(tensor.shape, shape, strict=True)
    ):
        raise ValueError(
            f"{name}: shape {list(tensor.shape)} does not match the {spec.layout} layout, "
            f"expected {shape_text(shape)}"
        )
    if tensor.device != device:
        raise ValueError(f"{name}: on {tensor.device}, expected {device} like the other KV tensors")


def _int_list(name: str, values: Sequence[int]) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    try:
        result = [operator.index(value) for value in values]
    except TypeError:
        raise ValueError(f"{name}: expected a sequence of integers, got {values!r}") from None
    for index, value in enumerate(result):
        if value < 0:
            raise ValueError(f"{name}[{index}]: {value} is negative")
    return result


def _check_buffer(
    buffer: torch.Tensor, device: torch.device, offsets: list[int], page_bytes: int, *, overlap_ok: bool
) -> None:
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"buffer: expected a 1-D uint8 torch.Tensor, got {type(buffer).__name__}")
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(
            f"buffer: expected a 1-D uint8 tensor, got {str(buffer.dtype).removeprefix('torch.')} "
            f"with shape {list(buffer.shape)}"
        )
    if buffer.stride(0) != 1 and buffer.numel() > 1:
        raise ValueError(f"buffer: expected contiguous bytes, got stride {buffer.stride(0)}")
    if buffer.device.type != "cpu" and buffer.device != device:
        raise ValueError(f"buffer: on {buffer.device}; expected the CPU or the KV cache's device {device}")
    size = buffer.numel()
    for index, offset in enumerate(offsets):
        if offset + page_bytes > size:
            raise ValueError(
                f"offsets[{index}]: page {offset}..{offset + page_bytes} ({page_bytes} bytes) "
                f"runs past the end of the {size}-byte buffer"
            )
    if not overlap_ok:
        ordered = sorted(enumerate(offsets), key=lambda item: item[1])
        for (before, start), (after, next_start) in zip(ordered, ordered[1:], strict=False):
            if next_start < start + page_bytes:
                raise ValueError(
                    f"offsets[{before}] and offsets[{after}]: pages at {start} and {next_start} "
                    f"overlap ({page_bytes}-byte pages); gather needs one page per chunk"
                )


def _block_table(
    spec: KVSpec,
    page: PageSpec,
    block_ids: Any,
    chunks: list[int],
    num_blocks: int,
    layer: int,
    device: torch.device,
) -> np.ndarray | torch.Tensor:
    per_chunk = page.chunk_tokens // spec.block_size
    # numpy, not torch: these arrays are small and torch's per-op cost dominates a call.
    slots = np.asarray(chunks, dtype=np.int64).reshape(-1, 1) * per_chunk + np.arange(per_chunk)
    if spec.layout == "hf":
        if slots.size and int(slots.max()) >= num_blocks:
            chunk = chunks[int(slots.max(axis=1).argmax())]
            seq, chunk_tokens = spec.block_size * num_blocks, page.chunk_tokens
            raise ValueError(
                f"chunks: chunk {chunk} needs seq positions up to {(chunk + 1) * chunk_tokens - 1}, "
                f"but layer {layer}'s cache holds {seq} (whole blocks of {spec.block_size})"
            )
        return slots
    table = _table_array(block_ids)
    entries = table.numel() if isinstance(table, torch.Tensor) else table.size
    if slots.size and int(slots.max()) >= entries:
        raise ValueError(
            f"block_ids: the block table has {entries} entries; chunk {max(chunks)} needs "
            f"{(max(chunks) + 1) * per_chunk} ({per_chunk} blocks per chunk)"
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
    bad = np.argwhere((blocks < 0) | (blocks >= num_blocks))
    if bad.size:
        row, column = (int(i) for i in bad[0])
        raise ValueError(
            f"block_ids[{int(slots[row, column])}]: block {int(blocks[row, column])} "
            f"(chunk {chunks[row]}) is outside 0..{num_blocks - 1}, the blocks of layer {layer}"
        )
    return blocks


def _table_array(block_ids: Any) -> np.ndarray | torch.Tensor:
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


def _check_writable(blocks: np.ndarray | torch.Tensor, views: dict[int, tuple[torch.Tensor, ...]]) -> None:
    """Scatter writes each cache element once; refuse what would write one place twice."""
    if isinstance(blocks, np.ndarray):  # a device table is not read back: see the module docstring
        values, counts = np.unique(blocks, return_counts=True)
        if values.size != blocks.size:
            raise ValueError(
                f"block_ids: block {int(values[counts > 1][0])} appears twice among the chunks' blocks; "
                "scatter would write it twice"
            )
    seen: dict[int, int] = {}
    for layer, kv in views.items():
        for view in kv:
            if any(stride == 0 and size > 1 for stride, size in zip(view.stride(), view.shape, strict=True)):
                raise ValueError(
                    f"kv_caches[{layer}]: has a zero stride (an expanded view); scatter cannot write it"
                )
            if view.data_ptr() in seen:
                raise ValueError(
                    f"kv_caches[{layer}]: same memory as layer {seen[view.data_ptr()]}; "
                    "declare it in spec.kv_sharing instead of passing it twice"
                )
            seen[view.data_ptr()] = layer
