"""KV specs and page geometry, shared by the daemon and the client.

- `PageSpec`: everything that changes the bytes of a stored page (model, dtype,
  stored layers, heads, head dim, page format, chunk size, TP rank/size, salt).
  Its namespace digest keys every page; the daemon knows only this.
- `KVSpec`: a `PageSpec` plus how the engine lays KV out in GPU memory
  (`layout`, `block_size`). Engines with different layouts share pages.

Two kinds of pages beyond a whole model's KV:

- A layer range (`first_layer`, `stop_layer`): the KV of engine layers `[first, stop)` only.
  With `weights`, the namespace names the weights instead of the model: `weights` lists, from
  layer 0 up to `stop`, `(stop of a range, weights id)`, so the KV of layers `[0, b)` of two
  models that share those weights (a progressive model's stages) is one set of pages, and a
  model that changed any layer before `stop` can never read them (the KV of layer `l` depends
  on the weights of every layer up to `l`, and on the embedding, which the first range's id
  must cover).
- A group of layers (`layer_ids`): the KV of those engine layers only, in that order
  (`num_layers` of them): one of a hybrid model's KV-cache groups (its sliding-window layers,
  say), whose pages are loaded apart from the other groups'.
- Quantized caches (fp8): `scales` names the scales that give the bytes their meaning, so pages
  written under other scales are another namespace, never a hit.
- Hidden states (`hidden_layer=b`): the residual stream entering layer `b`, `[token][hidden]`
  in the model's dtype, one "layer" of a latent-format page (`num_kv_heads=1`, `head_dim` the
  hidden size), keyed by the weights up to `b`.
- Recurrent state (`state`, the text naming its format): per stored layer, the fixed-size state
  a linear-attention or Mamba layer holds after the chunk's last token, as raw bytes (`uint8`,
  a latent-format page of one "token" `head_dim` bytes wide, whatever `chunk_tokens` is). Its
  key is the chunk's, in the state's own namespace: the state after exactly that prefix.

A page is one chunk of one namespace, laid out layer-major:
`[stored_layer][k|v][token][kv_head][head_dim]`, or `[stored_layer][token][latent]`
for MLA, so any range of stored layers is one contiguous span.

`PageSpec` is made in `spec_page`, the checks of single fields (`dtype_name`, `check_name`, the
limits) in `spec_fields`; every name is importable from here.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvstore.shared.spec_fields import (
    DTYPE_ITEMSIZE,
    MAX_NAME_BYTES,
    MAX_SCALES_BYTES,
    SPEC_LIMITS,
    check_name,
    check_positive,
    check_weights,
    dtype_name,
)
from kvstore.shared.spec_page import PAGE_LAYOUT_VERSION, PageSpec

__all__ = [
    "KVSpec",
    "PageSpec",
    "LAYOUTS",
    "PAGE_LAYOUT_VERSION",
    "DTYPE_ITEMSIZE",
    "MAX_NAME_BYTES",
    "MAX_SCALES_BYTES",
    "SPEC_LIMITS",
    "check_name",
    "dtype_name",
]

LAYOUTS = ("flash_attn", "flashinfer", "cross_layer", "mla", "hf", "vllm", "vllm_rows")


@dataclass(frozen=True)
class KVSpec:
    """A worker's KV cache: the page spec plus the engine's GPU layout.

    `chunk_tokens=None` takes the daemon's configured chunk size at connect.
    """

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: Any
    block_size: int = 16
    layout: str = "flash_attn"
    chunk_tokens: int | None = None
    kv_sharing: Mapping[int, int] = field(default_factory=dict)
    tp_rank: int = 0
    tp_size: int = 1
    salt: str = ""
    first_layer: int = 0  # see PageSpec: the layers a page holds, the weights that key them
    stop_layer: int = 0
    weights: Sequence[tuple[int, str]] = ()  # kept as a tuple
    hidden_layer: int = -1
    layer_ids: Sequence[int] = ()  # see PageSpec: a group of the engine's layers, kept as a tuple
    scales: str = ""
    state: str = ""  # see PageSpec: a recurrent state page (layout "mla", block_size 1, uint8)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        object.__setattr__(self, "kv_sharing", dict(self.kv_sharing))
        object.__setattr__(self, "weights", check_weights(self.weights))
        object.__setattr__(self, "stop_layer", self.stop_layer or self.num_layers)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        check_positive("block_size", self.block_size)
        if self.chunk_tokens is not None:
            check_positive("chunk_tokens", self.chunk_tokens)
            if self.chunk_tokens % self.block_size:
                raise ValueError(
                    f"chunk_tokens: {self.chunk_tokens} is not a multiple of block_size {self.block_size}"
                )
        if self.state and (self.layout != "mla" or self.block_size != 1):
            raise ValueError("state: a state cache is one state per block (layout='mla', block_size=1)")
        self.page_for(self.chunk_tokens or self.block_size)  # validates the page fields

    def page_for(self, chunk_tokens: int) -> PageSpec:
        """The page spec of chunks of `chunk_tokens` tokens (`page`: of this spec's own)."""
        shared = {f.name: getattr(self, f.name) for f in fields(PageSpec) if hasattr(self, f.name)}
        return PageSpec(
            **shared
            | {
                "chunk_tokens": chunk_tokens,
                "latent": self.layout == "mla",
                "kv_sharing": tuple(self.kv_sharing.items()),
            }
        )

    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        *,
        model: str | None = None,
        dtype: Any = None,
        block_size: int = 16,
        chunk_tokens: int | None = None,
        kv_sharing: Mapping[int, int] | None = None,
        salt: str = "",
        weights: Any = (),
    ) -> KVSpec:
        """The spec of a transformers model's DynamicCache (`layout="hf"`), from its config.

        `model` names the weights (default: the config's `name_or_path`); two models with the
        same name share pages, so give random-weight or fine-tuned models their own name or
        `salt`. `dtype` defaults to the config's. `weights`: (stop layer, weights id) per layer
        range, for a model whose layers before some boundary are another's (`KVSpec.layer_range`).
        """
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        name = model or getattr(config, "name_or_path", "") or getattr(text, "name_or_path", "")
        if not name:
            raise ValueError("model: the config has no name_or_path; pass model='...' naming these weights")
        heads = _config_int(text, "num_attention_heads")
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or _config_int(text, "hidden_size") // heads
        dtype = dtype if dtype is not None else getattr(config, "dtype", None) or "float32"
        return cls(
            model=name,
            num_layers=_config_int(text, "num_hidden_layers"),
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            dtype=dtype,
            block_size=block_size,
            layout="hf",
            chunk_tokens=chunk_tokens,
            kv_sharing=dict(kv_sharing or {}),
            salt=salt,
            weights=tuple(tuple(entry) for entry in weights),
        )

    @property
    def stored_layers(self) -> tuple[int, ...]:
        """Engine layers whose KV a page holds (without building the page spec)."""
        return tuple(
            layer for layer in range(self.first_layer, self.stop_layer) if layer not in self.kv_sharing
        )

    def layer_range(self, first: int, stop: int) -> KVSpec:
        """This spec's pages cut to engine layers `[first, stop)`, keyed by the weights up to `stop`
        (which must end a range of `weights`, when it has them)."""
        return replace(self, first_layer=first, stop_layer=stop, weights=self._weights_to(stop))

    def hidden_states(self, layer: int, hidden_size: int, block_size: int | None = None) -> KVSpec:
        """The spec of the hidden states entering `layer`, `[token][hidden_size]` in this spec's
        dtype, keyed by the weights up to `layer`. Its cache is latent-format (`layout="mla"`):
        one tensor `[blocks, block_size, hidden_size]`, a `[seq, hidden]` tensor cut into blocks."""
        check_positive("hidden_size", hidden_size)
        return KVSpec(
            model=self.model,
            num_layers=1,
            num_kv_heads=1,
            head_dim=hidden_size,
            dtype=self.dtype,
            block_size=block_size or self.block_size,
            layout="mla",
            chunk_tokens=self.chunk_tokens,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            salt=self.salt,
            weights=self._weights_to(layer),
            hidden_layer=layer,
        )

    def _weights_to(self, stop: int) -> tuple[tuple[int, str], ...]:
        if not self.weights:
            return ()
        kept = tuple(entry for entry in self.weights if entry[0] <= stop)
        if not kept or kept[-1][0] != stop:
            ends = ", ".join(str(end) for end, _ in self.weights)
            raise ValueError(f"layer {stop}: not where a range of weights ends ({ends})")
        return kept

    @functools.cached_property
    def page(self) -> PageSpec:
        """The page spec (made once: a transfer asks for it several times per call)."""
        if self.chunk_tokens is None:
            raise ValueError("chunk_tokens: not set; connect to a daemon or pass chunk_tokens")
        return self.page_for(self.chunk_tokens)

    @property
    def blocks_per_chunk(self) -> int:
        return self.page.page_tokens // self.block_size

    def with_chunk_tokens(self, chunk_tokens: int) -> KVSpec:
        return replace(self, chunk_tokens=chunk_tokens)


def _config_int(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.{name}: expected a positive integer, got {value!r}")
    return value
