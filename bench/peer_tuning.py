"""The copy kernel's shape for a buffer on another GPU (peer access, NVLink) and on the same GPU.

Issue 32: a hand-over through the GPU tier is two copies, a gather into the producer's pool
(same GPU) and the consumer's scatter from it (over the link); by the kernel's default shape for
a device buffer (`triton_copy.DEVICE_TUNING`: 32 KiB per program, one program per step) they ran
at 1.0 ms per GiB and at 0.81 of a peer copy (bench/NOTES-handover.md). This sweeps the shape
(bytes per load, segments per step, warps, program count) for the four copies of a Llama-3.1-8B
prompt (flash_attn, blocks of 16), each against the copy engines' copy of the same bytes in the
same run (a device copy on the same GPU, a peer copy across), every shape's bytes checked
against the default's (poisoned first).

    python bench/peer_tuning.py                 # 8192 tokens, GPUs 0 and 1
    python bench/peer_tuning.py --tokens 32768

Writes bench/results/peer_tuning.json (`--name`). Needs two CUDA GPUs with peer access.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvstore_kernels  # noqa: E402
from bench.common import print_table, write_results  # noqa: E402
from bench.handover import cache_on  # noqa: E402
from bench.transfer_cases import make_spec  # noqa: E402
from kvstore_kernels import triton_copy  # noqa: E402
from kvstore_kernels.validate import plan_transfer  # noqa: E402

SHAPES = [
    (tile, segments, warps, programs)
    for tile, segments, warps, programs in itertools.product(
        (16384, 32768, 65536), (1, 2, 4), (None, 8, 16), (None, 528)
    )
    if tile * segments <= 131072
]


def timed_ms(run: Any, devices: tuple[torch.device, ...], reps: int) -> float:
    walls = []
    for attempt in range(reps + 1):
        for device in devices:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        for device in devices:
            torch.cuda.synchronize(device)
        if attempt:
            walls.append((time.perf_counter() - start) * 1e3)
    return statistics.median(walls)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--name", default="peer_tuning")
    args = parser.parse_args(argv)
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench/peer_tuning.py needs two CUDA GPUs")
    spec = make_spec("flash_attn")
    zero, one = torch.device("cuda", 0), torch.device("cuda", 1)
    chunks = args.tokens // spec.chunk_tokens
    moved = chunks * spec.page.page_bytes
    table = list(range(args.tokens // spec.block_size))
    offsets = [chunk * spec.page.page_bytes for chunk in range(chunks)]
    cache = cache_on(spec, args.tokens, zero, seed=1)
    buffers = {"local": torch.empty(moved, dtype=torch.uint8, device=zero)}
    buffers["peer"] = torch.empty(moved, dtype=torch.uint8, device=one)
    flat = torch.randint(0, 256, (moved,), dtype=torch.uint8, device=zero)
    baselines = {
        "local": timed_ms(lambda: buffers["local"].copy_(flat), (zero,), args.reps),
        "peer": timed_ms(lambda: buffers["peer"].copy_(flat, non_blocking=True), (zero, one), args.reps),
    }
    expected = {}
    for where, buffer in buffers.items():
        buffer.fill_(0xA5)
        torch.cuda.synchronize(buffer.device)  # the poison lands before the kernel on GPU 0 writes
        kvstore_kernels.gather(spec, cache, table, range(chunks), buffer, offsets)
        torch.cuda.synchronize(zero)  # the kernel ran on the cache's GPU
        expected[where] = buffer.cpu()
    rows = []
    for (tile, segments, warps, programs), where, to_page in itertools.product(
        SHAPES, ("local", "peer"), (True, False)
    ):
        buffer = buffers[where]
        tuning = triton_copy.Tuning(tile_bytes=tile, segments_per_step=segments, num_warps=warps)
        plan = plan_transfer(
            spec, cache, table, range(chunks), buffer, offsets, None, 0, writes_cache=not to_page
        )

        def run(
            plan: Any = plan, to_page: bool = to_page, tuning: Any = tuning, programs: Any = programs
        ) -> None:
            with torch.cuda.device(zero):
                triton_copy.launch(
                    spec,
                    plan,
                    to_page=to_page,
                    tuning=tuning,
                    max_programs=programs or triton_copy.DEVICE_MAX_PROGRAMS,
                )

        devices = (zero, one) if where == "peer" else (zero,)
        ms = timed_ms(run, devices, args.reps)
        ok = True
        if to_page:
            buffer.fill_(0x5A)
            torch.cuda.synchronize(buffer.device)
            run()
            torch.cuda.synchronize(zero)
            ok = torch.equal(buffer.cpu(), expected[where])
        rows.append(
            {
                "tile_bytes": tile,
                "segments_per_step": segments,
                "num_warps": warps,
                "max_programs": programs,
                "buffer": where,
                "direction": "gather" if to_page else "scatter",
                "ms": ms,
                "x_copy": baselines[where] / ms,
                "ok": ok,
            }
        )
        print(
            f"{where:5} {rows[-1]['direction']:7} tile {tile:6} seg {segments} warps {warps} "
            f"programs {programs}: {ms:.3f} ms, {rows[-1]['x_copy']:.3f}x copy, ok {ok}",
            flush=True,
        )
    path = write_results(
        args.name, {"tokens": args.tokens, "bytes": moved, "baselines_ms": baselines, "rows": rows}
    )
    best = []
    for where, direction in itertools.product(("local", "peer"), ("gather", "scatter")):
        group = [r for r in rows if r["buffer"] == where and r["direction"] == direction]
        default = next(
            r
            for r in group
            if (r["tile_bytes"], r["segments_per_step"], r["num_warps"], r["max_programs"])
            == (32768, 1, None, None)
        )
        top = max(group, key=lambda r: r["x_copy"])
        best.append(
            [
                where,
                direction,
                round(default["ms"], 3),
                round(default["x_copy"], 3),
                round(top["ms"], 3),
                round(top["x_copy"], 3),
                f"{top['tile_bytes']}/{top['segments_per_step']}/{top['num_warps']}/{top['max_programs']}",
                all(r["ok"] for r in group),
            ]
        )
    print_table(
        ["buffer", "way", "default ms", "x copy", "best ms", "x copy", "tile/seg/warps/programs", "ok"], best
    )
    print(path)


if __name__ == "__main__":
    main()
