"""transformers integration: keep a model's prompt KV in kvstored, restore it as a DynamicCache.

    spec = KVSpec.from_hf_config(model.config, dtype=torch.bfloat16, model="my-llama")
    prefix = HFPrefixCache(KVStoreClient.connect(address, spec))
    out = model(input_ids, use_cache=True)
    prefix.save(input_ids, out.past_key_values)
    hit, cache = prefix.restore(input_ids)  # a DynamicCache holding the first `hit` tokens
    out = model(input_ids[:, hit:], past_key_values=cache, use_cache=True)

`hit` covers the stored chunks of the prompt, at most `len(input_ids) - 1` tokens, so the
forward always has a token to compute (it needs one for its logits). The KV of token j
depends on tokens 0..j only, so a chunk that ends past the prompt's last token still serves
the tokens before it. Batch size 1, full-attention layers.

Hand-over: `save(input_ids, cache, tail=True)` also stores the prompt's trailing partial chunk,
keyed by exactly its tokens, so another process restores every token but the last (the one
it must compute for its logits) and the tail never matches a prompt that goes on differently.
`restore` always looks for a tail.

Layer-wise overlap (opt-in): `HFPrefixCache(client, model=model)` puts a forward pre-hook on
each decoder layer, and `restore(input_ids, overlap=True)` returns once the copies are
enqueued, one per layer. Decoder layer i then waits, on the GPU and not on the host, for
layer i's KV alone, so layer i computes while later layers still cross PCIe. The daemon's
lease is released when that forward ends (or by `finish()`); if it lapsed meanwhile, the
bytes were not guaranteed and the forward raises `StaleKV` instead of returning.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvstore.shared.spec import KVSpec
from kvstore_client.client import KVStoreClient
from kvstore_client.handles import LoadHandle, StoreHandle

log = logging.getLogger(__name__)


class StaleKV(RuntimeError):
    """A layer-wise restore's lease lapsed before the forward using it ended: recompute."""


class HFPrefixCache:
    """Saves and restores the KV of prompt prefixes for one transformers model."""

    def __init__(self, client: KVStoreClient, model: Any = None, *, device: Any = None) -> None:
        if client.spec.layout != "hf":
            raise ValueError(
                f"client: its KVSpec has layout={client.spec.layout!r}; HFPrefixCache needs "
                "layout='hf' (build the spec with KVSpec.from_hf_config)"
            )
        self.client = client
        self.model = model
        if device is not None:
            self.device = torch.device(device)
        elif model is not None:
            self.device = next(model.parameters()).device
        else:
            self.device = torch.device("cpu")
        self._dtype = getattr(torch, client.spec.dtype)
        self._pending: tuple[LoadHandle, int] | None = None
        self._waited: Any = None  # the pending load's event the current stream last waited for
        self._hooks: list[Any] = []
        if model is not None:
            self._hooks = _register_hooks(model, client.spec.num_layers, self)

    def close(self) -> None:
        """Removes the hooks and releases a restore still pending (the client stays open)."""
        self.finish()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # -- save ---------------------------------------------------------------

    def save_async(self, input_ids: Any, past_key_values: Any, *, tail: bool = False) -> StoreHandle:
        """Starts storing the whole chunks of `input_ids` from a forward's cache (and with `tail`
        its trailing partial chunk); `wait()` commits.

        On CUDA the copy runs on the client's side stream after the work already queued, so the
        caller may go on (the cache must stay unchanged until `wait()`).
        """
        kv = cache_tensors(past_key_values, self.client.spec.num_layers)
        return store_cache(self.client, token_list(input_ids), kv, tail)

    def save(self, input_ids: Any, past_key_values: Any, *, tail: bool = False) -> int:
        """Stores the whole chunks of `input_ids` from a forward's cache (and with `tail` its
        trailing partial chunk); returns how many chunks were new."""
        return self.save_async(input_ids, past_key_values, tail=tail).wait()

    # -- restore ------------------------------------------------------------

    def restore(self, input_ids: Any, *, overlap: bool = False) -> tuple[int, Any]:
        """(hit, cache): a DynamicCache holding the KV of the first `hit` tokens of `input_ids`.

        `hit` is 0 (an empty cache) when nothing is stored or the daemon cannot be reached.
        With `overlap` (needs `model=` at construction) the copies may still be in flight when
        this returns; the model's decoder layers wait for them one by one.
        """
        if overlap and not self._hooks:
            raise ValueError("overlap: needs HFPrefixCache(client, model=model) to hook the decoder layers")
        self.finish()
        tokens = token_list(input_ids)
        limit = len(tokens) - 1  # leave a token to compute
        keys = self.client.keys(tokens, tail=True) if limit > 0 else []
        stored = self.client.lookup(tokens, keys=keys, tail=True) if keys else 0
        if stored == 0:
            return 0, self._dynamic_cache([], 0)
        chunk_tokens = self.client.spec.page.chunk_tokens
        chunks = -(-stored // chunk_tokens)
        kv = kv_buffers(self.client.spec, chunks * chunk_tokens, self.device)
        handle = self.client.load_async(None, kv, None, layerwise=overlap, keys=keys[:chunks])
        if overlap and handle.tokens and self.device.type == "cuda":
            hit = min(handle.tokens, stored, limit)
            self._pending, self._waited = (handle, hit), None
        else:
            hit = min(handle.wait(), stored, limit)
        return hit, self._dynamic_cache(kv, hit)

    def finish(self) -> int:
        """Releases a pending layer-wise restore once its copies completed; returns its valid tokens.

        The forward's end calls this; call it yourself if you drop a restored cache unused.
        """
        if self._pending is None:
            return 0
        handle, hit = self._pending
        self._pending = None
        valid = handle.wait()
        if valid < hit:
            raise StaleKV(
                f"the restored KV of {hit} tokens could not be confirmed (the daemon's lease lapsed "
                f"during the copy); restore again or recompute"
            )
        return hit

    def _wait_layer(self, layer: int) -> None:
        if self._pending is None:
            return
        handle = self._pending[0]
        event = handle.layer_events.get(layer)
        if event is not self._waited:  # layers of one run share its event: the stream waits once
            handle.wait_layer(layer)
            self._waited = event

    def _dynamic_cache(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor] | None], tokens: int) -> Any:
        return dynamic_cache(getattr(self.model, "config", None), kv, tokens)


def dynamic_cache(config: Any, kv: Sequence[tuple[torch.Tensor, torch.Tensor] | None], tokens: int) -> Any:
    """A DynamicCache over the first `tokens` positions of `kv`, without copying them; layers
    whose entry is None stay empty."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    if not kv:
        return cache
    from transformers.cache_utils import DynamicLayer

    if not cache.layers:
        cache.layers = [DynamicLayer() for _ in kv]
    layers: list[Any] = list(cache.layers)
    for index, (layer, pair) in enumerate(zip(layers, kv, strict=True)):
        if pair is None:
            continue
        if getattr(layer, "is_sliding", False):
            raise ValueError(f"model: layer {index} uses sliding-window attention, which is not restored")
        key, value = (t[:, :, :tokens] for t in pair)
        # What DynamicLayer.lazy_initialization + update would leave, without update's copy
        # (torch.cat), which would also wait for a layer-wise copy on the host's stream.
        layer.dtype, layer.device = key.dtype, key.device
        layer.keys, layer.values = key, value
        layer.is_initialized = True
    return cache


def kv_buffers(spec: KVSpec, positions: int, device: Any) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """(key, value) `[1, kv_heads, positions, head_dim]` for each layer the spec's pages hold (None
    for the others), in one allocation."""
    stored = spec.stored_layers
    memory = torch.empty(
        (len(stored), 2, 1, spec.num_kv_heads, positions, spec.head_dim),
        dtype=getattr(torch, spec.dtype),
        device=device,
    )
    place = {layer: index for index, layer in enumerate(stored)}
    return [
        (memory[place[layer], 0], memory[place[layer], 1]) if layer in place else None
        for layer in range(spec.num_layers)
    ]


KVPairs = Sequence[tuple[torch.Tensor, torch.Tensor] | None]


def store_cache(client: KVStoreClient, tokens: np.ndarray, kv: KVPairs, tail: bool) -> StoreHandle:
    """Starts storing the whole chunks of `tokens` from a forward's cache `kv` (the layers the
    client's spec holds), and with `tail` the trailing partial chunk from a copy padded to a
    whole chunk (the cache holds only the prompt's positions)."""
    layers = set(client.spec.stored_layers)
    held = _held_tokens([pair for layer, pair in enumerate(kv) if layer in layers])
    if held < len(tokens):
        raise ValueError(
            f"past_key_values: holds {held} tokens, fewer than the {len(tokens)} of input_ids; "
            "pass the cache of a forward over these input_ids"
        )
    whole = client.store_async(tokens, kv, None)
    chunk_tokens = client.spec.page.chunk_tokens
    start = len(tokens) - len(tokens) % chunk_tokens
    if not tail or start == len(tokens):
        return whole
    keys = client.keys(tokens, tail=True)
    padded = kv_buffers(client.spec, chunk_tokens, kv[min(layers)][0].device)  # type: ignore[index]
    for layer, pair in enumerate(padded):
        if pair is not None:
            source = kv[layer]
            assert source is not None
            for target, tensor in zip(pair, source, strict=True):
                target[..., : len(tokens) - start, :].copy_(tensor[..., start : len(tokens), :])
                target[..., len(tokens) - start :, :].zero_()  # stored, never served: no stale bytes
    return _joined(whole, client.store_async(None, padded, None, keys=keys[-1:]))


def _joined(first: StoreHandle, second: StoreHandle) -> StoreHandle:
    """One handle over two stores: `wait()` commits both and returns their new chunks."""

    def finish() -> int:
        try:
            stored = first.wait()
        except BaseException:
            with contextlib.suppress(Exception):
                second.wait()
            raise
        return stored + second.wait()

    return StoreHandle(second.event, finish, lambda exc: None, first.chunks + second.chunks)


def token_list(input_ids: Any) -> np.ndarray:
    """Token ids of one sequence (a list, a 1-D tensor, or a `[1, seq]` batch) as an int64 array."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"input_ids: batch size {input_ids.shape[0]}; one sequence at a time")
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids: expected [seq] or [1, seq], got shape {list(input_ids.shape)}")
        return input_ids.detach().cpu().numpy().astype(np.int64, copy=False)
    tokens = np.asarray(input_ids)
    if tokens.ndim != 1:
        raise ValueError(f"input_ids: expected [seq] or [1, seq], got shape {list(tokens.shape)}")
    return tokens.astype(np.int64, copy=False)


def cache_tensors(past_key_values: Any, num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """(keys, values) per layer of a DynamicCache (or a legacy tuple of pairs); None: a layer with no KV."""
    layers = getattr(past_key_values, "layers", None)
    if layers is not None:
        pairs: list[Any] = [
            (layer.keys, layer.values) if getattr(layer, "is_initialized", True) else None for layer in layers
        ]
    elif isinstance(past_key_values, (list, tuple)):
        pairs = [tuple(pair[:2]) if pair is not None else None for pair in past_key_values]
    else:
        raise ValueError(
            f"past_key_values: expected a transformers Cache or a tuple of (key, value) pairs, "
            f"got {type(past_key_values).__name__}"
        )
    if len(pairs) != num_layers:
        raise ValueError(f"past_key_values: has {len(pairs)} layers, the spec {num_layers}")
    return pairs


def _held_tokens(kv: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> int:
    held = [pair[0].shape[-2] for pair in kv if pair is not None and pair[0] is not None]
    return min(held) if held else 0


def decoder_layers(model: Any, num_layers: int) -> Any:
    """The model's decoder layers: the module list of `num_layers` entries it runs in order."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) == num_layers:
        return layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    raise ValueError(f"model: found no list of {num_layers} decoder layers to hook")


def _register_hooks(model: Any, num_layers: int, prefix: HFPrefixCache) -> list[Any]:
    hooks = []
    for index, layer in enumerate(decoder_layers(model, num_layers)):
        hooks.append(layer.register_forward_pre_hook(lambda module, args, i=index: prefix._wait_layer(i)))

    def release(module: Any, args: Any, output: Any) -> None:
        prefix.finish()

    hooks.append(model.register_forward_hook(release))
    return hooks
