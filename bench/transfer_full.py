"""The transfer benchmark's full run: every variant of each layout and direction, against memcpy.

- `throughput_variants(setup, to_page, num_sms)`: one direction's variants by name (memcpy, the
  per-block baselines, the kernel at several program counts, the copy engines, the staged path
  and its knobs, the public call); `pair_variants(setup)`: (gather, scatter) pairs run at once.
- `full_layout(args, log, setup, matmul, num_sms)`: one layout's rows (verified where listed in
  `VERIFIED`, the model's slowdown beside those in `INTERFERENCE_*`), its both-ways rows, and
  the public call timed in turn with memcpy (`INTERLEAVED*`); `run_full(args, log)`: every
  layout's.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

import torch

from bench.interference import MatmulStream
from bench.transfer_cases import CAPS, Enqueue, Setup
from bench.transfer_rows import guarded, median_slowdown, timed_row
from bench.transfer_timing import both_ways, timed_against, verify
from bench.transfer_variants import (
    copy_engines,
    device_pack,
    kernel,
    memcpy,
    memcpy_pages,
    per_block_cuda,
    per_block_python,
    staged_path,
)
from kvstore_kernels import TransferOptions, staged

MiB = 1 << 20
STAGED_PROGRAMS = tuple(n for n in (8, 16, 32, 64) if n != staged.DEFAULT_PROGRAMS)
AUTO_CAPS = (4, 8, 16)  # public calls with max_programs: at most that many SMs
INTERLEAVED = ("auto", "auto@16", "auto/cold")  # also timed in turn with memcpy (`timed_against`)
INTERLEAVED_PAIRS = ("auto+auto", "auto/cold+auto/cold")

INTERFERENCE_VARIANTS = (
    "memcpy",
    "kernel@2",
    "copy_engine",
    "staged",
    "staged/serial",
    "staged/64MiB",
    "staged/2streams",
    *(f"staged@{n}" for n in STAGED_PROGRAMS),
    "auto",
    "auto@16",
)

INTERFERENCE_PAIRS = (
    "memcpy",
    "kernel+kernel",
    "copy_engine+copy_engine",
    "staged/serial+staged/serial",
    "auto+auto",
)

VERIFIED = (
    "kernel",
    "kernel@all",
    "copy_engine",
    "per_block_batch",
    "staged",
    "staged/serial",
    "staged/64MiB",
    "staged/2streams",
    "auto",
    "auto/cold",
    *(f"auto@{n}" for n in AUTO_CAPS),
)


def throughput_variants(setup: Setup, to_page: bool, num_sms: int) -> dict[str, Enqueue]:
    if setup.layout.startswith("vllm"):  # blocks are not packed runs: no per-block copy baselines
        return {
            "memcpy": memcpy(setup, to_page),
            "kernel": kernel(setup, to_page, None),
            "staged": staged_path(setup, to_page),
            "auto": setup.call(to_page, None),
            "auto/cold": setup.call(to_page, None, cold=True),
            "auto/per-layer": setup.per_layer(to_page),
            "memcpy x4": repeated(memcpy(setup, to_page), 4),
            "auto x4": repeated(setup.call(to_page, None), 4),
        }
    variants = {
        "memcpy": memcpy(setup, to_page),
        # The staged path's copies alone: one per 32 MiB page, on one side stream or two in turn.
        "memcpy/pages": memcpy_pages(setup, to_page),
        "memcpy/pages x2": memcpy_pages(setup, to_page, streams=2),
        "memcpy/pages+events": memcpy_pages(setup, to_page, handoff=True),
        "per_block_python": per_block_python(setup, to_page),
        "per_block_cuda": per_block_cuda(setup, to_page),
        "per_block_batch": copy_engines(setup, to_page, "1d"),
        "kernel@2": kernel(setup, to_page, 2),
        **{f"kernel@{cap or 'all'}": kernel(setup, to_page, cap or num_sms) for cap in CAPS},
        "kernel": kernel(setup, to_page, None),
        "copy_engine": copy_engines(setup, to_page),
        "staged": staged_path(setup, to_page),
        "staged/serial": staged_path(setup, to_page, overlap=False),
        "staged/64MiB": staged_path(setup, to_page, staging_bytes=64 * MiB),
        "staged/2streams": staged_path(setup, to_page, copy_streams=2),
        # Public calls, each timed alone (issue + run, synchronised): "auto" on cache tensors
        # seen before (a serving engine's case), "auto/cold" as the first call on them.
        "auto": setup.call(to_page, None),
        "auto/cold": setup.call(to_page, None, cold=True),
        **{f"auto@{n}": setup.call(to_page, TransferOptions(max_programs=n)) for n in AUTO_CAPS},
        # Four calls back to back, as a serving engine issues them: each call's host work
        # (validation, tables) overlaps the copies of the one before.
        "memcpy x4": repeated(memcpy(setup, to_page), 4),
        "auto x4": repeated(setup.call(to_page, None), 4),
    }
    if setup.layout == "flash_attn":  # the staged path's knobs: pack programs, slot size
        for programs in STAGED_PROGRAMS:
            variants[f"staged@{programs}"] = staged_path(setup, to_page, programs)
        for programs in (16, 32, 64):  # how long a pack burst holds its SMs: bytes / this rate
            variants[f"d2d@{programs}"] = device_pack(setup, to_page, programs)
    return variants


def picked(variants: dict[str, Any], names: list[str] | None) -> dict[str, Any]:
    """The variants named in `names` (None: all); the rest are never built into a row."""
    return variants if names is None else {name: v for name, v in variants.items() if name in names}


def repeated(enqueue: Enqueue, times: int) -> Enqueue:
    def enqueue_all() -> int:
        return sum(enqueue() for _ in range(times))

    return enqueue_all


def pair_variants(setup: Setup) -> dict[str, tuple[Enqueue, Enqueue]]:
    """(gather, scatter) pairs for both directions at once; the scatter uses the second table."""
    g_kernel, s_kernel = kernel(setup, True, None), kernel(setup, False, None, second=True)
    pairs = {
        "memcpy": (memcpy(setup, True), memcpy(setup, False, second=True)),
        "kernel+kernel": (g_kernel, s_kernel),
        "kernel@16+kernel@16": (kernel(setup, True, 16), kernel(setup, False, 16, second=True)),
        "copy_engine+copy_engine": (copy_engines(setup, True), copy_engines(setup, False, second=True)),
        "staged+staged": (staged_path(setup, True), staged_path(setup, False, second=True)),
        "staged/serial+staged/serial": (
            staged_path(setup, True, overlap=False),
            staged_path(setup, False, overlap=False, second=True),
        ),
        "auto+auto": (setup.call(True, None), setup.call(False, None, second=True)),
        "auto/cold+auto/cold": (
            setup.call(True, None, cold=True),
            setup.call(False, None, second=True, cold=True),
        ),
        "auto@16+auto@16": (
            setup.call(True, TransferOptions(max_programs=16)),
            setup.call(False, TransferOptions(max_programs=16), second=True),
        ),
    }
    if setup.layout != "cross_layer":  # 1-D copy batches: 23-35 GB/s, measured before
        del pairs["copy_engine+copy_engine"]
    return pairs


def full_layout(
    args: argparse.Namespace, log: list[str], setup: Setup, matmul: MatmulStream, num_sms: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """One layout's rows: each direction's variants, then both directions at once; and the rows
    timed in turn with memcpy."""
    rows: list[dict[str, Any]] = []
    interleaved: list[dict[str, Any]] = []
    for to_page in (True, False):
        direction_rows, direction_turns = one_direction(args, log, setup, matmul, num_sms, to_page)
        rows += direction_rows
        interleaved += direction_turns
    pairs, pair_turns = both_directions(args, log, setup, matmul)
    return rows, pairs, interleaved + pair_turns


def one_direction(
    args: argparse.Namespace, log: list[str], setup: Setup, matmul: MatmulStream, num_sms: int, to_page: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One direction's variants, each verified (where listed) and timed; then the public call's
    variants in turn with memcpy."""
    layout, direction = setup.layout, "gather" if to_page else "scatter"
    measure_interference = layout in args.interference_layouts
    variants = picked(throughput_variants(setup, to_page, num_sms), args.variants)
    # The per-block variants hold tens of thousands of objects: keep them out of the cyclic
    # collector's scans, which otherwise land in the timed calls as millisecond pauses.
    gc.collect()
    gc.freeze()
    checks = {
        name: guarded(log, f"verify {layout} {direction} {name}", verify, setup, to_page, variants[name])
        for name in VERIFIED
        if name in variants
    }
    rows = []
    for name, enqueue in variants.items():
        reps = 1 if name.startswith("per_block") else args.reps
        fields = {"layout": layout, "direction": direction, "variant": name, "ok": checks.get(name)}
        beside = matmul if measure_interference and name in INTERFERENCE_VARIANTS else None
        label = f"{layout} {direction} {name}"
        row = timed_row(log, label, [enqueue], reps, fields, beside, args.repeats)
        if row is None:
            continue
        rows.append(row)
        print(
            f"{layout:12} {direction:8} {name:18} {row['gbps']:7.2f} GB/s slowdown {median_slowdown(row)}",
            flush=True,
        )
    turns = [
        in_turn_with_memcpy(log, layout, direction, name, variants[name], variants["memcpy"], args.reps)
        for name in INTERLEAVED  # the acceptance ratios, each in turn with memcpy
        if name in variants and "memcpy" in variants
    ]
    return rows, [turn for turn in turns if turn is not None]


def both_directions(
    args: argparse.Namespace, log: list[str], setup: Setup, matmul: MatmulStream
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A gather and a scatter at once, each pair of variants; then the public call's pairs in turn
    with memcpy's."""
    layout = setup.layout
    measure_interference = layout in args.interference_layouts
    chosen = picked(pair_variants(setup), args.pairs)
    pairs = []
    for name, (first, second) in chosen.items():
        beside = matmul if measure_interference and name in INTERFERENCE_PAIRS else None
        label = f"{layout} both {name}"
        row = timed_row(
            log, label, [first, second], args.reps, {"layout": layout, "variant": name}, beside, args.repeats
        )
        if row is None:
            continue
        pairs.append(row)
        print(
            f"{layout:12} both     {name:24} {row['gbps']:7.2f} GB/s slowdown {median_slowdown(row)}",
            flush=True,
        )
    turns = [
        in_turn_with_memcpy(
            log, layout, "both", name, both_ways(*chosen[name]), both_ways(*chosen["memcpy"]), args.reps
        )
        for name in INTERLEAVED_PAIRS
        if name in chosen and "memcpy" in chosen
    ]
    return pairs, [turn for turn in turns if turn is not None]


def in_turn_with_memcpy(
    log: list[str], layout: str, direction: str, name: str, variant: Enqueue, baseline: Enqueue, reps: int
) -> dict[str, Any] | None:
    """`variant` timed in turn with memcpy (`timed_against`): a row of the "interleaved" list."""
    turns = guarded(log, f"{layout} {direction} {name} vs memcpy", timed_against, variant, baseline, reps)
    if turns is None:
        return None
    print(f"{layout:12} {direction:8} {name:18} in turn with memcpy: {turns['ratio']:.3f}")
    return {"layout": layout, "direction": direction, "variant": name, **turns}


def run_full(args: argparse.Namespace, log: list[str]) -> dict[str, Any]:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    matmul = MatmulStream(8192)
    rows: list[dict[str, Any]] = []
    pairs: list[dict[str, Any]] = []
    interleaved: list[dict[str, Any]] = []
    for layout in args.layouts:
        setup = Setup(layout, args.tokens)
        layout_rows, layout_pairs, layout_turns = full_layout(args, log, setup, matmul, num_sms)
        setup.release()
        rows += layout_rows
        pairs += layout_pairs
        interleaved += layout_turns
        torch.cuda.empty_cache()
        if args.partial:
            Path(args.partial).write_text(json.dumps({"rows": rows, "both_ways": pairs, "errors": log}))
    return {"rows": rows, "both_ways": pairs, "interleaved": interleaved}
