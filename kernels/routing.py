"""Transfer options and the rule that picks what moves a validated transfer.

- `TransferOptions(max_programs=None, engine="auto", staging_bytes=128 MiB)`: what a caller
  may ask for.
- `choose(spec, plan, options, to_page=...)`: a `Route`: "torch" (the reference), "kernel"
  (Triton), "copy_engine" (DMA straight from the cache) or "staged" (the kernel packs into
  a device ring, the copy engines move it), and why.

The auto rule, in order. Figures: H100 PCIe Gen5, 8k tokens of an 8B model (1 GiB each way,
32 pages of 32 MiB), bench/NOTES-transfer.md (runs of 2026-11-22 09:51Z-10:06Z); "x memcpy"
is against one cudaMemcpyAsync of the same bytes (54-55 GB/s each way), "slowdown" that of a
stream of bf16 8192^3 matrix products beside the transfer.
1. `KVSTORE_KERNELS=torch` or `=triton` forces the reference or the kernel.
2. A CPU cache, or a CUDA cache with a pageable host buffer: the reference.
3. A buffer in device memory: the kernel, one program per 32 KiB step (`triton_copy.DEVICE_*`):
   1.44 TB/s back to back reading a GPU-tier pool, 0.98x a device copy of the same bytes
   (bench/gpu_tier.py --sweep, 10:22Z); the copy engines, 32768 copies of 32 KiB in one
   batched call, moved 8 GB/s.
4. A pinned buffer whose staging slots hold at least one stored layer of a page: the staged
   path, every layout, host or device block table. One isolated public call on cache
   tensors seen before: 0.93-0.95x memcpy each way (timed in turn with memcpy, 10:06Z:
   gather 0.946 / 0.934, scatter 0.933 / 0.933 for flash_attn / cross_layer), the gap mostly
   host time before the first piece; the first call on new tensors 0.89-0.91x; calls back
   to back 0.97-1.00x; the plan prepared 0.94-0.97x. `max_programs=16`: 0.93-0.95x too, but
   slowdown 1.10-1.15. Default slowdown 0.99-1.01 (products keep the copy at 52-53 GB/s).
   Both ways at once, two public calls from one thread: 0.96-0.97x the two-way memcpy
   (slowdown 1.02-1.03). Its 32 pack programs hold their SMs ~50 us per 32 MiB page (~9% of
   the 610 us the page spends on PCIe).
5. Otherwise the copy engines where one 2-D copy per block moves the transfer (pinned
   buffer, block table on the host, every (layer, k|v) segment of a block at one pitch on
   both sides, as in the cross_layer layout): 0.88-0.91x, no SM, both ways 0.86-0.90x.
6. Otherwise the kernel, with the measured program count per direction (`triton_copy`):
   0.81-0.93x at 2 programs, but those SMs are held for the whole transfer (slowdown
   1.09-1.17, both ways 0.57-0.64x).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

from kvstore.spec import KVSpec

from . import copy_engine, staged
from .geometry import Geometry, geometry_of
from .validate import Transfer

ENGINES = ("auto", "kernel", "copy_engine", "staged")
BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class TransferOptions:
    """How one gather or scatter may move its bytes.

    `max_programs`: at most this many kernel programs, so at most that many SMs (None: the
    measured default of the path); it applies to the kernel and to the staged path's pack and
    unpack. `engine`: "kernel", "copy_engine", "staged", or "auto" (the module's rule).
    `staging_bytes`: the staged path's device ring per direction (`staged.NUM_SLOTS` slots);
    allocated on the first staged transfer, it grows to the largest slot asked for.
    """

    max_programs: int | None = None
    engine: str = "auto"
    staging_bytes: int = staged.DEFAULT_STAGING_BYTES

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine: expected one of {', '.join(ENGINES)}, got {self.engine!r}")
        programs = self.max_programs
        if programs is not None and (
            not isinstance(programs, int) or isinstance(programs, bool) or programs < 1
        ):
            raise ValueError(f"max_programs: expected a positive integer or None, got {programs!r}")
        size = self.staging_bytes
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"staging_bytes: expected a positive integer, got {size!r}")


class Route(NamedTuple):
    engine: str  # "torch", "kernel", "copy_engine" or "staged"
    reason: str
    geometry: Geometry | None = None  # where the rule computed it: the engine reuses it


def backend_name() -> str:
    """The backend `KVSTORE_KERNELS` asks for: 'auto' (unset), 'triton' or 'torch'."""
    name = os.environ.get("KVSTORE_KERNELS", "").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"KVSTORE_KERNELS: expected one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def choose(spec: KVSpec, plan: Transfer, options: TransferOptions, *, to_page: bool) -> Route:
    """What moves `plan`: the caller's explicit engine, or the auto rule."""
    if options.engine != "auto":
        return Route(options.engine, "asked for")
    backend = backend_name()
    if backend != "auto":
        return Route("kernel" if backend == "triton" else "torch", f"KVSTORE_KERNELS={backend}")
    if plan.device.type != "cuda":
        return Route("torch", "the KV cache is not on CUDA")
    if plan.buffer.device == plan.device:
        return Route("kernel", "device buffer")
    if not plan.buffer.is_pinned():
        return Route("torch", "pageable host buffer")
    reason = staged.why_not(spec, plan, options.staging_bytes)
    if reason is None:
        return Route("staged", "pinned buffer")
    geometry = geometry_of(spec, plan)
    if copy_engine.why_not(plan, geometry) is None and copy_engine.can_copy_2d(spec, plan, geometry):
        return Route("copy_engine", f"{reason}; 2-D copies", geometry)
    return Route("kernel", reason, geometry)
