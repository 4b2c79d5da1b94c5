"""The transfer benchmark's profile (`--profile`): where the host's time goes before and while a
public call issues its transfer, per direction.

- `step_times`: each step of the call's checks and routing, median µs alone;
- `issue_times`: the public call's issue time, and its time until the staged path queues its
  first piece, against the staged path with its plan prepared;
- `print_cprofile`: cProfile's top functions over 5 public calls.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common_timing import median_us
from bench.transfer_cases import Enqueue, Setup
from bench.transfer_variants import staged_path
from kvstore_kernels import TransferOptions, staged


def run_profile(args: argparse.Namespace) -> None:
    """Where the host's time goes before and while a public call issues its transfer."""
    setup = Setup(args.layouts[0], args.tokens)
    for to_page in (True, False):
        profile_direction(setup, to_page)
    setup.release()


def profile_direction(setup: Setup, to_page: bool) -> None:
    """Each step's median time alone, then cProfile over 5 public calls."""
    direction = "gather" if to_page else "scatter"
    for name, took_us in step_times(setup, to_page).items():
        print(f"{direction:8} {name:44} {took_us:8.1f} us", flush=True)
    call = setup.call(to_page, None)
    issue_times(setup, to_page, call)
    print_cprofile(call, direction)


def step_times(setup: Setup, to_page: bool) -> dict[str, float]:
    """The median µs of each step of a public call's checks and routing, alone."""
    from kvstore_kernels import cache_facts, routing
    from kvstore_kernels.geometry import Geometry
    from kvstore_kernels.validate import plan_transfer

    spec = setup.spec

    def plan() -> Any:
        return plan_transfer(
            spec, setup.caches, setup.table, setup.chunks, setup.buffer, setup.offsets, None, 0,
            writes_cache=not to_page,
        )  # fmt: skip

    def cold_plan() -> Any:
        cache_facts.forget()
        return plan()

    made = plan()
    steps: dict[str, Callable[[], Any]] = {
        "plan_transfer (tensors seen before)": plan,
        "plan_transfer (first call: full checks)": cold_plan,
        "buffer.is_pinned()": setup.buffer.is_pinned,
        "routing.choose": lambda: routing.choose(spec, made, TransferOptions(), to_page=to_page),
        "Geometry": lambda: Geometry(spec, made),
    }
    return {name: median_us(function, 200) for name, function in steps.items()}


def issue_times(setup: Setup, to_page: bool, call: Enqueue) -> None:
    """The host's time to issue the public call and the staged path with its plan prepared, and
    until each queues its first piece (`staged._issue_cuda` marked while they run)."""
    direction = "gather" if to_page else "scatter"
    issue_pieces = staged._issue_cuda
    reached: list[float] = []

    def marked(*args: Any, **kwargs: Any) -> Any:
        reached.append(time.perf_counter())  # the host is about to queue the first piece
        return issue_pieces(*args, **kwargs)

    staged._issue_cuda = marked
    try:
        for name, enqueue in (("public call", call), ("staged, plan prepared", staged_path(setup, to_page))):
            enqueue()
            torch.cuda.synchronize()
            issue, first = [], []
            for _ in range(20):
                start = time.perf_counter()
                enqueue()
                issue.append(time.perf_counter() - start)
                first.append(reached[-1] - start)
                torch.cuda.synchronize()
            for what, samples in (("issue", issue), ("until the first piece is queued", first)):
                label = f"{name}: {what}"
                print(f"{direction:8} {label:44} {statistics.median(samples) * 1e6:8.1f} us", flush=True)
    finally:
        staged._issue_cuda = issue_pieces


def print_cprofile(call: Enqueue, direction: str) -> None:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        call()
        torch.cuda.synchronize()
    profiler.disable()
    print(f"-- {direction}: 5 public calls")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)
