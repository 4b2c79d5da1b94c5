"""How a worker's KV-cache tensors hold each group's bytes, read from the attention backend vLLM
chose for the group, never assumed from their shape.

vLLM 0.33 hands the connector one `[blocks, heads, block_size, content]` view per layer whatever
the backend, but backends read the content differently: the GPU backends (FlashAttention,
Triton, FlashInfer, FlexAttention) keep a token's K and V side by side in it (kvstore's `vllm`
layout), while the CPU backend keeps each (block, head)'s K rows, then its V rows
(`vllm_rows`); MLA backends keep one latent per token (`mla`, the heads dimension of one
dropped). Pages are the same canonical bytes whichever wrote them. A backend not listed here is
refused at start-up by name: a layout guessed wrong would be a hit with wrong bytes.

A Mamba group's layers have no attention backend: vLLM hands each a raw `[blocks, 1, 1, page]`
byte view whose blocks hold the layer's states packed from the block's first byte (and padding
after them); a state page takes the states' bytes of each block (`mla` layout, one "token").

An attention backend may split vLLM's blocks into kernel blocks (a backend capped at 64 tokens
under `--block-size 128`): the tensors then hold `ratio` kernel blocks per vLLM block, which
`GroupCache.kernel_blocks` turns vLLM's block ids into.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvstore.shared.spec import KVSpec
from kvstore_client.vllm.groups import MAMBA, MLA, Group

KV_SIDE_BY_SIDE = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION"})
KV_ROWS = frozenset({"CPU_ATTN"})
MLA_LATENT = frozenset(
    {"FLASHMLA", "FLASH_ATTN_MLA", "TRITON_MLA", "CUTLASS_MLA", "FLASHINFER_MLA", "CPU_MLA"}
)


@dataclass(frozen=True)
class GroupCache:
    """One group's tensors as the kernels take them, with the layout and block size they hold."""

    group: Group
    spec: KVSpec  # the group's page spec with the layout read and the kernel block size
    tensors: tuple[torch.Tensor, ...]
    ratio: int  # kernel blocks per vLLM block

    def kernel_blocks(self, block_ids: Iterable[int]) -> list[int]:
        """vLLM's block ids as the tensors' (kernel) block ids."""
        ratio = self.ratio
        if ratio == 1:
            return list(block_ids)
        return [block * ratio + part for block in block_ids for part in range(ratio)]


def backend_name(vllm_config: Any, group: Group) -> str:
    """The name of the one attention backend the group's layers use, or a ValueError."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    model = vllm_config.model_config.model
    try:
        backends = get_current_attn_backends(vllm_config, list(group.layer_names))
    except Exception as exc:  # no layers registered and no default backend for this platform
        raise ValueError(
            f"KVStoreConnector: {model}: cannot tell which attention backend layer(s) "
            f"{group.layer_names[0]} use ({exc}); their KV layout is not assumed"
        ) from exc
    names = sorted({backend.get_name() for backend in backends})
    if len(names) != 1:
        raise ValueError(
            f"KVStoreConnector: {model}: layer(s) {group.layer_names[0]}... of one KV-cache group use "
            f"several attention backends ({', '.join(names)})"
        )
    return names[0]


def group_cache(
    vllm_config: Any, group: Group, spec: KVSpec, kv_caches: dict[str, torch.Tensor]
) -> GroupCache:
    """The group's tensors from `kv_caches`, checked against the layout its backend reads."""
    model = vllm_config.model_config.model
    missing = [name for name in group.layer_names if name not in kv_caches]
    if missing:
        raise ValueError(f"kv_caches: no tensor for layer(s) {', '.join(missing[:4])}")
    tensors = [kv_caches[name] for name in group.layer_names]
    if group.kind == MAMBA:
        return _state_cache(model, group, spec, tensors)
    backend = backend_name(vllm_config, group)
    if group.kind == MLA:
        if backend not in MLA_LATENT:
            raise _unknown(model, group, backend, MLA_LATENT)
        layout, width = "mla", spec.head_dim
    elif backend in KV_SIDE_BY_SIDE:
        layout, width = "vllm", 2 * spec.head_dim
    elif backend in KV_ROWS:
        layout, width = "vllm_rows", 2 * spec.head_dim
    else:
        raise _unknown(model, group, backend, KV_SIDE_BY_SIDE | KV_ROWS)
    first = tensors[0]
    heads = 1 if group.kind == MLA else spec.num_kv_heads
    if first.dim() != 4 or first.shape[1] != heads or first.shape[3] != width:
        raise ValueError(
            f"KVStoreConnector: {model}: layer {group.layer_names[0]}'s cache is "
            f"{list(first.shape)}; the {backend} backend's {layout} layout needs "
            f"[blocks, {heads}, block_size, {width}]"
        )
    kernel_block = int(first.shape[2])
    if kernel_block <= 0 or group.block_size % kernel_block:
        raise ValueError(
            f"KVStoreConnector: {model}: kernel blocks of {kernel_block} tokens do not divide vLLM's "
            f"blocks of {group.block_size}"
        )
    want = getattr(torch, spec.dtype)
    if first.dtype != want:  # vLLM keeps fp8 caches as bytes
        if first.element_size() != want.itemsize:
            raise ValueError(
                f"KVStoreConnector: {model}: layer {group.layer_names[0]}'s cache holds "
                f"{first.dtype}, not the {spec.dtype} of kv_cache_dtype"
            )
        tensors = [tensor.view(want) for tensor in tensors]
    if group.kind == MLA:
        tensors = [tensor.squeeze(1) for tensor in tensors]
    return GroupCache(
        group,
        replace(spec, layout=layout, block_size=kernel_block),
        tuple(tensors),
        group.block_size // kernel_block,
    )


def _state_cache(model: Any, group: Group, spec: KVSpec, tensors: list[torch.Tensor]) -> GroupCache:
    """A Mamba group's raw block views as `[blocks, 1, state bytes]` byte views."""
    views = []
    for name, tensor in zip(group.layer_names, tensors, strict=True):
        if (
            tensor.dim() != 4
            or tensor.shape[1:3] != (1, 1)
            or tensor.shape[3] < spec.head_dim
            or tensor.element_size() != 1
        ):
            raise ValueError(
                f"KVStoreConnector: {model}: Mamba layer {name}'s cache is {list(tensor.shape)} of "
                f"{tensor.dtype}; kvstore reads raw [blocks, 1, 1, >= {spec.head_dim}] byte views"
            )
        views.append(tensor.view(torch.uint8)[:, 0, :, : spec.head_dim])
    return GroupCache(group, spec, tuple(views), 1)


def layer_scales(vllm_config: Any, names: Sequence[str]) -> list[tuple[str, float, float]]:
    """(name, k scale, v scale) of each attention layer, or a ValueError naming one without them."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, names)  # type: ignore[type-abstract]
    scales = []
    for name in names:
        layer = layers.get(name)
        k, v = getattr(layer, "_k_scale_float", None), getattr(layer, "_v_scale_float", None)
        if not isinstance(k, float) or not isinstance(v, float):
            raise ValueError(
                f"KVStoreConnector: cannot read the fp8 k/v scales of layer {name}; its pages could "
                "not be told from pages written under other scales"
            )
        scales.append((name, k, v))
    return scales


def _unknown(model: Any, group: Group, backend: str, known: Iterable[str]) -> ValueError:
    return ValueError(
        f"KVStoreConnector: {model}: layer(s) {group.layer_names[0]}... use the {backend} attention "
        f"backend, whose KV layout kvstore does not know ({group.kind} layers are read from "
        f"{', '.join(sorted(known))})"
    )
