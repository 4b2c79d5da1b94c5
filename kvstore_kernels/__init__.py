"""Page transfer between an engine's KV cache and pages in a flat uint8 buffer.

- `gather(spec, kv_caches, block_ids, chunks, buffer, offsets, layers=None, *, batch_index=0,
  stream=None, options=None)`: engine KV cache -> one page per chunk at `buffer[offsets[j]:]`.
- `scatter(...)`: pages -> engine KV cache, the exact inverse.
- `TransferOptions(max_programs=None, engine="auto", staging_bytes=128 MiB)`: SM cap, engine
  choice and the staged path's ring size (`routing`); `engine="torch"` takes the torch
  reference (`reference`), the tests' oracle.

These two are the only entry points with the transfer's arguments. Each checks them once
(`validate.plan_transfer`) into a `Transfer`, and every path takes that checked plan:
`triton_copy.launch`, `copy_engine.launch`, `staged.launch`, `reference.gather_plan` /
`scatter_plan`.

The buffer is host memory (pinned for the GPU paths), the KV cache's device, or another GPU
the cache's device reaches over peer access (`peer`: turned on once per pair; a GPU-tier pool
of another device, over NVLink): the kernel then reads or writes it in place.

A page is layer-major, `[stored_layer][k|v][token][kv_head][head_dim]` (MLA:
`[stored_layer][token][latent]`), whatever the engine's layout (`spec.layout`).

Engines: the Triton kernel (`triton_copy`), the GPU's copy engines (`copy_engine`), the
kernel packing into a device ring that the copy engines move (`staged`), or the torch
reference; `routing` documents the auto rule. `KVSTORE_KERNELS=triton` or `=torch`
forces the kernel or the reference under engine="auto"; forced Triton on CPU tensors needs
`TRITON_INTERPRET=1` set before import.

Work is enqueued on `stream` (default: the current stream) and the call returns without
waiting for the GPU, except on the reference path (a CPU cache or a pageable buffer). The
caller keeps the cache and the buffer alive, and unchanged by other streams, until the
stream has run the copy (record an event after the call). Pass the block table on the
host (list, numpy, CPU tensor) to have it checked; a CUDA block table is not read back:
see `validate`. The checks of the cache tensors (and the views made of them) are remembered
per tensor fingerprint (`cache_facts`), so a call on tensors seen before checks only its
block table, chunks, offsets and buffer: a fraction of the first call's host time
(bench/NOTES-transfer.md, item 9a).
`register(spec, kv_caches)` checks an engine's tensors once and returns them as
`RegisteredCaches`: calls given that object skip the fingerprints too (the engine promises
the tensors keep their storage, shape and strides, as vLLM's `register_kv_caches` does).
`prepare(spec, kv_caches, block_ids, chunks, buffer, layers, to_page=...)` checks a transfer of
every chunk and sets it up (the staged path's kernel arguments too) before its page offsets are
known; `Prepared.run(pages, offsets, marks=())` then moves the pages that turn out to be wanted,
with only those offsets left to check (and, at each mark, an event once the pages before it are
in place): a store or load does the setup while the daemon answers.
`check_blocks(spec, kv_caches, block_ids, chunks, writes_cache=...)` checks a host block
table's first chunks ahead of the calls that use it (`validate`): a load does it while its
Lookup is in flight. A scatter from a device buffer given both (registered caches, checked
blocks) takes a shorter path (`device_scatter`: the GPU tier's loads).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from kvstore.shared.spec import KVSpec

from . import reference
from .cache_facts import RegisteredCaches, register
from .kept import Kept, without_references
from .layouts import KVCaches
from .routing import TransferOptions, backend_name, choose
from .validate import CheckedBlocks, Transfer, check_blocks, facts_of, plan_pages, plan_transfer, replan

__all__ = [
    "gather",
    "scatter",
    "prepare",
    "Prepared",
    "TransferOptions",
    "RegisteredCaches",
    "register",
    "check_blocks",
    "CheckedBlocks",
    "backend_name",
    "copy_blocks",
]


def __getattr__(name: str) -> Any:  # `copy_blocks` (`blocks`) imports Triton: imported on first use
    if name == "copy_blocks":
        return __import__(f"{__name__}.blocks", fromlist=["copy_blocks"]).copy_blocks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def gather(
    spec: KVSpec,
    kv_caches: KVCaches,
    block_ids: Any,
    chunks: Sequence[int],
    buffer: torch.Tensor,
    offsets: Sequence[int],
    layers: range | None = None,
    *,
    batch_index: int = 0,
    stream: torch.cuda.Stream | None = None,
    options: TransferOptions | None = None,
) -> None:
    """Engine KV cache -> pages: chunk `chunks[j]` becomes the page at `buffer[offsets[j]:]`.

    With `layers`, only the spans of those engine layers are written; layers that reuse
    another's KV (`spec.kv_sharing`) are not stored and are skipped.
    """
    _transfer(spec, kv_caches, block_ids, chunks, buffer, offsets, layers, batch_index, stream, options, True)


def scatter(
    spec: KVSpec,
    kv_caches: KVCaches,
    block_ids: Any,
    chunks: Sequence[int],
    buffer: torch.Tensor,
    offsets: Sequence[int],
    layers: range | None = None,
    *,
    batch_index: int = 0,
    stream: torch.cuda.Stream | None = None,
    options: TransferOptions | None = None,
) -> None:
    """Pages -> engine KV cache: the page at `buffer[offsets[j]:]` fills chunk `chunks[j]`'s blocks.

    With `layers`, only those engine layers are written; shared layers are never written.
    """
    _transfer(
        spec, kv_caches, block_ids, chunks, buffer, offsets, layers, batch_index, stream, options, False
    )


def _transfer(
    spec: KVSpec,
    kv_caches: KVCaches,
    block_ids: Any,
    chunks: Sequence[int],
    buffer: torch.Tensor,
    offsets: Sequence[int],
    layers: range | None,
    batch_index: int,
    stream: torch.cuda.Stream | None,
    options: TransferOptions | None,
    to_page: bool,
) -> None:
    if (
        type(block_ids) is CheckedBlocks
        and options is None
        and not to_page
        and not batch_index
        and isinstance(buffer, torch.Tensor)
        and buffer.is_cuda
    ):
        from . import device_scatter  # the GPU tier's hot path, where it applies

        if device_scatter.scatter(spec, kv_caches, block_ids, chunks, buffer, offsets, layers, stream):
            return
    options = options or TransferOptions()
    if not isinstance(options, TransferOptions):
        raise ValueError(f"options: expected a TransferOptions, got {type(options).__name__}")
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        plan = plan_transfer(
            spec, kv_caches, block_ids, chunks, buffer, offsets, layers, batch_index, writes_cache=not to_page
        )
        if stream is not None and plan.device != stream.device:
            raise ValueError(f"stream: on {stream.device}, but the KV cache is on {plan.device}")
        _run(spec, plan, options, to_page)


def _run(spec: KVSpec, plan: Transfer, options: TransferOptions, to_page: bool) -> None:
    route = choose(spec, plan, options, to_page=to_page)
    geometry = route.geometry  # computed once where the rule needed it; the staged path makes its own
    if route.engine == "kernel":
        from . import triton_copy

        triton_copy.launch(spec, plan, to_page=to_page, max_programs=options.max_programs, geometry=geometry)
    elif route.engine == "copy_engine":
        from . import copy_engine

        copy_engine.launch(spec, plan, to_page=to_page, geometry=geometry)
    elif route.engine == "staged":
        from . import staged

        programs, staging_bytes = options.max_programs, options.staging_bytes
        staged.launch(spec, plan, to_page=to_page, max_programs=programs, staging_bytes=staging_bytes)
    elif to_page:
        reference.gather_plan(plan)
    else:
        reference.scatter_plan(plan)


def prepare(
    spec: KVSpec,
    kv_caches: KVCaches,
    block_ids: Any,
    chunks: Sequence[int],
    buffer: torch.Tensor,
    layers: range | None = None,
    *,
    to_page: bool,
    batch_index: int = 0,
    stream: torch.cuda.Stream | None = None,
    options: TransferOptions | None = None,
) -> Prepared:
    """A gather (`to_page`) or scatter of `chunks` checked, and set up where the staged path moves
    it, before the pages' offsets in `buffer` are known: `run(pages, offsets)` moves some of
    them. The same checks as `gather` / `scatter` (a ValueError here or in `run`); the setup's
    small uploads are queued on `stream` (default: the current one), where `run` queues too.

    With `RegisteredCaches` (tensors that keep their storage, shape and strides), what does not
    depend on the block table is kept on that object (`Kept`) for the next call with the same
    spec, layers, buffer and direction: that call checks its chunks and block table and uploads
    the kernel's tables, nothing else."""
    options = options or TransferOptions()
    if not isinstance(options, TransferOptions):
        raise ValueError(f"options: expected a TransferOptions, got {type(options).__name__}")
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        kept = Kept.of(spec, kv_caches, buffer, layers, batch_index, to_page, options)
        plan = _prepared_plan(spec, kv_caches, block_ids, chunks, buffer, layers, batch_index, to_page, kept)
        if stream is not None and plan.device != stream.device:
            raise ValueError(f"stream: on {stream.device}, but the KV cache is on {plan.device}")
        staged_path = _staged_path(spec, plan, options, to_page, kept)
    prepared = Prepared(spec, plan, options, to_page, stream, staged_path)
    prepared._chunks, prepared.layers = chunks, layers
    return prepared


def _prepared_plan(
    spec: KVSpec,
    kv_caches: KVCaches,
    block_ids: Any,
    chunks: Sequence[int],
    buffer: torch.Tensor,
    layers: range | None,
    batch_index: int,
    to_page: bool,
    kept: Kept | None,
) -> Transfer:
    """The checked plan of every chunk, offsets not known yet: the kept plan with this call's
    chunks and block table, or a new one (then kept, where `kept` is given)."""
    writes_cache = not to_page
    if kept is not None and kept.plan is not None:
        plan = replan(kept.plan, kept.facts, block_ids, chunks, writes_cache=writes_cache)
        return plan._replace(buffer=buffer, kv_caches=kv_caches)
    plan = plan_transfer(
        spec, kv_caches, block_ids, chunks, buffer, None, layers, batch_index, writes_cache=writes_cache
    )
    if kept is not None:
        kept.plan, kept.facts = without_references(plan), facts_of(spec, kv_caches, layers, batch_index)
    return plan


def _staged_path(
    spec: KVSpec, plan: Transfer, options: TransferOptions, to_page: bool, kept: Kept | None
) -> Any:
    """The staged path's setup of `plan` where the route takes the staged path, else None."""
    if not (plan.layers and len(plan.blocks)):
        return None
    every = plan._replace(offsets=(0,) * len(plan.blocks))  # the staged path's view: no offsets
    staged = kept.staged if kept is not None else None
    if staged is None:
        staged = choose(spec, every, options, to_page=to_page).engine == "staged"
        if kept is not None and staged:  # a buffer not pinned yet may be later: asked again
            kept.staged = staged
    if staged:
        return _staged(spec, every, to_page, options, kept)
    return None


def _staged(spec: KVSpec, every: Transfer, to_page: bool, options: TransferOptions, kept: Kept | None) -> Any:
    """The staged path's setup of `every`: made, or a kept one of as many pages renewed."""
    from .staged import Staged

    pages = len(every.blocks)
    setup = kept.setups.get(pages) if kept is not None else None
    if setup is not None:
        return setup.renewed(every)
    setup = Staged(
        spec, every, to_page=to_page, max_programs=options.max_programs, staging_bytes=options.staging_bytes
    )
    if kept is not None:
        if len(kept.setups) >= Kept.MAX_SETUPS:  # one call, atomic: transfers on other threads
            kept.setups.clear()
        template = copy.copy(setup)
        template.plan = without_references(every)
        kept.setups[pages] = template
    return setup


class Prepared:
    """A transfer of some chunks, checked (and set up) ahead of its offsets (`prepare`)."""

    def __init__(
        self,
        spec: KVSpec,
        plan: Transfer,
        options: TransferOptions,
        to_page: bool,
        stream: torch.cuda.Stream | None,
        staged_path: Any,
    ) -> None:
        self.spec, self.plan, self.options, self.to_page = spec, plan, options, to_page
        self.stream = stream
        self._staged = staged_path
        self._chunks: Sequence[int] = ()
        self.layers: range | None = None  # the layers asked for (None: every layer)

    @property
    def chunks(self) -> int:
        """How many chunks it was prepared for (`run` takes pages among 0..chunks-1)."""
        return len(self.plan.blocks)

    def checked_blocks(self, block_ids: Any) -> Any:
        """`block_ids` (the table `prepare` took) as `check_blocks` would give it for the prepared
        chunks, where they are chunks 0..n-1 of a host table: their blocks were checked here."""
        plan = self.plan
        if isinstance(block_ids, CheckedBlocks) or not isinstance(plan.blocks, np.ndarray):
            return block_ids
        if tuple(self._chunks) != tuple(range(len(plan.blocks))):
            return block_ids
        return CheckedBlocks(block_ids, plan.blocks, plan.num_blocks, not self.to_page)

    def transfer(
        self,
        spec: KVSpec,
        kv_caches: KVCaches,
        block_ids: Any,
        chunks: Sequence[int],
        buffer: torch.Tensor,
        offsets: Sequence[int],
        layers: range | None = None,
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """`run` with `gather`'s (or `scatter`'s) signature, for callers that take either: moves
        prepared chunks `chunks` at `offsets`; the other arguments are the ones `prepare` took."""
        self.run(chunks, offsets)

    def run(self, pages: Sequence[int], offsets: Sequence[int], marks: Sequence[int] = ()) -> list[Any]:
        """Moves prepared chunks `pages` (indices among the chunks `prepare` took) between the KV
        cache and the pages at `offsets` in the buffer: one offset per page, checked here.

        `marks`: increasing counts m (0 < m < len(pages)) of the first pages the caller wants to
        know moved before the rest (a store that commits them early): for each, what to
        `synchronize()` on until pages[:m] are in place (None: they are). The staged path moves
        every page in one transfer and marks it as it goes; the others move each part in turn."""
        bounds = [0, *marks, len(pages)]
        if marks and any(stop <= start for start, stop in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(f"marks: expected increasing counts in 1..{len(pages) - 1}, got {list(marks)}")
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            if self._staged is not None:
                plan = plan_pages(self.plan, pages, offsets, writes_cache=not self.to_page)
                return self._staged.issue(pages, plan.offsets, marks=marks)
            done: list[Any] = []
            for start, stop in zip(bounds, bounds[1:], strict=False):
                part, at = pages[start:stop], offsets[start:stop]
                plan = plan_pages(self.plan, part, at, writes_cache=not self.to_page)
                _run(self.spec, plan, self.options, self.to_page)
                if stop < len(pages):
                    done.append(_event_after(plan.device))
            return done


def _event_after(device: torch.device) -> torch.cuda.Event | None:
    """An event after the work queued so far on `device`'s current stream (None: a CPU device)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
