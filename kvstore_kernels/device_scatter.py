"""The GPU tier's hot path: a scatter from a device buffer into registered caches, blocks checked ahead.

A load from the daemon's GPU tier is one kernel launch reading a pool on the cache's device:
the copy is short, so the general path's host work before it (`plan_transfer`, the route, the
geometry, the launch arguments: a few hundred small Python steps) is a large part of the load
(bench/NOTES-gpu-tier.md, "Round of 13:06-14:00Z" and "Figures behind the code"). When the
caller has done the slow checks once (`register` for the cache, `check_blocks` for the table,
as `KVStoreClient.load` does), everything but the page addresses is the same from one load to
the next, so this path keeps it per (registered cache, spec, layers, buffer) and does per call
only what depends on the chunks and offsets.

`scatter(spec, kv_caches, block_ids, chunks, buffer, offsets, layers, stream)` moves the
transfer and returns True, or returns False having moved nothing: the caller then takes the
general path, which checks everything and names any fault. It takes only the plain case: a
scatter with no options, batch index 0, `RegisteredCaches`, `CheckedBlocks` covering the chunks
in increasing order, a CUDA buffer on the cache's device (and the stream's) whose pages lie
inside it, the kernel left to its auto rule (`KVSTORE_KERNELS` unset), no launch hooks, and a
kernel compiled for the shape already (the general path's first call compiles it). It moves
exactly the bytes the general path moves (`tests/test_kernels.py` compares both, with pages
aligned every way).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, NamedTuple

import numpy as np
import torch

from kvstore.shared.spec import KVSpec

from . import staging, triton_copy
from .cache_facts import RegisteredCaches
from .geometry import Geometry, geometry_of
from .routing import backend_name
from .validate import CheckedBlocks, Transfer, plan_transfer


class _Route(NamedTuple):
    """What a registered cache's scatters from one buffer share (all but the pages' place)."""

    spec: KVSpec
    buffer: torch.Tensor
    base: int  # the buffer's address
    size: int  # its bytes
    page_bytes: int
    device: int  # the CUDA device index of the cache and the buffer
    geometry: Geometry  # of a plan on this buffer: its cache-only part is every call's
    plan: Transfer  # that plan: its fields but blocks and offsets hold for every call
    shapes: dict[tuple[int, int], Any]  # (pages, their address alignment) -> the kernel's arguments


_lock = threading.Lock()
_MAX_ROUTES = 16  # per registered cache
taken = 0  # scatters this path moved (tests and benchmarks read it)


def scatter(
    spec: KVSpec,
    kv_caches: Any,
    block_ids: Any,
    chunks: Any,
    buffer: torch.Tensor,
    offsets: Any,
    layers: range | None,
    stream: torch.cuda.Stream | None = None,
) -> bool:
    """Move the scatter if it is the plain case (module docstring); False: nothing moved.

    On `stream` (default: the device's current stream); the tables' memory is then marked as
    used by that stream, so the allocator reuses it only after the kernel ran."""
    if type(kv_caches) is not RegisteredCaches or type(block_ids) is not CheckedBlocks:
        return False
    route = _route(spec, kv_caches, block_ids, buffer, layers)
    if route is None or torch.cuda.current_device() != route.device:
        return False
    chunk_array = _chunks(chunks, block_ids.chunks)
    if chunk_array is None:
        return False
    page_addrs = _page_addrs(route, offsets, chunk_array.size)
    if page_addrs is None:
        return False
    pages = page_addrs.size
    alignment = int(np.gcd.reduce(page_addrs))
    shape = route.shapes.get((pages, alignment))
    if shape is None:
        shape = route.shapes[(pages, alignment)] = triton_copy.shape_of(
            route.spec,
            route.plan,
            route.geometry.with_pages(pages, alignment),
            False,
            triton_copy.DEVICE_TUNING,
            False,
        )
    if not _launch(route, shape, page_addrs, block_ids.blocks[chunk_array], stream):
        return False
    global taken
    taken += 1
    return True


def _page_addrs(route: _Route, offsets: Any, chunks: int) -> np.ndarray | None:
    """The pages' addresses: one offset per chunk, each page inside the buffer; else None."""
    try:
        page_offsets = np.asarray(offsets, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return None
    pages = page_offsets.size
    if page_offsets.ndim != 1 or pages != chunks or not pages:
        return None
    if int(page_offsets.min()) < 0 or int(page_offsets.max()) + route.page_bytes > route.size:
        return None
    return page_offsets + route.base


def _launch(
    route: _Route,
    shape: triton_copy.Shape,
    page_addrs: np.ndarray,
    blocks: np.ndarray,
    stream: torch.cuda.Stream | None,
) -> bool:
    """Upload the tables and launch the kernel compiled for `shape` already; False: nothing launched."""
    pages = page_addrs.size
    geometry = route.geometry
    values = np.concatenate([page_addrs, blocks.ravel(), geometry.static_values])
    starts = list(itertools.accumulate((pages, blocks.size, *geometry.static_lengths)))[:-1]
    device = route.buffer.device
    if stream is not None and stream.device != device:
        return False  # the general path names the mismatch
    handle = (stream if stream is not None else torch.cuda.current_stream(device)).cuda_stream
    tables = staging.to_device(values, device, handle)
    if stream is not None:
        tables.record_stream(stream)  # allocated on the current stream, read on this one
    pointer = tables.data_ptr()
    segments = pages * geometry.num_layer_kv * geometry.blocks_per_chunk
    pointers = (pointer, pointer + starts[0] * 8)
    key = triton_copy.specialisation(route.device, pointers, starts[1:], shape)
    compiled = triton_copy.compiled_for(key, 0, segments)
    if compiled is None or not triton_copy.no_launch_hooks():
        return False  # the general path launches it (and compiles the kernel, for the next call)
    grid = max(1, min(-(-segments // shape.segments), triton_copy.DEVICE_MAX_PROGRAMS))
    triton_copy.run_compiled(
        compiled, grid, handle, (*pointers, *starts[1:]), 0, segments, (0, 0), shape.constants
    )
    return True


def _route(
    spec: KVSpec,
    kv_caches: RegisteredCaches,
    checked: CheckedBlocks,
    buffer: torch.Tensor,
    layers: range | None,
) -> _Route | None:
    """The route of this cache, spec, layers and buffer: made once through the general checks, kept."""
    if not isinstance(buffer, torch.Tensor) or not buffer.is_cuda:
        return None
    routes: dict[Any, _Route] = kv_caches.__dict__.setdefault("_device_routes", {})
    key = (id(spec), layers, buffer.data_ptr(), buffer.numel(), checked.num_blocks)
    route = routes.get(key)
    if route is not None and route.spec is spec and route.buffer is buffer:
        return route
    if backend_name() != "auto" or not _FAST_LAUNCH or not checked.chunks:
        return None
    try:  # the general checks, for a page at the buffer's start: what the cache and buffer allow
        plan = plan_transfer(spec, kv_caches, checked, [0], buffer, [0], layers, 0, writes_cache=True)
    except ValueError:
        return None
    if plan.device != buffer.device or not plan.layers or plan.page.page_bytes > buffer.numel():
        return None
    device = buffer.device.index if buffer.device.index is not None else torch.cuda.current_device()
    route = _Route(
        spec, buffer, buffer.data_ptr(), buffer.numel(), plan.page.page_bytes, device,
        geometry_of(spec, plan), plan, {},
    )  # fmt: skip
    with _lock:
        if len(routes) >= _MAX_ROUTES:
            routes.clear()
        routes[key] = route
    return route


def _chunks(chunks: Any, checked: int) -> np.ndarray | None:
    """`chunks` as int64 when they are among the `checked` first ones, in increasing order; else None."""
    if isinstance(chunks, range):
        if chunks.step != 1 or chunks.start < 0 or chunks.stop > checked:
            return None
        return np.arange(chunks.start, chunks.stop, dtype=np.int64)
    if isinstance(chunks, torch.Tensor):
        return None
    try:
        array = np.asarray(chunks)
    except (TypeError, ValueError, OverflowError):
        return None
    if array.ndim != 1 or array.dtype.kind not in "iu":
        return None
    if array.size and (int(array[0]) < 0 or int(array[-1]) >= checked):
        return None
    if array.size > 1 and not bool((array[1:] > array[:-1]).all()):
        return None
    return array.astype(np.int64, copy=False)


_FAST_LAUNCH = triton_copy.FAST_LAUNCH
