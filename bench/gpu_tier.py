"""Loads from the GPU tier vs from the CPU tier vs a device-to-device copy of the same bytes.

Llama-3.1-8B geometry (32 layers, 8 KV heads, head dim 128, bf16, 16-token blocks, flash-attn
layout), 8k tokens = 1 GiB of KV in 32 pages of 256 tokens. One daemon with both tiers; prompt A
stays in the CPU tier (promote_after_hits is set out of reach), prompt B is moved into the GPU
tier with a Pin. Each figure is the median of `--repeats` timed calls after a warm-up, GPU
synchronised, GB/s of KV bytes landed in the cache:

- d2d copy: one `copy_` of a 1 GiB device tensor (the same bytes, contiguous): the ceiling;
- load, CPU tier: `client.load` of A (Lookup with lease, Acquire, scatter from the registered
  arena over PCIe, Release);
- load, GPU tier: `client.load` of B: the same calls, the scatter reading the daemon's pool
  opened over CUDA IPC; once with the kernels' default program count for a device buffer and
  once with one program per SM;
- scatter only: the kernel alone from the pool (no control calls), both program counts.

Acceptance (issue 7): GPU-tier load >= 10x the CPU-tier load and >= 0.5x the d2d copy.

    python bench/gpu_tier.py            # writes bench/results/gpu_tier.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

from bench.common import print_table, running_daemon, write_results  # noqa: E402
from kvstore.keys import pack_keys  # noqa: E402
from kvstore.proto import kvstore_pb2 as pb  # noqa: E402
from kvstore.tiers import Tier  # noqa: E402
from kvstore_client import KVSpec, KVStoreClient  # noqa: E402
from kvstore_kernels import TransferOptions, scatter  # noqa: E402

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


def median_s(run: Callable[[], Any], repeats: int) -> float:
    samples = []
    for attempt in range(repeats + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        if attempt:
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_tier.py needs a CUDA device")
    chunks = args.tokens // CHUNK
    blocks = args.tokens // BLOCK
    page_bytes = SPEC.page.page_bytes
    total = chunks * page_bytes
    pool_bytes = (total // (256 << 20) + 1) * (256 << 20)
    config = {
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
    }
    prompt_a = list(range(args.tokens))
    prompt_b = list(range(1 << 20, (1 << 20) + args.tokens))
    source_a, source_b, target = cache(blocks), cache(blocks), cache(blocks, fill=0.0)
    block_ids = list(range(blocks))
    rows: list[list[Any]] = []
    results: dict[str, Any] = {}
    with running_daemon(config) as daemon, KVStoreClient.connect(daemon.address, SPEC) as client:
        assert client.store(prompt_a, source_a, block_ids) == chunks
        assert client.store(prompt_b, source_b, block_ids) == chunks
        started = time.perf_counter()
        pin = pb.PinRequest(
            namespace=client.namespace, keys=pack_keys(client.keys(prompt_b)), ttl_ms=3_600_000
        )
        client._rpc("Pin", pin)
        while tiers_of(client, prompt_b) != bytes([Tier.GPU]) * chunks:
            time.sleep(0.001)
        promote_s = time.perf_counter() - started
        assert tiers_of(client, prompt_a) == bytes([Tier.CPU]) * chunks

        def load(prompt: list[int], source: list[torch.Tensor]) -> Callable[[], None]:
            def run() -> None:
                assert client.load(prompt, target, block_ids) == args.tokens

            run()
            for got, want in zip(target, source, strict=True):
                if not torch.equal(got, want):
                    raise AssertionError("loaded bytes differ from the stored ones")
            return run

        src, dst = (
            torch.empty(total, dtype=torch.uint8, device="cuda"),
            torch.empty(total, dtype=torch.uint8, device="cuda"),
        )
        timings = {"d2d copy": median_s(lambda: dst.copy_(src), args.repeats)}
        timings["load, CPU tier"] = median_s(load(prompt_a, source_a), args.repeats)
        timings["load, GPU tier"] = median_s(load(prompt_b, source_b), args.repeats)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        client._gpu_pools.max_programs = sms
        timings[f"load, GPU tier, {sms} programs"] = median_s(load(prompt_b, source_b), args.repeats)
        client._gpu_pools.max_programs = None
        hit = client._rpc(
            "Lookup",
            pb.LookupRequest(
                namespace=client.namespace, keys=pack_keys(client.keys(prompt_b)), lease=True, gpu_pools=[0]
            ),
        )
        lease = pb.LeaseRequest(namespace=client.namespace, lease_id=hit.lease_id)
        acquired = client._rpc("Acquire", lease)
        assert bytes(acquired.tiers) == bytes([Tier.GPU]) * chunks
        pool = client._gpu_pools.tensors[acquired.pools[0]]
        offsets = list(acquired.offsets)
        for programs in (None, sms):
            options = TransferOptions(max_programs=programs)
            label = f"scatter only, {programs or 'default'} programs"
            timings[label] = median_s(
                lambda options=options: scatter(
                    SPEC, target, block_ids, range(chunks), pool, offsets, options=options
                ),
                args.repeats,
            )
        client._rpc("Release", lease)
        stats = client.stats()
    d2d = total / timings["d2d copy"] / 1e9
    for name, seconds in timings.items():
        rate = total / seconds / 1e9
        rows.append([name, seconds * 1e3, rate, rate / d2d])
        results[name] = {"ms": seconds * 1e3, "gb_s": rate, "x_d2d": rate / d2d}
    cpu_rate = results["load, CPU tier"]["gb_s"]
    gpu_rate = results["load, GPU tier"]["gb_s"]
    checks = {
        "GPU-tier load >= 10x CPU-tier load": gpu_rate >= 10 * cpu_rate,
        "GPU-tier load >= 0.5x d2d copy": gpu_rate >= 0.5 * d2d,
    }
    size = f"{total / 2**30:.2f} GiB in {chunks} pages"
    print(f"{args.tokens} tokens, {size}; pin -> GPU tier in {promote_s * 1e3:.1f} ms")
    print_table(("what", "ms", "GB/s", "x d2d"), rows)
    print_table(("acceptance", "holds"), [[name, ok] for name, ok in checks.items()])
    print(f"GPU-tier load / CPU-tier load: {gpu_rate / cpu_rate:.1f}x")
    path = write_results(
        "gpu_tier",
        {
            "geometry": {
                "layers": LAYERS,
                "kv_heads": HEADS,
                "head_dim": HEAD_DIM,
                "dtype": "bfloat16",
                "block": BLOCK,
                "chunk_tokens": CHUNK,
                "tokens": args.tokens,
                "bytes": total,
            },
            "repeats": args.repeats,
            "promote_by_pin_ms": promote_s * 1e3,
            "results": results,
            "gpu_vs_cpu_load": gpu_rate / cpu_rate,
            "acceptance": checks,
            "daemon_gpu_tier": stats["tiers"]["gpu"],
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
