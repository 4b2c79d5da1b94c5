"""Staged copy-engine path: pages packed on the GPU, moved over PCIe by the copy engines.

- `why_not(spec, plan, staging_bytes)`: None when the staged path can move `plan`, else why.
- `pieces(spec, plan, staging_bytes)` (`staged_pieces`): the transfer cut into `Piece`s, each
  one contiguous run of a page's stored layers that fits one staging slot (a whole page when
  it fits); where a page takes at most half a slot, a slot moves several whole pages.
- `launch(spec, plan, *, to_page, max_programs, staging_bytes, overlap)`: run a validated
  transfer. Gather: per piece, the Triton kernel packs the piece from the KV cache into a
  slot of a device staging ring (device to device, `max_programs` programs for a few tens
  of microseconds), then one `cudaMemcpyAsync` moves the slot to its place in the pinned
  buffer on a copy engine (one per run of its pages that lie one after another there).
  Scatter: the reverse (copy into a slot, then unpack).
- `StagingRing` (`staged_ring`), `ring_for(device, to_page)`: the per-device, per-direction
  ring of `NUM_SLOTS` slots (more, up to `MAX_SLOTS`, where pieces are smaller than a slot of
  `staging_bytes / NUM_SLOTS`), allocated on first use and reused.

Why: the kernel alone must issue PCIe reads and writes from the SMs, which holds SMs for
the whole transfer and slows the model's kernels; the copy engines alone move 1-D copies
of one block slowly (`copy_engine`). Packing first turns any layout into one large copy per
piece, and SMs are busy only while packing, a small part of the time (bench/NOTES-transfer.md,
item 8).

A block id outside the cache (possible only with a device block table) is skipped by the
unpack, as by the kernel; the pack writes zeros for it, so a slot's stale bytes, which
belong to another page, never reach the buffer.

Ordering: the pack and unpack run on the caller's stream, after its earlier work. With
`overlap` the copies run on one side stream per device and direction (so a gather and a
scatter use both copy engines at once), handed over with events; without it everything
runs on the caller's stream. A slot is refilled only after the last use of its previous
contents has run (an event per slot, recorded after that use, waited on before the next),
so the ring is never overwritten while a copy or an unpack still reads it, whichever
stream the calls come from. The caller's stream waits for the copies before the call
returns, so an event recorded after the call covers the whole transfer.

With CPU tensors (tests) the kernel runs in Triton's interpreter and the copies are
`memmove`s, in the same pieces and slots.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from kvstore.shared.spec import KVSpec, PageSpec

from .geometry import Geometry
from .staged_issue import Done
from .staged_issue import issue_cpu as _issue_cpu
from .staged_issue import issue_cuda as _issue_cuda
from .staged_issue import runs as _runs
from .staged_pieces import Piece, layers_per_piece, pages_per_slot, slot_pieces
from .staged_pieces import pieces as pieces  # staged.pieces, as before it moved
from .staged_ring import NUM_SLOTS, StagingRing
from .validate import Transfer

# Chosen on the H100 with 8B-geometry pages of 32 MiB (bench/NOTES-transfer.md, item 8), with
# the ring's `NUM_SLOTS` (`staged_ring`):
# - 32 pack programs: short wide bursts slow the model's products less than long narrow ones
#   (8 or 16 programs); 64 slow them no less than 32.
# - Overlap (packing the next piece during this piece's copy): faster alone, and it keeps the
#   copy near the link's rate beside matrix products, where a serial pack and copy do not.
DEFAULT_STAGING_BYTES = 128 << 20  # per direction and device: 4 slots of 32 MiB, one 8B page each
DEFAULT_PROGRAMS = 32  # pack/unpack programs, so SMs, for the few tens of microseconds of a burst
OVERLAP = True  # copies on a side stream, so packing the next piece overlaps the copy of this one
COPY_STREAMS = 1


def why_not(spec: KVSpec, plan: Transfer, staging_bytes: int) -> str | None:
    """Why the staged path cannot move `plan` (None: it can)."""
    if plan.device.type == "cpu":
        from . import triton_kernel

        if plan.buffer.device.type != "cpu":
            return "the buffer is not on the CPU"
        if not triton_kernel.is_interpreted():
            return "CPU tensors need TRITON_INTERPRET=1 set before import (the kernel packs the pages)"
    elif plan.buffer.device.type != "cpu":
        return "the buffer is in device memory; the copy engines gain nothing there (use the kernel)"
    elif not plan.buffer.is_pinned():
        return "the buffer is pageable host memory; the copy engines need pinned (registered) memory"
    if plan.layers and not layers_per_piece(spec, plan, staging_bytes):
        return (
            f"staging_bytes={staging_bytes} gives {NUM_SLOTS} slots of {staging_bytes // NUM_SLOTS} bytes, "
            f"less than one stored layer of a page ({plan.page.layer_bytes} bytes)"
        )
    return None


def _staged_geometry(spec: KVSpec, plan: Transfer, ring: StagingRing) -> tuple[Transfer, Geometry]:
    """The kernel's view of `plan` (every page packed at the ring's start, its first moved layer at
    0; each launch says where its piece's page would start) and its geometry. A geometry depends
    on the cache's remembered facts (`plan.view_facts`, the same object while they are
    remembered), the layers, the page count and the ring only, so it is kept for the next call."""
    first_position = plan.positions[0]
    staged_plan = plan._replace(
        buffer=ring.memory,
        offsets=(0,) * len(plan.offsets),
        positions=tuple(position - first_position for position in plan.positions),
    )
    key = (
        id(plan.view_facts),
        staged_plan.positions,
        len(plan.offsets),
        ring.memory.data_ptr(),
        spec.block_size,
    )
    with _made:
        kept = _geometries.get(key)
    if kept is not None and kept[0] is plan.view_facts and kept[1] == plan.page:
        return staged_plan, kept[2]
    geometry = Geometry(spec, staged_plan)
    with _made:  # holds the facts (numbers only) so that their id is not reused meanwhile
        _geometries[key] = (plan.view_facts, plan.page, geometry)
        while len(_geometries) > _KEPT_GEOMETRIES:
            del _geometries[next(iter(_geometries))]
    return staged_plan, geometry


_rings: dict[tuple[torch.device, bool], StagingRing] = {}
_geometries: dict[tuple[Any, ...], tuple[Any, PageSpec, Geometry]] = {}
_KEPT_GEOMETRIES = 32
_copy_streams: dict[tuple[torch.device, bool, int], torch.cuda.Stream] = {}
_made = threading.Lock()


def ring_for(device: torch.device, to_page: bool) -> StagingRing:
    """The staging ring of one device and direction, made on first use."""
    with _made:
        key = (device, to_page)
        if key not in _rings:
            _rings[key] = StagingRing(device)
        return _rings[key]


def _copy_stream(device: torch.device, to_page: bool, index: int = 0) -> torch.cuda.Stream:
    with _made:
        key = (device, to_page, index)
        if key not in _copy_streams:
            _copy_streams[key] = torch.cuda.Stream(device)
        return _copy_streams[key]


def launch(
    spec: KVSpec,
    plan: Transfer,
    *,
    to_page: bool,
    max_programs: int | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    overlap: bool = OVERLAP,
    copy_streams: int = COPY_STREAMS,
) -> None:
    """Enqueue a validated transfer through the staging ring, ordered on the current stream.

    `copy_streams` (with `overlap`): side streams the copies alternate between, so one copy
    is queued while another runs."""
    if not plan.offsets or not plan.layers:
        why_not_raise(spec, plan, staging_bytes)
        programs_of(max_programs)
        return
    staged = Staged(spec, plan, to_page=to_page, max_programs=max_programs, staging_bytes=staging_bytes)
    staged.issue(range(len(plan.offsets)), plan.offsets, overlap=overlap, copy_streams=copy_streams)


def why_not_raise(spec: KVSpec, plan: Transfer, staging_bytes: int) -> None:
    reason = why_not(spec, plan, staging_bytes)
    if reason is not None:
        raise ValueError(f"engine='staged': {reason}")


def programs_of(max_programs: int | None) -> int:
    """The pack/unpack programs asked for (None: the default), checked."""
    programs = DEFAULT_PROGRAMS if max_programs is None else max_programs
    if programs < 1:
        raise ValueError(f"max_programs: expected a positive integer, got {programs}")
    return programs


class Staged:
    """A validated transfer set up for the staging ring: its ring, the kernel's view of it and the
    kernel's arguments (tables uploaded on the current stream). `issue(pages, offsets)` then
    queues pages of the plan (indices into its pages) at byte offsets in its buffer: every page
    at once (`launch`), or pages chosen later (`kvstore_kernels.prepare`: set up while the
    daemon answers, issued once its reply names the pages and their slots). Issue on the stream
    that was current when it was made, or on one ordered after it."""

    def __init__(
        self,
        spec: KVSpec,
        plan: Transfer,
        *,
        to_page: bool,
        max_programs: int | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ) -> None:
        why_not_raise(spec, plan, staging_bytes)
        self.spec, self.plan, self.to_page = spec, plan, to_page
        self.programs = programs_of(max_programs)
        self.per_piece = layers_per_piece(spec, plan, staging_bytes)
        self.staging_bytes = staging_bytes
        self.page_span = self.per_piece * plan.page.layer_bytes
        self.per_slot = pages_per_slot(plan, self.per_piece, staging_bytes)
        self.ring = ring_for(plan.device, to_page)
        self.cuda = plan.device.type == "cuda"
        with self.ring.lock, torch.cuda.device(plan.device) if self.cuda else nullcontext():
            self._set_up()

    def _set_up(self) -> None:
        """The kernel's arguments for the ring as it is now (its lock held)."""
        from . import triton_copy

        plan, ring = self.plan, self.ring
        ring.reserve(self.per_slot * self.page_span, self.staging_bytes)
        self.memory = ring.memory
        staged_plan, geometry = _staged_geometry(self.spec, plan, ring)
        self.kernel = triton_copy.Launch(self.spec, staged_plan, geometry, to_page=self.to_page, staged=True)
        self.segments_per_layer = len(plan.view_facts[0]) * geometry.blocks_per_chunk

    def renewed(self, plan: Transfer) -> Staged:
        """This setup for `plan`: the same cache, layers, buffer and page count with other block
        ids (`validate.replan`). Only the kernel's tables are made and uploaded again, on the
        current stream; the ring, the kernel's view and its shape are this one's."""
        other = copy.copy(self)
        other.plan = plan
        with self.ring.lock, torch.cuda.device(plan.device) if self.cuda else nullcontext():
            if self.ring.memory is not self.memory:  # another transfer grew the ring since
                other._set_up()
            else:
                other.kernel = self.kernel.with_blocks(plan.blocks)
        return other

    def issue(
        self,
        pages: Iterable[int],
        offsets: Sequence[int],
        *,
        overlap: bool = OVERLAP,
        copy_streams: int = COPY_STREAMS,
        marks: Sequence[int] = (),
    ) -> list[Done | None]:
        """Queue `pages` (indices into the plan's pages; checked by the caller) at `offsets` (one
        per page, in the plan's buffer, checked by the caller) on the current stream.

        `marks`: increasing counts m of first pages: for each, a `Done` right after pages[:m]'s
        copies (None: CPU tensors); a store committed in parts is one transfer, not one a part."""
        plan, ring, to_page = self.plan, self.ring, self.to_page
        if not plan.layers:
            return [None] * len(marks)
        layer_bytes = plan.page.layer_bytes
        cuda = self.cuda
        with ring.lock, torch.cuda.device(plan.device) if cuda else nullcontext():
            if ring.memory is not self.memory:  # another transfer grew the ring since: set up again
                self._set_up()
            kernel, programs = self.kernel, self.programs
            segments_per_layer = self.segments_per_layer
            segments_per_page = len(plan.layers) * segments_per_layer
            host = plan.buffer.data_ptr()
            stream = torch.cuda.current_stream(plan.device).cuda_stream if cuda else None
            ring_base = ring.memory.data_ptr()
            slot_bytes = ring.slot_bytes
            # A piece's `page` is its index j in `pages` here: plan page pages[j] at offsets[j].
            pages = list(pages)
            if len(pages) != len(offsets):
                raise ValueError(f"pages and offsets: {len(pages)} pages but {len(offsets)} offsets")
            breaks = _breaks(marks, len(pages))
            work = slot_pieces(pages, len(plan.layers), self.per_piece, self.per_slot, breaks)
            page_span = self.page_span

            def pack(piece: Piece, slot: int) -> None:
                first = pages[piece.page] * segments_per_page + piece.first_layer * segments_per_layer
                end = (
                    pages[piece.page + piece.pages - 1] * segments_per_page
                    + piece.stop_layer * segments_per_layer
                )
                base = ring_base + slot * slot_bytes - piece.first_layer * layer_bytes
                kernel.run(first, end, programs, (base, page_span), stream)

            def span(piece: Piece) -> list[tuple[int, int, int]]:
                """(host address, offset in the slot, bytes) of each run of the piece's pages that
                lie one after another in the buffer: one copy each."""
                at = host + plan.positions[piece.first_layer] * layer_bytes
                size = (piece.stop_layer - piece.first_layer) * layer_bytes
                return _runs([at + offsets[piece.page + k] for k in range(piece.pages)], size, page_span)

            if stream is None:
                _issue_cpu(ring, work, pack, span, to_page=to_page)
                return [None] * len(breaks)
            streams = max(1, copy_streams) if overlap else 0
            sides = [_copy_stream(plan.device, to_page, i) for i in range(streams)]
            marked = (breaks, len(plan.layers))
            return list(_issue_cuda(ring, work, pack, span, stream, sides, to_page=to_page, marked=marked))


def _breaks(marks: Sequence[int], pages: int) -> frozenset[int]:
    """`Staged.issue`'s marks, checked: increasing counts of its first pages, short of all."""
    breaks = frozenset(marks)
    if list(marks) != sorted(breaks) or any(not 0 < mark < pages for mark in breaks):
        raise ValueError(f"marks: expected increasing counts in 1..{pages - 1}, got {list(marks)}")
    return breaks
