"""The checks of a transfer's arguments but its block table (`validate_blocks`) and its cache
tensors (`cache_facts`), shared by every backend through `validate`.

- `check_layers(spec, layers)`: the engine layers asked for, a range with step 1 (None: all).
- `int_array(name, values)`: chunks, offsets or pages as an int64 array, every entry an
  integer, not negative and far below overflow.
- `check_buffer(buffer, device, offsets, page_bytes, overlap_ok=...)`: a 1-D contiguous uint8
  buffer on the CPU, the KV cache's device or a peer GPU, holding every page at its offset
  (without `overlap_ok`, pages that do not overlap: a gather writes one page per chunk).

Every problem is a `ValueError` that names the argument or the index at fault.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

from kvstore.shared.spec import KVSpec


def check_layers(spec: KVSpec, layers: range | None) -> range:
    if layers is None:
        return range(spec.num_layers)
    if not isinstance(layers, range) or layers.step != 1:
        raise ValueError(f"layers: expected a range with step 1, got {layers!r}")
    if not 0 <= layers.start <= layers.stop <= spec.num_layers:
        raise ValueError(f"layers: {layers!r} is outside 0..{spec.num_layers} engine layers")
    return layers


def int_array(name: str, values: Sequence[int]) -> np.ndarray:
    """`values` as an int64 array, every entry an integer and not negative."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    array: np.ndarray | None = None
    if isinstance(values, (list, tuple, range, np.ndarray)):
        try:
            array = np.asarray(values)
        except (OverflowError, ValueError, TypeError):
            array = None
    if array is None or array.ndim != 1 or array.dtype.kind not in "iu" or _too_large(array):
        array = np.asarray(_int_list(name, values), dtype=np.int64).reshape(-1)
    negative = np.flatnonzero(array < 0)
    if negative.size:
        index = int(negative[0])
        raise ValueError(f"{name}[{index}]: {int(array[index])} is negative")
    return array.astype(np.int64, copy=False)


_MAX_VALUE = 1 << 62  # page offsets and chunk numbers stay far below; int64 sums cannot overflow


def _too_large(array: np.ndarray) -> bool:
    return bool(array.size) and int(array.max()) >= _MAX_VALUE


def _int_list(name: str, values: Sequence[int]) -> list[int]:
    """The per-entry path (anything iterable, bools, numpy scalars), with its messages."""
    try:
        result = [operator.index(value) for value in values]
    except TypeError:
        raise ValueError(f"{name}: expected a sequence of integers, got {values!r}") from None
    for index, value in enumerate(result):
        if value >= _MAX_VALUE:
            raise ValueError(f"{name}[{index}]: {value} is too large")
    return result


def check_buffer(
    buffer: torch.Tensor, device: torch.device, offsets: np.ndarray, page_bytes: int, *, overlap_ok: bool
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
        _check_peer(buffer.device, device)
    size = buffer.numel()
    if offsets.size and int(offsets.max()) + page_bytes > size:
        past = np.flatnonzero(offsets + page_bytes > size)
        index = int(past[0])
        offset = int(offsets[index])
        raise ValueError(
            f"offsets[{index}]: page {offset}..{offset + page_bytes} ({page_bytes} bytes) "
            f"runs past the end of the {size}-byte buffer"
        )
    if not overlap_ok and offsets.size > 1:
        order = np.argsort(offsets, kind="stable")
        starts = offsets[order]
        clash = np.flatnonzero(starts[1:] < starts[:-1] + page_bytes)
        if clash.size:
            at = int(clash[0])
            before, after = int(order[at]), int(order[at + 1])
            raise ValueError(
                f"offsets[{before}] and offsets[{after}]: pages at {int(starts[at])} and "
                f"{int(starts[at + 1])} overlap ({page_bytes}-byte pages); gather needs one page per chunk"
            )


def _check_peer(buffer_device: torch.device, device: torch.device) -> None:
    """A buffer on another GPU than the KV cache's: one its kernels reach over peer access."""
    if buffer_device.type != "cuda" or device.type != "cuda":
        raise ValueError(
            f"buffer: on {buffer_device}; expected the CPU, the KV cache's device {device}, or another "
            "GPU that device has peer access to"
        )
    from . import peer

    reason = peer.why_not(device, buffer_device)
    if reason is not None:
        raise ValueError(f"buffer: on {buffer_device}, which the KV cache's {device} cannot reach: {reason}")
