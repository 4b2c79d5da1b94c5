"""Weights ids for a progressive model's layer ranges: equal ids promise equal weights.

- `weights_ids(model, stops)`: `(stop, id)` for each layer range `[previous stop, stop)`, the
  `weights` of `KVSpec.from_hf_config`, each id a digest of what computes that range's KV (the
  configuration, less the fields that compute nothing, and the tensors of its layers).

Tensors are read where they are, streaming: a CPU tensor in place, a GPU tensor in pieces of
`_PIECE_BYTES` through two pinned buffers (`_HostReader`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from kvstore_client.hf import decoder_layers
from kvstore_client.hf_stages_models import config_int, text_config

# Config fields that name, label or bookkeep a model but compute nothing in its layers; every other
# field (rope, norms' eps, Granite's multipliers, ...) goes into each id: a change is a miss, never
# a wrong hit. `num_hidden_layers` differs between stages; `layer_types` goes in cut to the range.
_NOT_COMPUTING = frozenset(
    {
        "_name_or_path",
        "architectures",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "num_hidden_layers",
        "layer_types",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "initializer_range",
    }
)
_PIECE_BYTES = 64 << 20  # a GPU tensor crosses to the host in pieces of at most this, through pinned memory


def weights_ids(model: Any, stops: Sequence[int]) -> list[tuple[int, str]]:
    """`weights` for `KVSpec.from_hf_config`: `(stop, id)` for each layer range `[previous stop,
    stop)`, the id an xxh3-128 digest of what computes that range's KV.

    It covers, for each range: the model's configuration (less `_NOT_COMPUTING`), and every
    tensor of the state dict of its decoder layers (and of the embedding for the first range),
    each by name, dtype, shape and bytes. Tensors are hashed where they are, streaming: a CPU
    tensor in place, a GPU tensor 64 MiB at a time through two pinned buffers (no copy of the
    model anywhere). The cost is one read of the covered bytes at xxh3's rate on one host core:
    a Llama of 1.24 B parameters in bf16 (2.3 GiB) took 0.33 s on an H200 and 0.33 s from its
    host's memory, the same ids on both. The final norm and the head are not covered (no KV
    depends on them). A checksum, not a signature: someone who can choose the weights could make
    two sets collide; labels chosen by hand promise even less.
    """
    num_layers = config_int(model.config, "num_hidden_layers")
    if not stops or list(stops) != sorted(set(stops)) or stops[0] <= 0 or stops[-1] > num_layers:
        raise ValueError(f"stops: expected increasing layers in 1..{num_layers}, got {list(stops)}")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = decoder_layers(model, num_layers)
    config = text_config(model.config)
    settings = {key: value for key, value in config.to_dict().items() if key not in _NOT_COMPUTING}
    layer_types = list(getattr(config, "layer_types", None) or ())
    ids, first, reader = [], 0, _HostReader()
    for stop in stops:
        digest = xxhash.xxh3_128()
        settings["layer_types"] = layer_types[first:stop]
        _update(digest, type(model).__name__.encode())
        _update(digest, json.dumps(settings, sort_keys=True, default=str).encode())
        parts = [("embed_tokens.", decoder.embed_tokens)] if first == 0 else []
        parts += [(f"layers.{index}.", layers[index]) for index in range(first, stop)]
        for prefix, module in parts:
            for name, tensor in module.state_dict(prefix=prefix).items():
                _update_tensor(digest, name, tensor, reader)
        ids.append((stop, f"xxh3:{digest.hexdigest()}"))
        first = stop
    return ids


def _update(digest: Any, data: bytes) -> None:
    digest.update(len(data).to_bytes(8, "little"))  # length-prefixed: no field runs into the next
    digest.update(data)


def _update_tensor(digest: Any, name: str, tensor: torch.Tensor, reader: _HostReader) -> None:
    if tensor.device.type == "meta":
        raise ValueError(f"model: {name} has no data (meta device); load the weights before hashing them")
    _update(digest, f"{name}|{tensor.dtype}|{list(tensor.shape)}".encode())
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    digest.update(data.numel().to_bytes(8, "little"))
    for piece in reader.pieces(data):
        digest.update(piece)


class _HostReader:
    """A tensor's bytes on the host, piece by piece: a CPU tensor in place; a GPU tensor through two
    pinned buffers, the next piece crossing while the caller hashes this one."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def pieces(self, data: torch.Tensor) -> Iterator[np.ndarray]:
        starts = range(0, data.numel(), _PIECE_BYTES)
        if data.device.type != "cuda":
            for start in starts:
                yield data[start : start + _PIECE_BYTES].cpu().numpy()  # in place on the CPU
            return
        if not starts:
            return
        if not self.buffers:
            self.buffers = [torch.empty(_PIECE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        stream = torch.cuda.current_stream(data.device)  # after whatever wrote the weights

        def send(index: int) -> tuple[torch.Tensor, Any]:
            piece = data[starts[index] : starts[index] + _PIECE_BYTES]
            host = self.buffers[index % 2][: piece.numel()]
            host.copy_(piece, non_blocking=True)
            return host, stream.record_event()

        sent = send(0)
        for index in range(len(starts)):
            host, copied = sent
            if index + 1 < len(starts):  # into the buffer the caller hashed before asking for this one
                sent = send(index + 1)
            copied.synchronize()
            yield host.numpy()
