"""Timing the transfer benchmark's variants, and checking what they moved.

- `timed(enqueue)`: median wall time of one whole transfer (issue + run), GB/s, host issue time;
  `timed_pair(first, second)`: both at once on two streams (`both_ways`).
- `timed_against(enqueue, baseline)`: the two in turn, the median of the per-round ratios.
- `verify(setup, to_page, enqueue)`: one transfer checked against the torch reference.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from bench.transfer_cases import Enqueue, Setup
from kvstore_kernels import reference


def timed(enqueue: Enqueue, reps: int = 5, warmup: int = 1) -> dict[str, Any]:
    """Median wall time of one whole transfer (issue + run), its GB/s, and the host issue time."""
    for _ in range(warmup):
        enqueue()
    torch.cuda.synchronize()
    walls, issues, moved = [], [], 0
    for _ in range(reps):
        start = time.perf_counter()
        moved = enqueue()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
        issues.append(issued - start)
    wall = statistics.median(walls)
    return {
        "ms": wall * 1e3,
        "gbps": moved / wall / 1e9,
        "issue_ms": statistics.median(issues) * 1e3,
        "spread": (max(walls) - min(walls)) / wall,
        "walls_ms": [round(w * 1e3, 3) for w in walls],
    }


def timed_pair(first: Enqueue, second: Enqueue, reps: int = 5) -> dict[str, Any]:
    """Both transfers at once on two streams: total bytes over the wall time."""
    return timed(both_ways(first, second), reps)


def both_ways(first: Enqueue, second: Enqueue) -> Enqueue:
    """`first` and `second` on two side streams, after the current stream's work and before its next."""
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def both() -> int:
        moved = 0
        for stream, enqueue in zip(streams, (first, second), strict=True):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                moved += enqueue()
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
        return moved

    return both


def timed_against(enqueue: Enqueue, baseline: Enqueue, reps: int = 7, warmup: int = 1) -> dict[str, Any]:
    """`baseline` and `enqueue` in turn, each timed alone (issue + run, synchronised): the median of
    the per-round ratios of their rates (baseline wall / wall). Slow stretches of the link (seen on
    the H100: one memcpy's seven walls wandering from 19.5 to 22.4 ms) then hit both alike, where
    two medians taken seconds apart can differ by 10%."""
    for _ in range(warmup):
        baseline()
        enqueue()
    torch.cuda.synchronize()
    walls: dict[str, list[float]] = {"baseline": [], "variant": []}
    for _ in range(reps):
        for key, function in (("baseline", baseline), ("variant", enqueue)):
            start = time.perf_counter()
            function()
            torch.cuda.synchronize()
            walls[key].append(time.perf_counter() - start)
    ratios = [b / v for b, v in zip(walls["baseline"], walls["variant"], strict=True)]
    return {
        "ratio": statistics.median(ratios),
        "ratios": [round(r, 4) for r in ratios],
        "ms": statistics.median(walls["variant"]) * 1e3,
        "baseline_ms": statistics.median(walls["baseline"]) * 1e3,
    }


def verify(setup: Setup, to_page: bool, enqueue: Enqueue) -> bool:
    """One transfer, checked against the torch reference (gather: the page bytes; scatter: the blocks
    read back by the reference)."""
    pages = torch.empty(setup.bytes, dtype=torch.uint8, device="cuda")
    check = setup.plan(to_page=True, buffer=pages)
    if to_page:
        setup.buffer.fill_(0xA5)
    else:  # bytes the cache does not hold yet
        setup.buffer.copy_(torch.randint(0, 256, (setup.bytes,), dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    enqueue()
    reference.gather_plan(check)
    torch.cuda.synchronize()
    return bool(torch.equal(pages, setup.buffer.to("cuda")))
