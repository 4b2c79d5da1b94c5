"""Triton page gather and scatter: one persistent launch moves every layer of every page.

- `gather` / `scatter`: the public signatures plus `max_programs` and `tuning`.
- `launch(spec, plan, to_page=..., max_programs=..., tuning=...)`: run a validated transfer.
- `Launch(spec, plan, geometry, to_page=..., tuning=..., staged=...)`: the kernel's arguments,
  tables uploaded once; `Launch.run(first, end, programs, stage_base)` moves segments
  `first..end-1` (the staged path, `staged`, runs one launch per piece of a page).
- `Tuning`: the kernel's shape (bytes per load, segments per step, warps, cache hints);
  `DEFAULT_TUNING` is the measured choice, other values are for benchmarks.
- `_copy_pages`: the kernel. Its unit of work is a segment (see `geometry`). At most
  `max_programs` programs stride over steps of `segments_per_step` segments, moving each in
  tiles of up to `tile_bytes`: host reads need many bytes in flight per program, and few
  programs leave the SMs to the model.

Addresses travel as int64 tables (layer base pointers, page addresses), so the cache's
layers and a pinned host buffer need no single base tensor; the kernel casts them with
`.to(tl.pointer_type(...))`. Data moves as integer words of 1-8 bytes, the widest that
every address and stride allows, so no dtype (fp8, bf16) needs special casing. A cache
whose views are not contiguous within a block is honoured through its strides. A block id
outside `0..num_blocks-1` (possible only with a device block table) moves nothing (a staged
gather writes zeros for it in its staging slot instead, so no stale slot bytes reach a page).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from kvstore.spec import KVSpec

from . import staging
from .geometry import Geometry, geometry_of
from .layouts import KVCaches
from .validate import Transfer, plan_transfer

# Programs (so at most that many SMs) when the buffer is in host memory, per direction. With
# DEFAULT_TUNING 2 programs already move nearly what more would, and each program held for a
# whole transfer slows the model's matrix products more: bench/NOTES-transfer.md (item 4, and
# "The auto rule's figures").
HOST_PROGRAMS = {"gather": 2, "scatter": 2}
# A buffer in device memory (the GPU tier's pools): one program per 32 KiB step, no persistent
# loop. With 32 KiB in flight per program every shape reads a pool at nearly the device copy's
# rate at its best program count, and an isolated scatter from a pool was fastest with one
# program per step (bench/gpu_tier.py --sweep; bench/NOTES-gpu-tier.md).
DEVICE_MAX_PROGRAMS = 1 << 20
_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


class Tuning(NamedTuple):
    """How the kernel moves a segment; each field is a compile-time constant."""

    tile_bytes: int = 16384  # bytes per load per segment, at most
    segments_per_step: int = 4  # segments loaded together: bytes in flight = this * tile
    num_warps: int | None = None  # None: from the bytes in flight
    load_cache: str = ""  # tl.load cache_modifier: "", ".cg", ".ca", ".cv"
    store_cache: str = ""  # tl.store cache_modifier: "", ".wb", ".cg", ".cs", ".wt"
    eviction: str = ""  # eviction_policy of both: "", "evict_first", "evict_last"
    word_bytes: int = 8  # the widest integer word moved (the addresses may allow less)


# 64 KiB in flight per program: host reads need it (one 16 KiB load per step moves a fraction
# of the link's rate at 2 programs: bench/NOTES-transfer.md, item 1).
DEFAULT_TUNING = Tuning()
# A buffer in device memory: see DEVICE_MAX_PROGRAMS.
DEVICE_TUNING = Tuning(tile_bytes=32768, segments_per_step=1)


# Per-launch values of the staged path: not specialised, so one compiled kernel serves every piece.
@triton.jit(do_not_specialize=["first_segment", "num_segments", "stage_base"])
def _copy_pages(
    tables,  # int64: page addresses, then the parts that start at the *_at offsets
    blocks,  # int64 [pages, blocks_per_chunk]: a part of `tables`, or a device tensor
    layer_addrs_at,
    layer_strides_at,  # per (layer, k|v): block stride in bytes; token, head, dim strides in elements
    layer_page_offsets_at,
    first_segment,  # this launch moves segments first_segment..num_segments-1
    num_segments,
    stage_base,  # STAGED: every page of this launch starts here (a staging slot, less its offset)
    num_layer_kv,  # runtime, not constexpr: a new layer range must not recompile
    blocks_per_chunk,
    num_blocks,
    SEGMENT_WORDS: tl.constexpr,
    TILE: tl.constexpr,
    SEGMENTS: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WORDS_PER_ELEMENT: tl.constexpr,
    WORD: tl.constexpr,
    WORD_BYTES: tl.constexpr,
    ALIGN: tl.constexpr,
    TO_PAGE: tl.constexpr,
    STAGED: tl.constexpr,
    LOAD_CACHE: tl.constexpr,
    STORE_CACHE: tl.constexpr,
    EVICTION: tl.constexpr,
):
    layer_addrs = tables + layer_addrs_at
    layer_strides = tables + layer_strides_at
    layer_page_offsets = tables + layer_page_offsets_at
    num_steps = tl.cdiv(num_segments - first_segment, SEGMENTS)
    # A while loop, not range(program_id, ...): the interpreter cannot index with a traced scalar.
    step = tl.program_id(0)
    while step < num_steps:
        segment = first_segment + step * SEGMENTS + tl.arange(0, SEGMENTS)
        in_range = segment < num_segments
        block_in_chunk = segment % blocks_per_chunk
        layer_kv = (segment // blocks_per_chunk) % num_layer_kv
        page = segment // (blocks_per_chunk * num_layer_kv)
        block = tl.load(blocks + page * blocks_per_chunk + block_in_chunk, mask=in_range, other=0)
        live = in_range & (block >= 0) & (block < num_blocks)
        # A staged gather writes zeros for a block outside the cache: a slot's stale bytes are another page's.
        writes = (in_range if TO_PAGE else live) if STAGED else live
        cache_addr = tl.load(layer_addrs + layer_kv, mask=live, other=0) + block * tl.load(
            layer_strides + layer_kv * 4, mask=live, other=0
        )
        page_base = stage_base.to(tl.int64) if STAGED else tl.load(tables + page, mask=live, other=0)
        page_addr = (
            page_base
            + tl.load(layer_page_offsets + layer_kv, mask=writes, other=0)
            + block_in_chunk.to(tl.int64) * (SEGMENT_WORDS * WORD_BYTES)
        )
        # Loaded addresses carry no alignment facts; the host checked ALIGN, so say it (vector loads).
        cache_ptr = tl.multiple_of(cache_addr, ALIGN).to(tl.pointer_type(WORD))[:, None]
        page_ptr = tl.multiple_of(page_addr, ALIGN).to(tl.pointer_type(WORD))[:, None]
        if not CONTIGUOUS:  # strides in elements: token, head, dim
            token_stride = tl.load(layer_strides + layer_kv * 4 + 1, mask=live, other=0)[:, None]
            head_stride = tl.load(layer_strides + layer_kv * 4 + 2, mask=live, other=0)[:, None]
            dim_stride = tl.load(layer_strides + layer_kv * 4 + 3, mask=live, other=0)[:, None]
        for start in range(0, SEGMENT_WORDS, TILE):
            words = (start + tl.arange(0, TILE))[None, :]
            mask = live[:, None] & (words < SEGMENT_WORDS) if SEGMENT_WORDS % TILE else live[:, None]
            page_mask = writes[:, None] & (words < SEGMENT_WORDS) if SEGMENT_WORDS % TILE else writes[:, None]
            if CONTIGUOUS:
                cache_words = words.to(tl.int64)
            else:
                element = words // WORDS_PER_ELEMENT
                token = element // (HEADS * HEAD_DIM)
                head = (element // HEAD_DIM) % HEADS
                dim = element % HEAD_DIM
                cache_elements = token * token_stride + head * head_stride + dim * dim_stride
                cache_words = cache_elements * WORDS_PER_ELEMENT + words % WORDS_PER_ELEMENT
            if TO_PAGE:
                data = tl.load(
                    cache_ptr + cache_words,
                    mask=mask,
                    other=0,
                    cache_modifier=LOAD_CACHE,
                    eviction_policy=EVICTION,
                )
                tl.store(
                    page_ptr + words,
                    data,
                    mask=page_mask,
                    cache_modifier=STORE_CACHE,
                    eviction_policy=EVICTION,
                )
            else:
                data = tl.load(
                    page_ptr + words, mask=mask, cache_modifier=LOAD_CACHE, eviction_policy=EVICTION
                )
                tl.store(
                    cache_ptr + cache_words,
                    data,
                    mask=mask,
                    cache_modifier=STORE_CACHE,
                    eviction_policy=EVICTION,
                )
        step += tl.num_programs(0)


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
    max_programs: int | None = None,
    tuning: Tuning | None = None,
) -> None:
    """Engine KV cache -> pages at `buffer[offsets[j]:]`, one launch for all layers and pages."""
    plan = plan_transfer(
        spec, kv_caches, block_ids, chunks, buffer, offsets, layers, batch_index, writes_cache=False
    )
    launch(spec, plan, to_page=True, max_programs=max_programs, tuning=tuning)


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
    max_programs: int | None = None,
    tuning: Tuning | None = None,
) -> None:
    """Pages at `buffer[offsets[j]:]` -> the engine KV cache, one launch for all layers and pages."""
    plan = plan_transfer(
        spec, kv_caches, block_ids, chunks, buffer, offsets, layers, batch_index, writes_cache=True
    )
    launch(spec, plan, to_page=False, max_programs=max_programs, tuning=tuning)


def is_interpreted() -> bool:
    """Whether this module's kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_copy_pages, triton.runtime.JITFunction)


def can_reach(plan: Transfer) -> bool:
    """Whether the kernel can address both the cache and the buffer of `plan`."""
    if is_interpreted():
        return plan.device.type == "cpu" and plan.buffer.device.type == "cpu"
    if plan.device.type != "cuda":
        return False
    return plan.buffer.device == plan.device or plan.buffer.is_pinned()


def default_programs(plan: Transfer, *, to_page: bool) -> int:
    """The measured program count for this buffer's memory and direction."""
    if plan.buffer.device.type == "cuda":
        return DEVICE_MAX_PROGRAMS
    return HOST_PROGRAMS["gather" if to_page else "scatter"]


def default_tuning(plan: Transfer) -> Tuning:
    """The measured kernel shape for this buffer's memory."""
    return DEVICE_TUNING if plan.buffer.device.type == "cuda" else DEFAULT_TUNING


def launch(
    spec: KVSpec,
    plan: Transfer,
    *,
    to_page: bool,
    max_programs: int | None = None,
    tuning: Tuning | None = None,
    geometry: Geometry | None = None,
) -> Any:
    """Run a validated transfer in one kernel launch on the current stream; returns Triton's
    compiled kernel (its `asm`, `n_regs`, `n_spills`), or None when nothing moves.

    `max_programs`, `tuning`: None takes the measured choice for the buffer's memory."""
    tuning = tuning or default_tuning(plan)
    _check_tuning(tuning)
    check_reach(plan)
    if max_programs is None:
        max_programs = default_programs(plan, to_page=to_page)
    if max_programs < 1:
        raise ValueError(f"max_programs: expected a positive integer, got {max_programs}")
    geometry = geometry or geometry_of(spec, plan)
    if not geometry.num_segments:
        return None
    with torch.cuda.device(plan.device) if plan.device.type == "cuda" else nullcontext():
        kernel = Launch(spec, plan, geometry, to_page=to_page, tuning=tuning)
        return kernel.run(0, geometry.num_segments, max_programs)


def check_reach(plan: Transfer) -> None:
    """ValueError unless the kernel can address both the cache and the buffer of `plan`."""
    if not can_reach(plan):
        raise ValueError(
            f"buffer: the Triton kernels need the KV cache on CUDA and the buffer on that device or in "
            f"pinned (registered) host memory, or CPU tensors with TRITON_INTERPRET=1 set before import "
            f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r}); got the cache on "
            f"{plan.device}, the buffer on {plan.buffer.device}"
        )


class Launch:
    """One validated transfer's kernel arguments; its tables go to the device once, on the current
    stream, and every `run` on that stream reads them. Make and run it with the cache's device
    current."""

    def __init__(
        self,
        spec: KVSpec,
        plan: Transfer,
        geometry: Geometry,
        *,
        to_page: bool,
        tuning: Tuning = DEFAULT_TUNING,
        staged: bool = False,
    ) -> None:
        shape = _shape_of(spec, plan, geometry, to_page, tuning, staged)
        self.segments_per_step = shape.segments
        host_blocks = plan.blocks if isinstance(plan.blocks, np.ndarray) else None
        values, starts = geometry.table_values(host_blocks)
        self.tables = staging.to_device(values, plan.device)
        blocks = self.tables[starts[0] :] if isinstance(plan.blocks, np.ndarray) else plan.blocks
        self._args = (self.tables, blocks, *starts[1:])
        self._kwargs = shape.kwargs
        self._constants = shape.constants
        self._key: tuple[Any, ...] | None = None
        self._kernels: dict[tuple[str, ...], Any] = {}  # int kinds -> compiled kernel, for this launch
        self._pointers: tuple[int, ...] = ()
        if plan.device.type == "cuda":
            pointers = (self.tables.data_ptr(), blocks.data_ptr())
            self._pointers = (*pointers, *starts[1:])
            device = plan.device.index if plan.device.index is not None else torch.cuda.current_device()
            self._key = specialisation(device, pointers, starts[1:], shape)

    def run(
        self, first: int, end: int, max_programs: int, stage_base: int = 0, stream: int | None = None
    ) -> Any:
        """Move segments `first..end-1` with at most `max_programs` programs, on the current stream
        (`stream`: its handle, when the caller has it).

        `stage_base` (staged launches only): the address that stands for each page's start.
        The first launch of a specialisation goes through Triton's dispatch, which compiles or
        finds the kernel; later ones (every piece of the staged path, and later calls with the
        same geometry) call its launcher directly: equal `_key`s (the device, the tables' alignment
        and offsets, `_Shape.key`) mean the same compiled kernel."""
        grid = max(1, min(triton.cdiv(end - first, self.segments_per_step), max_programs))
        kinds = (_int_kind(first), _int_kind(end), _int_kind(stage_base))
        compiled = self._kernels.get(kinds)
        if compiled is None and _FAST_LAUNCH and self._key is not None:
            compiled = self._kernels[kinds] = _compiled.get((self._key, kinds))
        if compiled is not None and _no_launch_hooks():
            if stream is None:
                stream = torch.cuda.current_stream().cuda_stream
            run_compiled(compiled, grid, stream, self._pointers, first, end, stage_base, self._constants)
            return compiled
        compiled = _copy_pages[(grid,)](*self._args, first, end, stage_base, **self._kwargs)
        if _FAST_LAUNCH and self._key is not None and hasattr(compiled, "packed_metadata"):
            _compiled[(self._key, kinds)] = self._kernels[kinds] = compiled
        return compiled


# Calling a compiled kernel's launcher directly skips Triton's per-launch argument binding and
# specialisation, most of a launch's host time (bench/NOTES-transfer.md, item 9b);
# KVSTORE_TRITON_DISPATCH=1 turns it off.
_FAST_LAUNCH = os.environ.get("KVSTORE_TRITON_DISPATCH", "") in ("", "0") and list(
    getattr(_copy_pages, "arg_names", [])[5:8]
) == ["first_segment", "num_segments", "stage_base"]
_compiled: dict[tuple[Any, ...], Any] = {}  # specialisation (`Launch._key` + int kinds) -> kernel


def specialisation(
    device: int, pointers: tuple[int, int], starts: Sequence[int], shape: _Shape
) -> tuple[Any, ...]:
    """What Triton specialises a launch of `_copy_pages` on, but the three unspecialised integers'
    kinds: the device, the tables' 16-byte alignment (`pointers`: the tables', the block ids'),
    the tables' offsets after the block ids (`starts`) and the shape. Equal keys (with equal int
    kinds): the same compiled kernel, in `_compiled`."""
    return (device, (pointers[0] % 16, pointers[1] % 16), tuple(starts), shape.key)


def compiled_for(key: tuple[Any, ...], first: int, end: int, stage_base: int = 0) -> Any:
    """The kernel compiled for `key` (`specialisation`) and these integers, or None (not yet)."""
    return _compiled.get((key, (_int_kind(first), _int_kind(end), _int_kind(stage_base))))


def run_compiled(
    compiled: Any,
    grid: int,
    stream: int,
    pointers: Sequence[int],
    first: int,
    end: int,
    stage_base: int,
    constants: tuple[Any, ...],
) -> None:
    """Launch a compiled `_copy_pages` through its launcher: `pointers` are the tables', the block
    ids' and the three table offsets; `constants` a `_Shape`'s."""
    compiled.run(
        grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
        *pointers, first, end, stage_base, *constants,
    )  # fmt: skip


class _Shape(NamedTuple):
    """What a launch's kernel arguments are, but for its tables: the same for every transfer of one
    cache geometry, direction and tuning with pages aligned alike."""

    segments: int
    kwargs: dict[str, Any]  # the kernel's keyword arguments after the tables' (read, never changed)
    constants: tuple[Any, ...]  # the same in the launcher's order
    key: tuple[Any, ...]  # every value of kwargs: part of `Launch._key`


def _shape_of(
    spec: KVSpec, plan: Transfer, geometry: Geometry, to_page: bool, tuning: Tuning, staged: bool
) -> _Shape:
    """The kernel's arguments but for the tables, made once per distinct set of the values they
    come from (a load's host time: ~20 dict entries and their key, not rebuilt per call)."""
    num_segments = max(geometry.num_segments, 1)
    segments = max(1, min(tuning.segments_per_step, triton.next_power_of_2(num_segments)))
    source = (
        segments,
        geometry.num_layer_kv,
        geometry.blocks_per_chunk,
        plan.num_blocks,
        geometry.segment_bytes,
        geometry.contiguous,
        geometry.word_bytes,
        geometry.words_per_element,
        geometry.align,
        spec.num_kv_heads,
        spec.head_dim,
        to_page,
        staged,
        tuning,
    )
    shape = _shapes.get(source)
    if shape is not None:
        return shape
    _check_tuning(tuning)
    word_bytes = min(geometry.word_bytes, tuning.word_bytes)
    segment_words = geometry.segment_bytes // word_bytes
    tile = min(triton.next_power_of_2(segment_words), tuning.tile_bytes // word_bytes)
    step_bytes = segments * tile * word_bytes
    kwargs = dict(
        num_layer_kv=geometry.num_layer_kv,
        blocks_per_chunk=geometry.blocks_per_chunk,
        num_blocks=plan.num_blocks,
        SEGMENT_WORDS=segment_words,
        TILE=tile,
        SEGMENTS=segments,
        CONTIGUOUS=geometry.contiguous,
        HEADS=spec.num_kv_heads,
        HEAD_DIM=spec.head_dim,
        WORDS_PER_ELEMENT=geometry.words_per_element * geometry.word_bytes // word_bytes,
        WORD=_WORDS[word_bytes],
        WORD_BYTES=word_bytes,
        ALIGN=geometry.align,
        TO_PAGE=to_page,
        STAGED=staged,
        LOAD_CACHE=tuning.load_cache,
        STORE_CACHE=tuning.store_cache,
        EVICTION=tuning.eviction,
        num_warps=tuning.num_warps or (8 if step_bytes >= 8192 else 4 if step_bytes >= 2048 else 1),
    )
    # The launcher takes every kernel argument in order, constexprs included (it skips them),
    # and pointers as plain addresses (a tensor costs it a driver call to check).
    names = getattr(_copy_pages, "arg_names", [])
    constants = tuple(kwargs[name] for name in names[8:])
    # What Triton may specialise a launch on, beyond the pointers' alignment, the tables' offsets
    # and the three unspecialised integers: the exact value of every other integer (Triton looks at
    # divisibility by 16 and equality to 1 only: a superset), every constant and option.
    shape = _Shape(segments, kwargs, constants, tuple(kwargs.items()))
    with _shapes_lock:
        if len(_shapes) >= _SHAPES:
            _shapes.clear()
        _shapes[source] = shape
    return shape


_shapes: dict[tuple[Any, ...], _Shape] = {}
_SHAPES = 256
_shapes_lock = threading.Lock()


def _int_kind(value: int) -> str:
    """The type Triton gives an unspecialised integer argument: it is part of the compiled kernel."""
    if -(1 << 31) <= value < 1 << 31:
        return "i32"
    return "i64" if -(1 << 63) <= value < 1 << 63 else "u64"


def _no_launch_hooks() -> bool:
    """Whether no profiler hooks Triton's launches (they need its dispatch, which calls them)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        return False
    return all(_inactive(getattr(runtime, name, None)) for name in ("launch_enter_hook", "launch_exit_hook"))


def _inactive(hook: Any) -> bool:
    """None, or a chain of hooks (Triton 3.5+) holding none."""
    return hook is None or (isinstance(getattr(hook, "calls", None), list) and not hook.calls)


def _check_tuning(tuning: Tuning) -> None:
    for name in ("tile_bytes", "segments_per_step", "word_bytes"):
        value = getattr(tuning, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"tuning.{name}: expected a power of two, got {value}")
    if tuning.eviction and (tuning.load_cache or tuning.store_cache):
        raise ValueError(
            "tuning: a cache modifier (load_cache, store_cache) cannot be combined with an eviction "
            "policy (ptxas refuses it)"
        )
