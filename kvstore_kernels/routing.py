"""Transfer options and the rule that picks what moves a validated transfer.

- `TransferOptions(max_programs=None, engine="auto", staging_bytes=128 MiB)`: what a caller
  may ask for; `engine` names a path, or "auto".
- `choose(spec, plan, options, to_page=...)`: a `Route`: "torch" (the reference), "kernel"
  (Triton), "copy_engine" (DMA straight from the cache) or "staged" (the kernel packs into
  a device ring, the copy engines move it), and why.

The auto rule, in order. Each path is weighed by its rate against one cudaMemcpyAsync of the
same bytes and by what it costs the model: how much it slows matrix products running beside
the transfer, i.e. how many SMs it holds and for how long. The figures behind each step (H100,
8k tokens of an 8B model) are in bench/NOTES-transfer.md, "The auto rule's figures".
1. `KVSTORE_KERNELS=torch` or `=triton` forces the reference or the kernel.
2. A CPU cache, or a CUDA cache with a pageable host buffer: the reference.
3. A buffer in device memory: the kernel, one program per 32 KiB step (`triton_copy.DEVICE_*`):
   it reads a GPU-tier pool at nearly the rate of a device copy, where the copy engines'
   batched 32 KiB copies are far slower. The same for a buffer on another GPU that the
   cache's device reaches over peer access (NVLink): its programs read or write it in place.
4. A pinned buffer whose staging slots hold at least one stored layer of a page: the staged
   path, every layout, host or device block table. Closest to memcpy each way and both ways
   at once, and the model barely slows: its pack programs hold their SMs for a small part of
   the time each page spends on PCIe. What it lacks is mostly host time before the first
   piece (less on tensors seen before, none left to hide in calls issued back to back).
5. Otherwise the copy engines where one 2-D copy per block moves the transfer (pinned
   buffer, block table on the host, every (layer, k|v) segment of a block at one pitch on
   both sides, as in the cross_layer layout): a little slower, and no SM.
6. Otherwise the kernel, with the measured program count per direction (`triton_copy`):
   slower still, and its SMs are held for the whole transfer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

from kvstore.shared.spec import KVSpec

from . import copy_engine, staged
from .geometry import Geometry, geometry_of
from .validate import Transfer

ENGINES = ("auto", "kernel", "copy_engine", "staged", "torch")
BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class TransferOptions:
    """How one gather or scatter may move its bytes.

    `max_programs`: at most this many kernel programs, so at most that many SMs (None: the
    measured default of the path); it applies to the kernel and to the staged path's pack and
    unpack. `engine`: "kernel", "copy_engine", "staged", "torch" (the reference), or "auto"
    (the module's rule).
    `staging_bytes`: the staged path's device ring per direction (`staged.NUM_SLOTS` slots, or
    as many as it holds of smaller pieces, up to `MAX_SLOTS`); allocated on the first staged
    transfer, it grows to the largest slot asked for.
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
    if plan.buffer.device.type == "cuda":  # validated: a GPU the cache's device reaches as a peer
        return Route("kernel", "a buffer on another GPU, over peer access")
    if not plan.buffer.is_pinned():
        return Route("torch", "pageable host buffer")
    reason = staged.why_not(spec, plan, options.staging_bytes)
    if reason is None:
        return Route("staged", "pinned buffer")
    geometry = geometry_of(spec, plan)
    if copy_engine.why_not(plan, geometry) is None and copy_engine.can_copy_2d(spec, plan, geometry):
        return Route("copy_engine", f"{reason}; 2-D copies", geometry)
    return Route("kernel", reason, geometry)
