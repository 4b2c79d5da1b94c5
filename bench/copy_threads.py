"""The host's CPU copy rate by thread count: what the client's bounce ring (`kvstore_client/bounce.py`) can
move from its pinned slots into arena slabs not registered yet (`memmove` in 4 MiB pieces, the
GIL released), into memory already faulted in, as the registrar's faulters leave it.

    python bench/copy_threads.py [--gib 4] [--threads 1 2 4 8 12]

Prints GB/s per thread count (the best of 3 rounds) and writes bench/results/copy-threads.json.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_results  # noqa: E402
from kvstore_client.bounce import PIECE_BYTES  # noqa: E402


def rate(source: torch.Tensor, target: torch.Tensor, threads: int) -> float:
    """GB/s of one copy of `source` into `target` on `threads` threads, in PIECE_BYTES pieces."""
    size = source.numel()
    with ThreadPoolExecutor(threads) as pool:
        started = time.perf_counter()
        pieces = [
            pool.submit(
                ctypes.memmove, target.data_ptr() + at, source.data_ptr() + at, min(PIECE_BYTES, size - at)
            )
            for at in range(0, size, PIECE_BYTES)
        ]
        for piece in pieces:
            piece.result()
        return size / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8, 12])
    args = parser.parse_args()
    size = int(args.gib * (1 << 30))
    source = torch.randint(0, 256, (size,), dtype=torch.uint8)
    target = torch.ones(size, dtype=torch.uint8)  # faulted in
    rows, results = [], []
    for threads in args.threads:
        best = max(rate(source, target, threads) for _ in range(3))
        if not torch.equal(source[:: 1 << 20], target[:: 1 << 20]):
            raise SystemExit("the copy is wrong")
        rows.append([threads, f"{best:.1f}"])
        results.append({"threads": threads, "gbps": best})
    print(f"CPU copy rate, {args.gib:g} GiB, {len(os.sched_getaffinity(0))} CPUs")
    print_table(["threads", "GB/s"], rows)
    print(
        f"wrote {write_results('copy-threads', {'cpus': len(os.sched_getaffinity(0)), 'results': results})}"
    )


if __name__ == "__main__":
    main()
