"""What the control-plane benchmark's parts share: geometry, daemon configs, stored pages, timing.

- `lookup_spec()`, `throughput_spec(args)`: the tiny page the Lookup parts store, and the model
  page the throughput part moves; `kv_caches(spec, blocks, random)`: flash_attn KV caches.
- `daemon_config(args)`: the daemon of the lookup and throughput parts, sized for both;
  `small_daemon_config(**server)`: the 64 MiB daemon of the side-by-side parts.
- `store_lookup_pages(client, spec, tokens)`, `lookup_rpc`, `lookup_series`: pages stored for
  Lookups and the client's own Lookup calls, each a series to time.
- `measure(series, calls, warmup, daemon)`: latency and CPU per call, series taking turns;
  `timed_in_turns(series, calls, warmup)`: pooled samples of series timed in turns.
- `in_process_stores(tenants)`: real `Store`s in this process, for the daemon's own work.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import Daemon, Latency
from bench.common_timing import time_calls
from kvstore.config.root import EvictionConfig, format_size
from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.keys import pack_keys
from kvstore.store.policy import make_policy
from kvstore.store.store import Store
from kvstore.store.store_settings import StoreSettings
from kvstore.tiers.cpu import Arena, CpuTier
from kvstore_client import KVSpec, KVStoreClient

CHUNK_TOKENS = 256
BLOCK_SIZE = 16
LOOKUP_SIZES = (1, 64, 512)
DEFAULT_SLAB_BYTES = 256 << 20

Rpc = Callable[[str, Any], Any]  # the client's `_rpc`: local channel or gRPC stub


def lookup_spec() -> KVSpec:
    """A tiny page (8 KiB): the Lookup path walks the index only, so page size does not matter."""
    return _spec("bench/lookup", 1, 1, 8)


def throughput_spec(args: argparse.Namespace) -> KVSpec:
    return _spec("bench/throughput", args.layers, args.kv_heads, args.head_dim)


def _spec(model: str, layers: int, kv_heads: int, head_dim: int) -> KVSpec:
    return KVSpec(
        model=model,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        block_size=BLOCK_SIZE,
        layout="flash_attn",
        chunk_tokens=CHUNK_TOKENS,
    )


def daemon_config(args: argparse.Namespace) -> dict[str, Any]:
    """A slab fits a throughput page; the arena holds one request plus a slab of lookup pages."""
    page_bytes = throughput_spec(args).page.page_bytes
    stride, lookup_stride = _stride(page_bytes), _stride(lookup_spec().page.page_bytes)
    slab_bytes = _stride(max(stride, min(DEFAULT_SLAB_BYTES, args.arena // 8)))
    chunks = args.tokens // CHUNK_TOKENS
    slabs = -(-chunks // (slab_bytes // stride)) + -(-max(LOOKUP_SIZES) // (slab_bytes // lookup_stride))
    needed = slabs * slab_bytes
    if "throughput" in args.parts and needed > args.arena:
        raise SystemExit(
            f"--arena: {format_size(args.arena)} cannot hold {chunks} pages of "
            f"{format_size(page_bytes)} plus the lookup pages; use --arena "
            f"{format_size(needed)} or fewer --tokens/--layers"
        )
    return {
        "log_level": "warning",
        "chunk_tokens": CHUNK_TOKENS,
        "server": {"grace_s": 1.0},
        "leases": {"ttl_s": 60.0},
        "tiers": {"cpu": {"bytes": args.arena, "slab_bytes": slab_bytes}},
    }


def small_daemon_config(**server: Any) -> dict[str, Any]:
    """The daemon of the side-by-side parts: 64 MiB of CPU tier in 16 MiB slabs; `server` adds
    to its server section."""
    return {
        "log_level": "warning",
        "chunk_tokens": CHUNK_TOKENS,
        "server": {"grace_s": 1.0, **server},
        "leases": {"ttl_s": 60.0},
        "tiers": {"cpu": {"bytes": "64MiB", "slab_bytes": "16MiB"}},
    }


def _stride(num_bytes: int) -> int:
    return -(-num_bytes // 4096) * 4096  # the slab allocator's 4 KiB slot alignment


def kv_caches(spec: KVSpec, num_blocks: int, random: bool) -> list[torch.Tensor]:
    """flash_attn layout: per layer `[2, num_blocks, block_size, kv_heads, head_dim]`."""
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    caches = []
    for _ in range(spec.num_layers):
        cache = torch.zeros(shape, dtype=torch.bfloat16)
        if random:  # random bit patterns, NaNs included: the copy must move bits, not values
            cache.view(torch.int16).random_(-(2**15), 2**15)
        caches.append(cache)
    return caches


def lookup_tokens(chunks: int, seed: int) -> torch.Tensor:
    """`chunks` chunks of random token ids."""
    return torch.randint(0, 128_000, (chunks * CHUNK_TOKENS,), generator=torch.Generator().manual_seed(seed))


def store_lookup_pages(client: KVStoreClient, spec: KVSpec, tokens: torch.Tensor) -> int:
    """Stores `tokens`' pages (random bytes, blocks in order); returns the chunks stored."""
    num_blocks = len(tokens) // BLOCK_SIZE
    stored: int = client.store(tokens, kv_caches(spec, num_blocks, random=True), torch.arange(num_blocks))
    return stored


def lookup_rpc(rpc: Rpc, namespace: bytes, packed: bytes) -> Any:
    """What `KVStoreClient.lookup` does once it has the keys: build the request, call the stub."""
    return rpc("Lookup", pb.LookupRequest(namespace=namespace, keys=packed))


def lookup_series(
    calls: Sequence[tuple[str, Rpc, int]], namespace: bytes, keys: list[bytes], checked: str | None
) -> dict[str, Callable[[], object]]:
    """`{name}_{n}`: a Lookup of the first n of `keys` through `rpc`, per (name, rpc, n) of `calls`.
    `checked`: each is first made once and must hit every key (the label of the error if not)."""
    series: dict[str, Callable[[], object]] = {}
    for name, rpc, n in calls:
        packed = pack_keys(keys[:n])
        if checked is not None and lookup_rpc(rpc, namespace, packed).hit_chunks != n:
            raise RuntimeError(f"{checked}: a Lookup of {n} stored keys did not hit all of them")
        series[f"{name}_{n}"] = functools.partial(lookup_rpc, rpc, namespace, packed)
    return series


def measure(
    series: Mapping[str, Callable[[], object]], calls: int, warmup: int, daemon: Daemon, rounds: int = 5
) -> dict[str, dict[str, Any]]:
    """Latency of each call, plus CPU µs per call in this process and in the daemon.

    The series take turns in `rounds` rounds, so a noisy moment on the machine is shared out
    among them instead of landing on one.
    """
    samples: dict[str, list[float]] = {name: [] for name in series}
    cpu = {name: [0.0, 0.0] for name in series}  # client, daemon
    for call in series.values():
        time_calls(call, warmup)
    for round_ in range(rounds):
        share = calls // rounds + (round_ < calls % rounds)
        for name, call in series.items():
            client_cpu, daemon_cpu = time.process_time(), daemon.cpu_seconds()
            samples[name] += time_calls(call, share)
            cpu[name][0] += time.process_time() - client_cpu
            cpu[name][1] += daemon.cpu_seconds() - daemon_cpu
    return {
        name: {
            **Latency.of(samples[name])._asdict(),
            "client_cpu_us_per_call": client / calls * 1e6,
            "daemon_cpu_us_per_call": daemon_ / calls * 1e6,
        }
        for name, (client, daemon_) in cpu.items()
    }


def timed_in_turns(
    series: Mapping[str, Callable[[], object]], calls: int, warmup: int, turns: int = 10
) -> dict[str, list[float]]:
    """Each series' call seconds: `warmup` untimed calls each, then `turns` turns of
    max(calls / turns, 10) calls each, the series in turn."""
    for call in series.values():
        time_calls(call, warmup)
    samples: dict[str, list[float]] = {name: [] for name in series}
    for _ in range(turns):
        for name, call in series.items():
            samples[name] += time_calls(call, max(calls // turns, 10))
    return samples


@contextlib.contextmanager
def in_process_stores(tenants: Sequence[str] = ("",)) -> Iterator[list[Store]]:
    """One `Store` per tenant name in this process (a 16 MiB CPU tier, the default policy), in a
    temporary directory: the daemon's own work timed without a daemon around it."""
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmp:
        arenas = [Arena(Path(tmp) / f"arena-{i}", 16 << 20, prefault=False) for i in range(len(tenants))]
        try:
            yield [
                Store(
                    CpuTier(arena, 16 << 20),
                    make_policy(EvictionConfig().policy),
                    StoreSettings(60.0, 600.0, tenant=name),
                )
                for arena, name in zip(arenas, tenants, strict=True)
            ]
        finally:
            for arena in arenas:
                arena.close(unlink=True)
