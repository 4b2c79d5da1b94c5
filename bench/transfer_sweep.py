"""The transfer benchmark's sweep (`--sweep`): kernel shapes and the copy-engine paths, for
choosing the defaults.

- `sweep_layout(args, log, setup, matmul)`: per direction, each kernel shape (`SWEEP_SHAPES`,
  cache hints `SWEEP_HINTS` on flash_attn) at each program count, with what Triton compiled
  (`compile_report`: registers, spills, 16-byte loads and stores); memcpy and the copy-engine
  paths with the model's slowdown beside them; and the slowdown beside the fastest shape at 2,
  4 and 8 programs. `run_sweep(args, log)`: every layout's.
- `print_sweep(result)`: the fastest shape per layout, direction and program count.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench.common import print_table
from bench.interference import MatmulStream
from bench.transfer_cases import Setup
from bench.transfer_rows import guarded, median_slowdown, timed_row, with_interference
from bench.transfer_variants import copy_engines, kernel, memcpy
from kvstore_kernels import copy_engine, triton_copy

SWEEP_SHAPES = [  # (tile_bytes, segments_per_step, num_warps)
    (16384, 1, 8),
    (32768, 1, 8),
    (16384, 2, 8),
    (32768, 2, 8),
    (16384, 4, 8),
    (32768, 4, 8),
    (16384, 1, 4),
    (32768, 1, 4),
    (16384, 2, 4),
]

SWEEP_PROGRAMS = (2, 4, 8, 16)

SWEEP_HINTS = [
    {"load_cache": ".cg"},
    {"store_cache": ".cs"},
    {"eviction": "evict_first"},
    {"load_cache": ".cg", "store_cache": ".cs"},
]


def compile_report(compiled: Any) -> dict[str, Any]:
    """Registers, spills and how wide the global loads and stores are, from Triton's compiled kernel."""
    ptx = compiled.asm.get("ptx", "") if compiled is not None else ""
    loads = [line for line in ptx.splitlines() if "ld.global" in line]
    stores = [line for line in ptx.splitlines() if "st.global" in line]
    return {
        "n_regs": getattr(compiled, "n_regs", None),
        "n_spills": getattr(compiled, "n_spills", None),
        "ld_global_16B": sum(".v4.b32" in line or ".v2.b64" in line for line in loads),
        "ld_global": len(loads),
        "st_global_16B": sum(".v4.b32" in line or ".v2.b64" in line for line in stores),
        "st_global": len(stores),
    }


def sweep_shapes(layout: str) -> list[tuple[triton_copy.Tuning, str]]:
    shapes = [
        (triton_copy.Tuning(tile, segments, warps), f"tile={tile // 1024}K seg={segments} warps={warps}")
        for tile, segments, warps in SWEEP_SHAPES
    ]
    if layout != "flash_attn":  # the kernel's shape matters the same way on every layout
        return shapes[:2]
    return shapes + [
        (triton_copy.Tuning(**hints), ",".join(f"{k}={v}" for k, v in hints.items())) for hints in SWEEP_HINTS
    ]


def sweep_layout(
    args: argparse.Namespace, log: list[str], setup: Setup, matmul: MatmulStream
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Kernel shapes x program counts, and the copy-engine paths, of one layout."""
    kernels: list[dict[str, Any]] = []
    engines: list[dict[str, Any]] = []
    for to_page in (True, False):
        plan = setup.plan(to_page=to_page)
        direction_kernels = kernel_rows(log, setup, plan, to_page)
        kernels += direction_kernels
        engines += engine_rows(args, log, setup, plan, matmul, to_page)
        best_beside(args, log, setup, direction_kernels, matmul, to_page)
    return kernels, engines


def kernel_rows(log: list[str], setup: Setup, plan: Any, to_page: bool) -> list[dict[str, Any]]:
    """Each kernel shape at each of `SWEEP_PROGRAMS`, with what Triton compiled for it."""
    layout, direction = setup.layout, "gather" if to_page else "scatter"
    rows = []
    for tuning, label in sweep_shapes(layout):
        compiled = guarded(log, f"compile {label}", _launch_once, setup, plan, to_page, tuning)
        report = compile_report(compiled)
        for programs in SWEEP_PROGRAMS:
            fields = {"layout": layout, "direction": direction, "shape": label, "programs": programs}
            fields |= {"tuning": tuning._asdict(), **report}
            label_at = f"{layout} {direction} {label} @{programs}"
            row = timed_row(log, label_at, [kernel(setup, to_page, programs, tuning)], 3, fields)
            if row is None:
                continue
            rows.append(row)
            print(
                f"{layout:12} {direction:8} {label:44} @{programs:<3} {row['gbps']:7.2f} GB/s "
                f"regs={report['n_regs']} 16B={report['ld_global_16B']}/{report['ld_global']}",
                flush=True,
            )
    return rows


def engine_rows(
    args: argparse.Namespace, log: list[str], setup: Setup, plan: Any, matmul: MatmulStream, to_page: bool
) -> list[dict[str, Any]]:
    """memcpy and the copy engines (1-D batches, and 2-D copies where the layout allows them),
    each with the model's slowdown beside it."""
    layout, direction = setup.layout, "gather" if to_page else "scatter"
    paths = [("memcpy", memcpy(setup, to_page)), ("copy_engine_1d", copy_engines(setup, to_page, "1d"))]
    if copy_engine.can_copy_2d(setup.spec, plan):
        paths.append(("copy_engine_2d", copy_engines(setup, to_page, "2d")))
    rows = []
    for name, enqueue in paths:
        fields = {"layout": layout, "direction": direction, "variant": name}
        label = f"{layout} {direction} {name}"
        row = timed_row(log, label, [enqueue], args.reps, fields, matmul, args.repeats)
        if row is None:
            continue
        rows.append(row)
        print(
            f"{layout:12} {direction:8} {name:20} {row['gbps']:7.2f} GB/s issue {row['issue_ms']:.2f} ms "
            f"slowdown {median_slowdown(row)}",
            flush=True,
        )
    return rows


def best_beside(
    args: argparse.Namespace,
    log: list[str],
    setup: Setup,
    kernels: list[dict[str, Any]],
    matmul: MatmulStream,
    to_page: bool,
) -> None:
    """The kernel's interference: the fastest shape at each program count, measured into its row."""
    layout, direction = setup.layout, "gather" if to_page else "scatter"
    for programs in (2, 4, 8):
        mine = [r for r in kernels if (r["direction"], r["programs"]) == (direction, programs)]
        if not mine:
            continue
        best = max(mine, key=lambda r: r["gbps"])
        enqueue = kernel(setup, to_page, programs, triton_copy.Tuning(**best["tuning"]))
        with_interference(log, f"kernel {best['shape']}@{programs}", best, matmul, [enqueue], args.repeats)
        print(
            f"{layout:12} {direction:8} best@{programs} {best['shape']:40} slowdown {median_slowdown(best)}",
            flush=True,
        )


def _launch_once(setup: Setup, plan: Any, to_page: bool, tuning: triton_copy.Tuning) -> Any:
    compiled = triton_copy.launch(setup.spec, plan, to_page=to_page, max_programs=2, tuning=tuning)
    torch.cuda.synchronize()
    return compiled


def run_sweep(args: argparse.Namespace, log: list[str]) -> dict[str, Any]:
    matmul = MatmulStream(8192)
    kernels: list[dict[str, Any]] = []
    engines: list[dict[str, Any]] = []
    for layout in args.layouts:
        setup = Setup(layout, args.tokens)
        layout_kernels, layout_engines = sweep_layout(args, log, setup, matmul)
        setup.release()
        kernels += layout_kernels
        engines += layout_engines
        torch.cuda.empty_cache()
    return {"kernels": kernels, "engines": engines}


def print_sweep(result: dict[str, Any]) -> None:
    best: dict[tuple[str, str, int], dict[str, Any]] = {}
    for row in result["kernels"]:
        key = (row["layout"], row["direction"], row["programs"])
        if key not in best or row["gbps"] > best[key]["gbps"]:
            best[key] = row
    print_table(
        ["layout", "direction", "programs", "best shape", "GB/s", "slowdown"],
        [
            [*key, row["shape"], round(row["gbps"], 2), median_slowdown(row) or "-"]
            for key, row in best.items()
        ],
    )
