"""Transfer options and the rule that picks what moves a validated transfer.

- `TransferOptions(max_programs=None, engine="auto")`: what a caller may ask for.
- `choose(spec, plan, options, to_page=...)`: a `Route`: "torch" (the reference),
  "kernel" (Triton) or "copy_engine" (DMA), and why.

The auto rule, in order (figures: H100 PCIe Gen5, bench/NOTES-transfer.md):
1. `KVSTORE_KERNELS=torch` or `=triton` forces the reference or the kernel.
2. A CPU cache, or a CUDA cache with a pageable host buffer: the reference.
3. A buffer in device memory: the kernel (device-to-device; copy engines are slower there).
4. The copy engines where they can move the transfer (pinned buffer, block table on the
   host, blocks contiguous) as one 2-D copy per block: every (layer, k|v) segment of a block
   at one pitch on both sides, as in the cross_layer layout (or per-layer tensors that sit
   at one stride). They take no SM, so the model's kernels keep the whole GPU, at 0.87x the
   memcpy rate against the kernel's 0.85-0.9x at the default cap (`AUTO_COPY_ENGINE_SHAPES`).
5. Otherwise the kernel, with the measured program count per direction (`triton_copy`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

from kvstore.spec import KVSpec

from . import copy_engine
from .geometry import Geometry
from .validate import Transfer

ENGINES = ("auto", "kernel", "copy_engine")
BACKENDS = ("auto", "triton", "torch")

# Copy-list shapes that auto sends to the copy engines, per direction (rule 4). Measured on the
# H100, 8k tokens of an 8B model: 2-D copies (one per block, 64 rows of 32 KiB) move 48 GB/s each
# way with no SM (matrix products beside them: 0.99-1.02x); the kernel at 2 programs moves 46-50
# GB/s but slows them 1.09-1.20x. One batch of 32768 1-D copies of 32 KiB moves only 23-35 GB/s
# and costs 18-43 ms of host time to issue, so 1-D copy lists stay with the kernel.
AUTO_COPY_ENGINE_SHAPES: dict[str, frozenset[str]] = {
    "gather": frozenset({"2d"}),
    "scatter": frozenset({"2d"}),
}


@dataclass(frozen=True)
class TransferOptions:
    """How one gather or scatter may move its bytes.

    `max_programs`: at most this many kernel programs, so at most that many SMs (None: the
    measured default per direction); it applies when the kernel runs. `engine`: "kernel",
    "copy_engine", or "auto" (the module's rule).
    """

    max_programs: int | None = None
    engine: str = "auto"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine: expected one of {', '.join(ENGINES)}, got {self.engine!r}")
        programs = self.max_programs
        if programs is not None and (
            not isinstance(programs, int) or isinstance(programs, bool) or programs < 1
        ):
            raise ValueError(f"max_programs: expected a positive integer or None, got {programs!r}")


class Route(NamedTuple):
    engine: str  # "torch", "kernel" or "copy_engine"
    reason: str


def backend_name() -> str:
    """The backend `KVSTORE_KERNELS` asks for: 'auto' (unset), 'triton' or 'torch'."""
    name = os.environ.get("KVSTORE_KERNELS", "").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"KVSTORE_KERNELS: expected one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def choose(
    spec: KVSpec, plan: Transfer, options: TransferOptions, *, to_page: bool, geometry: Geometry | None = None
) -> Route:
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
    reason = copy_engine.why_not(plan, geometry)
    if reason is not None:
        return Route("kernel", reason)
    shape = "2d" if copy_engine.can_copy_2d(spec, plan, geometry) else "1d"
    if shape in AUTO_COPY_ENGINE_SHAPES["gather" if to_page else "scatter"]:
        return Route("copy_engine", f"{shape} copies")
    return Route("kernel", f"{shape} copies are slower than the kernel")
