"""Engine KV-cache layouts, seen through one canonical view.

Every layout is reduced, per engine layer, to `kv_factor` strided views of shape
`[num_blocks, block_size, kv_heads, head_dim]` (K then V, or the MLA latent with one
head). Both the torch reference and the Triton kernels work on these views only, so
this is the one module that knows how each engine arranges its cache.

- `expected_shape(spec)`: the named dimensions a layout's tensors must have.
- `layer_tensors(spec, kv_caches, layer)`: the named tensors that hold one layer.
- `num_blocks_of(spec, tensor)`: how many blocks one cache tensor holds.
- `kv_views(spec, kv_caches, layer, batch_index)`: the canonical views of one layer.

The `vllm` layout is vLLM's (0.33 and later) per-layer view `[blocks, kv_heads, block_size,
k|v content]`: K and V of a (block, head, token) side by side in the last dimension, under any
of the stride orders vLLM allocates (LBHNC, LBNHC, or block-outermost BLHNC / BLNHC, where one
block holds every layer: vLLM's cross-layer cache, still one view per layer).

The `vllm_rows` layout is the same tensor as vLLM's CPU attention backend reads it: each
(block, head)'s bytes hold the block's K rows, then its V rows (`[blocks, kv_heads, 2 *
block_size, head_dim]` over the `[blocks, kv_heads, block_size, 2 * head_dim]` view vLLM hands
the connector), which needs each (block, head)'s tokens and content dense (`LBHNC`, the one
stride order that backend takes). Which of the two a vLLM engine's tensors hold is its attention
backend's to say, never the shape's: the connector reads it (`kvstore_client.vllm.groups`).

The `hf` layout has no blocks: sequence position `p` is presented as block
`p // block_size`, token `p % block_size`, so a chunk's blocks are consecutive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvstore.shared.spec import KVSpec

KVCaches = Any  # list of tensors, one tensor (cross_layer), or list of (key, value) pairs (hf)


def expected_shape(spec: KVSpec) -> tuple[tuple[str, int | None], ...]:
    """(name, size) of each dimension of `spec.layout`'s tensors; size `None`: any."""
    bs = ("block_size", spec.block_size)
    heads, dim = ("kv_heads", spec.num_kv_heads), ("head_dim", spec.head_dim)
    shapes: dict[str, tuple[tuple[str, int | None], ...]] = {
        "flash_attn": (("k|v", 2), ("num_blocks", None), bs, heads, dim),
        "flashinfer": (("num_blocks", None), ("k|v", 2), bs, heads, dim),
        "cross_layer": (("num_blocks", None), ("num_layers", spec.num_layers), ("k|v", 2), bs, heads, dim),
        "mla": (("num_blocks", None), bs, ("latent_dim", spec.head_dim)),
        "vllm": (("num_blocks", None), heads, bs, ("k|v content", 2 * spec.head_dim)),
        "vllm_rows": (("num_blocks", None), heads, bs, ("k|v content", 2 * spec.head_dim)),
        "hf": (("batch", None), heads, ("seq", None), dim),
    }
    return shapes[spec.layout]


def shape_text(shape: Sequence[tuple[str, int | None]]) -> str:
    return "[" + ", ".join(name if size is None else f"{name}={size}" for name, size in shape) + "]"


def layer_tensors(spec: KVSpec, kv_caches: KVCaches, layer: int) -> list[tuple[str, Any]]:
    """(name for messages, object) of each tensor holding `layer`, unchecked."""
    if spec.layout == "cross_layer":
        return [("kv_caches", kv_caches)]
    entry = kv_caches[layer]
    if spec.layout == "hf":
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            return [(f"kv_caches[{layer}] (a (key, value) pair)", entry)]
        return [(f"kv_caches[{layer}] key", entry[0]), (f"kv_caches[{layer}] value", entry[1])]
    return [(f"kv_caches[{layer}]", entry)]


def num_blocks_of(spec: KVSpec, tensor: torch.Tensor) -> int:
    """Blocks (whole blocks of positions, for hf) in one checked cache tensor."""
    if spec.layout == "flash_attn":
        return tensor.shape[1]
    if spec.layout == "hf":
        return tensor.shape[2] // spec.block_size
    return tensor.shape[0]


def kv_views(spec: KVSpec, kv_caches: KVCaches, layer: int, batch_index: int = 0) -> tuple[torch.Tensor, ...]:
    """K and V (or the latent) of `layer`, each `[num_blocks, block_size, kv_heads, head_dim]`."""
    layout = spec.layout
    if layout == "flash_attn":
        cache = kv_caches[layer]
        return cache[0], cache[1]
    if layout == "flashinfer":
        cache = kv_caches[layer]
        return cache[:, 0], cache[:, 1]
    if layout == "cross_layer":
        return kv_caches[:, layer, 0], kv_caches[:, layer, 1]
    if layout == "mla":
        return (kv_caches[layer].unsqueeze(2),)
    if layout == "vllm":
        cache, dim = kv_caches[layer], spec.head_dim
        return cache[..., :dim].transpose(1, 2), cache[..., dim:].transpose(1, 2)
    if layout == "vllm_rows":
        return _row_views(kv_caches[layer], spec.block_size, spec.head_dim)
    key, value = kv_caches[layer]
    return _hf_blocks(spec, key, batch_index), _hf_blocks(spec, value, batch_index)


def _hf_blocks(spec: KVSpec, tensor: torch.Tensor, batch_index: int) -> torch.Tensor:
    by_position = tensor[batch_index].transpose(0, 1)  # [seq, heads, dim]
    num_blocks = by_position.shape[0] // spec.block_size
    # unflatten of one dimension is always a view, whatever the strides.
    return by_position[: num_blocks * spec.block_size].unflatten(0, (num_blocks, spec.block_size))


def _row_views(cache: torch.Tensor, block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a `vllm_rows` layer: per (block, head), `block_size` K rows then as many V
    rows, each `head_dim` wide. A cache whose (token, content) bytes are not dense raises."""
    if cache.stride(-1) != 1 or cache.stride(-2) != 2 * head_dim:
        raise ValueError(
            "kv_caches: the vllm_rows layout needs each (block, head)'s tokens and content dense "
            f"(strides [..., {2 * head_dim}, 1]), got strides {tuple(cache.stride())}"
        )
    rows = torch.as_strided(
        cache,
        (cache.shape[0], cache.shape[1], 2, block_size, head_dim),
        (cache.stride(0), cache.stride(1), block_size * head_dim, head_dim, 1),
    )
    return rows[:, :, 0].transpose(1, 2), rows[:, :, 1].transpose(1, 2)
