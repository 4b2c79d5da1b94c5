"""Part 2 of the control-plane benchmark: store and load throughput, shared memory vs inline bytes.

- `bench_throughput(daemon, args)`: a request's pages (`--tokens` of `--layers`) stored after a
  Clear and loaded back, `--repeats` times each, through the shared-memory arena and through
  inline Put/Get bytes; the first and last load of each checked byte for byte.
- `report_throughput(moved)`: its table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.common import Daemon, print_table
from bench.control_plane_setup import BLOCK_SIZE, CHUNK_TOKENS, kv_caches, throughput_spec
from kvstore.config.root import format_size
from kvstore_client import KVStoreClient

PATHS = (("shm", True), ("bytes", False))  # results key, shared_memory


def bench_throughput(daemon: Daemon, args: argparse.Namespace) -> dict[str, Any]:
    spec = throughput_spec(args)
    num_blocks = args.tokens // BLOCK_SIZE
    chunks = args.tokens // CHUNK_TOKENS
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 128_000, (args.tokens,), generator=generator)
    block_ids = torch.randperm(num_blocks, generator=generator)  # scattered, as an engine allocates them
    source = kv_caches(spec, num_blocks, random=True)
    target = kv_caches(spec, num_blocks, random=False)
    moved = chunks * spec.page.page_bytes
    results: dict[str, Any] = {
        "page_bytes": spec.page.page_bytes,
        "chunks_per_call": chunks,
        "bytes_per_call": moved,
    }
    for path, shared in PATHS:
        with KVStoreClient.connect(daemon.address, spec, shared_memory=shared) as client:
            if client.shared_memory != shared:
                raise RuntimeError(f"{path}: connected with shared_memory={client.shared_memory}")
            store_s = _timed_stores(client, path, tokens, source, block_ids, chunks, args.repeats)
            load_s = _timed_loads(client, path, tokens, source, target, block_ids, args.repeats)
            results[path] = {
                op: throughput(samples, moved) for op, samples in (("store", store_s), ("load", load_s))
            }
    results["verified"] = True
    results["shm_over_bytes"] = {
        op: results["shm"][op]["gb_s"] / results["bytes"][op]["gb_s"] for op in ("store", "load")
    }
    return results


def _timed_stores(
    client: KVStoreClient,
    path: str,
    tokens: torch.Tensor,
    source: list[torch.Tensor],
    block_ids: torch.Tensor,
    chunks: int,
    repeats: int,
) -> list[float]:
    """Seconds of `repeats` stores, each after a Clear; the first, untimed, maps and faults in memory."""
    store_s = []
    for repeat in range(1 + repeats):
        client.clear()
        started = time.perf_counter()
        new = client.store(tokens, source, block_ids)
        elapsed = time.perf_counter() - started
        if new != chunks:
            raise RuntimeError(f"{path} store wrote {new} of {chunks} chunks after clear()")
        if repeat:
            store_s.append(elapsed)
    return store_s


def _timed_loads(
    client: KVStoreClient,
    path: str,
    tokens: torch.Tensor,
    source: list[torch.Tensor],
    target: list[torch.Tensor],
    block_ids: torch.Tensor,
    repeats: int,
) -> list[float]:
    """Seconds of `repeats` loads into the zeroed `target` after an untimed one; the first and the
    last checked against `source`."""
    load_s = []
    for repeat in range(1 + repeats):
        for cache in target:
            cache.zero_()
        started = time.perf_counter()
        loaded = client.load(tokens, target, block_ids)
        elapsed = time.perf_counter() - started
        if loaded != len(tokens):
            raise RuntimeError(f"{path} load returned {loaded} of {len(tokens)} tokens")
        if repeat in (0, repeats):  # the first and the last load
            verify(source, target, path)
        if repeat:
            load_s.append(elapsed)
    return load_s


def verify(source: list[torch.Tensor], target: list[torch.Tensor], path: str) -> None:
    for layer, (expected, got) in enumerate(zip(source, target, strict=True)):
        if not torch.equal(expected.view(torch.int16), got.view(torch.int16)):
            raise RuntimeError(f"{path} load: layer {layer} differs from the stored KV cache")


def throughput(samples_s: list[float], moved: int) -> dict[str, Any]:
    median = statistics.median(samples_s)
    return {
        "gb_s": moved / median / 1e9,
        "best_gb_s": moved / min(samples_s) / 1e9,
        "median_ms": median * 1e3,
        "calls": len(samples_s),
        "samples_ms": [s * 1e3 for s in samples_s],
    }


def report_throughput(moved: dict[str, Any]) -> None:
    rows = [
        [path, op, *(moved[path][op][k] for k in ("gb_s", "best_gb_s", "median_ms"))]
        for path, _ in PATHS
        for op in ("store", "load")
    ]
    print(
        f"\nThroughput: {moved['chunks_per_call']} pages of {format_size(moved['page_bytes'])} "
        f"= {format_size(moved['bytes_per_call'])} per call (loads verified)"
    )
    print_table(["path", "op", "GB/s", "best GB/s", "median ms"], rows)
