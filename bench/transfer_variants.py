"""The ways the transfer benchmark moves a `Setup`'s pages: each a callable that queues one whole
transfer on the current stream and returns its bytes (an `Enqueue`).

- Baselines: `memcpy` (one copy of the same bytes, contiguous), `memcpy_pages` (one per page),
  `per_block_python`, `per_block_torch`, `per_block_cuda` (one copy per block and layer, as
  vLLM's swap_blocks), `staging` (torch index_select into a GPU buffer as large as the transfer).
- The kernels' paths: `kernel` (Triton), `copy_engines`, `staged_path` (the kernel packing into
  the staging ring, copy engines moving it), `device_pack` (its pack alone, into device memory).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from bench.transfer_cases import Enqueue, Setup
from kvstore_kernels import copy_engine, cudart, reference, staged, triton_copy


def memcpy(setup: Setup, to_page: bool, second: bool = False) -> Enqueue:
    host = setup.buffer2 if second else setup.buffer
    device = setup.flat2 if second else setup.flat

    def enqueue() -> int:
        (host.copy_(device, non_blocking=True) if to_page else device.copy_(host, non_blocking=True))
        return setup.bytes

    return enqueue


def memcpy_pages(setup: Setup, to_page: bool, streams: int = 1, handoff: bool = False) -> Enqueue:
    """One cudaMemcpyAsync per page (a contiguous GPU buffer <-> the pages at their offsets), the
    copies alternating between `streams` side streams: what the staged path's copies cost alone.
    `handoff`: with the staged path's events around each copy (the side stream waits for one
    recorded on the caller's stream, then records one), without its packs."""
    runtime = cudart.runtime()
    sides = [torch.cuda.Stream() for _ in range(streams)]
    with torch.cuda.device(setup.flat.device):
        events = [runtime.event_create() for _ in range(2)]
    device = setup.flat.data_ptr()
    host = setup.buffer.data_ptr()
    pairs = [(device + i * setup.page_bytes, host + offset) for i, offset in enumerate(setup.offsets)]

    def enqueue() -> int:
        current = torch.cuda.current_stream()
        handles = []
        for side in sides:
            side.wait_stream(current)
            handles.append(side.cuda_stream)
        for index, (gpu, page) in enumerate(pairs):
            dst, src = (page, gpu) if to_page else (gpu, page)
            handle = handles[index % streams]
            if handoff:
                runtime.event_record(events[0], current.cuda_stream)
                runtime.stream_wait_event(handle, events[0])
            runtime.memcpy_async(dst, src, setup.page_bytes, handle)
            if handoff:
                runtime.event_record(events[1], handle)
        for side in sides:
            current.wait_stream(side)
        return setup.bytes

    return enqueue


def per_block_torch(setup: Setup, to_page: bool) -> Enqueue:
    """One torch copy_ per segment, through tensor views made once."""
    copies = copy_engine.plan_copies(setup.spec, setup.plan(to_page=to_page), to_page=to_page, shape="1d")
    segment = int(copies.sizes.min())
    as_tensor = _address_views(setup, segment)
    pairs = [
        (as_tensor(d), as_tensor(s)) for d, s in zip(copies.dsts.tolist(), copies.srcs.tolist(), strict=True)
    ]

    def enqueue() -> int:
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        return setup.bytes

    return enqueue


def per_block_python(setup: Setup, to_page: bool) -> Enqueue:
    """The plain Python loop: index the cache and the buffer for every (block, layer, k|v) copy."""
    spec, page = setup.spec, setup.spec.page
    per_chunk, segment = spec.blocks_per_chunk, spec.block_size * page.token_bytes
    span = page.chunk_tokens * page.token_bytes
    caches = setup.caches

    def block_bytes(layer: int, kv: int, block: int) -> torch.Tensor:
        if setup.layout == "cross_layer":
            return caches[block, layer, kv].view(-1).view(torch.uint8)
        if setup.layout == "flashinfer":
            return caches[layer][block, kv].view(-1).view(torch.uint8)
        return caches[layer][kv, block].view(-1).view(torch.uint8)

    def enqueue() -> int:
        for page_index, offset in enumerate(setup.offsets):
            for layer in range(spec.num_layers):
                for kv in range(2):
                    for b in range(per_chunk):
                        block = setup.table[page_index * per_chunk + b]
                        at = offset + (2 * layer + kv) * span + b * segment
                        host = setup.buffer[at : at + segment]
                        if to_page:
                            host.copy_(block_bytes(layer, kv, block), non_blocking=True)
                        else:
                            block_bytes(layer, kv, block).copy_(host, non_blocking=True)
        return setup.bytes

    return enqueue


def per_block_cuda(setup: Setup, to_page: bool) -> Enqueue:
    """One cudaMemcpyAsync per segment (what swap_blocks does in C++), from the tightest Python
    loop: the copy list made beforehand, libcudart's function called through ctypes with its
    argument types declared, statuses checked after the loop."""
    copies = copy_engine.plan_copies(setup.spec, setup.plan(to_page=to_page), to_page=to_page, shape="1d")
    runtime = cudart.runtime()
    memcpy = runtime.memcpy_async_unchecked  # no per-call status check
    rows = list(zip(copies.dsts.tolist(), copies.srcs.tolist(), copies.sizes.tolist(), strict=True))

    def enqueue() -> int:
        stream = torch.cuda.current_stream().cuda_stream
        failed = 0
        for dst, src, size in rows:
            failed |= memcpy(dst, src, size, 4, stream)  # 4: cudaMemcpyDefault
        if failed:
            raise RuntimeError("cudaMemcpyAsync failed in the per-block loop")
        return setup.bytes

    return enqueue


def staging(setup: Setup, to_page: bool) -> Enqueue:
    """torch index_select into a GPU staging buffer, then one copy (scatter: the reverse)."""
    packed = torch.empty(setup.bytes, dtype=torch.uint8, device="cuda")
    plan = setup.plan(to_page=to_page, buffer=packed)

    def enqueue() -> int:
        if to_page:
            reference.gather_plan(plan)
            setup.buffer.copy_(packed, non_blocking=True)
        else:
            packed.copy_(setup.buffer, non_blocking=True)
            reference.scatter_plan(plan)
        return setup.bytes

    return enqueue


def kernel(
    setup: Setup, to_page: bool, programs: int | None, tuning: Any = None, second: bool = False
) -> Enqueue:
    plan = setup.plan(to_page=to_page, second=second)
    tuning = tuning or triton_copy.DEFAULT_TUNING

    def enqueue() -> int:
        triton_copy.launch(setup.spec, plan, to_page=to_page, max_programs=programs, tuning=tuning)
        return setup.bytes

    return enqueue


def device_pack(setup: Setup, to_page: bool, programs: int) -> Enqueue:
    """The staged path's GPU half alone: the kernel between the cache and a device buffer (the
    pages packed or unpacked device to device), to time a pack burst."""
    plan = setup.plan(to_page=to_page, buffer=setup.flat2)

    def enqueue() -> int:
        triton_copy.launch(setup.spec, plan, to_page=to_page, max_programs=programs)
        return setup.bytes

    return enqueue


def copy_engines(setup: Setup, to_page: bool, shape: str | None = None, second: bool = False) -> Enqueue:
    plan = setup.plan(to_page=to_page, second=second)

    def enqueue() -> int:
        copy_engine.launch(setup.spec, plan, to_page=to_page, shape=shape)
        return setup.bytes

    return enqueue


def staged_path(
    setup: Setup,
    to_page: bool,
    programs: int | None = None,
    staging_bytes: int | None = None,
    overlap: bool = staged.OVERLAP,
    second: bool = False,
    copy_streams: int = staged.COPY_STREAMS,
) -> Enqueue:
    """The staged path (`kvstore_kernels.staged`) with its knobs, the plan prepared; None: the default."""
    plan = setup.plan(to_page=to_page, second=second)
    size = staging_bytes or staged.DEFAULT_STAGING_BYTES

    def enqueue() -> int:
        staged.launch(
            setup.spec,
            plan,
            to_page=to_page,
            max_programs=programs,
            staging_bytes=size,
            overlap=overlap,
            copy_streams=copy_streams,
        )
        return setup.bytes

    return enqueue


def _address_views(setup: Setup, size: int) -> Callable[[int], torch.Tensor]:
    """A `size`-byte uint8 view at an address inside the cache or a pinned buffer."""
    bases = [setup.buffer, setup.buffer2, setup.flat]
    caches = [setup.caches] if isinstance(setup.caches, torch.Tensor) else setup.caches
    bases += [c.view(-1).view(torch.uint8) for c in caches]
    spans = sorted((b.data_ptr(), b) for b in bases)
    starts = [s for s, _ in spans]

    def view(address: int) -> torch.Tensor:
        index = int(np.searchsorted(starts, address, side="right")) - 1
        start, base = spans[index]
        return base[address - start : address - start + size]

    return view
