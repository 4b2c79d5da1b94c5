"""What the GPU-tier benchmark's parts share: the geometry, the daemon, and GPU timing.

- `LAYERS`, `HEADS`, `HEAD_DIM`, `BLOCK`, `CHUNK`, `SPEC`: Llama-3.1-8B's pages (flash_attn,
  bf16, 16-token blocks, pages of 256 tokens), also `bench/transfer_checks.py`'s geometry.
- `daemon_config(total, poll_ms)`: a daemon with both tiers, its GPU tier a pool that holds a
  prompt of `total` bytes, promotion by hits out of reach (a Pin moves pages in).
- `cache(blocks, fill)`: a KV cache on the GPU; `tiers_of(client, tokens)`: where each chunk is.
- `median_s(run, repeats)`: median wall seconds, GPU synchronised; `gpu_ms(run, repeats)`: GPU
  time per call of calls issued back to back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bench.common_timing import medians_in_turn
from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.keys import pack_keys
from kvstore_client import KVSpec, KVStoreClient

LAYERS, HEADS, HEAD_DIM, BLOCK, CHUNK = 32, 8, 128, 16, 256

SPEC = KVSpec(
    model="llama-3.1-8b-bench",
    num_layers=LAYERS,
    num_kv_heads=HEADS,
    head_dim=HEAD_DIM,
    dtype=torch.bfloat16,
    block_size=BLOCK,
    chunk_tokens=CHUNK,
)


def daemon_config(total: int, poll_ms: float) -> dict[str, Any]:
    """Both tiers: the GPU pool holds `total` bytes (in 256 MiB slabs), the CPU tier twice that;
    pages reach the GPU tier by a Pin only; `server.local_poll_ms` is `poll_ms`."""
    pool_bytes = (total // (256 << 20) + 1) * (256 << 20)
    return {
        "chunk_tokens": CHUNK,
        "tiers": {
            "cpu": {"bytes": 2 * pool_bytes, "slab_bytes": 256 << 20},
            "gpu": {
                "enabled": True,
                "bytes": pool_bytes,
                "slab_bytes": 256 << 20,
                "promote_after_hits": 1 << 30,
            },
        },
        "eviction": {"pin_fraction": 1.0},
        "server": {"local_poll_ms": poll_ms},
    }


def median_s(run: Callable[[], Any], repeats: int) -> float:
    """Median wall seconds of `repeats` calls after an untimed one, GPU synchronised around each."""
    return medians_in_turn({"run": run}, repeats)["run"]


def cache(blocks: int, fill: float | None = None) -> list[torch.Tensor]:
    shape = (2, blocks, BLOCK, HEADS, HEAD_DIM)
    if fill is None:
        return [torch.randn(shape, device="cuda").bfloat16() for _ in range(LAYERS)]
    return [torch.full(shape, fill, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]


def tiers_of(client: KVStoreClient, tokens: list[int]) -> bytes:
    reply = client._rpc(
        "Lookup", pb.LookupRequest(namespace=client.namespace, keys=pack_keys(client.keys(tokens)))
    )
    return bytes(reply.tiers)


def gpu_ms(run: Callable[[], Any], repeats: int) -> float:
    """GPU time per call of `repeats` calls issued back to back, after one warm-up call."""
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / repeats
