"""Block-to-block copies between two paged KV caches of one spec: a prompt's KV handed from a
prefill GPU to a decode GPU in one copy, the decode worker reading the prefill worker's blocks in
place (over NVLink or PCIe peer access) and writing its own.

- `copy_blocks(spec, src_caches, src_blocks, dst_caches, dst_blocks, layers=None)`: block
  `src_blocks[i]` of the source cache into block `dst_blocks[i]` of the destination, the K and V
  (or latent) of every moved layer.
- `copy_block_runs`: the Triton kernel, one launch for the whole copy.

What moves per block pair is a run: one (moved layer, K|V) view's block where every such block
is one contiguous run in both caches, else a moved layer's whole block where that is one (vLLM's
layouts, whose K and V lie side by side or row after row). Both caches are checked against the
spec (layout, dtype, shape but the block count), so their runs match byte for byte. Caches with
neither (hf's DynamicCache, views whose blocks have gaps) are refused with a ValueError naming
the layout, so a caller can fall back to a gather and a scatter through a buffer.

The copy runs on the destination's device, on its current stream (or `stream`), and returns
without waiting: between two GPUs by the copy engines where the blocks come in long runs
(`block_engines`), else by the kernel. The caller orders the source's writes before it (an event
the destination's stream waits for) and keeps both caches alive, and the blocks unchanged, until
it has run. CPU caches (or `KVSTORE_KERNELS=torch`) take the torch reference
(`reference.copy_blocks`); `KVSTORE_KERNELS=triton` forces the kernel, on CPU tensors in
Triton's interpreter (`TRITON_INTERPRET=1` set before this module is imported).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from kvstore.shared.spec import DTYPE_ITEMSIZE, KVSpec

from . import peer, reference, staging
from .block_engines import copy_by_engines
from .cache_facts import CacheFacts, RegisteredCaches, cache_facts, is_packed_run
from .layouts import KVCaches, kv_views, layer_tensors
from .routing import backend_name
from .triton_copy import _int_kind, no_launch_hooks
from .triton_kernel import WORDS
from .validate_args import check_layers
from .validate_blocks import block_ids, check_overlap, check_pairs

TILE_BYTES = 32768  # bytes per load per run, at most
# Bytes in flight per program: a step loads several runs at once (small runs: up to MAX_SEGMENTS).
STEP_BYTES = 65536
MAX_SEGMENTS = 16
MAX_PROGRAMS = 1 << 20  # one program per step, as a gather into a device buffer (`triton_copy`)
# One tensor per layer with the blocks outermost: a layer's whole block may be one run.
_LAYER_TENSOR_LAYOUTS = ("flashinfer", "mla", "vllm", "vllm_rows")


class Runs(NamedTuple):
    """Where one cache's runs lie, in the kernel's order: each one's address and block stride."""

    addresses: tuple[int, ...]
    strides: tuple[int, ...]  # bytes from one block to the next
    run_bytes: int  # of every run


def copy_blocks(
    spec: KVSpec,
    src_caches: KVCaches,
    src_blocks: Any,
    dst_caches: KVCaches,
    dst_blocks: Any,
    *,
    layers: range | None = None,
    stream: Any = None,
) -> None:
    """Copy every (layer, K|V) segment of block `src_blocks[i]` of `src_caches` into block
    `dst_blocks[i]` of `dst_caches`, for each i.

    Both caches are `spec`'s (as `gather`/`scatter` take them; their block counts may differ);
    the block ids are on the host, each inside its cache, each destination block once. With
    `layers`, only those engine layers move; layers that reuse another's KV (`spec.kv_sharing`)
    never do. A source on another GPU is read over peer access (turned on here). Every problem
    is a ValueError naming the argument at fault, raised before any byte moves.
    """
    plan = _plan(spec, src_caches, dst_caches, check_layers(spec, layers))
    src_ids = block_ids("src_blocks", src_blocks, plan.src_num_blocks, "src_caches")
    dst_ids = block_ids("dst_blocks", dst_blocks, plan.dst_num_blocks, "dst_caches")
    check_pairs(src_ids, dst_ids)
    if plan.shared:
        check_overlap(src_ids, dst_ids)
    if not src_ids.size or not plan.moved:
        return
    if _uses_kernel(plan.device):
        if not (
            plan.across
            and copy_by_engines(plan.src_runs, plan.dst_runs, src_ids, dst_ids, plan.device, stream)
        ):
            _launch(plan, src_ids, dst_ids, stream)
    else:
        sources = _run_tensors(spec, src_caches, plan.moved, plan.whole)
        targets = _run_tensors(spec, dst_caches, plan.moved, plan.whole)
        reference.copy_blocks(list(zip(sources, targets, strict=True)), src_ids, dst_ids)


class _Plan(NamedTuple):
    """What a copy between two caches is, but for its block ids: checked once per pair of
    registered caches (`kvstore_kernels.register`), which keep their tensors."""

    src: Any  # the source and the spec it is for (held: an id is never another object's)
    spec: KVSpec
    moved: tuple[int, ...]
    whole: bool
    device: torch.device
    src_num_blocks: int
    dst_num_blocks: int
    shared: bool  # the two caches share a run (one cache): no block both read and written
    src_runs: Runs
    dst_runs: Runs
    across: bool  # a cache's memory is another GPU's (the source's device, `RegisteredCaches.elsewhere`)


MAX_PLANS = 16  # per destination cache: its lenders, say


def _plan(spec: KVSpec, src_caches: KVCaches, dst_caches: KVCaches, layers: range) -> _Plan:
    """The checked plan of a copy from `src_caches` into `dst_caches`: kept on a registered
    destination for a registered source, made and checked again otherwise."""
    kept = type(src_caches) is RegisteredCaches and type(dst_caches) is RegisteredCaches
    key = (id(src_caches), id(spec), layers.start, layers.stop)  # both held by the plan
    plans: dict[Any, _Plan] = dst_caches.__dict__.setdefault("_copy_plans", {}) if kept else {}
    plan = plans.get(key)
    if plan is not None and plan.src is src_caches and plan.spec is spec:
        return plan
    if spec.layout == "hf":
        raise ValueError(
            "layout: hf is not supported by copy_blocks (a DynamicCache has no blocks); "
            "move the KV with gather and scatter"
        )
    stored = set(spec.stored_layers)
    moved = tuple(layer for layer in layers if layer in stored)
    src = _facts("src_caches", spec, src_caches, moved)
    dst = _facts("dst_caches", spec, dst_caches, moved)
    if dst.write_error is not None:
        raise ValueError(_renamed(dst.write_error, "dst_caches"))
    device = _device(src.device, dst.device)
    whole = _whole_layers(spec, (("src_caches", src_caches, src), ("dst_caches", dst_caches, dst)), moved)
    src_runs = _runs(spec, src_caches, src, moved, whole)
    dst_runs = _runs(spec, dst_caches, dst, moved, whole)
    shared = not set(src_runs.addresses).isdisjoint(dst_runs.addresses)
    plan = _Plan(
        src_caches, spec, moved, whole, device, src.num_blocks, dst.num_blocks, shared, src_runs, dst_runs,
        src.device != device or any(getattr(c, "elsewhere", False) for c in (src_caches, dst_caches)),
    )  # fmt: skip
    if kept:
        if len(plans) >= MAX_PLANS:
            plans.clear()
        plans[key] = plan
    return plan


def _facts(name: str, spec: KVSpec, caches: KVCaches, moved: tuple[int, ...]) -> CacheFacts:
    """The checked facts of one cache (remembered per fingerprint, as a transfer's are)."""
    try:
        return cache_facts(spec, caches, moved, moved or spec.stored_layers, 0)
    except ValueError as error:
        raise ValueError(_renamed(str(error), name)) from None


def _renamed(message: str, name: str) -> str:
    """A cache check's message, naming the argument (`src_caches`, `dst_caches`) it is about."""
    if message.startswith("kv_caches"):
        return name + message.removeprefix("kv_caches")
    return f"{name}: {message}"


def _device(src: torch.device, dst: torch.device) -> torch.device:
    """The device that runs the copy (the destination's), once it is known to reach the source."""
    if src.type != dst.type:
        raise ValueError(
            f"src_caches: on {src}, but dst_caches on {dst}; copy_blocks copies between CUDA devices "
            "(or between CPU caches)"
        )
    if src.type == "cuda" and src != dst:
        reason = peer.why_not(dst, src)
        if reason is not None:
            raise ValueError(f"src_caches: on {src}, which the destination's {dst} cannot reach: {reason}")
    return dst


def _whole_layers(
    spec: KVSpec, named: tuple[tuple[str, KVCaches, CacheFacts], ...], moved: tuple[int, ...]
) -> bool:
    """Whether a run is a moved layer's whole block rather than one K|V view's: False where every
    view's block is one contiguous run in both caches, True where instead every moved layer's
    tensor's block is (K and V side by side); ValueError, naming a layer that is neither, else."""
    if all(view.packed for _, _, facts in named for views in facts.views for view in views):
        return False
    layer_runs = spec.layout in _LAYER_TENSOR_LAYOUTS
    misfit = next(
        (
            (name, caches, layer)
            for name, caches, facts in named
            for layer, views in zip(moved, facts.views, strict=True)
            if not (_is_one_run(caches[layer]) if layer_runs else all(view.packed for view in views))
        ),
        None,
    )
    if misfit is None:
        return True
    name, caches, layer = misfit
    strides = tuple(layer_tensors(spec, caches, layer)[0][1].stride())
    raise ValueError(
        f"layout: {spec.layout} with these strides is not supported by copy_blocks: {name}, layer "
        f"{layer}, strides {strides}: a block is not one contiguous run; move these blocks with "
        "gather and scatter"
    )


def _is_one_run(tensor: torch.Tensor) -> bool:
    """Whether each block of a `[blocks, ...]` tensor is one contiguous run."""
    return is_packed_run(tensor.shape, tensor.stride())


def _runs(spec: KVSpec, caches: KVCaches, facts: CacheFacts, moved: tuple[int, ...], whole: bool) -> Runs:
    """Where `caches`' runs lie: per moved layer its whole block (`whole`), else its K, V (or latent)."""
    itemsize = DTYPE_ITEMSIZE[spec.dtype]
    if whole:
        tensors = [caches[layer] for layer in moved]
        return Runs(
            tuple(tensor.data_ptr() for tensor in tensors),
            tuple(tensor.stride(0) * itemsize for tensor in tensors),
            math.prod(tensors[0].shape[1:]) * itemsize,
        )
    views = [view for layer_views in facts.views for view in layer_views]
    return Runs(
        tuple(view.address for view in views),
        tuple(view.strides[0] * itemsize for view in views),
        math.prod(views[0].shape[1:]) * itemsize if views else 0,
    )


def _run_tensors(spec: KVSpec, caches: KVCaches, moved: tuple[int, ...], whole: bool) -> list[torch.Tensor]:
    """The tensors `_runs` describes, `[blocks, ...]` each: what the reference indexes."""
    if whole:
        return [caches[layer] for layer in moved]
    return [view for layer in moved for view in kv_views(spec, caches, layer)]


def _uses_kernel(device: torch.device) -> bool:
    """Whether the kernel moves the copy (else the reference): `KVSTORE_KERNELS`, then the device."""
    backend = backend_name()
    runnable = (device.type == "cuda") != is_interpreted()
    if backend == "auto":
        return device.type == "cuda" and runnable
    if backend == "torch":
        return False
    if not runnable:
        raise ValueError(
            f"KVSTORE_KERNELS=triton: the copy_blocks kernel needs the caches on CUDA, or on the CPU with "
            f"TRITON_INTERPRET=1 set before import (TRITON_INTERPRET="
            f"{os.environ.get('TRITON_INTERPRET', '')!r}); got caches on {device}"
        )
    return True


def _launch(plan: _Plan, src_ids: np.ndarray, dst_ids: np.ndarray, on: Any) -> None:
    """One launch of `copy_block_runs` on `on` (or the destination's current stream): the first of
    a shape through Triton's dispatch, later ones through its launcher (as `triton_copy` does)."""
    device, num_pairs = plan.device, int(src_ids.size)
    word_bytes, run_words, tile, align, runs = _shape(plan.src_runs, plan.dst_runs)
    num_runs = len(plan.src_runs.addresses)
    num_segments = num_runs * num_pairs
    segments = min(MAX_SEGMENTS, STEP_BYTES // (tile * word_bytes), 1 << (num_segments - 1).bit_length())
    step_bytes = segments * tile * word_bytes
    values = np.concatenate([runs, src_ids, dst_ids])
    grid = min(-(-num_segments // segments), MAX_PROGRAMS)
    constants = (run_words, tile, segments, WORDS[word_bytes], align)
    num_warps = 8 if step_bytes >= 8192 else 4 if step_bytes >= 2048 else 1
    if device.type != "cuda":  # Triton's interpreter
        copy_block_runs[(grid,)](staging.to_device(values, device), 4 * num_runs, num_pairs, num_runs,
                                 *constants, num_warps=num_warps)  # fmt: skip
        return
    with torch.cuda.device(device):
        stream = (on or torch.cuda.current_stream(device)).cuda_stream
        tables = staging.to_device(values, device, stream)
        key = (device.index, tables.data_ptr() % 16, num_runs, _int_kind(num_pairs), constants, num_warps)
        compiled = _compiled.get(key)
        if compiled is not None and no_launch_hooks():
            compiled.run(
                grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                tables.data_ptr(), 4 * num_runs, num_pairs, num_runs, *constants,
            )  # fmt: skip
            return
        compiled = copy_block_runs[(grid,)](
            tables, 4 * num_runs, num_pairs, num_runs, *constants, num_warps=num_warps
        )
        if FAST_LAUNCH and hasattr(compiled, "packed_metadata"):
            _compiled[key] = compiled


@functools.lru_cache(maxsize=64)
def _shape(src: Runs, dst: Runs) -> tuple[int, int, int, int, np.ndarray]:
    """(word bytes, words a run, tile, alignment, the runs' table) of a copy between these runs."""
    alignment = math.gcd(src.run_bytes, *src.addresses, *src.strides, *dst.addresses, *dst.strides)
    word_bytes = next(width for width in (8, 4, 2, 1) if alignment % width == 0)
    run_words = src.run_bytes // word_bytes
    tile = min(triton.next_power_of_2(run_words), TILE_BYTES // word_bytes)
    runs = np.array([src.addresses, src.strides, dst.addresses, dst.strides], dtype=np.int64).T.ravel()
    runs.flags.writeable = False  # shared by every launch of these runs
    return word_bytes, run_words, tile, 16 if alignment % 16 == 0 else word_bytes, runs


# Compiled kernels by what Triton specialises a launch on: the device, the tables' alignment, the run
# count's value, the pair count's integer type, constants, warps (KVSTORE_TRITON_DISPATCH=1: none).
FAST_LAUNCH = os.environ.get("KVSTORE_TRITON_DISPATCH", "") in ("", "0")
_compiled: dict[tuple[Any, ...], Any] = {}


# The block count changes from call to call: not specialised, so one compiled kernel serves them.
@triton.jit(do_not_specialize=["num_pairs"])
def copy_block_runs(
    tables,  # int64: per run (src address, src block stride, dst address, dst block stride), then ids
    ids_at,  # where the pairs' source block ids start; their destination ids follow
    num_pairs,
    num_runs,
    RUN_WORDS: tl.constexpr,
    TILE: tl.constexpr,
    SEGMENTS: tl.constexpr,
    WORD: tl.constexpr,
    ALIGN: tl.constexpr,
):
    num_segments = num_pairs * num_runs
    num_steps = tl.cdiv(num_segments, SEGMENTS)
    # A while loop, not range(program_id, ...): the interpreter cannot index with a traced scalar.
    step = tl.program_id(0)
    while step < num_steps:
        segment = step * SEGMENTS + tl.arange(0, SEGMENTS)
        live = segment < num_segments
        pair = segment // num_runs
        run = segment % num_runs
        src_block = tl.load(tables + ids_at + pair, mask=live, other=0)
        dst_block = tl.load(tables + ids_at + num_pairs + pair, mask=live, other=0)
        src_addr = tl.load(tables + run * 4, mask=live, other=0) + src_block * tl.load(
            tables + run * 4 + 1, mask=live, other=0
        )
        dst_addr = tl.load(tables + run * 4 + 2, mask=live, other=0) + dst_block * tl.load(
            tables + run * 4 + 3, mask=live, other=0
        )
        # Loaded addresses carry no alignment facts; the host checked ALIGN, so say it (vector loads).
        src_ptr = tl.multiple_of(src_addr, ALIGN).to(tl.pointer_type(WORD))[:, None]
        dst_ptr = tl.multiple_of(dst_addr, ALIGN).to(tl.pointer_type(WORD))[:, None]
        for start in range(0, RUN_WORDS, TILE):
            words = (start + tl.arange(0, TILE))[None, :]
            mask = live[:, None] & (words < RUN_WORDS) if RUN_WORDS % TILE else live[:, None]
            data = tl.load(src_ptr + words, mask=mask)
            tl.store(dst_ptr + words, data, mask=mask)
        step += tl.num_programs(0)


def is_interpreted() -> bool:
    """Whether the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(copy_block_runs, triton.runtime.JITFunction)
