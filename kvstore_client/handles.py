"""Handles of transfers in flight: what `store_async` and `load_async` return.

A handle holds the daemon lease and a completion event recorded after the
transfer was enqueued on its stream (or, for a store through the bounce ring,
`bounce.HostCompletion`, which answers the same two questions on the host).
`wait()` blocks until the bytes moved, then finishes the protocol (Commit for a
store, Release for a load) and returns the result; an error raised by the
transfer, or by that last RPC, surfaces there. `done()` asks without blocking.

A layer-wise load (`load_async(..., layerwise=True)`) records an event after each run of
layers it moves (1, 1, 2, 4, ... layers): `wait_layer(i)` makes the current stream wait
for layer i's run alone, so a model's layer i runs while later layers still cross PCIe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class TransferHandle:
    def __init__(
        self,
        event: torch.cuda.Event | None,
        finish: Callable[[], int],
        fail: Callable[[BaseException], object],
    ) -> None:
        self.event = event  # None: the transfer already completed on the CPU
        self._finish = finish
        self._fail = fail
        self._result: int | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._result is not None or self._error is not None or self.event is None or self.event.query()

    def wait(self) -> int:
        """Blocks until the transfer completed; returns its result or raises its error."""
        if self._error is not None:
            raise self._error
        if self._result is None:
            try:
                if self.event is not None:
                    self.event.synchronize()
                self._result = self._finish()
            except BaseException as exc:
                self._error = exc
                self._fail(exc)
                raise
        return self._result

    def wait_stream(self, stream: Any) -> None:
        """Makes `stream` wait for the transfer on the device, without blocking the host (for a
        store through the bounce ring: for its reads of the KV cache; its copies into the arena
        end on the host, and `wait()` waits for them).

        The protocol still needs `wait()` (Commit or Release) once the caller is done.
        """
        event = getattr(self.event, "gathered", self.event)  # a bounced store: its last gather
        if event is not None:
            stream.wait_event(event)


class StoreHandle(TransferHandle):
    """`wait()` commits the pages and returns how many chunks were newly stored."""

    def __init__(
        self,
        event: torch.cuda.Event | None,
        finish: Callable[[], int],
        fail: Callable[[BaseException], object],
        chunks: int,
        positions: Sequence[int] = (),
        early: Callable[[], None] | None = None,
        progress: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(event, finish, fail)
        self.chunks = chunks  # chunks being written (not yet stored)
        self.positions = positions  # their indices among the call's chunks
        self._early = early  # run by the first wait(), before it waits for the last pages
        self._progress = progress  # the early Commits of the parts written already, without waiting

    def progress(self) -> None:
        """Commits the pages of a store issued in parts that are written already, without
        blocking. An engine that waits for its stores only once they are `done()` calls it at
        each step, so the first pages are stored (every worker's lookups find them) while the
        last ones are still being copied."""
        if self._progress is not None and self._result is None and self._error is None:
            self._progress()

    def wait(self) -> int:
        """Blocks until the pages are written and commits them; returns how many were new. A store
        issued in parts commits its first pages once they are written, while the last ones are
        still being copied."""
        early, self._early = self._early, None
        if early is not None and self._result is None and self._error is None:
            early()
        return super().wait()


class LoadHandle(TransferHandle):
    """`wait()` releases the lease and returns how many leading tokens are valid in the KV cache.

    `layers`: the engine layers this load writes. `layer_events[i]`: the event after which
    layer i's KV is in place (None: already there); without a layer-wise load every layer
    shares the whole load's event.
    """

    def __init__(
        self,
        event: torch.cuda.Event | None,
        finish: Callable[[], int],
        fail: Callable[[BaseException], object],
        tokens: int,
        layers: range = range(0),
        layer_events: dict[int, torch.cuda.Event | None] | None = None,
        early: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(event, finish, fail)
        self.tokens = tokens  # tokens being loaded, if every chunk arrives
        self.layers = layers
        self.layer_events = layer_events if layer_events is not None else dict.fromkeys(layers, event)
        self._early = early  # run by the first wait(), before it waits for the copy (a lent read's answer)

    def wait(self) -> int:
        early, self._early = self._early, None
        if early is not None and self._result is None and self._error is None:
            try:
                early()
            except BaseException as exc:
                self._error = exc
                self._fail(exc)
                raise
        return super().wait()

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Makes `stream` (default: the current CUDA stream) wait until `layer`'s KV is in place.

        The host does not block; a load with nothing to move returns at once. The lease is
        still released by `wait()` once the caller has used the KV.
        """
        if self.tokens == 0:
            return
        if layer not in self.layer_events:
            raise ValueError(f"layer: {layer} is not among this load's layers {self.layers!r}")
        event = self.layer_events[layer]
        if event is not None:
            (stream if stream is not None else torch.cuda.current_stream()).wait_event(event)

    def layer_done(self, layer: int) -> bool:
        """Whether `layer`'s KV is in place, without blocking."""
        event = self.layer_events.get(layer)
        return event is None or event.query()
