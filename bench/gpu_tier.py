"""Loads from the GPU tier vs from the CPU tier vs a device-to-device copy of the same bytes.

Llama-3.1-8B geometry (32 layers, 8 KV heads, head dim 128, bf16, 16-token blocks, flash-attn
layout), 8k tokens = 1 GiB of KV in 32 pages of 256 tokens. One daemon with both tiers; prompt A
stays in the CPU tier (promote_after_hits is set out of reach), prompt B is moved into the GPU
tier with a Pin. Each figure is the median of `--repeats` timed calls, GPU synchronised, the
rows timed in turn in each round after an untimed round, GB/s of KV bytes landed in the cache:

- d2d copy: one `copy_` of a 1 GiB device tensor (the same bytes, contiguous): the ceiling;
- load, CPU tier: `client.load` of A (Lookup with lease, Acquire, scatter from the registered
  arena over PCIe, Release);
- load, GPU tier: `client.load` of B: the same calls, the scatter reading the daemon's pool
  opened over CUDA IPC; once with the kernels' default program count for a device buffer and
  once with one program per SM;
- scatter only: the kernel alone from the pool (no control calls), both program counts;
- both loads again with the chunk keys passed in (`keys=`), as an engine does that hashed
  the prompt once when it looked it up; and again with the keys and the KV cache registered
  once (`client.register_kv_caches`), as vLLM's connectors register it;
- 4 loads in flight: four `load_async` (keys, registered cache) issued before the first is
  waited for, as an engine issues the loads of a batch; ms per load, so each load's host
  work overlaps the copies of the loads before it;
- after the rows above, the d2d copy and the loads of each tier (plain, and keys + registered
  cache) again, each timed on its own: a warm-up call, then `--repeats` calls back to back,
  median (the method's way, and the acceptance's rows: timed in turn, a GPU-tier load always
  follows a 21 ms CPU-tier load, after which the GPU machine's host runs every step of the next
  load slower, see `--profile` and NOTES-gpu-tier.md). "x d2d" compares a row with the copy
  timed the same way.

`--daemon-poll-ms N` runs the daemon with `server.local_poll_ms: N`.

`measure()` is also run by `bench/transfer.py`, which prints these rows after its own.

Acceptance (issue 7): GPU-tier load >= 10x the CPU-tier load and >= 0.5x the d2d copy, with the
loads as an engine's connector makes them (keys from its lookup, cache registered once) and
timed back to back; the other comparisons are printed as "also".

`--profile` adds where one GPU-tier load spends its time: each step of `client.load` taken
one by one (keys, Lookup with lease, Acquire unless the Lookup answered it, cutting the reply
into pieces, the public scatter call's host time, the wait for the GPU, Release), the GPU
span of the scatter (events), the scatter call's own steps (checks, geometry, kernel
arguments and table upload, launch), and cProfile's top functions over a run of loads; and
a GPU-tier load's time after pauses of several kinds (a CPU-tier load, a sleep, GPU work),
with its steps back to back and after a sleep.
`--sweep` times the kernel's shapes and program counts reading the pool (GPU time of calls
back to back), and the copy engines moving the same segments in one batched call.

    python bench/gpu_tier.py            # writes bench/results/gpu_tier.json
    python bench/gpu_tier.py --profile --sweep

This module holds the command line; the parts are modules of their own: `gpu_tier_measure` (the
rows, the acceptance, `measure` and `print_report`, which this module also offers), the loads it
times (`gpu_tier_loads`), `gpu_tier_sweep`, `gpu_tier_profile` with `gpu_tier_host_steps`, and
what they share (`gpu_tier_setup`: the geometry, the daemon, GPU timing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

from bench.common import write_results  # noqa: E402
from bench.gpu_tier_measure import measure, print_report  # noqa: E402

__all__ = ["main", "measure", "print_report"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="time each step of a GPU-tier load")
    parser.add_argument("--sweep", action="store_true", help="time the kernel's shapes reading the pool")
    parser.add_argument(
        "--daemon-poll-ms", type=float, default=0.0, help="the daemon's server.local_poll_ms (default 0)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_tier.py needs a CUDA device")
    measured = measure(
        args.tokens, args.repeats, profile=args.profile, sweep=args.sweep, daemon_poll_ms=args.daemon_poll_ms
    )
    print_report(measured)
    path = write_results("gpu_tier", {key: value for key, value in measured.items() if key != "rows"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
