"""One request's load on the connector's worker side (`kvstore_client.vllm.worker`).

- `Load(spec, parts)`: the load's parts (a handle and the chunks it covers), the event after its
  scratch copy and the event after all of it; `done()`: whether all of it has finished.
- `queue_parts(load, side, cache, client, keys, stream)`: queues the load's parts on `stream`: a
  chunk whose first blocks vLLM already holds through the group's scratch cache, of which only
  the remaining blocks are copied into vLLM's, then the other chunks straight into vLLM's blocks.
- `record_event(stream)`: an event recorded on `stream` now (None without a stream).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from kvstore_client.client import KVStoreClient
from kvstore_client.handles import LoadHandle
from kvstore_client.vllm.layouts import GroupCache
from kvstore_client.vllm.metadata import LoadSpec
from kvstore_client.vllm.worker_groups import GroupSide


class Load:
    """One request's load: its parts (a handle and the chunks it covers), the event after its
    scratch copy (every layer of the first chunk, queued before the other chunks) and the event
    after all of it (None on the CPU, where both are done when the load starts)."""

    def __init__(
        self,
        spec: LoadSpec,
        parts: list[tuple[LoadHandle, int, int]],
        copied: Any = None,
        event: Any = None,
    ) -> None:
        self.spec = spec
        self.parts = parts
        self.copied = copied
        self.event = event

    def done(self) -> bool:
        return (self.event is None or self.event.query()) and all(
            handle.done() for handle, _, _ in self.parts
        )


def queue_parts(
    load: Load,
    side: GroupSide,
    cache: GroupCache,
    client: KVStoreClient,
    keys: tuple[bytes, ...],
    stream: Any,
    *,
    layerwise: bool,
) -> None:
    """Queues the parts of `load` (this rank's `keys`) on `stream`, each added to `load.parts` as
    it is queued: a failure midway keeps those queued before it."""
    spec = load.spec
    ratio, per_chunk = cache.ratio, spec.chunk_tokens // cache.spec.block_size
    first = spec.first
    if spec.skip:  # the chunk's first blocks are vLLM's (or none): through the scratch cache
        scratch = side.scratch_cache(per_chunk)
        handle = client.load_async(None, scratch, list(range(per_chunk)), keys=keys[:1], stream=stream)
        load.parts.append((handle, first, first + 1))
        if handle.tokens:
            target = cache.kernel_blocks(spec.block_ids[spec.skip : per_chunk // ratio])
            copy_blocks(cache, scratch, spec.skip * ratio, target, stream)
            load.copied = record_event(stream)
        first += 1
    if first < spec.stop and all(handle.tokens for handle, _, _ in load.parts):
        handle = client.load_async(
            None,
            side.registered,
            cache.kernel_blocks(spec.block_ids[(first - spec.first) * (per_chunk // ratio) :]),
            keys=keys[first - spec.first :],
            stream=stream,
            layerwise=layerwise,
        )
        load.parts.append((handle, first, spec.stop))


def copy_blocks(
    cache: GroupCache, scratch: list[torch.Tensor], skip: int, block_ids: list[int], stream: Any
) -> None:
    """Scratch blocks `skip..` -> `block_ids` of the group, every layer, on `stream` after the scatter."""
    target = torch.tensor(block_ids, dtype=torch.int64, device=cache.tensors[0].device)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for tensor, source in zip(cache.tensors, scratch, strict=True):
            tensor.index_copy_(0, target, source[skip : skip + len(block_ids)])


def record_event(stream: Any) -> Any:
    """An event recorded on `stream` now (None without a stream: the CPU's work is done)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event
