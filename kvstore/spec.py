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
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import xxhash

PAGE_LAYOUT_VERSION = 1

DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,  # raw bytes: a recurrent state's (PageSpec.state) and nothing else
}

LAYOUTS = ("flash_attn", "flashinfer", "cross_layer", "mla", "hf", "vllm", "vllm_rows")
MAX_SCALES_BYTES = 1024  # the text of a cache's quantization scales (`PageSpec.scales`)


def dtype_name(dtype: Any) -> str:
    """Canonical dtype name ('bfloat16') from a torch dtype or a string, without importing torch."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        supported = ", ".join(DTYPE_ITEMSIZE)
        raise ValueError(f"dtype: unsupported {dtype!r}; expected one of {supported}")
    return name


def _check_weights(weights: Any) -> tuple[tuple[int, str], ...]:
    """`weights` as ((stop, id), ...): ranges from layer 0, stops increasing, ids named."""
    checked: list[tuple[int, str]] = []
    for entry in weights:
        try:
            stop, ident = entry
        except (TypeError, ValueError):
            raise ValueError(f"weights: expected (stop layer, weights id) pairs, got {entry!r}") from None
        if not isinstance(stop, int) or isinstance(stop, bool) or not isinstance(ident, str):
            raise ValueError(f"weights: expected (stop layer, weights id) pairs, got {entry!r}")
        low = checked[-1][0] if checked else 0
        if not low < stop <= SPEC_LIMITS["num_layers"]:
            raise ValueError(f"weights: range ({low}, {stop}) is empty or out of order; stops must increase")
        if not ident or len(ident.encode()) > MAX_NAME_BYTES:
            raise ValueError(
                f"weights: the id of the range ending at {stop} must be 1-{MAX_NAME_BYTES} bytes"
            )
        check_name(f"weights: the id of the range ending at {stop}", ident)
        checked.append((stop, ident))
    return tuple(checked)


def _check_layer_ids(layer_ids: Any, num_layers: int) -> tuple[int, ...]:
    """`layer_ids` as a tuple of distinct increasing engine layer indices, one per layer (or empty)."""
    ids = tuple(layer_ids)
    if not ids:
        return ()
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
        raise ValueError(f"layer_ids: expected engine layer indices, got {ids!r:.120}")
    if len(ids) != num_layers or list(ids) != sorted(set(ids)):
        raise ValueError(
            f"layer_ids: expected {num_layers} distinct increasing layer indices (one per layer), "
            f"got {len(ids)}"
        )
    if ids[-1] >= SPEC_LIMITS["num_layers"]:
        raise ValueError(f"layer_ids: {ids[-1]} is over {SPEC_LIMITS['num_layers']}")
    return ids


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")


MAX_NAME_BYTES = 256  # a model id or salt (UTF-8): it is listed in every Stats reply
# What moves a terminal's cursor or reorders what it shows: C0 and C1 controls, DEL, line and
# paragraph separators, and the bidi marks, embeddings, overrides and isolates.
_CONTROL_CHARACTERS = re.compile(
    "[\x00-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)


def check_name(name: str, text: str) -> None:
    """Refuses a name (model, salt, weights id) with a control character: names reach admins'
    terminals (`kvctl ls`, `kvctl events`), where an escape sequence would be another user's
    input on root's screen."""
    found = _CONTROL_CHARACTERS.search(text)
    if found is not None:
        raise ValueError(
            f"{name}: control character U+{ord(found.group()):04X} at index {found.start()}; names "
            f"must be printable text (no C0 or C1 controls, DEL, line separators or bidi controls)"
        )


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
        object.__setattr__(self, "stop_layer", self.stop_layer or self.num_layers)
        if not 0 <= self.first_layer < self.stop_layer <= self.num_layers:
            raise ValueError(
                f"first_layer, stop_layer: expected 0 <= {self.first_layer} < {self.stop_layer} <= "
                f"num_layers {self.num_layers}"
            )
        object.__setattr__(self, "weights", _check_weights(self.weights))
        object.__setattr__(self, "layer_ids", _check_layer_ids(self.layer_ids, self.num_layers))
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

    @property
    def layer_bytes(self) -> int:
        """Bytes of one stored layer of one page: its contiguous span."""
        return self.kv_factor * self.page_tokens * self.token_bytes

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
        object.__setattr__(self, "weights", _check_weights(self.weights))
        object.__setattr__(self, "stop_layer", self.stop_layer or self.num_layers)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        _check_positive("block_size", self.block_size)
        if self.chunk_tokens is not None:
            _check_positive("chunk_tokens", self.chunk_tokens)
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
        _check_positive("hidden_size", hidden_size)
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
