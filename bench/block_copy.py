"""`kvstore_kernels.copy_blocks` between two GPUs: the copy engines (`KVSTORE_BLOCK_COPY=auto`, block
ids consecutive on both sides) against the Triton kernel (`kernel`), against the flat peer copy of the
same bytes in the same run.

Llama-3.1-8B's geometry (32 layers, 8 KV heads, head dim 128, bf16, flash_attn layout, blocks of 16);
the source's blocks on GPU 0, copied into a zeroed cache on GPU 1 on a side stream. Each row: `--reps`
copies after 2 untimed, median; the peer copy timed before each copy; every byte compared.

    python bench/block_copy.py --tokens 8192 32768 --turns 2

Writes bench/results/block_copy.json (`--name`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvstore_kernels  # noqa: E402
from bench.common import print_table, write_results  # noqa: E402
from bench.transfer_cases import make_spec  # noqa: E402
from kvstore_kernels import block_engines, blocks  # noqa: E402


def row(spec: object, tokens: int, mode: str, reps: int) -> dict[str, object]:
    blocks_count = tokens // 16
    shape = (2, blocks_count, 16, 8, 256)  # bytes
    src = [
        torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda:0").view(torch.bfloat16)
        for _ in range(32)
    ]
    dst = [torch.zeros_like(t, device="cuda:1") for t in src]
    flat0 = torch.randint(0, 256, (32 * src[0].numel() * 2,), dtype=torch.uint8, device="cuda:0")
    flat1 = torch.empty_like(flat0, device="cuda:1")
    ids, side = np.arange(blocks_count), torch.cuda.Stream("cuda:1")
    os.environ["KVSTORE_BLOCK_COPY"] = mode
    ways: list[bool] = []
    engines = blocks.copy_by_engines
    blocks.copy_by_engines = lambda *args: ways.append(engines(*args)) or ways[-1]  # type: ignore[assignment]
    copies, peers = [], []
    try:
        for _ in range(reps + 2):
            torch.cuda.synchronize("cuda:0")
            torch.cuda.synchronize("cuda:1")
            started = time.perf_counter()
            flat1.copy_(flat0, non_blocking=True)
            torch.cuda.synchronize("cuda:1")
            peers.append((time.perf_counter() - started) * 1e3)
            started = time.perf_counter()
            kvstore_kernels.copy_blocks(spec, src, ids, dst, ids, stream=side)  # type: ignore[arg-type]
            side.synchronize()
            copies.append((time.perf_counter() - started) * 1e3)
    finally:
        blocks.copy_by_engines = engines  # type: ignore[assignment]
    same = all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8).to("cuda:0"))
        for a, b in zip(src, dst, strict=True)
    )
    peer, copy = statistics.median(peers[2:]), statistics.median(copies[2:])
    return {"tokens": tokens, "mode": mode, "engines": all(ways), "copy_ms": copy, "peer_ms": peer,
            "x_peer_copy": peer / copy, "ok": same}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--turns", type=int, default=2, help="each mode this many times, in turn")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--name", default="block_copy")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench/block_copy.py needs two CUDA GPUs")
    spec = make_spec("flash_attn")
    rows = [
        row(spec, tokens, mode, args.reps)
        for tokens in args.tokens
        for _ in range(args.turns)
        for mode in ("auto", "kernel")
    ]
    table = [
        [r["tokens"], r["mode"], r["engines"], round(r["copy_ms"], 3), round(r["peer_ms"], 3),
         round(r["x_peer_copy"], 3), "PASS" if r["ok"] else "FAIL"]
        for r in rows
    ]  # fmt: skip
    print_table(
        ["tokens", "KVSTORE_BLOCK_COPY", "by the engines", "copy ms", "peer copy ms", "x peer", "bytes"],
        table,
    )
    print("batch calls refused:", block_engines._failed or "none")
    print(write_results(args.name, {"gpus": torch.cuda.get_device_name(0), "rows": rows}))


if __name__ == "__main__":
    main()
