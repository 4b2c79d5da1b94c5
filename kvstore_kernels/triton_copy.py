"""Launching the Triton kernel (`triton_kernel.copy_pages`) on a validated transfer.

- `launch(spec, plan, to_page=..., max_programs=..., tuning=...)`: run a checked plan
  (`validate.Transfer`) in one launch; `kvstore_kernels.gather`/`scatter` call it where
  the route (`routing`) picks the kernel.
- `Launch(spec, plan, geometry, to_page=..., tuning=..., staged=...)`: the kernel's arguments,
  tables uploaded once; `Launch.run(first, end, programs, stage)` moves segments `first..end-1`
  (the staged path, `staged`, runs one launch per slot: a piece of a page, or several pages).
- `Tuning`: the kernel's shape (bytes per load, segments per step, warps, cache hints);
  `DEFAULT_TUNING` is the measured choice, other values are for benchmarks.
- `shape_of`, `specialisation`, `compiled_for`, `run_compiled`: a launch's arguments made once
  per shape, and a compiled kernel called through its launcher (`device_scatter` uses them).
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, NamedTuple

import numpy as np
import torch
import triton

from kvstore.shared.spec import KVSpec

from . import staging, triton_kernel
from .geometry import Geometry, geometry_of
from .validate import Transfer

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
# Host buffers with small segments (a TP rank's share of the heads, fp8, few KV heads): a step of
# 4 segments of 8 KiB at 2 programs loaded at 0.50 of memcpy on an H200, 4 KiB ones at 0.27.
# Each program's step has a fixed latency (its block ids, then the host reads), so small
# segments need more of them in flight: (segment bytes below, shape, programs), first match.
# Four H200s at once: 8 KiB at 4 programs 0.93 / 0.91 of memcpy (store / load), 4 KiB with 8
# segments a step at 8 programs 0.93 / 0.90 (bench/segment_shapes.py; bench/NOTES-host-gpus.md,
# "Small segments").
SMALL_SEGMENTS = (
    (8192, Tuning(segments_per_step=8), 8),
    (16384, Tuning(segments_per_step=4), 4),
)


def can_reach(plan: Transfer) -> bool:
    """Whether the kernel can address both the cache and the buffer of `plan`."""
    if triton_kernel.is_interpreted():
        return plan.device.type == "cpu" and plan.buffer.device.type == "cpu"
    if plan.device.type != "cuda":
        return False
    # A buffer on another GPU was checked for peer access when the plan was validated.
    return plan.buffer.device.type == "cuda" or plan.buffer.is_pinned()


def default_programs(plan: Transfer, *, to_page: bool, geometry: Geometry | None = None) -> int:
    """The measured program count for this buffer's memory, direction and segment size."""
    if plan.buffer.device.type == "cuda":
        return DEVICE_MAX_PROGRAMS
    small = _small_segments(geometry)
    return small[1] if small else HOST_PROGRAMS["gather" if to_page else "scatter"]


def default_tuning(plan: Transfer, geometry: Geometry | None = None) -> Tuning:
    """The measured kernel shape for this buffer's memory and segment size."""
    if plan.buffer.device.type == "cuda":
        return DEVICE_TUNING
    small = _small_segments(geometry)
    return small[0] if small else DEFAULT_TUNING


def _small_segments(geometry: Geometry | None) -> tuple[Tuning, int] | None:
    """The shape and programs of a host transfer whose segments are under 16 KiB, or None."""
    if geometry is None:
        return None
    for below, tuning, programs in SMALL_SEGMENTS:
        if geometry.segment_bytes < below:
            return tuning, programs
    return None


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
    check_reach(plan)
    geometry = geometry or geometry_of(spec, plan)
    tuning = tuning or default_tuning(plan, geometry)
    _check_tuning(tuning)
    if max_programs is None:
        max_programs = default_programs(plan, to_page=to_page, geometry=geometry)
    if max_programs < 1:
        raise ValueError(f"max_programs: expected a positive integer, got {max_programs}")
    if not geometry.num_segments:
        return None
    with torch.cuda.device(plan.device) if plan.device.type == "cuda" else nullcontext():
        kernel = Launch(spec, plan, geometry, to_page=to_page, tuning=tuning)
        return kernel.run(0, geometry.num_segments, max_programs)


def check_reach(plan: Transfer) -> None:
    """ValueError unless the kernel can address both the cache and the buffer of `plan`."""
    if not can_reach(plan):
        raise ValueError(
            f"buffer: the Triton kernels need the KV cache on CUDA and the buffer on that device (or a "
            f"peer GPU) or in pinned (registered) host memory, or CPU tensors with TRITON_INTERPRET=1 "
            f"set before import "
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
        shape = shape_of(spec, plan, geometry, to_page, tuning, staged)
        self.segments_per_step = shape.segments
        self._kwargs = shape.kwargs
        self._constants = shape.constants
        self._shape, self._geometry, self._device = shape, geometry, plan.device
        self._key: tuple[Any, ...] | None = None
        self._kernels: dict[tuple[str, ...], Any] = {}  # int kinds -> compiled kernel, for this launch
        self._set_tables(plan.blocks)

    def _set_tables(self, plan_blocks: np.ndarray | torch.Tensor) -> None:
        """The tables on the device (one upload, on the current stream) and what a launch passes."""
        host_blocks = plan_blocks if isinstance(plan_blocks, np.ndarray) else None
        values, starts = self._geometry.table_values(host_blocks)
        self.tables = staging.to_device(values, self._device)
        blocks = self.tables[starts[0] :] if isinstance(plan_blocks, np.ndarray) else plan_blocks
        self._args = (self.tables, blocks, *starts[1:])
        self._pointers: tuple[int, ...] = ()
        if self._device.type == "cuda":
            pointers = (self.tables.data_ptr(), blocks.data_ptr())
            self._pointers = (*pointers, *starts[1:])
            index = self._device.index
            device = index if index is not None else torch.cuda.current_device()
            key = specialisation(device, pointers, starts[1:], self._shape)
            if key != self._key:  # the compiled kernels found so far were for other alignments
                self._key, self._kernels = key, {}

    def with_blocks(self, plan_blocks: np.ndarray | torch.Tensor) -> Launch:
        """This launch for other block ids of the same pages' count (a transfer of the same cache,
        layers and geometry): only the tables are made and uploaded again."""
        other = copy.copy(self)
        other._set_tables(plan_blocks)
        return other

    def run(
        self, first: int, end: int, programs: int, stage: tuple[int, int] = (0, 0), stream: int | None = None
    ) -> Any:
        """Move segments `first..end-1` with at most `programs` programs, on the current stream
        (`stream`: its handle, when the caller has it).

        `stage` (staged launches only): the address that stands for the first page's start, and
        the bytes from each page of the launch to the next.
        The first launch of a specialisation goes through Triton's dispatch, which compiles or
        finds the kernel; later ones (every piece of the staged path, and later calls with the
        same geometry) call its launcher directly: equal `_key`s (the device, the tables' alignment
        and offsets, `Shape.key`) mean the same compiled kernel."""
        grid = max(1, min(triton.cdiv(end - first, self.segments_per_step), programs))
        kinds = (_int_kind(first), _int_kind(end), *map(_int_kind, stage))
        compiled = self._kernels.get(kinds)
        if compiled is None and FAST_LAUNCH and self._key is not None:
            compiled = self._kernels[kinds] = _compiled.get((self._key, kinds))
        if compiled is not None and no_launch_hooks():
            if stream is None:
                stream = torch.cuda.current_stream().cuda_stream
            run_compiled(compiled, grid, stream, self._pointers, first, end, stage, self._constants)
            return compiled
        compiled = triton_kernel.copy_pages[(grid,)](*self._args, first, end, *stage, **self._kwargs)
        if FAST_LAUNCH and self._key is not None and hasattr(compiled, "packed_metadata"):
            _compiled[(self._key, kinds)] = self._kernels[kinds] = compiled
        return compiled


# Calling a compiled kernel's launcher directly skips Triton's per-launch argument binding and
# specialisation, most of a launch's host time (bench/NOTES-transfer.md, item 9b);
# KVSTORE_TRITON_DISPATCH=1 turns it off.
FAST_LAUNCH = os.environ.get("KVSTORE_TRITON_DISPATCH", "") in ("", "0") and list(
    getattr(triton_kernel.copy_pages, "arg_names", [])[5:9]
) == ["first_segment", "num_segments", "stage_base", "stage_stride"]
_compiled: dict[tuple[Any, ...], Any] = {}  # specialisation (`Launch._key` + int kinds) -> kernel


def specialisation(
    device: int, pointers: tuple[int, int], starts: Sequence[int], shape: Shape
) -> tuple[Any, ...]:
    """What Triton specialises a launch of `copy_pages` on, but the four unspecialised integers'
    kinds: the device, the tables' 16-byte alignment (`pointers`: the tables', the block ids'),
    the tables' offsets after the block ids (`starts`) and the shape. Equal keys (with equal int
    kinds): the same compiled kernel, in `_compiled`."""
    return (device, (pointers[0] % 16, pointers[1] % 16), tuple(starts), shape.key)


def compiled_for(key: tuple[Any, ...], first: int, end: int, stage_base: int = 0) -> Any:
    """The kernel compiled for `key` (`specialisation`) and these integers (a stride of 0), or
    None (not yet)."""
    return _compiled.get((key, (_int_kind(first), _int_kind(end), _int_kind(stage_base), _int_kind(0))))


def run_compiled(
    compiled: Any,
    grid: int,
    stream: int,
    pointers: Sequence[int],
    first: int,
    end: int,
    stage: tuple[int, int],
    constants: tuple[Any, ...],
) -> None:
    """Launch a compiled `copy_pages` through its launcher: `pointers` are the tables', the block
    ids' and the three table offsets; `constants` a `Shape`'s."""
    compiled.run(
        grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
        *pointers, first, end, *stage, *constants,
    )  # fmt: skip


class Shape(NamedTuple):
    """What a launch's kernel arguments are, but for its tables: the same for every transfer of one
    cache geometry, direction and tuning with pages aligned alike."""

    segments: int
    kwargs: dict[str, Any]  # the kernel's keyword arguments after the tables' (read, never changed)
    constants: tuple[Any, ...]  # the same in the launcher's order
    key: tuple[Any, ...]  # every value of kwargs: part of `Launch._key`


def shape_of(
    spec: KVSpec, plan: Transfer, geometry: Geometry, to_page: bool, tuning: Tuning, staged: bool
) -> Shape:
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
    kwargs = _kernel_kwargs(spec, plan, geometry, to_page, tuning, staged, segments)
    # The launcher takes every kernel argument in order, constexprs included (it skips them),
    # and pointers as plain addresses (a tensor costs it a driver call to check).
    names = getattr(triton_kernel.copy_pages, "arg_names", [])
    constants = tuple(kwargs[name] for name in names[9:])
    # What Triton may specialise a launch on, beyond the pointers' alignment, the tables' offsets
    # and the four unspecialised integers: the exact value of every other integer (Triton looks at
    # divisibility by 16 and equality to 1 only: a superset), every constant and option.
    shape = Shape(segments, kwargs, constants, tuple(kwargs.items()))
    with _shapes_lock:
        if len(_shapes) >= _SHAPES:
            _shapes.clear()
        _shapes[source] = shape
    return shape


def _kernel_kwargs(
    spec: KVSpec,
    plan: Transfer,
    geometry: Geometry,
    to_page: bool,
    tuning: Tuning,
    staged: bool,
    segments: int,
) -> dict[str, Any]:
    """The kernel's keyword arguments after the tables', `segments` segments loaded together."""
    word_bytes = min(geometry.word_bytes, tuning.word_bytes)
    segment_words = geometry.segment_bytes // word_bytes
    tile = min(triton.next_power_of_2(segment_words), tuning.tile_bytes // word_bytes)
    step_bytes = segments * tile * word_bytes
    return dict(
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
        WORD=triton_kernel.WORDS[word_bytes],
        WORD_BYTES=word_bytes,
        ALIGN=geometry.align,
        TO_PAGE=to_page,
        STAGED=staged,
        LOAD_CACHE=tuning.load_cache,
        STORE_CACHE=tuning.store_cache,
        EVICTION=tuning.eviction,
        num_warps=tuning.num_warps or (8 if step_bytes >= 8192 else 4 if step_bytes >= 2048 else 1),
    )


_shapes: dict[tuple[Any, ...], Shape] = {}
_SHAPES = 256
_shapes_lock = threading.Lock()


def _int_kind(value: int) -> str:
    """The type Triton gives an unspecialised integer argument: it is part of the compiled kernel."""
    if -(1 << 31) <= value < 1 << 31:
        return "i32"
    return "i64" if -(1 << 63) <= value < 1 << 63 else "u64"


def no_launch_hooks() -> bool:
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
