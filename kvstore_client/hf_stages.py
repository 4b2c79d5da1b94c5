"""Progressive models in transformers: restore layers [0, b) and the hidden states entering layer b,
then run only layers [b, L) over the prompt.

A model served in stages keeps the weights of layers [0, b) from one stage to the next and
replaces the layers after them. The KV of layers [0, b) for a prompt is then the same in both
stages, and so is the residual stream entering layer b. Name the weights per layer range in the
spec (`weights_ids` digests them), and a stage restores what an earlier one stored:

    spec = KVSpec.from_hf_config(model.config, model="llama-stage2",
                                 weights=weights_ids(model, [16, 32]))
    stages = StagedPrefixCache.connect(address, spec, model, boundary=16)
    result = stages.prefill(input_ids)   # logits of the last token, a cache ready for decoding
    stages.save(input_ids, result.past_key_values, result.hidden_states)

Three namespaces, one client each (siblings: one connection and one mapped arena): the KV of
layers [0, b) (keyed by the weights of [0, b): shared by every stage with those weights), the KV
of layers [b, L) (keyed by all of them), and the hidden states entering b (keyed by the weights
of [0, b), like the KV before them). A stage
that changed a layer before b has other keys for all three and finds nothing.

`prefill` takes the cheapest of three paths, counted in token-layers to compute:
- "whole": every layer's KV is stored for all but the last token (this stage saw the prompt):
  the last token runs through the model;
- "partial": layers [0, b) and the hidden states at b are stored for the first h tokens: the
  tokens after h run through layers [0, b) on the restored cache, then every token runs
  through layers [b, L) (no layer before b runs at all when h covers the prompt);
- "none": a forward over the prompt.
A restored page that cannot be read back (a corrupted record is a miss) shortens what is
restored, down to a plain forward: never other logits. `save(..., tail=True)` (the default)
also keeps each trailing partial chunk, so a prompt of any length is covered to its last token.

The stage runner computes outside the decoder layers only what the model class's own forward
does there, step for step: the classes of `hf_stages_models.MODEL_STEPS` (Llama, Mistral, Qwen2,
Qwen3; Granite with its embedding multiplier and `logits_scaling`), batch size 1, full attention in
every layer. Any other class (Gemma2's logit soft-capping, Cohere's `logit_scale`, ...) or a
sliding window is refused at `connect`, by name.

`weights_ids(model, [b, L])` (`kvstore_client.hf_stages_weights`) derives the ids from the weights
themselves: equal ids promise equal weights (and configuration) up to the range's end, so pages are
shared only where they are equal.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstore.shared.spec import KVSpec
from kvstore_client.client import KVStoreClient
from kvstore_client.hf import (
    KVPairs,
    cache_tensors,
    decoder_layers,
    dynamic_cache,
    kv_buffers,
    store_cache,
    token_list,
)
from kvstore_client.hf_stages_models import config_int, model_steps
from kvstore_client.hf_stages_weights import weights_ids

__all__ = ["Prefill", "StagedPrefixCache", "weights_ids"]


@dataclass
class Prefill:
    """What `StagedPrefixCache.prefill` computed."""

    logits: torch.Tensor  # [1, 1, vocab]: the last token's
    past_key_values: Any  # a DynamicCache holding every layer's KV of the whole prompt
    hidden_states: torch.Tensor | None  # [1, seq, hidden] entering the boundary layer (None: not known)
    path: str  # "whole", "partial" or "none"
    restored: int  # prompt tokens whose KV came from the store (layers [0, b) for "partial")


class StagedPrefixCache:
    """Stores and restores a staged model's prompts: KV per layer range, hidden states at `boundary`."""

    def __init__(
        self, clients: tuple[KVStoreClient, KVStoreClient, KVStoreClient], model: Any, boundary: int
    ):
        self.lower, self.upper, self.hidden = clients
        self.model = model
        self.steps = model_steps(model)
        self.boundary = boundary
        self.num_layers = self.upper.spec.num_layers
        self.spec = self.upper.spec.layer_range(0, self.num_layers)  # the whole model's layers
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.layers = decoder_layers(model, self.num_layers)
        self.device = next(model.parameters()).device

    @classmethod
    def connect(
        cls, address: str | None, spec: KVSpec, model: Any, boundary: int, **options: Any
    ) -> StagedPrefixCache:
        """Connects the three clients, siblings over one connection (`options` as for
        `KVStoreClient.connect`). `spec` is the whole model's, with `weights` that end a range at
        `boundary`."""
        if spec.layout != "hf":
            raise ValueError(f"spec: layout={spec.layout!r}; a staged model's cache needs layout='hf'")
        if not 0 < boundary < spec.num_layers:
            raise ValueError(f"boundary: expected a layer in 1..{spec.num_layers - 1}, got {boundary}")
        if not spec.weights:
            raise ValueError("spec: needs weights=[(boundary, id of layers before it), (num_layers, id)]")
        model_steps(model)  # refused before anything connects
        hidden_size = config_int(model.config, "hidden_size")
        specs = (
            spec.layer_range(0, boundary),
            spec.layer_range(boundary, spec.num_layers),
            spec.hidden_states(boundary, hidden_size),
        )
        clients = [KVStoreClient.connect(address, specs[0], **options)]
        try:
            for part in specs[1:]:
                clients.append(clients[0].sibling(part))
            return cls((clients[0], clients[1], clients[2]), model, boundary)
        except BaseException:
            for client in clients:
                client.close()
            raise

    def close(self) -> None:
        for client in (self.lower, self.upper, self.hidden):
            client.close()

    def __enter__(self) -> StagedPrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- save ---------------------------------------------------------------

    def save(self, input_ids: Any, past_key_values: Any, hidden_states: Any, *, tail: bool = True) -> int:
        """Stores a forward's KV (both layer ranges) and the hidden states entering the boundary
        (`hidden_states`: `[1, seq, hidden]`, the tuple of `output_hidden_states=True`, or None
        to store KV only); returns the chunks newly stored, over the three namespaces."""
        tokens = token_list(input_ids)
        kv = cache_tensors(past_key_values, self.num_layers)
        handles = [store_cache(client, tokens, kv, tail) for client in (self.lower, self.upper)]
        if hidden_states is not None:
            if isinstance(hidden_states, (tuple, list)):
                hidden_states = hidden_states[self.boundary]
            handles.append(self._store_hidden(tokens, hidden_states, tail))
        return sum(handle.wait() for handle in handles)

    def _store_hidden(self, tokens: np.ndarray, hidden_states: torch.Tensor, tail: bool) -> Any:
        spec = self.hidden.spec
        if hidden_states.dim() != 3 or hidden_states.shape[0] != 1 or hidden_states.shape[2] != spec.head_dim:
            raise ValueError(
                f"hidden_states: expected [1, seq, {spec.head_dim}], got {list(hidden_states.shape)}"
            )
        if hidden_states.shape[1] < len(tokens):
            raise ValueError(
                f"hidden_states: holds {hidden_states.shape[1]} tokens, fewer than the "
                f"{len(tokens)} of input_ids"
            )
        chunk_tokens = spec.page.chunk_tokens
        positions = -(-len(tokens) // chunk_tokens) * chunk_tokens
        blocks = _hidden_buffer(spec, positions, hidden_states.device)
        flat = blocks.view(positions, spec.head_dim)
        flat[: len(tokens)].copy_(hidden_states[0, : len(tokens)])
        flat[len(tokens) :].zero_()
        return self.hidden.store_async(tokens, [blocks], torch.arange(blocks.shape[0]), tail=tail)

    # -- prefill ------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, input_ids: Any) -> Prefill:
        """The last token's logits and a cache of the whole prompt, computing as little as the
        store allows (see the module's paths)."""
        tokens = token_list(input_ids)
        n, b, layers = len(tokens), self.boundary, self.num_layers
        if n == 0:
            raise ValueError("input_ids: expected at least one token")
        keys = [client.keys(tokens, tail=True) for client in (self.lower, self.upper, self.hidden)]
        lower = self.lower.lookup(tokens, keys=keys[0], tail=True)
        upper = self.upper.lookup(tokens, keys=keys[1], tail=True) if lower else 0
        hidden = self.hidden.lookup(tokens, keys=keys[2], tail=True) if lower else 0
        whole, partial = min(lower, upper, n - 1), min(lower, hidden)
        cost = {
            "whole": layers * (n - whole) if whole else None,
            "partial": b * (n - partial) + (layers - b) * n if partial else None,
        }
        ranked = sorted((value, path) for path, value in cost.items() if value is not None)
        for _, path in ranked:
            done = (
                self._whole(tokens, whole, keys) if path == "whole" else self._partial(tokens, partial, keys)
            )
            if done is not None:
                return done
        out = self.model(
            _ids(tokens, self.device), use_cache=True, output_hidden_states=True, logits_to_keep=1
        )
        return Prefill(out.logits, out.past_key_values, out.hidden_states[b], "none", 0)

    def _whole(self, tokens: np.ndarray, stored: int, keys: list[list[bytes]]) -> Prefill | None:
        """Every layer restored for `stored` tokens, the rest through the model; None if the
        pages could not all be read back."""
        kv = self._load_kv((self.lower, self.upper), keys[:2], stored, self.spec)
        if kv is None:
            return None
        pairs, got = kv
        cache = dynamic_cache(self.model.config, pairs, got)
        out = self.model(
            _ids(tokens[got:], self.device),
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=1,
        )
        return Prefill(out.logits, out.past_key_values, None, "whole", got)

    def _partial(self, tokens: np.ndarray, stored: int, keys: list[list[bytes]]) -> Prefill | None:
        """Layers [0, b) and the hidden states at b restored for the first tokens; the others
        through layers [0, b), then every token through layers [b, L). None if nothing could be
        read back. Layers [b, L) need only the hidden states: the KV of layers [0, b) is copied
        meanwhile (on the client's side stream on CUDA) and waited for before it is read."""
        spec, chunk_tokens = self.hidden.spec, self.hidden.spec.page.chunk_tokens
        chunks = -(-stored // chunk_tokens)
        pairs = kv_buffers(self.lower.spec, chunks * chunk_tokens, self.device)
        lower = self.lower.load_async(None, pairs, None, keys=keys[0][:chunks])
        try:
            blocks = _hidden_buffer(spec, chunks * chunk_tokens, self.device)
            loaded = self.hidden.load(None, [blocks], torch.arange(blocks.shape[0]), keys=keys[2][:chunks])
            restored = min(stored, lower.tokens, loaded)
            if restored == 0:
                lower.wait()
                return None
            n, b = len(tokens), self.boundary
            cache = dynamic_cache(self.model.config, pairs, restored)
            hidden = blocks.view(-1, spec.head_dim)[:restored].unsqueeze(0)
            if restored < n:  # the tokens after the restored ones through layers [0, b), on their KV
                if self.device.type == "cuda":
                    lower.wait_stream(torch.cuda.current_stream(self.device))
                rest = self.steps.embed(self.model, _ids(tokens[restored:], self.device))
                rest = self._run(range(0, b), rest, restored, cache)
                hidden = torch.cat([hidden, rest], dim=1)
            out = self._run(range(b, self.num_layers), hidden, 0, cache)
            logits = self.steps.head(self.model, out[:, -1:])
        except BaseException:
            with contextlib.suppress(Exception):
                lower.wait()
            raise
        if lower.wait() < restored:  # the lease lapsed during the copy: its bytes are not sure
            return None
        return Prefill(logits, cache, hidden, "partial", restored)

    def _run(self, layers: range, hidden: torch.Tensor, start: int, cache: Any) -> torch.Tensor:
        """`hidden` (positions start..) through the decoder's `layers`, with the model's own
        rotary embeddings and causal mask against what `cache` holds for those layers."""
        from transformers.masking_utils import create_causal_mask

        positions = torch.arange(start, start + hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.decoder.config,
            inputs_embeds=hidden,
            attention_mask=None,
            past_key_values=cache,
            position_ids=positions,
            layer_idx=layers.start,
        )
        rotary = self.decoder.rotary_emb(hidden, position_ids=positions)
        for index in layers:
            hidden = self.layers[index](
                hidden,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                position_embeddings=rotary,
            )
        return hidden

    def _load_kv(
        self, clients: tuple[KVStoreClient, ...], keys: list[list[bytes]], stored: int, spec: KVSpec
    ) -> tuple[KVPairs, int] | None:
        """The KV of `spec`'s layers for the first `stored` tokens, loaded by `clients` (each
        its layers) into one buffer; the tokens every client made valid (None: none)."""
        chunk_tokens = spec.page.chunk_tokens
        chunks = -(-stored // chunk_tokens)
        pairs = kv_buffers(spec, chunks * chunk_tokens, self.device)
        got = stored
        for client, client_keys in zip(clients, keys, strict=True):
            got = min(got, client.load(None, pairs, None, keys=client_keys[:chunks]))
        return (pairs, got) if got else None


def _hidden_buffer(spec: KVSpec, positions: int, device: Any) -> torch.Tensor:
    """`[positions // block_size, block_size, hidden]`: hidden states as the latent layout's blocks."""
    return torch.empty(
        (positions // spec.block_size, spec.block_size, spec.head_dim),
        dtype=getattr(torch, spec.dtype),
        device=device,
    )


def _ids(tokens: np.ndarray, device: Any) -> torch.Tensor:
    return torch.as_tensor(tokens, dtype=torch.long, device=device).unsqueeze(0)
