"""The GPU-tier benchmark's sweep (`--sweep`): the kernel's shapes and program counts reading the
daemon's pool, and the copy engines moving the same segments.

- `sweep_kernel(...)`: GPU time of each shape (`SWEEP_SHAPES`, `SWEEP_HINTS`) at each program
  count (`SWEEP_PROGRAMS_PER_SM`), checked for exact bytes, and of one batched copy-engine call.
- `run_sweep(loads, pool, offsets, repeats)`: the sweep, printed; the fastest exact shape made
  the kernels' device default, and a GPU-tier load and the scatter alone timed with it.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import torch
import triton

from bench.common import print_table
from bench.gpu_tier_loads import TierLoads
from bench.gpu_tier_setup import SPEC, gpu_ms, median_s
from kvstore_kernels import scatter, triton_copy
from kvstore_kernels.geometry import Geometry
from kvstore_kernels.validate import plan_transfer

SWEEP_SHAPES = [  # (tile_bytes, segments_per_step, num_warps, word_bytes)
    (16384, 4, 8, 8),  # DEFAULT_TUNING
    (4096, 1, 4, 8),
    (8192, 1, 4, 8),
    (8192, 1, 8, 8),
    (16384, 1, 8, 8),
    (32768, 1, 8, 8),
    (32768, 1, 16, 8),
    (8192, 2, 8, 8),
    (16384, 2, 8, 8),
    (4096, 4, 4, 8),
    (8192, 4, 8, 8),
    (8192, 1, 4, 4),
    (16384, 1, 8, 4),
    (16384, 4, 8, 4),
]

SWEEP_HINTS = [{"load_cache": ".cg", "store_cache": ".cs"}, {"eviction": "evict_first"}]
SWEEP_PROGRAMS_PER_SM = (1, 2, 4, 8, 16, 0)  # 0: one program per step (no persistent loop)


def run_sweep(
    loads: TierLoads, pool: torch.Tensor, offsets: list[int], repeats: int
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The sweep's rows, and the seconds of a GPU-tier load and of the scatter alone with the
    fastest exact shape, which stays the kernels' device default (`triton_copy.DEVICE_TUNING`)."""
    p = loads.prompts
    swept = sweep_kernel(p.target, p.source_b, p.block_ids, p.chunks, pool, offsets, p.total, repeats)
    best = min((row for row in swept if row["exact"]), key=lambda row: row["ms"])
    print_table(
        ("kernel shape (reading the pool)", "programs", "ms", "GB/s"),
        [[r["shape"], r["programs"], r["ms"], r["gb_s"]] for r in sorted(swept, key=lambda r: r["ms"])[:25]],
    )
    print(f"best: {best}")
    shape = next(t for t in sweep_tunings() if sweep_label(t) == best["shape"])
    triton_copy.DEVICE_TUNING, triton_copy.DEVICE_MAX_PROGRAMS = shape, best["programs"]
    timings = {
        "load, GPU tier, swept best": median_s(loads.load(p.prompt_b, p.source_b), repeats),
        "scatter only, swept best": median_s(
            lambda: scatter(SPEC, p.target, p.block_ids, range(p.chunks), pool, offsets), repeats
        ),
    }
    return swept, timings


def sweep_tunings() -> list[triton_copy.Tuning]:
    shapes = [
        triton_copy.Tuning(tile, segments, warps, word_bytes=word)
        for tile, segments, warps, word in SWEEP_SHAPES
    ]
    return shapes + [triton_copy.Tuning(8192, 1, 4, **hints) for hints in SWEEP_HINTS]  # type: ignore[arg-type]


def sweep_label(tuning: triton_copy.Tuning) -> str:
    label = f"tile={tuning.tile_bytes // 1024}K seg={tuning.segments_per_step} warps={tuning.num_warps}"
    hints = ("load_cache", "store_cache", "eviction")
    return (
        label
        + f" word={tuning.word_bytes}"
        + "".join(f" {h}={getattr(tuning, h)}" for h in hints if getattr(tuning, h))
    )


def ptx_counts(compiled: Any) -> str:
    ptx = getattr(compiled, "asm", {}).get("ptx", "")
    kinds = ("ld.global.v4", "ld.global.v2", "ld.global.", "st.global.v4", "st.global.v2", "st.global.")
    counts = {kind: ptx.count(kind) for kind in kinds}
    regs = getattr(compiled, "n_regs", "?")
    return f"regs={regs} " + " ".join(f"{k.removesuffix('.')}={v}" for k, v in counts.items())


def sweep_kernel(
    target: list[torch.Tensor],
    source: list[torch.Tensor],
    block_ids: list[int],
    chunks: int,
    pool: torch.Tensor,
    offsets: list[int],
    total: int,
    repeats: int,
) -> list[dict[str, Any]]:
    """GPU time of the kernel's shapes and program counts reading the pool, and of the copy engines."""
    plan = plan_transfer(SPEC, target, block_ids, range(chunks), pool, offsets, None, 0, writes_cache=True)
    geometry = Geometry(SPEC, plan)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows: list[dict[str, Any]] = []
    for tuning in sweep_tunings():
        rows += _shape_rows(tuning, plan, geometry, target, source, sms, total, repeats)
    try:
        rows.append(_copy_engine_row(plan, geometry, total, repeats))
    except Exception as exc:
        print(f"sweep copy engines: failed: {exc!r}"[:300], flush=True)
    return rows


def _shape_rows(
    tuning: triton_copy.Tuning,
    plan: Any,
    geometry: Geometry,
    target: list[torch.Tensor],
    source: list[torch.Tensor],
    sms: int,
    total: int,
    repeats: int,
) -> list[dict[str, Any]]:
    """One shape at each program count: its GPU time, and whether one run moved the exact bytes.
    A shape that does not compile is reported, the sweep goes on."""
    label = sweep_label(tuning)
    rows: list[dict[str, Any]] = []
    try:
        launch = triton_copy.Launch(SPEC, plan, geometry, to_page=False, tuning=tuning)
        steps = triton.cdiv(geometry.num_segments, launch.segments_per_step)
        for t in target:
            t.fill_(-1.0)
        compiled = launch.run(0, geometry.num_segments, steps)
        torch.cuda.synchronize()
        exact = all(torch.equal(a, b) for a, b in zip(target, source, strict=True))
        print(f"sweep {label}: {ptx_counts(compiled)} exact={exact}", flush=True)
        for per_sm in SWEEP_PROGRAMS_PER_SM:
            programs = per_sm * sms or steps
            ms = gpu_ms(functools.partial(launch.run, 0, geometry.num_segments, programs), repeats)
            rows.append(
                {"shape": label, "programs": programs, "ms": ms, "gb_s": total / ms / 1e6, "exact": exact}
            )
    except Exception as exc:  # a shape that does not compile is reported, the sweep goes on
        print(f"sweep {label}: failed: {exc!r}"[:300], flush=True)
    return rows


def _copy_engine_row(plan: Any, geometry: Geometry, total: int, repeats: int) -> dict[str, Any]:
    """The same segments moved by the copy engines, one batched call."""
    from kvstore_kernels import cudart

    runtime = cudart.runtime()
    cache_addrs, page_addrs = geometry.segment_addresses(np.asarray(plan.blocks))
    sizes = np.full(cache_addrs.size, geometry.segment_bytes, dtype=np.uint64)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):

        def batch() -> None:
            runtime.memcpy_batch_async(cache_addrs.ravel(), page_addrs.ravel(), sizes, stream.cuda_stream)

        started = time.perf_counter()
        batch()
        host_ms = (time.perf_counter() - started) * 1e3
        ms = gpu_ms(batch, max(2, repeats // 4))
    return {
        "shape": f"copy engines, one batched call (host {host_ms:.2f} ms)",
        "programs": 0,
        "ms": ms,
        "gb_s": total / ms / 1e6,
        "exact": None,
    }
