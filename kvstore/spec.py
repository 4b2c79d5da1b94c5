"""KV specs and page geometry, shared by the daemon and the client.

- `PageSpec`: everything that changes the bytes of a stored page (model, dtype,
  stored layers, heads, head dim, page format, chunk size, TP rank/size, salt).
  Its namespace digest keys every page; the daemon knows only this.
- `KVSpec`: a `PageSpec` plus how the engine lays KV out in GPU memory
  (`layout`, `block_size`). Engines with different layouts share pages.

A page is one chunk of one namespace, laid out layer-major:
`[stored_layer][k|v][token][kv_head][head_dim]`, or `[stored_layer][token][latent]`
for MLA, so any range of stored layers is one contiguous span.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import xxhash

PAGE_LAYOUT_VERSION = 1

DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
}

LAYOUTS = ("flash_attn", "flashinfer", "cross_layer", "mla", "hf", "vllm")


def dtype_name(dtype: Any) -> str:
    """Canonical dtype name ('bfloat16') from a torch dtype or a string, without importing torch."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        supported = ", ".join(DTYPE_ITEMSIZE)
        raise ValueError(f"dtype: unsupported {dtype!r}; expected one of {supported}")
    return name


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")


MAX_NAME_BYTES = 256  # a model id or salt (UTF-8): it is listed in every Stats reply
SPEC_LIMITS = {  # far above any model, low enough that no request makes the daemon build a huge table
    "num_layers": 4096,
    "num_kv_heads": 4096,
    "head_dim": 1 << 16,
    "chunk_tokens": 1 << 20,
    "tp_size": 4096,
}


@dataclass(frozen=True)
class PageSpec:
    """What a page holds; two workers with equal PageSpecs share pages."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    chunk_tokens: int
    latent: bool = False  # MLA: one latent vector per token instead of K and V
    kv_sharing: tuple[tuple[int, int], ...] = ()  # (layer, source layer): not stored
    tp_rank: int = 0
    tp_size: int = 1
    salt: str = ""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: expected a non-empty model id")
        for name in ("model", "salt"):
            size = len(getattr(self, name).encode())
            if size > MAX_NAME_BYTES:
                raise ValueError(f"{name}: {size} bytes; at most {MAX_NAME_BYTES}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens", "tp_size"):
            _check_positive(name, getattr(self, name))
            if getattr(self, name) > SPEC_LIMITS[name]:
                raise ValueError(f"{name}: {getattr(self, name)} is over {SPEC_LIMITS[name]}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: expected 0 <= tp_rank < tp_size={self.tp_size}, got {self.tp_rank}")
        if self.latent and self.num_kv_heads != 1:
            raise ValueError(
                f"num_kv_heads: MLA pages hold one latent vector per token; set num_kv_heads=1 "
                f"and head_dim to the latent width (got num_kv_heads={self.num_kv_heads})"
            )
        sharing = tuple(sorted((int(a), int(b)) for a, b in dict(self.kv_sharing).items()))
        for layer, source in sharing:
            if not (0 <= layer < self.num_layers and 0 <= source < self.num_layers):
                raise ValueError(f"kv_sharing: layer {layer} -> {source} is outside 0..{self.num_layers - 1}")
            if source == layer or source in dict(sharing):
                raise ValueError(
                    f"kv_sharing: layer {layer} must reuse a layer that stores its own KV, "
                    f"but {source} is itself shared"
                )
        object.__setattr__(self, "kv_sharing", sharing)

    @functools.cached_property
    def stored_layers(self) -> tuple[int, ...]:
        """Engine layer indices whose KV is stored, in page order."""
        shared = {layer for layer, _ in self.kv_sharing}
        return tuple(layer for layer in range(self.num_layers) if layer not in shared)

    @functools.cached_property
    def stored_position(self) -> Mapping[int, int]:
        """Engine layer -> its stored-layer index in a page, for the stored layers."""
        return {layer: index for index, layer in enumerate(self.stored_layers)}

    @property
    def num_stored_layers(self) -> int:
        return self.num_layers - len(self.kv_sharing)

    @property
    def kv_factor(self) -> int:
        return 1 if self.latent else 2

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K (or V, or latent) in one layer."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def layer_bytes(self) -> int:
        """Bytes of one stored layer of one page: its contiguous span."""
        return self.kv_factor * self.chunk_tokens * self.token_bytes

    @property
    def page_bytes(self) -> int:
        return self.num_stored_layers * self.layer_bytes

    def layer_span(self, first: int, stop: int) -> tuple[int, int]:
        """(offset, length) in a page of stored-layer positions first..stop-1."""
        if not 0 <= first <= stop <= self.num_stored_layers:
            raise ValueError(
                f"layers: span {first}..{stop} outside 0..{self.num_stored_layers} stored layers"
            )
        return first * self.layer_bytes, (stop - first) * self.layer_bytes

    def canonical_bytes(self, tenant: str = "") -> bytes:
        """Deterministic encoding of every field that changes a page's bytes, and of the tenant
        whose pages they are (none: a daemon without tenants; see `namespace`)."""
        fields = {
            "layout_version": str(PAGE_LAYOUT_VERSION),
            "model": self.model,
            "dtype": self.dtype,
            "page_format": "latent" if self.latent else "kv",
            "stored_layers": ",".join(map(str, self.stored_layers)),
            "num_layers": str(self.num_layers),
            "num_kv_heads": str(self.num_kv_heads),
            "head_dim": str(self.head_dim),
            "chunk_tokens": str(self.chunk_tokens),
            "tp_rank": str(self.tp_rank),
            "tp_size": str(self.tp_size),
            "salt": self.salt,
        }
        if tenant:  # absent without tenants: those namespaces are what they always were
            fields["tenant"] = tenant
        # Length-prefixed values: no model id or salt can forge another field.
        text = "".join(f"{key}={len(value)}:{value}\n" for key, value in fields.items())
        return b"kvstore-namespace\n" + text.encode()

    def namespace(self, tenant: str = "") -> bytes:
        """16-byte namespace digest, the root of every chunk-key chain. A tenant's namespaces
        are keyed by its name: two tenants that store the same prompt with the same spec get
        different keys, so no key of one can name a page of the other."""
        return xxhash.xxh3_128_digest(self.canonical_bytes(tenant))


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "kv_sharing", dict(self.kv_sharing))
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        _check_positive("block_size", self.block_size)
        if self.chunk_tokens is not None:
            _check_positive("chunk_tokens", self.chunk_tokens)
            if self.chunk_tokens % self.block_size:
                raise ValueError(
                    f"chunk_tokens: {self.chunk_tokens} is not a multiple of block_size {self.block_size}"
                )
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
    ) -> KVSpec:
        """The spec of a transformers model's DynamicCache (`layout="hf"`), from its config.

        `model` names the weights (default: the config's `name_or_path`); two models with the
        same name share pages, so give random-weight or fine-tuned models their own name or
        `salt`. `dtype` defaults to the config's.
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
        )

    @functools.cached_property
    def page(self) -> PageSpec:
        """The page spec (made once: a transfer asks for it several times per call)."""
        if self.chunk_tokens is None:
            raise ValueError("chunk_tokens: not set; connect to a daemon or pass chunk_tokens")
        return self.page_for(self.chunk_tokens)

    @property
    def blocks_per_chunk(self) -> int:
        return self.page.chunk_tokens // self.block_size

    def with_chunk_tokens(self, chunk_tokens: int) -> KVSpec:
        return replace(self, chunk_tokens=chunk_tokens)


def _config_int(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.{name}: expected a positive integer, got {value!r}")
    return value
