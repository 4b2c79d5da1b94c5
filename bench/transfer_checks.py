"""Host time a transfer call spends checking its arguments, before any byte moves (no GPU needed).

Every gather or scatter (`kvstore_kernels`) first checks the KV cache, the block table, the
chunks, the offsets and the buffer (`validate.plan_transfer`). On the GPU-tier path this is
host time on the critical path of a load whose copy takes ~0.7 ms for 1 GiB, so it is measured
here on its own, for Llama-3.1-8B geometry (32 layers, 8 KV heads, head dim 128, bf16,
16-token blocks, flash-attn layout) and 8k tokens (32 pages of 256 tokens), CPU tensors:

- `first call`: the tensors' facts are not remembered (`cache_facts.forget()` before each).
- `remembered`: the facts are found by the tensors' fingerprints (every call fingerprints the
  64 tensors of 32 layers).
- `registered`: the cache was checked once by `kvstore_kernels.register`; a call neither
  checks nor fingerprints it.

each with the block table as a Python list, a numpy array and a CPU tensor. The variants are
timed in turn, round by round, and each row's ratio to `remembered` (the same block table) is
the median of its per-round ratios. Prints a table, writes `bench/results/transfer_checks.json`.

    python bench/transfer_checks.py [--rounds N] [--calls N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

from bench.common import print_table, write_results  # noqa: E402
from bench.common_timing import median_us  # noqa: E402
from bench.gpu_tier_setup import BLOCK, CHUNK, HEAD_DIM, HEADS, LAYERS, SPEC  # noqa: E402  (one geometry)
from kvstore_kernels import cache_facts, register  # noqa: E402
from kvstore_kernels.validate import plan_transfer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200, help="timed calls per variant and round")
    args = parser.parse_args()
    variants = checked_calls(args.tokens)
    for call in variants.values():
        call()  # warm: imports, the first allocations
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in variants}
    for _ in range(args.rounds):
        for key, call in variants.items():
            samples[key].append(median_us(call, args.calls))
    rows, results = [], {}
    for (cache, table), values in samples.items():
        baseline = samples[("remembered", table)]
        ratio = statistics.median(v / b for v, b in zip(values, baseline, strict=True))
        median = statistics.median(values)
        rows.append([cache, table, median, ratio])
        results[f"{cache}, {table} table"] = {"us": median, "x_remembered": ratio, "rounds_us": values}
    chunks, blocks = args.tokens // CHUNK, args.tokens // BLOCK
    print(f"{args.tokens} tokens, {LAYERS} layers ({chunks} pages, {blocks} blocks): host us per call")
    print_table(("cache", "block table", "us (median)", "x remembered"), rows)
    geometry = {
        "layers": LAYERS,
        "kv_heads": HEADS,
        "head_dim": HEAD_DIM,
        "block": BLOCK,
        "chunk_tokens": CHUNK,
    }
    path = write_results(
        "transfer_checks",
        {
            "geometry": {**geometry, "tokens": args.tokens},
            "rounds": args.rounds,
            "calls": args.calls,
            "results": results,
        },
    )
    print(f"wrote {path}")


def checked_calls(tokens: int) -> dict[tuple[str, str], Callable[[], Any]]:
    """The checks of a scatter of `tokens` into an 8B cache, by (cache, block table): the cache
    checked on the first call, remembered, or registered; the table a list, an array, a tensor."""
    chunks = tokens // CHUNK
    blocks = tokens // BLOCK
    page_bytes = SPEC.page.page_bytes
    # Untouched CPU memory: the checks read addresses, shapes and strides, never the bytes.
    caches = [torch.empty(2, blocks, BLOCK, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    registered = register(SPEC, caches)
    buffer = torch.empty(chunks * page_bytes, dtype=torch.uint8)
    offsets = [i * page_bytes for i in range(chunks)]
    order = np.random.default_rng(0).permutation(blocks)
    tables = {"list": order.tolist(), "numpy": order, "tensor": torch.from_numpy(order)}

    def plan(kv: Any, table: Any) -> Callable[[], Any]:
        return lambda: plan_transfer(
            SPEC, kv, table, range(chunks), buffer, offsets, None, 0, writes_cache=True
        )

    def first_call(table: Any) -> Callable[[], Any]:
        checked = plan(caches, table)

        def call() -> None:
            cache_facts.forget()
            checked()

        return call

    variants: dict[tuple[str, str], Callable[[], Any]] = {}
    for name, table in tables.items():
        variants[("first call", name)] = first_call(table)
        variants[("remembered", name)] = plan(caches, table)
        variants[("registered", name)] = plan(registered, table)
    return variants


if __name__ == "__main__":
    main()
