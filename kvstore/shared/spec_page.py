"""`PageSpec`: what a stored page holds, its geometry and its namespace (the kinds of pages and
their layout: `spec`, which also holds the engine side, `KVSpec`).

- `PageSpec(model, num_layers, num_kv_heads, head_dim, dtype, chunk_tokens, ...)`: checked
  when made (`spec_fields`); two workers with equal PageSpecs share pages.
- Geometry: `stored_layers`, `stored_position`, `token_bytes`, `layer_bytes`, `page_bytes`,
  `layer_span(first, stop)`; `contents`: what a page holds, for people.
- `canonical_bytes(tenant)`, `namespace(tenant)`: the encoding of every field that changes a
  page's bytes (`PAGE_LAYOUT_VERSION` among them), and its 16-byte digest.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import xxhash

from kvstore.shared.spec_fields import (
    DTYPE_ITEMSIZE,
    MAX_NAME_BYTES,
    MAX_SCALES_BYTES,
    SPEC_LIMITS,
    check_layer_ids,
    check_name,
    check_positive,
    check_weights,
    dtype_name,
)

PAGE_LAYOUT_VERSION = 1


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
    first_layer: int = 0  # the engine layers [first_layer, stop_layer) a page holds
    stop_layer: int = 0  # 0: num_layers
    weights: tuple[tuple[int, str], ...] = ()  # (stop, weights id) of each layer range up to stop_layer
    hidden_layer: int = -1  # >= 0: the page holds the hidden states entering this layer
    layer_ids: tuple[int, ...] = ()  # the engine layers of a group of them (num_layers of them)
    scales: str = ""  # what gives quantized bytes their meaning ("k=0.0125,v=0.02")
    state: str = ""  # a recurrent state page: its format (dtypes and shapes of its tensors)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: expected a non-empty model id")
        for name in ("model", "salt"):
            size = len(getattr(self, name).encode())
            if size > MAX_NAME_BYTES:
                raise ValueError(f"{name}: {size} bytes; at most {MAX_NAME_BYTES}")
            check_name(name, getattr(self, name))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens", "tp_size"):
            check_positive(name, getattr(self, name))
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
        object.__setattr__(self, "stop_layer", self.stop_layer or self.num_layers)
        if not 0 <= self.first_layer < self.stop_layer <= self.num_layers:
            raise ValueError(
                f"first_layer, stop_layer: expected 0 <= {self.first_layer} < {self.stop_layer} <= "
                f"num_layers {self.num_layers}"
            )
        object.__setattr__(self, "weights", check_weights(self.weights))
        object.__setattr__(self, "layer_ids", check_layer_ids(self.layer_ids, self.num_layers))
        if self.layer_ids and (self.layered or self.hidden_layer >= 0):
            raise ValueError(
                "layer_ids: a group of layers cannot also be a layer range, weights or hidden states"
            )
        if not isinstance(self.scales, str) or len(self.scales.encode()) > MAX_SCALES_BYTES:
            raise ValueError(
                f"scales: expected text of at most {MAX_SCALES_BYTES} bytes, got {self.scales!r:.80}"
            )
        check_name("scales", self.scales)
        self._check_state()
        self._check_kind()

    def _check_state(self) -> None:
        """A state page is latent-format raw bytes, one state per layer; raw bytes are only that."""
        if not isinstance(self.state, str) or len(self.state.encode()) > MAX_SCALES_BYTES:
            raise ValueError(
                f"state: expected text of at most {MAX_SCALES_BYTES} bytes, got {self.state!r:.80}"
            )
        check_name("state", self.state)
        if self.state and not (
            self.latent and self.num_kv_heads == 1 and self.dtype == "uint8" and self.hidden_layer < 0
        ):
            raise ValueError(
                "state: a recurrent state page is raw bytes, one state per layer (latent=True, "
                "num_kv_heads=1, dtype uint8, head_dim=the state's bytes per layer)"
            )
        if self.dtype == "uint8" and not self.state:
            raise ValueError("dtype: uint8 holds a recurrent state's raw bytes; KV pages name their dtype")

    def _check_kind(self) -> None:
        """A hidden-state page is one latent-format layer; weights end where the page's layers do."""
        end = self.stop_layer
        if self.hidden_layer >= 0:
            if not self.latent or self.num_layers != 1 or self.kv_sharing:
                raise ValueError(
                    "hidden_layer: a hidden-state page is one latent-format layer (latent=True, "
                    "num_layers=1, num_kv_heads=1, head_dim=the hidden size, no kv_sharing)"
                )
            if self.hidden_layer > SPEC_LIMITS["num_layers"]:
                raise ValueError(f"hidden_layer: {self.hidden_layer} is over {SPEC_LIMITS['num_layers']}")
            end = self.hidden_layer
        elif self.hidden_layer != -1:
            raise ValueError(
                f"hidden_layer: expected -1 (KV pages) or a layer index, got {self.hidden_layer}"
            )
        if self.weights and self.weights[-1][0] != end:
            raise ValueError(
                f"weights: the last range ends at layer {self.weights[-1][0]}, but these pages "
                f"depend on the layers before {end}: list the weights of every range up to {end}"
            )

    @property
    def layered(self) -> bool:
        """Whether the pages are keyed by a layer range or weights (not a whole model's KV)."""
        return bool(self.weights) or (self.first_layer, self.stop_layer) != (0, self.num_layers)

    @functools.cached_property
    def contents(self) -> str:
        """What a page holds, for people (`kvctl ls`); empty for a whole model's KV."""
        if self.hidden_layer >= 0:
            held = f"hidden states entering layer {self.hidden_layer}"
        elif self.state:
            layers = ",".join(map(str, self.layer_ids)) or f"0-{self.num_layers - 1}"
            held = f"state of layers {layers} after each chunk"
        elif self.layer_ids:
            held = f"KV of layers {','.join(map(str, self.layer_ids))}"
        elif self.layered:
            held = f"KV of layers {self.first_layer}-{self.stop_layer - 1}"
        else:
            return ""
        return held + (f", weights {self.weights[-1][1]}" if self.weights else "")

    @functools.cached_property
    def stored_layers(self) -> tuple[int, ...]:
        """Engine layer indices whose KV is stored, in page order."""
        shared = {layer for layer, _ in self.kv_sharing}
        return tuple(layer for layer in range(self.first_layer, self.stop_layer) if layer not in shared)

    @functools.cached_property
    def stored_position(self) -> Mapping[int, int]:
        """Engine layer -> its stored-layer index in a page, for the stored layers."""
        return {layer: index for index, layer in enumerate(self.stored_layers)}

    @property
    def num_stored_layers(self) -> int:
        return len(self.stored_layers)

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
    def page_tokens(self) -> int:
        """The "tokens" a page holds per layer: the chunk's, or one state for a state page."""
        return 1 if self.state else self.chunk_tokens

    @functools.cached_property
    def layer_bytes(self) -> int:
        """Bytes of one stored layer of one page: its contiguous span (kept: the daemon reads it
        for every page it reserves, commits and frees)."""
        return self.kv_factor * self.page_tokens * self.token_bytes

    @functools.cached_property
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
        if self.hidden_layer >= 0:
            fields["page_format"] = "hidden"
            fields["hidden_layer"] = str(self.hidden_layer)
        if self.layered:  # absent for a whole model's KV: those namespaces are what they always were
            fields["layers"] = f"{self.first_layer},{self.stop_layer}"
        if self.weights:  # the weights, not the model's name or depth, say what the pages hold
            del fields["model"], fields["num_layers"]
            fields["weights"] = ";".join(f"{stop}={len(ident)}:{ident}" for stop, ident in self.weights)
        if self.layer_ids:  # a group of the engine's layers: which ones (absent for a whole model)
            fields["layer_ids"] = ",".join(map(str, self.layer_ids))
        if self.scales:  # quantized pages: the scales that give the bytes their meaning
            fields["scales"] = self.scales
        if self.state:  # recurrent state pages: the state's format
            fields["page_format"] = "state"
            fields["state"] = self.state
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
