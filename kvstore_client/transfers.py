"""Moving pages between an engine's KV cache and a buffer: on the caller's device, ordered on streams.

- `cache_device(kv_caches)`: the device of an engine's KV cache.
- `layer_groups(layers, runs)`: the runs of layers a layer-wise load moves and signals on their own.
- `Streams`: one side stream per device; `enqueue(transfer, ...)` runs a gather or scatter there
  (on CUDA, after the caller's current stream: the caller's stream is never blocked) and returns
  its completion event; `settle(kv_caches)` waits for whatever a failed call enqueued.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstore.shared.spec import KVSpec

log = logging.getLogger(__name__)


def cache_device(kv_caches: Any) -> torch.device:
    """The device of an engine's KV cache (a tensor, a list of them, or a list of (k, v) pairs)."""
    first = kv_caches
    while isinstance(first, list | tuple) and first:
        first = first[0]
    return first.device if isinstance(first, torch.Tensor) else torch.device("cpu")


def layer_groups(layers: range, runs: int) -> list[range]:
    """`layers` cut into at most `runs` consecutive runs of 1, 1, 2, 4, ... layers, the last
    run taking the rest.

    A layer-wise load moves and signals each run on its own: the first layers arrive first,
    and the host issues `runs` calls. Each call costs host time that the model's own forward
    would otherwise use, so few runs are best where the forward is host-bound
    (`KVStoreClient.layerwise_runs`, measured in bench/NOTES-ttft.md).
    """
    if runs < 1:
        raise ValueError(f"runs: expected a positive integer, got {runs}")
    groups: list[range] = []
    start, size = layers.start, 1
    while start < layers.stop:
        stop = layers.stop if len(groups) == runs - 1 else min(start + size, layers.stop)
        groups.append(range(start, stop))
        size = size * 2 if len(groups) > 1 else 1
        start = stop
    return groups


# cudaStreamLegacy: the legacy default stream (torch's default stream, handle 0) named as such, so
# that the record means that stream whatever default-stream mode the binding's calls would get.
LEGACY_STREAM = 1


def _current_stream(device: torch.device) -> int:
    """The handle of `device`'s current stream (torch's raw call where it has one: no Stream object
    made on the transfers' path)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device.index))
    return int(torch.cuda.current_stream(device).cuda_stream)


class Streams:
    def __init__(self) -> None:
        self._side: dict[torch.device, Any] = {}
        self._ordering: dict[torch.device, int] = {}  # per device: a raw event that orders the side stream

    def side(self, device: torch.device) -> Any:
        """This client's side stream on `device` (made once)."""
        stream = self._side.get(device)
        if stream is None:
            stream = self._side[device] = torch.cuda.Stream(device)
        return stream

    def ordered_side(self, device: torch.device) -> Any:
        """The side stream, after the work queued so far on the caller's current stream (one raw
        event per device, recorded there and waited on here: a wait takes the event's latest
        record, so one event serves every call; torch's `wait_stream` makes a new one each time)."""
        stream = self.side(device)
        from kvstore_kernels import cudart

        runtime = cudart.runtime()
        event = self._ordering.get(device)
        if event is None:
            with torch.cuda.device(device):
                event = self._ordering[device] = runtime.event_create()
        current = _current_stream(device)
        if current == 0:  # torch's default stream
            with torch.cuda.device(device):
                runtime.event_record(event, LEGACY_STREAM)
        else:
            runtime.event_record(event, current)
        runtime.stream_wait_event(stream.cuda_stream, event)
        return stream

    def enqueue(
        self,
        transfer: Callable[..., None],
        spec: KVSpec,
        kv_caches: Any,
        block_ids: Any,
        chunks: Sequence[int],
        buffer: torch.Tensor,
        offsets: list[int],
        layers: range | None,
        stream: Any,
    ) -> torch.cuda.Event | None:
        """Runs `transfer`; on CUDA enqueues it on `stream` (default: the ordered side stream) and
        returns its completion event."""
        device = cache_device(kv_caches)
        if device.type != "cuda":
            transfer(spec, kv_caches, block_ids, chunks, buffer, offsets, layers)
            return None
        if stream is None:
            stream = self.ordered_side(device)
        transfer(spec, kv_caches, block_ids, chunks, buffer, offsets, layers, stream=stream)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def synchronize(self) -> None:
        """Waits for every transfer on the side streams."""
        for stream in self._side.values():
            stream.synchronize()

    @staticmethod
    def settle(kv_caches: Any) -> None:
        """Waits for transfers a failed call may have enqueued, before its slots are given up."""
        device = cache_device(kv_caches)
        if device.type == "cuda":
            try:
                torch.cuda.synchronize(device)
            except Exception:
                log.debug("synchronizing after a failed transfer failed", exc_info=True)
