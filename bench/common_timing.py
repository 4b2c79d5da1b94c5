"""Timing loops the benchmarks share; standard library only (torch imported where CUDA is waited for).

- `time_calls(call, calls)`: seconds of each of `calls` calls, one after another.
- `median_us(call, calls)`: their median, in microseconds.
- `walls_in_turn(runs, reps, before)`: each run's wall seconds, the runs in turn in each round,
  the GPU (where there is one) synchronised around each.

`bench/control_plane_host.py` runs as a script against other source trees and imports this
module by its bare name (bench/ is the script's folder), so it imports nothing of this tree.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def time_calls(call: Callable[[], object], calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


def median_us(call: Callable[[], object], calls: int) -> float:
    """Median microseconds of `calls` calls, one at a time."""
    return statistics.median(time_calls(call, calls)) * 1e6


def synchronizer() -> Callable[[], None]:
    """What waits for the GPU's queued work: `torch.cuda.synchronize`, or nothing without CUDA (a
    dry run on the CPU, where every copy is done when its call returns)."""
    import torch

    return torch.cuda.synchronize if torch.cuda.is_available() else _nothing


def _nothing() -> None:
    pass


def walls_in_turn(
    runs: dict[str, Callable[[], Any]], reps: int, before: dict[str, Callable[[], Any]] | None = None
) -> dict[str, list[float]]:
    """Each run's wall seconds (synchronised), the runs in turn in each of `reps` rounds after one
    untimed round; `before[name]`, if given, runs untimed ahead of each `name` (a Clear, a pause)."""
    before = before or {}
    synchronize = synchronizer()
    walls: dict[str, list[float]] = {name: [] for name in runs}
    for attempt in range(reps + 1):
        for name, run in runs.items():
            if name in before:
                before[name]()
            synchronize()
            start = time.perf_counter()
            run()
            synchronize()
            if attempt:
                walls[name].append(time.perf_counter() - start)
    return walls


def medians_in_turn(runs: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median seconds of each run, timed as `walls_in_turn` times them."""
    return {name: statistics.median(walls) for name, walls in walls_in_turn(runs, reps).items()}
