"""What the connector stores of each of a vLLM engine's KV-cache groups, read from vLLM's own specs.

vLLM (0.33, with its hybrid allocator) gives a model one group per kind of layer and block table:
full attention, MLA, sliding window, Mamba state. Each group the connector serves is a `Group`
with a namespace of its own (`PageSpec.layer_ids` names its layers), so a hybrid model's hit
can restore each group from its own pages:

- `full`: every chunk of the prompt, K and V of the group's layers (as a one-group model).
- `mla`: every chunk, the latent (`kv_lora_rank + rope dim` values per token) of the group's
  layers. The latent is the same on every TP rank: one copy, keyed with tp_rank 0 of 1, which
  TP rank 0 stores and every rank loads (`Group.replicated`).
- `sliding` (window w): every chunk is stored, since any chunk boundary may be where a later
  prompt resumes; a prompt resumed at token t loads only the chunks of tokens [t - (w - 1), t),
  the ones its next token attends to (vLLM gives those layers blocks for the window alone). A
  chunk's page holds the tokens of the window at its own end; the rest of its positions are
  zeros (vLLM may have freed those blocks before the chunk was complete) and are never loaded.

- `chunked` (chunked-local attention, Llama 4's, chunks of c tokens): as `sliding`, with the
  window of a resume point t the tokens of its attention chunk, [c * (t // c), t).
- `mamba` (Mamba, linear attention: vLLM's `MambaSpec` with `mamba_cache_mode="align"`): no KV
  per token but one fixed-size state per layer, which vLLM keeps at block boundaries. A state
  page holds the group's layers' states after a chunk's last token (the raw bytes of each
  layer's block, its states packed as vLLM packs them), keyed by that chunk's key in the
  group's namespace, whose `state` text names the format. vLLM says which boundary states a
  step committed and in which block (`boundary_state_offloads`): those are stored. A hit must
  end on a boundary whose state is stored, so a model with such a group has chunks of its Mamba
  block size (`chunk_tokens`), and a lookup ends at the last stored state within what every other
  group can restore. States sharded across TP ranks are stored per rank; replicated ones once.

Anything else (Mamba state outside align mode, sliding-window MLA, quantizations whose
bytes carry their own scales, an attention kind a later vLLM adds) is refused at start-up by
`read_groups`, naming the layer kind and the model: never a wrong hit, never a crash mid-serving.
The page dtype is the cache's (`cache_dtype`: auto is the model's dtype; fp8, fp8_e4m3 and
fp8_e5m2 are one byte a value) and an fp8 cache's per-tensor k/v scales are part of the
namespace (`scales_text`), so pages written under other scales are never a hit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from kvstore.shared.spec import KVSpec

FULL, MLA, SLIDING, CHUNKED, MAMBA = "full", "mla", "sliding", "chunked", "mamba"
# vLLM's cache dtypes a page can hold ("auto": the model's dtype)
CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True)
class Group:
    """One KV-cache group the connector serves."""

    index: int  # vLLM's group id: the position of its block ids in a request's block table
    kind: str  # FULL, MLA, SLIDING, CHUNKED or MAMBA
    layer_names: tuple[str, ...]
    layer_ids: tuple[int, ...]  # the model's layer index of each
    block_size: int  # vLLM's (the scheduler's) block size for this group
    num_kv_heads: int
    head_dim: int  # MLA: the latent width; MAMBA: a layer's state bytes
    dtype: str
    retained: int = 0  # SLIDING: tokens before a resume point its layers attend to (w - 1)
    attention_chunk: int = 0  # CHUNKED: the tokens of an attention chunk
    state: str = ""  # MAMBA: the state's format (its tensors' dtypes and shapes)
    shared: bool = False  # MAMBA: every TP rank holds the whole state

    @property
    def windowed(self) -> bool:
        """Whether a resumed request's layers of this group attend to a window of tokens only."""
        return self.kind in (SLIDING, CHUNKED)

    @property
    def frees_blocks(self) -> bool:
        """Whether vLLM may free or move blocks of this group while the request runs (a window's
        blocks behind it, a state's after the next step): a save must be read before the next
        forward."""
        return self.windowed or self.kind == MAMBA

    def window_start(self, end: int) -> int:
        """The first token a request resumed at token `end` attends to in these layers."""
        if self.kind == SLIDING:
            return max(0, end - self.retained)
        if self.kind == CHUNKED:
            return end // self.attention_chunk * self.attention_chunk
        return 0

    @property
    def replicated(self) -> bool:
        """Whether every TP rank holds the same bytes (one copy is stored for all)."""
        return self.kind == MLA or self.shared

    def spec(
        self,
        config: Any,
        model: str,
        tp_rank: int,
        tp_size: int,
        *,
        whole: bool,
        scales: str = "",
        chunk_tokens: int | None = None,
    ) -> KVSpec:
        """The KVSpec of this group on TP rank `tp_rank` (`whole`: the model's only group, whose
        namespace is a whole model's; layout: the `vllm` default, the worker sets the one read;
        `chunk_tokens`: None for the daemon's)."""
        if self.replicated:
            tp_rank, tp_size = 0, 1
        if self.kind == MAMBA:
            return KVSpec(
                model=model,
                num_layers=len(self.layer_ids),
                num_kv_heads=1,
                head_dim=self.head_dim,
                dtype="uint8",
                block_size=1,
                layout="mla",
                chunk_tokens=chunk_tokens,
                tp_rank=tp_rank,
                tp_size=tp_size,
                salt=config.salt,
                layer_ids=self.layer_ids,
                state=self.state,
            )
        return KVSpec(
            model=model,
            num_layers=len(self.layer_ids),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            block_size=self.block_size,
            layout="mla" if self.kind == MLA else "vllm",
            chunk_tokens=chunk_tokens,
            tp_rank=tp_rank,
            tp_size=tp_size,
            salt=config.salt,
            layer_ids=() if whole else self.layer_ids,
            scales=scales,
        )


def read_groups(vllm_config: Any, kv_cache_config: Any) -> list[Group]:
    """The groups of the engine `vllm_config` describes, or a ValueError naming what the
    connector does not serve (a layer kind, a cache dtype, pipeline stages)."""
    model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
    model = str(model_config.model)
    if parallel.pipeline_parallel_size != 1:
        raise ValueError(
            "KVStoreConnector: pipeline parallelism is not supported (each stage would need its own "
            "layer range in the namespace); run with pipeline_parallel_size=1"
        )
    dtype = page_dtype(vllm_config)
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not groups:
        raise ValueError(f"KVStoreConnector: {model} has no KV-cache groups (an attention-free model)")
    served = []
    for index, group in enumerate(groups):
        if not getattr(group, "enable_kv_transfer", True):
            continue
        spec = group.kv_cache_spec
        kind = _kind(spec, group, model)
        names = tuple(group.layer_names)
        if kind == MAMBA:
            served.append(_mamba_group(index, spec, names, model))
            continue
        heads = 1 if kind == MLA else int(spec.num_kv_heads)
        served.append(
            Group(
                index=index,
                kind=kind,
                layer_names=names,
                layer_ids=tuple(_layer_index(name, model) for name in names),
                block_size=int(spec.block_size),
                num_kv_heads=heads,
                head_dim=int(spec.head_size),
                dtype=dtype,
                retained=int(spec.sliding_window) - 1 + int(getattr(spec, "extra_retained_tokens", 0))
                if kind == SLIDING
                else 0,
                attention_chunk=int(spec.attention_chunk_size) if kind == CHUNKED else 0,
            )
        )
    if not served:
        raise ValueError(f"KVStoreConnector: {model} has no KV-cache group that can be transferred")
    return served


def _mamba_group(index: int, spec: Any, names: tuple[str, ...], model: str) -> Group:
    import torch

    dtypes = [str(dtype).removeprefix("torch.") for dtype in spec.dtypes]
    shapes = list(zip(spec.shapes, dtypes, strict=True))
    sizes = [math.prod(shape) * getattr(torch, dtype).itemsize for shape, dtype in shapes]
    parts = ";".join(f"{dtype}{list(shape)}" for shape, dtype in shapes)
    kind = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    return Group(
        index=index,
        kind=MAMBA,
        layer_names=names,
        layer_ids=tuple(_layer_index(name, model) for name in names),
        block_size=int(spec.block_size),
        num_kv_heads=1,
        head_dim=sum(sizes),
        dtype="uint8",
        state=f"vllm-{kind.lower()}:{parts}",
        shared=bool(getattr(spec, "tp_replicated", False)),
    )


def chunk_tokens_of(groups: Sequence[Group], model: str) -> int | None:
    """The chunk size a model's namespaces take: a model with Mamba state has chunks of its Mamba
    block size (a hit must end where a state is kept); None for others (the daemon's)."""
    sizes = {group.block_size for group in groups if group.kind == MAMBA}
    if not sizes:
        return None
    if len(sizes) > 1:
        raise ValueError(f"KVStoreConnector: {model}: Mamba groups of several block sizes ({sorted(sizes)})")
    chunk = sizes.pop()
    for group in groups:
        if chunk % group.block_size:
            raise ValueError(
                f"KVStoreConnector: {model}: the Mamba block size {chunk} is not a multiple of "
                f"layer(s) {group.layer_names[0]}'s block size {group.block_size}"
            )
    return chunk


def page_dtype(vllm_config: Any) -> str:
    """The page dtype of the engine's KV cache, or a ValueError naming the cache dtype."""
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype == "auto":
        return str(vllm_config.model_config.dtype).removeprefix("torch.")
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(
            f"KVStoreConnector: kv_cache_dtype {cache_dtype!r} is not supported (its pages carry "
            f"scales of their own); use auto, {', '.join(CACHE_DTYPES)}"
        )
    if getattr(vllm_config.cache_config, "calculate_kv_scales", False):
        raise ValueError(
            "KVStoreConnector: calculate_kv_scales makes each engine's fp8 scales from its first "
            "batch, so two engines' pages of one prompt differ; use the checkpoint's scales"
        )
    return CACHE_DTYPES[cache_dtype]


def is_quantized(vllm_config: Any) -> bool:
    return str(vllm_config.cache_config.cache_dtype) in CACHE_DTYPES


def scales_text(layers: Sequence[tuple[str, float, float]]) -> str:
    """The namespace's text for per-layer (name, k scale, v scale): a digest of their exact values."""
    text = ";".join(f"{name}={k.hex()},{v.hex()}" for name, k, v in layers)
    return f"kv-per-tensor:{len(layers)}:{xxhash.xxh3_128_hexdigest(text.encode())}"


def _kind(spec: Any, group: Any, model: str) -> str:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    kind_name = type(spec).__name__
    where = f"layer(s) {', '.join(list(group.layer_names)[:3])}"
    if type(spec) is MLAAttentionSpec:
        if spec.cache_dtype_str not in (None, "auto", "fp8", "fp8_e4m3", "fp8_e5m2") or spec.alignment:
            raise ValueError(
                f"KVStoreConnector: {model}: {where} use an MLA cache of format "
                f"{spec.cache_dtype_str!r}, which kvstore does not serve"
            )
        return MLA
    if type(spec) is SlidingWindowSpec:
        return SLIDING
    if type(spec) is ChunkedLocalAttentionSpec:
        return CHUNKED
    if type(spec) is MambaSpec:
        if spec.mamba_cache_mode != "align":
            raise ValueError(
                f"KVStoreConnector: {model}: {where} keep Mamba state in mamba_cache_mode "
                f"{spec.mamba_cache_mode!r}, where no state is kept at block boundaries; run with "
                "--enable-prefix-caching --mamba-cache-mode align"
            )
        if spec.num_speculative_blocks:
            raise ValueError(
                f"KVStoreConnector: {model}: {where} keep speculative Mamba states (speculative "
                "decoding), which kvstore does not serve"
            )
        return MAMBA
    if type(spec) is FullAttentionSpec and spec.attention_chunk_size is None:
        # a sliding window vLLM counts as full attention (its hybrid allocator off) is stored as
        # full attention: every block of it is allocated and loaded
        if spec.head_size_v != spec.head_size or spec.page_size_padded is not None:
            raise ValueError(
                f"KVStoreConnector: {model}: {where} have K and V of different widths or padded "
                "pages, which kvstore does not serve"
            )
        return FULL
    reason = {
        SlidingWindowMLASpec: "sliding-window MLA",
    }.get(type(spec), kind_name)
    raise ValueError(
        f"KVStoreConnector: {model}: {where} are {reason} ({kind_name}), which kvstore does not "
        "serve; run without the connector, or with --disable-hybrid-kv-cache-manager where vLLM "
        "allows it"
    )


def _layer_index(name: str, model: str) -> int:
    numbers = re.findall(r"\.(\d+)(?=\.|$)", "." + name)
    if not numbers:
        raise ValueError(f"KVStoreConnector: {model}: layer {name!r} has no layer index in its name")
    return int(numbers[0])
