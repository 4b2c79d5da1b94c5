"""The SGLang host pools the HiCache backend serves (SGLang 0.5.23), and how it sees them.

- `host_pool(pool, config, salt)`: the pool as the backend serves it (`HostPool`: its pages'
  spec, its buffers as per-layer views, the shape of one flat page); a ValueError naming what
  is not served. `mha_pool` / `mla_pool`: the same for a pool known to be MHA / MLA.
- `layer_views(buffer, layout, page_size)`: an MHA pool's buffer as `[k|v][page][token][head][dim]`
  views per layer; `mla_layer_views`: an MLA pool's as `[page][token][latent]` views.
- `page_shape(...)` / `mla_page_shape(...)`: the shape SGLang gives one page of a layout.
- `MHA_LAYOUTS`, `MLA_LAYOUTS`: the layouts served.

Views, never copies: `kvstore_kernels` gathers and scatters the pages from the pool itself.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from kvstore.shared.spec import KVSpec

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_unified")
MLA_POOL_MODULE = "sglang.srt.mem_cache.pool_host.mla"


def _unserved_layout(kind: str, served: Sequence[str], layout: str) -> ValueError:
    served_text = ", ".join(served)
    return ValueError(f"layout: kvstore serves SGLang {kind} host pools of {served_text}; got {layout!r}")


def layer_views(buffer: torch.Tensor, layout: str, page_size: int) -> list[torch.Tensor]:
    """An MHA pool's `kv_buffer` (of `layout`) as one `[k|v][page][token][head][dim]` view per
    layer, the `flash_attn` layout with one block per SGLang page. Views, never copies."""
    if layout == "layer_first":  # [2, L, S, H, D]
        return [buffer[:, layer].unflatten(1, (-1, page_size)) for layer in range(buffer.shape[1])]
    if layout == "page_first":  # [2, S, L, H, D]
        return [buffer[:, :, layer].unflatten(1, (-1, page_size)) for layer in range(buffer.shape[2])]
    if layout == "page_first_direct":  # [2, P, L, ps, H, D]
        return [buffer[:, :, layer] for layer in range(buffer.shape[2])]
    if layout == "page_head":  # [2, P, H, ps, L, D]
        return [buffer[:, :, :, :, layer].transpose(2, 3) for layer in range(buffer.shape[4])]
    raise _unserved_layout("MHA", MHA_LAYOUTS, layout)


def mla_layer_views(buffer: torch.Tensor, layout: str, page_size: int) -> list[torch.Tensor]:
    """An MLA pool's `kv_buffer` (of `layout`) as one `[page][token][latent]` view per layer, the
    `mla` layout with one block per SGLang page. Views, never copies."""
    if layout == "layer_first":  # [L, S, 1, D]
        return [buffer[layer, :, 0].unflatten(0, (-1, page_size)) for layer in range(buffer.shape[0])]
    if layout == "page_first":  # [S, L, 1, D]
        return [buffer[:, layer, 0].unflatten(0, (-1, page_size)) for layer in range(buffer.shape[1])]
    if layout == "page_first_direct":  # [P, L, ps, 1, D]
        return [buffer[:, layer, :, 0] for layer in range(buffer.shape[1])]
    if layout == "page_unified":  # [P, L, ps, D]
        return [buffer[:, layer] for layer in range(buffer.shape[1])]
    raise _unserved_layout("MLA", MLA_LAYOUTS, layout)


def page_shape(layout: str, layers: int, page_size: int, heads: int, head_dim: int) -> tuple[int, ...]:
    """The shape SGLang gives one MHA page of `layout` (`get_data_page(flat=False)`)."""
    shapes = {
        "layer_first": (2, layers, page_size, heads, head_dim),
        "page_first": (2, page_size, layers, heads, head_dim),
        "page_first_direct": (2, 1, layers, page_size, heads, head_dim),
        "page_head": (2, 1, heads, page_size, layers, head_dim),
    }
    return shapes[layout]


def mla_page_shape(layout: str, layers: int, page_size: int, latent: int) -> tuple[int, ...]:
    """The shape of one MLA page of `layout` (`get_data_page(flat=False)`; `page_unified`: its
    page block, which SGLang 0.5.23 never hands out as a flat page)."""
    shapes = {
        "layer_first": (layers, page_size, 1, latent),
        "page_first": (page_size, layers, 1, latent),
        "page_first_direct": (1, layers, page_size, 1, latent),
        "page_unified": (1, layers, page_size, latent),
    }
    return shapes[layout]


class HostPool(NamedTuple):
    """What the backend serves of one SGLang host pool: its pages' spec, and how a buffer of its
    layout (the pool's, or one flat page of the older calls) is seen as per-layer views."""

    spec: KVSpec
    views: Callable[[torch.Tensor], list[torch.Tensor]]
    page_shape: tuple[int, ...]


def _is_mla_pool(pool: Any) -> bool:
    # An MLA pool exists only once SGLang imported its module; importing it here would cost an
    # MHA instance seconds (and, on CUDA, sgl_kernel) for nothing.
    module = sys.modules.get(MLA_POOL_MODULE)
    return module is not None and isinstance(pool, module.MLATokenToKVPoolHost)


def mha_pool(pool: Any, config: Any, model: str, salt: str) -> HostPool:
    """The pool's K and V pages, under this TP rank's namespace (each rank holds its own heads)."""
    layout, page_size = pool.layout, int(pool.page_size)
    if layout not in MHA_LAYOUTS:
        raise _unserved_layout("MHA", MHA_LAYOUTS, layout)
    spec = KVSpec(
        model=model,
        num_layers=int(pool.layer_num),
        num_kv_heads=int(pool.head_num),
        head_dim=int(pool.head_dim),
        dtype=pool.dtype,
        block_size=page_size,
        layout="flash_attn",
        chunk_tokens=page_size,
        tp_rank=int(getattr(config, "tp_rank", 0)),
        tp_size=int(getattr(config, "tp_size", 1)),
        salt=salt,
    )
    shape = page_shape(layout, spec.num_layers, page_size, spec.num_kv_heads, spec.head_dim)
    return HostPool(spec, lambda buffer: layer_views(buffer, layout, page_size), shape)


def mla_pool(pool: Any, config: Any, model: str, salt: str) -> HostPool:
    """The pool's latent pages, under a namespace of no TP rank (every rank holds the same)."""
    layout, page_size = pool.layout, int(pool.page_size)
    if layout not in MLA_LAYOUTS:
        raise _unserved_layout("MLA", MLA_LAYOUTS, layout)
    if getattr(pool, "kv_buffer", None) is None:
        raise ValueError("mem_pool_host: an allocator-only MLA host pool (no host buffer) is not served")
    if getattr(pool, "_layer_shard_enabled", False):
        raise ValueError(
            "mem_pool_host: a layer-sharded MLA host pool (each rank holds some of the layers) is not served"
        )
    dcp_size = max(int(getattr(pool, "dcp_size", 1)), int(getattr(config, "dcp_size", 1) or 1))
    if dcp_size > 1:
        raise ValueError(
            f"dcp_size: decode context parallelism ({dcp_size} ranks, each holding a share of a page's "
            "tokens) is not served"
        )
    spec = KVSpec(
        model=model,
        num_layers=int(pool.layer_num),
        num_kv_heads=1,
        head_dim=int(pool.kv_cache_dim),
        dtype=pool.dtype,
        block_size=page_size,
        layout="mla",
        chunk_tokens=page_size,
        tp_rank=0,
        tp_size=1,
        salt=salt,
    )
    shape = mla_page_shape(layout, spec.num_layers, page_size, spec.head_dim)
    return HostPool(spec, lambda buffer: mla_layer_views(buffer, layout, page_size), shape)


def host_pool(pool: Any, config: Any, salt: str) -> HostPool:
    """The pool as the backend serves it; a ValueError naming what is not served."""
    model = getattr(config, "model_name", None) or "sglang"
    if _is_mla_pool(pool):
        return mla_pool(pool, config, model, salt)
    if getattr(config, "is_mla_model", False) or not hasattr(pool, "head_num"):
        raise ValueError(
            f"mem_pool_host: kvstore serves SGLang's MHA host pools and its MLA host pool "
            f"(MLATokenToKVPoolHost); got a {type(pool).__name__}"
        )
    return mha_pool(pool, config, model, salt)
