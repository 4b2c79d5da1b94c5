"""How the staged path queues its pieces (`staged.Staged.issue`): slot by slot, pack then copy or
copy then unpack, on the caller's stream and the copy streams (`issue_cuda`), or in turn on CPU
tensors (`issue_cpu`); `runs`, the copies of one slot; `Done`, where a transfer's first pages are
in place."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Sequence

import torch

from . import cudart
from .staged_pieces import Piece
from .staged_ring import StagingRing


class Done:
    """Where a staged transfer's first pages are in place (`Staged.issue`'s `marks`): events after
    their copies on every stream that copies (or unpacks) for the transfer."""

    def __init__(self, streams: Sequence[torch.cuda.Stream]) -> None:
        self.events: list[torch.cuda.Event] = []
        for stream in streams:
            event = torch.cuda.Event()
            event.record(stream)
            self.events.append(event)

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()

    def query(self) -> bool:
        return all(event.query() for event in self.events)


def runs(addresses: list[int], size: int, stride: int) -> list[tuple[int, int, int]]:
    """(host address, offset in the slot, bytes) of each run of a slot's pages (`size` bytes at
    each of `addresses` in the buffer, `stride` apart in the slot) that lie one after another on
    both sides: one copy each."""
    runs: list[tuple[int, int, int]] = []
    for k, at in enumerate(addresses):
        last = runs[-1] if runs else None
        if last and last[0] + last[2] == at and last[1] + last[2] == k * stride:
            runs[-1] = (last[0], last[1], last[2] + size)
        else:
            runs.append((at, k * stride, size))
    return runs


def issue_cpu(
    ring: StagingRing,
    work: Iterable[Piece],
    pack: Callable[[Piece, int], None],
    span: Callable[[Piece], list[tuple[int, int, int]]],
    *,
    to_page: bool,
) -> None:
    """Every piece in turn with CPU tensors (tests): pack then `memmove`s, or the reverse."""
    for piece in work:
        slot = ring.take()
        if to_page:
            pack(piece, slot)
        for at, within, size in span(piece):
            if to_page:
                ctypes.memmove(at, ring.address(slot) + within, size)
            else:
                ctypes.memmove(ring.address(slot) + within, at, size)
        if not to_page:
            pack(piece, slot)


def issue_cuda(
    ring: StagingRing,
    work: Iterable[Piece],
    pack: Callable[[Piece, int], None],
    span: Callable[[Piece], list[tuple[int, int, int]]],
    current: int,
    side_streams: Sequence[torch.cuda.Stream],
    *,
    to_page: bool,
    marked: tuple[frozenset[int], int] = (frozenset(), 0),
) -> list[Done]:
    """Queue every piece: pack then copy (gather) or copy then unpack (scatter), slot by slot.
    `current`: the caller's stream (its handle). `side_streams`: the streams the copies take in
    turn, each piece's slot handed over with events (none: the copies run on `current`).
    `marked`: counts of first pages, and a page's moved layers: a `Done` after each piece that
    ends such a count's last page, returned in order."""
    runtime = cudart.runtime()
    record, wait, memcpy = runtime.event_record, runtime.stream_wait_event, runtime.memcpy_async
    overlap = bool(side_streams)
    sides = [side.cuda_stream for side in side_streams] or [current]
    (breaks, layers), done = marked, list[Done]()
    # A mark's pages are in place once the streams that write them ran past it.
    writers = side_streams if to_page and overlap or not breaks else [torch.cuda.ExternalStream(current)]
    if overlap and not to_page:
        # The copies read pages that work queued earlier on the caller's stream may write.
        record(ring.started, current)
        for side in sides:
            wait(side, ring.started)
    last: dict[int, int] = {}  # per side stream: the slot of its last copy
    for index, piece in enumerate(work):
        slot = ring.take()
        copies = sides[index % len(sides)]
        free, ready, address = ring.free[slot], ring.ready[slot], ring.address(slot)
        spans = span(piece)
        if to_page:
            wait(current, free)  # the copy out of this slot's last contents has run
            pack(piece, slot)
            if overlap:
                record(ready, current)
                wait(copies, ready)
            for at, within, size in spans:
                memcpy(at, address + within, size, copies)
            record(free, copies)
            last[copies] = slot
        else:
            wait(copies, free)  # the unpack of this slot's last contents has run
            for at, within, size in spans:
                memcpy(address + within, at, size, copies)
            if overlap:
                record(ready, copies)
                wait(current, ready)
            pack(piece, slot)
            record(free, current)
        if piece.stop_layer == layers and piece.page + piece.pages in breaks:
            done.append(Done(writers))
    if overlap and to_page:
        for slot in last.values():  # each side runs its copies in order: its last covers them
            wait(current, ring.free[slot])
    return done
