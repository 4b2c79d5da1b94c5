"""Control-plane benchmark: Lookup latency, and store/load throughput through shared memory vs Put/Get.

Starts its own kvstored (temporary directory and config), then measures:

1. Lookup latency (p50/p99/mean, µs) for 1, 64 and 512 keys over the unix socket, through the
   client's sync stub exactly as `KVStoreClient.lookup` calls it (keys packed in one bytes field),
   every key present; also `client.lookup` end to end (key hashing included), Lookup(lease) +
   Release and Lookup(lease) + Acquire + Release for 512 keys, a health check (the gRPC floor),
   the CPU time both processes spend per call, and the daemon's own work per call measured
   in this process (where the time goes).
2. Store and load throughput (GB/s of page bytes per client call) through the shared-memory
   arena vs inline Put/Get bytes, loads verified byte for byte against the original KV cache.

Prints tables and writes `bench/results/control_plane.json` (and a timestamped copy).

    python bench/control_plane.py            # 32 layers, 4096 tokens per request (512 MiB)
    python bench/control_plane.py --quick    # seconds: CI-sized
    python bench/control_plane.py --parts against --against ../before  # this tree against another

3. Lookup latency of a daemon on uvloop against one on asyncio's own event loop
   (`server.event_loop`), both running, timed in turns: the local channel, gRPC, and the
   client's `lookup_chunks`, with the ratio of their p50s.
7. Scrape turns (`--parts scrape_turns`): one daemon serving /metrics, its Lookups timed in
   `--windows` pairs of 1 s windows, one with a scraper process fetching /metrics every
   `--scrape-interval`, one with it idle, in random order: the scrape's cost without two
   daemons' scatter, with a bootstrap interval of the p99 ratio, the calls that overlapped a
   scrape, and the daemon's own work per scrape.
6. Metrics (`--parts metrics`): Lookup latency of a daemon serving /metrics, scraped every
   second meanwhile, against one without, side by side in the same way (target: p50 and p99
   within 5%).
5. Tenants (`--parts tenants`): Lookup latency of a daemon with tenants against one without,
   side by side and timed in turns: the local channel (1, 64, 512 keys, the caller known by its
   uid), gRPC (1 and 64 keys, the caller known by its tenant's token), the client's
   `lookup_chunks`; the ratio of their p50s (target: at most 1.05).
8. Host (`--parts host`, issue #31 part 3): the daemon's own work per Lookup (the policy's hit
   accounting for 512 pages, a leased and a plain 512-key Lookup, the local channel's answer to
   a 64-key one) and, with `--index-pages N`, the index's bytes per page at N pages, this tree
   and `--baseline TREE` each in processes of their own, in turns (`bench/control_plane_host.py`).
9. Storm (`--parts storm`): `--storm-processes` processes calling 64-key Lookups back to back
   over the local channel for `--storm-seconds`: calls per second and p50/p99, this tree's daemon
   and `--baseline TREE`'s in turns (`bench/lookup_storm.py`).
4. With `--against TREE` (another checkout, e.g. `git worktree add ../before REV`): Lookup, load
   and store latency of this tree's daemon and client against TREE's, both running side by side
   and timed in alternating batches (`bench/latency_probe.py`), in `--rounds` rounds of fresh
   processes: each p50 and p99 over all calls, and their ratio (target: at most 1.05 for
   Lookup and load).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import pickle
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

from bench.common import (  # noqa: E402
    Daemon,
    Latency,
    bootstrap_ratio_interval,
    overlapping,
    print_table,
    running_daemon,
    write_results,
)
from bench.control_plane_host import compare as compare_host  # noqa: E402
from bench.latency_probe import MAX_RATIO, SERIES, compare_trees  # noqa: E402
from bench.lookup_storm import compare as compare_storm  # noqa: E402
from kvstore.config import EvictionConfig, format_size, parse_size  # noqa: E402
from kvstore.handlers import Handlers  # noqa: E402
from kvstore.keys import chunk_keys, pack_keys, unpack_keys  # noqa: E402
from kvstore.metrics import Snapshot  # noqa: E402
from kvstore.policy import make_policy  # noqa: E402
from kvstore.proto import kvstore_pb2 as pb  # noqa: E402
from kvstore.spec import PageSpec  # noqa: E402
from kvstore.store import Store  # noqa: E402
from kvstore.tiers.cpu import Arena, CpuTier  # noqa: E402
from kvstore_client import KVSpec, KVStoreClient  # noqa: E402

CHUNK_TOKENS = 256
BLOCK_SIZE = 16
LOOKUP_SIZES = (1, 64, 512)
DEFAULT_SLAB_BYTES = 256 << 20
TARGET_LOOKUP_P50_US = 200.0
TARGET_LOOKUP_P99_US = 1000.0
TARGET_SHM_SPEEDUP = 5.0
EVENT_LOOPS = ("uvloop", "asyncio")  # server.event_loop: the default where uvloop is installed, and the other

FULL = {"tokens": 4096, "layers": 32, "arena": "2GiB", "repeats": 5, "lookup_calls": 3000, "warmup": 300}
QUICK = {"tokens": 512, "layers": 2, "arena": "64MiB", "repeats": 2, "lookup_calls": 200, "warmup": 20}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few calls (CI smoke run)")
    parser.add_argument("--tokens", type=int, help=f"tokens per store/load request (full: {FULL['tokens']})")
    parser.add_argument("--layers", type=int, help=f"model layers (full: {FULL['layers']})")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--arena", help=f"the daemon's CPU tier size (full: {FULL['arena']})")
    parser.add_argument("--repeats", type=int, help=f"timed stores/loads per path (full: {FULL['repeats']})")
    parser.add_argument(
        "--lookup-calls", type=int, help=f"timed Lookups per size (full: {FULL['lookup_calls']})"
    )
    parser.add_argument("--warmup", type=int, help="untimed calls before each latency series")
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=(
            "lookup",
            "throughput",
            "event_loop",
            "tenants",
            "metrics",
            "scrape_turns",
            "against",
            "host",
            "storm",
        ),
        default=["lookup", "throughput", "event_loop", "tenants", "metrics"],
    )
    parser.add_argument("--against", type=Path, help="another kvstore source tree to compare latency with")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of fresh processes for --against")
    parser.add_argument("--baseline", type=Path, help="host and storm parts: another tree, timed in turns")
    parser.add_argument(
        "--index-pages", type=int, default=0, help="host part: pages for the index size (0: none)"
    )
    parser.add_argument("--storm-processes", type=int, default=16, help="storm part: Lookup processes")
    parser.add_argument("--storm-seconds", type=float, default=5.0, help="storm part: seconds per round")
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=1.0,
        help="metrics part: seconds between scrapes (Prometheus: 15-60)",
    )
    parser.add_argument(
        "--windows", type=int, default=150, help="scrape_turns part: pairs of 1 s windows (scraping, quiet)"
    )
    parser.add_argument(
        "--quiet-probe",
        action="store_true",
        help="scrape_turns part: in the quiet windows the scraper fetches /healthz (the helper answers "
        "it alone) as often as it fetches /metrics in the others, so the scraper's own work is on "
        "both sides and what differs is the daemon's part of a scrape",
    )
    parser.add_argument("--name", help="results name (default: control_plane, or control_plane-quick)")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.arena = parse_size(args.arena)
    args.name = args.name or ("control_plane-quick" if args.quick else "control_plane")
    if args.against is not None and "against" not in args.parts:
        args.parts.append("against")
    if "against" in args.parts and (args.against is None or not (args.against / "kvstore").is_dir()):
        parser.error("--parts against needs --against TREE, a kvstore source tree")
    if args.tokens <= 0 or args.tokens % CHUNK_TOKENS:
        parser.error(f"--tokens: expected a positive multiple of chunk_tokens {CHUNK_TOKENS}")
    if min(args.layers, args.kv_heads, args.head_dim, args.repeats, args.lookup_calls) <= 0:
        parser.error("--layers, --kv-heads, --head-dim, --repeats and --lookup-calls must be positive")
    return args


def lookup_spec() -> KVSpec:
    """A tiny page (8 KiB): the Lookup path walks the index only, so page size does not matter."""
    return KVSpec(
        model="bench/lookup",
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        dtype=torch.bfloat16,
        block_size=BLOCK_SIZE,
        layout="flash_attn",
        chunk_tokens=CHUNK_TOKENS,
    )


def throughput_spec(args: argparse.Namespace) -> KVSpec:
    return KVSpec(
        model="bench/throughput",
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
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


def time_calls(call: Callable[[], object], calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


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


# -- 1. Lookup latency -------------------------------------------------------


def bench_lookup(daemon: Daemon, args: argparse.Namespace) -> dict[str, Any]:
    spec = lookup_spec()
    max_chunks = max(LOOKUP_SIZES)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128_000, (max_chunks * CHUNK_TOKENS,), generator=generator)
    num_blocks = len(tokens) // BLOCK_SIZE
    with (
        KVStoreClient.connect(daemon.address, spec) as client,
        KVStoreClient.connect(daemon.address, spec, local_channel=False) as grpc_client,
    ):
        if client._local is None:
            raise RuntimeError("the client did not open the daemon's local channel")
        stored = client.store(tokens, kv_caches(spec, num_blocks, random=True), torch.arange(num_blocks))
        if stored != max_chunks or client.lookup(tokens) != len(tokens):
            raise RuntimeError(
                f"lookup prefix: stored {stored} of {max_chunks} chunks, "
                f"lookup found {client.lookup(tokens)} of {len(tokens)} tokens"
            )
        # The client's own call (`_rpc`: local channel by default, or the gRPC stub), as in `lookup()`.
        ns = client.namespace
        rpc_series: dict[str, Callable[[], object]] = {}
        client_series: dict[str, Callable[[], object]] = {}
        for n in LOOKUP_SIZES:
            packed = pack_keys(client.keys(tokens[: n * CHUNK_TOKENS]))
            for name, rpc in (("rpc", client._rpc), ("grpc", grpc_client._rpc)):
                if lookup_rpc(rpc, ns, packed).hit_chunks != n:
                    raise RuntimeError(f"Lookup of {n} stored keys did not hit all of them")
                rpc_series[f"{name}_{n}"] = functools.partial(lookup_rpc, rpc, ns, packed)
            client_series[f"client_lookup_{n}"] = functools.partial(client.lookup, tokens[: n * CHUNK_TOKENS])
        packed = pack_keys(client.keys(tokens))

        def lease_release(rpc: Callable[[str, Any], Any]) -> None:
            reply = rpc("Lookup", pb.LookupRequest(namespace=ns, keys=packed, lease=True))
            rpc("Release", pb.LeaseRequest(namespace=ns, lease_id=reply.lease_id))

        def lease_acquire_release(rpc: Callable[[str, Any], Any]) -> None:
            reply = rpc("Lookup", pb.LookupRequest(namespace=ns, keys=packed, lease=True))
            lease = pb.LeaseRequest(namespace=ns, lease_id=reply.lease_id, epoch=client.epoch)
            rpc("Acquire", lease)
            rpc("Release", lease)

        health = health_pb2_grpc.HealthStub(client._conn.channel)
        rpc_series["health_check"] = functools.partial(
            health.Check, health_pb2.HealthCheckRequest(), timeout=client.timeout_s
        )
        results = measure(rpc_series, args.lookup_calls, args.warmup, daemon)
        results |= measure(client_series, max(args.lookup_calls // 4, 50), args.warmup // 4, daemon)
        leased = {
            "lease_release_512": functools.partial(lease_release, client._rpc),
            "lease_acquire_release_512": functools.partial(lease_acquire_release, client._rpc),
            "grpc_lease_acquire_release_512": functools.partial(lease_acquire_release, grpc_client._rpc),
        }
        results |= measure(leased, max(args.lookup_calls // 2, 50), args.warmup // 2, daemon)
        counters = client.stats()["counters"]
        if counters.get("active_load_leases", 0):
            raise RuntimeError(f"{counters['active_load_leases']} load leases left pinned after Release")
        results["server_breakdown_512"] = server_breakdown(spec.page, client.keys(tokens), args.lookup_calls)
    return results


def lookup_rpc(rpc: Callable[[str, Any], Any], namespace: bytes, packed: bytes) -> Any:
    """What `KVStoreClient.lookup` does once it has the keys: build the request, call the stub."""
    return rpc("Lookup", pb.LookupRequest(namespace=namespace, keys=packed))


def server_breakdown(page: PageSpec, keys: list[bytes], calls: int) -> dict[str, float]:
    """The daemon's Python work for one Lookup of `keys`, step by step, in this process (p50 µs)."""
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmp:
        arena = Arena(Path(tmp) / "arena", 16 << 20, prefault=False)
        try:
            store = Store(CpuTier(arena, 16 << 20), make_policy(EvictionConfig().policy), 60.0, 600.0)
            ns = store.connect(page).id
            store.commit(ns, store.reserve(ns, keys).lease_id)
            handlers = Handlers({"": store}, CHUNK_TOKENS, 4 << 20)
            wire = pb.LookupRequest(namespace=ns, keys=pack_keys(keys)).SerializeToString()
            request = pb.LookupRequest.FromString(wire)
            unpacked = unpack_keys(request.keys)
            result = store.lookup(ns, unpacked)
            hits = [store.namespaces[ns].entries[key] for key in keys]
            response = pb.LookupResponse(hit_chunks=result.hit_chunks, tiers=result.tiers)
            steps: dict[str, Callable[[], object]] = {
                "parse_request": lambda: pb.LookupRequest.FromString(wire),
                "unpack_keys": lambda: unpack_keys(request.keys),
                "store_lookup": lambda: store.lookup(ns, unpacked, touch=False),
                "store_lookup_counted_as_use": lambda: store.lookup(ns, unpacked),
                "of_which_policy_hit": lambda: store.policy.hit(hits),
                "build_response": lambda: pb.LookupResponse(hit_chunks=result.hit_chunks, tiers=result.tiers),
                "serialize_response": lambda: response.SerializeToString(),
                "handler_lookup_total": lambda: handlers.Lookup(request),
            }
            breakdown = {name: Latency.of(time_calls(step, calls)).p50_us for name, step in steps.items()}
        finally:
            arena.close(unlink=True)
    breakdown["keys"] = len(keys)
    return breakdown


# -- 2. Store / load throughput ------------------------------------------------


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
    for path, shared in (("shm", True), ("bytes", False)):
        with KVStoreClient.connect(daemon.address, spec, shared_memory=shared) as client:
            if client.shared_memory != shared:
                raise RuntimeError(f"{path}: connected with shared_memory={client.shared_memory}")
            store_s = []
            for repeat in range(1 + args.repeats):  # the first, untimed, maps and faults in memory
                client.clear()
                started = time.perf_counter()
                new = client.store(tokens, source, block_ids)
                elapsed = time.perf_counter() - started
                if new != chunks:
                    raise RuntimeError(f"{path} store wrote {new} of {chunks} chunks after clear()")
                if repeat:
                    store_s.append(elapsed)
            load_s = []
            for repeat in range(1 + args.repeats):
                for cache in target:
                    cache.zero_()
                started = time.perf_counter()
                loaded = client.load(tokens, target, block_ids)
                elapsed = time.perf_counter() - started
                if loaded != args.tokens:
                    raise RuntimeError(f"{path} load returned {loaded} of {args.tokens} tokens")
                if repeat in (0, args.repeats):  # the first and the last load
                    verify(source, target, path)
                if repeat:
                    load_s.append(elapsed)
            results[path] = {
                op: throughput(samples, moved) for op, samples in (("store", store_s), ("load", load_s))
            }
    results["verified"] = True
    results["shm_over_bytes"] = {
        op: results["shm"][op]["gb_s"] / results["bytes"][op]["gb_s"] for op in ("store", "load")
    }
    return results


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


# -- report --------------------------------------------------------------------


def targets(lookup: dict[str, Any] | None, moved: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    def check(value: float | None, target: float, at_most: bool) -> dict[str, Any]:
        passed = None if value is None else (value <= target if at_most else value >= target)
        return {"value": value, "target": target, "at_most": at_most, "pass": passed}

    rpc = lookup["rpc_512"] if lookup else None
    ratio = moved["shm_over_bytes"] if moved else None
    return {
        "lookup_512_p50_us": check(rpc["p50_us"] if rpc else None, TARGET_LOOKUP_P50_US, True),
        "lookup_512_p99_us": check(rpc["p99_us"] if rpc else None, TARGET_LOOKUP_P99_US, True),
        "store_shm_over_bytes": check(ratio["store"] if ratio else None, TARGET_SHM_SPEEDUP, False),
        "load_shm_over_bytes": check(ratio["load"] if ratio else None, TARGET_SHM_SPEEDUP, False),
    }


def report(lookup: dict[str, Any] | None, moved: dict[str, Any] | None, goals: dict[str, Any]) -> None:
    if lookup:
        labels = [(f"rpc_{n}", "Lookup, local channel", n) for n in LOOKUP_SIZES]
        labels += [(f"grpc_{n}", "Lookup, gRPC", n) for n in LOOKUP_SIZES]
        labels += [(f"client_lookup_{n}", "client.lookup (+key hashing)", n) for n in LOOKUP_SIZES]
        labels += [
            ("lease_release_512", "Lookup(lease)+Release", 512),
            ("lease_acquire_release_512", "Lookup(lease)+Acquire+Release", 512),
            ("grpc_lease_acquire_release_512", "same, gRPC", 512),
            ("health_check", "Health.Check (gRPC floor)", 0),
        ]
        rows: list[list[Any]] = []
        for key, label, keys in labels:
            f = lookup[key]
            rows.append(
                [
                    label,
                    keys,
                    f["p50_us"],
                    f["p99_us"],
                    f["mean_us"],
                    f["client_cpu_us_per_call"],
                    f["daemon_cpu_us_per_call"],
                    f["calls"],
                ]
            )
        print("\nControl-plane latency (µs): the client's local channel vs gRPC, unix sockets")
        print_table(["call", "keys", "p50", "p99", "mean", "client CPU", "daemon CPU", "calls"], rows)
        breakdown = lookup["server_breakdown_512"]
        print(f"\nDaemon-side work for one Lookup of {breakdown['keys']} keys, in-process (p50 µs)")
        print_table(["step", "µs"], [[k, v] for k, v in breakdown.items() if k != "keys"])
    if moved:
        rows = [
            [path, op, *(moved[path][op][k] for k in ("gb_s", "best_gb_s", "median_ms"))]
            for path in ("shm", "bytes")
            for op in ("store", "load")
        ]
        print(
            f"\nThroughput: {moved['chunks_per_call']} pages of {format_size(moved['page_bytes'])} "
            f"= {format_size(moved['bytes_per_call'])} per call (loads verified)"
        )
        print_table(["path", "op", "GB/s", "best GB/s", "median ms"], rows)
    print("\nTargets")
    print_table(
        ["target", "value", "goal", "result"],
        [
            [
                name,
                "-" if g["value"] is None else g["value"],
                f"{'<=' if g['at_most'] else '>='} {g['target']}",
                "skipped" if g["pass"] is None else g["pass"],
            ]
            for name, g in goals.items()
        ],
    )


def report_against(against: dict[str, Any]) -> None:
    rounds, calls = against["rounds"], against["calls"]
    print(f"\nThis tree against {against['trees']['against']} ({rounds} rounds of {calls} calls, µs)")
    rows = []
    for series in SERIES:
        for q in ("p50", "p99"):
            cell = against[series][q]
            this, other, ratio = round(cell["this"], 1), round(cell["against"], 1), round(cell["ratio"], 3)
            rows.append([series, q, this, other, ratio, round(cell["round_median_ratio"], 3)])
    print_table(["series", "q", "this", "against", "ratio", "ratio of round medians"], rows)
    verdict = "holds" if against["holds"] else "FAILS"
    print(f"Lookup and load p50/p99 within {MAX_RATIO:.2f}x of the other tree: {verdict}")


# -- 3. The daemon's event loop -------------------------------------------------


def bench_event_loops(config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Lookup latency of one daemon on uvloop and one on asyncio's own loop, side by side and timed
    in turns: the local channel (1 and 64 keys), gRPC (1 key), and the client's `lookup_chunks`."""
    spec = lookup_spec()
    tokens = torch.randint(0, 128_000, (64 * CHUNK_TOKENS,), generator=torch.Generator().manual_seed(3))
    num_blocks = len(tokens) // BLOCK_SIZE
    series: dict[str, Callable[[], object]] = {}
    with contextlib.ExitStack() as stack:
        for loop in EVENT_LOOPS:
            daemon = stack.enter_context(
                running_daemon(
                    config | {"log_level": "info", "server": config["server"] | {"event_loop": loop}}
                )
            )
            if f"event loop {loop})" not in daemon.log():
                raise RuntimeError(
                    f"the daemon asked for event loop {loop} did not run on it:\n{daemon.log()}"
                )
            client = stack.enter_context(KVStoreClient.connect(daemon.address, spec))
            grpc_client = stack.enter_context(
                KVStoreClient.connect(daemon.address, spec, local_channel=False)
            )
            if client.store(tokens, kv_caches(spec, num_blocks, random=True), torch.arange(num_blocks)) != 64:
                raise RuntimeError(f"{loop}: the lookup pages were not all stored")
            keys = client.keys(tokens)
            for name, rpc, n in (
                ("rpc", client._rpc, 1),
                ("rpc", client._rpc, 64),
                ("grpc", grpc_client._rpc, 1),
            ):
                packed = pack_keys(keys[:n])
                if lookup_rpc(rpc, client.namespace, packed).hit_chunks != n:
                    raise RuntimeError(f"{loop}: a Lookup of {n} stored keys did not hit all of them")
                series[f"{loop}/{name}_{n}"] = functools.partial(lookup_rpc, rpc, client.namespace, packed)
            series[f"{loop}/lookup_chunks_8"] = functools.partial(client.lookup_chunks, keys[:8])
        samples: dict[str, list[float]] = {name: [] for name in series}
        for call in series.values():
            time_calls(call, args.warmup)
        rounds = 10
        for _ in range(rounds):
            for name, call in series.items():
                samples[name] += time_calls(call, max(args.lookup_calls // rounds, 10))
    results: dict[str, Any] = {name: Latency.of(values)._asdict() for name, values in samples.items()}
    base, other = EVENT_LOOPS
    results["p50_ratio"] = {
        name.split("/", 1)[1]: results[name]["p50_us"] / results[f"{other}/{name.split('/', 1)[1]}"]["p50_us"]
        for name in series
        if name.startswith(f"{base}/")
    }
    return results


TENANT_SIZES = (1, 64, 512)
TARGET_TENANTS_RATIO = 1.05


def bench_tenants(args: argparse.Namespace) -> dict[str, Any]:
    """Lookup latency of a daemon with two tenants and one without, side by side and timed in
    turns, in `args.rounds` rounds of fresh daemons (which starts first alternates), samples
    pooled; and the daemon's own work per Lookup with and without tenants, in this process."""
    spec = lookup_spec()
    max_chunks = max(TENANT_SIZES)
    tokens = torch.randint(
        0, 128_000, (max_chunks * CHUNK_TOKENS,), generator=torch.Generator().manual_seed(4)
    )
    token = secrets.token_hex(16)
    samples: dict[str, list[float]] = {}
    per_round: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-tenants-") as tmp:
        tokens_file = Path(tmp) / "tokens"
        tokens_file.write_text(token + "\n")
        tokens_file.chmod(0o600)
        tenants = [
            {"name": "bench", "uids": [os.geteuid()], "cpu_bytes": "64MiB", "tokens_file": str(tokens_file)}
        ]
        if os.geteuid() == 0:
            tenants.append({"name": "other", "uids": [40001], "cpu_bytes": "64MiB"})
        base = {
            "log_level": "warning",
            "chunk_tokens": CHUNK_TOKENS,
            "server": {"grace_s": 1.0},
            "leases": {"ttl_s": 60.0},
            "tiers": {"cpu": {"bytes": "64MiB", "slab_bytes": "16MiB"}},
        }
        configs = {
            "off": base,
            "on": base | {"tiers": {"cpu": {"bytes": "128MiB", "slab_bytes": "16MiB"}}, "tenants": tenants},
        }
        for round_index in range(args.rounds):
            order = list(configs) if round_index % 2 == 0 else list(reversed(configs))
            taken = _side_by_side(args, {mode: configs[mode] for mode in order}, spec, tokens, {"on": token})
            for name, values in taken.items():
                samples.setdefault(name, []).extend(values)
            per_round.append(
                _on_over_off({name: Latency.of(values)._asdict() for name, values in taken.items()})
            )
    results: dict[str, Any] = {name: Latency.of(values)._asdict() for name, values in samples.items()}
    results["p50_ratio"] = _on_over_off(results)
    results["p50_ratio_per_round"] = per_round
    results["handler_lookup"] = handler_lookup_with_tenants(spec.page, tokens, args.lookup_calls)
    results["tenants"] = [t["name"] for t in tenants]
    results["rounds"] = args.rounds
    results["target_p50_ratio"] = TARGET_TENANTS_RATIO
    return results


def _on_over_off(latencies: Mapping[str, Any], figure: str = "p50_us") -> dict[str, float]:
    """Per series, its `figure` with the feature on over the same with it off."""
    return {
        name[3:]: latencies[name][figure] / latencies[f"off/{name[3:]}"][figure]
        for name in latencies
        if name.startswith("on/")
    }


def _side_by_side(
    args: argparse.Namespace,
    configs: Mapping[str, Any],
    spec: KVSpec,
    tokens: torch.Tensor,
    grpc_tokens: Mapping[str, str],
    scrape_every_s: float = 0.0,
) -> dict[str, list[float]]:
    """One round of an on/off comparison: both daemons running, every series timed in turns.
    `grpc_tokens`: the token a mode's gRPC client sends; `scrape_every_s`: a thread fetches each
    daemon's /metrics (where it serves them) this often while the series are timed."""
    num_blocks = len(tokens) // BLOCK_SIZE
    series: dict[str, Callable[[], object]] = {}
    scrape_urls: list[str] = []
    with contextlib.ExitStack() as stack:
        for mode, config in configs.items():
            daemon = stack.enter_context(running_daemon(config))
            client = stack.enter_context(KVStoreClient.connect(daemon.address, spec))
            grpc_client = stack.enter_context(
                KVStoreClient.connect(daemon.address, spec, local_channel=False, token=grpc_tokens.get(mode))
            )
            if config["server"].get("metrics_address"):
                scrape_urls.append(f"http://{config['server']['metrics_address']}/metrics")
            if client._local is None:
                raise RuntimeError(f"{mode}: the client did not open the local channel")
            stored = client.store(tokens, kv_caches(spec, num_blocks, random=True), torch.arange(num_blocks))
            if stored != max(TENANT_SIZES):
                raise RuntimeError(f"tenants {mode}: stored {stored} of {max(TENANT_SIZES)} chunks")
            keys = client.keys(tokens)
            calls = [("rpc", client._rpc, n) for n in TENANT_SIZES] + [
                ("grpc", grpc_client._rpc, n) for n in (1, 64)
            ]
            for name, rpc, n in calls:
                packed = pack_keys(keys[:n])
                if lookup_rpc(rpc, client.namespace, packed).hit_chunks != n:
                    raise RuntimeError(f"tenants {mode}: a Lookup of {n} stored keys did not hit all of them")
                series[f"{mode}/{name}_{n}"] = functools.partial(lookup_rpc, rpc, client.namespace, packed)
            series[f"{mode}/lookup_chunks_8"] = functools.partial(client.lookup_chunks, keys[:8])
        if scrape_every_s and scrape_urls:
            stack.enter_context(_scraping(scrape_urls, scrape_every_s))
        for call in series.values():
            time_calls(call, args.warmup)
        samples: dict[str, list[float]] = {name: [] for name in series}
        turns = 10
        for _ in range(turns):
            for name, call in series.items():
                samples[name] += time_calls(call, max(args.lookup_calls // turns, 10))
    return samples


@contextlib.contextmanager
def _scraping(urls: list[str], every_s: float) -> Any:
    """A thread that fetches each URL every `every_s`, as Prometheus would, until the block ends;
    a scrape that fails stops the benchmark."""
    stop = threading.Event()
    failures: list[BaseException] = []
    scrapes = [0]

    def run() -> None:
        while not stop.wait(every_s):
            for url in urls:
                try:
                    with urllib.request.urlopen(url, timeout=10) as reply:
                        if b"kvstore_lookups_total" not in reply.read():
                            raise RuntimeError(f"{url}: no kvstore_lookups_total in the scrape")
                    scrapes[0] += 1
                except BaseException as exc:
                    failures.append(exc)
                    return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield scrapes
    finally:
        stop.set()
        thread.join()
    if failures:
        raise RuntimeError(f"scraping failed: {failures[0]!r}")
    if not scrapes[0]:
        raise RuntimeError("no scrape happened while the series were timed")


def bench_metrics(args: argparse.Namespace) -> dict[str, Any]:
    """Lookup latency of a daemon serving /metrics, scraped every second meanwhile, against one
    without metrics: side by side, timed in turns, `args.rounds` rounds of fresh daemons."""
    spec = lookup_spec()
    tokens = torch.randint(
        0, 128_000, (max(TENANT_SIZES) * CHUNK_TOKENS,), generator=torch.Generator().manual_seed(5)
    )
    base: dict[str, Any] = {
        "log_level": "warning",
        "chunk_tokens": CHUNK_TOKENS,
        "server": {"grace_s": 1.0},
        "leases": {"ttl_s": 60.0},
        "tiers": {"cpu": {"bytes": "64MiB", "slab_bytes": "16MiB"}},
    }
    samples: dict[str, list[float]] = {}
    per_round: list[dict[str, float]] = []
    for round_index in range(args.rounds):
        configs = {
            "off": base,
            "on": base | {"server": base["server"] | {"metrics_address": f"127.0.0.1:{_free_port()}"}},
        }
        order = list(configs) if round_index % 2 == 0 else list(reversed(configs))
        taken = _side_by_side(
            args,
            {mode: configs[mode] for mode in order},
            spec,
            tokens,
            {},
            scrape_every_s=args.scrape_interval,
        )
        for name, values in taken.items():
            samples.setdefault(name, []).extend(values)
        per_round.append(_on_over_off({name: Latency.of(values)._asdict() for name, values in taken.items()}))
    results: dict[str, Any] = {name: Latency.of(values)._asdict() for name, values in samples.items()}
    results["p50_ratio"] = _on_over_off(results)
    results["p99_ratio"] = _on_over_off(results, "p99_us")
    results["p50_ratio_per_round"] = per_round
    results["rounds"] = args.rounds
    results["scrape_interval_s"] = args.scrape_interval
    results["target_ratio"] = TARGET_TENANTS_RATIO
    return results


SCRAPER = r"""
import json, sys, threading, time, urllib.request
urls, every = {"on": sys.argv[1], "off": sys.argv[2]}, float(sys.argv[3])
mode, done = ["idle"], threading.Event()
def control():
    for line in sys.stdin:
        mode[0] = line.strip()
    mode[0] = "idle"
    done.set()
threading.Thread(target=control, daemon=True).start()
spans = []
while not done.is_set():
    current = mode[0]
    url = urls.get(current, "-")
    if url == "-":
        time.sleep(0.005)
        continue
    start = time.monotonic()
    body = urllib.request.urlopen(url, timeout=10).read()
    if current == "on":
        spans.append((start, time.monotonic()))
        assert b"kvstore_lookups_total" in body
    while mode[0] == current and time.monotonic() < start + every:
        time.sleep(0.005)
print(json.dumps(spans))
"""


def bench_scrape_turns(args: argparse.Namespace, window_s: float = 1.0, batch: int = 10) -> dict[str, Any]:
    """One daemon serving /metrics, its Lookups timed in `args.windows` pairs of windows: one while
    a scraper (a process of its own, so that it costs this one nothing) fetches /metrics every
    `args.scrape_interval` s, one while it is idle, in random order within each pair. The same
    daemon, core and caches on both sides: what is left is the scrape's cost.

    Besides the pooled p50 and p99 of each side: a 90% bootstrap interval of the p99 ratio
    (window pairs resampled), the calls that overlapped a scrape (the scraper reports when each
    ran; both processes read CLOCK_MONOTONIC) and their latency, and the daemon's own work per
    scrape, measured in this process."""
    spec = lookup_spec()
    tokens = torch.randint(
        0, 128_000, (max(TENANT_SIZES) * CHUNK_TOKENS,), generator=torch.Generator().manual_seed(6)
    )
    num_blocks = len(tokens) // BLOCK_SIZE
    port = _free_port()
    config = {
        "log_level": "warning",
        "chunk_tokens": CHUNK_TOKENS,
        "server": {"grace_s": 1.0, "metrics_address": f"127.0.0.1:{port}"},
        "leases": {"ttl_s": 60.0},
        "tiers": {"cpu": {"bytes": "64MiB", "slab_bytes": "16MiB"}},
    }
    order = random.Random(7)
    # per mode and series: one list of durations per window; for "on", the calls' start times too
    windows: dict[str, dict[str, list[list[float]]]] = {"on": {}, "off": {}}
    starts: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        daemon = stack.enter_context(running_daemon(config))
        client = stack.enter_context(KVStoreClient.connect(daemon.address, spec))
        grpc_client = stack.enter_context(KVStoreClient.connect(daemon.address, spec, local_channel=False))
        if client.store(tokens, kv_caches(spec, num_blocks, random=True), torch.arange(num_blocks)) != max(
            TENANT_SIZES
        ):
            raise RuntimeError("scrape turns: the lookup pages were not all stored")
        keys = client.keys(tokens)
        calls = [("rpc", client._rpc, n) for n in TENANT_SIZES] + [
            ("grpc", grpc_client._rpc, n) for n in (1, 64)
        ]
        series = {
            f"{name}_{n}": functools.partial(lookup_rpc, rpc, client.namespace, pack_keys(keys[:n]))
            for name, rpc, n in calls
        }
        scraper = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SCRAPER,
                f"http://127.0.0.1:{port}/metrics",
                f"http://127.0.0.1:{port}/healthz" if args.quiet_probe else "-",
                str(args.scrape_interval),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert scraper.stdin is not None
        for call in series.values():
            time_calls(call, args.warmup)
        # This process's collector runs between windows only: its pauses would land in the
        # timed calls of either side, adding scatter that is not the daemon's.
        gc.collect()
        gc.freeze()
        gc.disable()
        for _ in range(args.windows):
            gc.collect()
            for mode in order.sample(("on", "off"), 2):
                scraper.stdin.write(f"{mode}\n")
                scraper.stdin.flush()
                taken: dict[str, list[float]] = {name: [] for name in series}
                end = time.perf_counter() + window_s
                while time.perf_counter() < end:
                    for name, call in series.items():
                        for _ in range(batch):
                            start = time.perf_counter()
                            call()
                            taken[name].append(time.perf_counter() - start)
                            if mode == "on":
                                starts.setdefault(name, []).append(start)
                for name, durations in taken.items():
                    windows[mode].setdefault(name, []).append(durations)
        gc.enable()
        out, _ = scraper.communicate(timeout=30)
        if scraper.returncode != 0:
            raise RuntimeError(f"the scraper failed (exit {scraper.returncode})")
        spans: list[tuple[float, float]] = [tuple(span) for span in json.loads(out)]
        if not spans:
            raise RuntimeError("the scraper never scraped")
        cost = snapshot_cost(daemon, args.lookup_calls)
    results: dict[str, Any] = {}
    for mode, per_series in windows.items():
        for name, per_window in per_series.items():
            results[f"{mode}/{name}"] = Latency.of([d for window in per_window for d in window])._asdict()
    results["p50_ratio"] = _on_over_off(results)
    results["p99_ratio"] = _on_over_off(results, "p99_us")
    results["p99_ratio_90ci"] = {
        name: bootstrap_ratio_interval(windows["on"][name], windows["off"][name], 99) for name in series
    }
    results["overlapping_a_scrape"] = {
        name: overlapping(starts[name], [d for window in windows["on"][name] for d in window], spans)
        for name in series
    }
    results["daemon_work_per_scrape_us"] = cost
    results["scrapes"] = len(spans)
    results["scrape_ms"] = Latency.of([end - start for start, end in spans])._asdict()
    results |= {"windows": args.windows, "window_s": window_s, "scrape_interval_s": args.scrape_interval}
    results["quiet_windows"] = "/healthz fetched as often" if args.quiet_probe else "scraper idle"
    return results


def snapshot_cost(daemon: Daemon, calls: int) -> dict[str, float]:
    """The daemon's own work per scrape, timed in this process on a store holding the pages the
    daemon holds (p50 µs): the snapshot the event loop takes, and its pickling in the daemon's
    metrics thread. A Lookup that arrives meanwhile waits for at most these."""
    page = lookup_spec().page
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmp:
        arena = Arena(Path(tmp) / "arena", 16 << 20, prefault=False)
        try:
            store = Store(CpuTier(arena, 16 << 20), make_policy(EvictionConfig().policy), 60.0, 600.0)
            ns = store.connect(page).id
            store.commit(ns, store.reserve(ns, [bytes([i % 256, i // 256]) * 8 for i in range(512)]).lease_id)
            handlers = Handlers({"": store}, CHUNK_TOKENS, 4 << 20)
            snap = Snapshot.take(handlers)
            return {
                "snapshot_on_loop": Latency.of(time_calls(lambda: Snapshot.take(handlers), calls)).p50_us,
                "pickle_in_thread": Latency.of(time_calls(lambda: pickle.dumps(snap), calls)).p50_us,
                "pickled_bytes": len(pickle.dumps(snap)),
            }
        finally:
            arena.close(unlink=True)


def report_scrape_turns(results: dict[str, Any]) -> None:
    print(
        f"\nOne daemon, Lookups in {results['windows']} pairs of {results['window_s']:g} s windows, /metrics "
        f"scraped every {results['scrape_interval_s']:g} s in one ({results['scrapes']} scrapes, "
        f"p50 {results['scrape_ms']['p50_us'] / 1e3:.1f} ms each) and not in the other "
        f"({results['quiet_windows']})"
    )
    rows = _on_off_rows(results)
    for row, name in zip(rows, results["p50_ratio"], strict=True):
        low, high = results["p99_ratio_90ci"][name]
        hit = results["overlapping_a_scrape"][name]
        row += [f"{low:.3f}-{high:.3f}", f"{hit['calls']} ({hit['share']:.2%}), p50 {hit['p50_us']:.0f}"]
    print_table(
        [
            "call",
            "scraping",
            "quiet",
            "p50 ratio",
            "p99 ratio",
            "p99 ratio, 90% interval",
            "overlapping a scrape",
        ],
        rows,
    )
    cost = results["daemon_work_per_scrape_us"]
    print(
        "The daemon's work per scrape (p50): the snapshot on the event loop "
        f"{cost['snapshot_on_loop']:.0f} µs, its pickling ({cost['pickled_bytes']} bytes) in the metrics "
        f"thread {cost['pickle_in_thread']:.0f} µs"
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def report_metrics(results: dict[str, Any]) -> None:
    print(
        f"\nLookup latency with /metrics scraped every {results['scrape_interval_s']:g} s and without "
        "(p50 / p99 µs; on / off p50, p99)"
    )
    print_table(["call", "metrics on", "metrics off", "p50 ratio", "p99 ratio"], _on_off_rows(results))


def _on_off_rows(results: dict[str, Any]) -> list[list[str]]:
    """Per call: on and off p50 / p99 (µs), and their ratios."""
    return [
        [
            call,
            f"{results[f'on/{call}']['p50_us']:.0f} / {results[f'on/{call}']['p99_us']:.0f}",
            f"{results[f'off/{call}']['p50_us']:.0f} / {results[f'off/{call}']['p99_us']:.0f}",
            f"{ratio:.3f}",
            f"{results['p99_ratio'][call]:.3f}",
        ]
        for call, ratio in results["p50_ratio"].items()
    ]


def handler_lookup_with_tenants(page: PageSpec, tokens: torch.Tensor, calls: int) -> dict[str, float]:
    """The daemon's own work for a Lookup of 512 keys (`Handlers.Lookup`: caller to store, the
    lookup, the reply) with tenants and without, in this process, timed in turns (p50 µs)."""
    from kvstore.config import TenantConfig
    from kvstore.peers import Peer
    from kvstore.tenants import Tenancy

    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmp:
        arenas = [Arena(Path(tmp) / f"arena-{i}", 16 << 20, prefault=False) for i in range(3)]
        try:
            stores = [
                Store(
                    CpuTier(arena, 16 << 20), make_policy(EvictionConfig().policy), 60.0, 600.0, tenant=name
                )
                for arena, name in zip(arenas, ("", "bench", "other"), strict=True)
            ]
            tenancy = Tenancy(
                [TenantConfig("bench", uids=(os.geteuid(),)), TenantConfig("other", uids=(40001,))]
            )
            modes = {
                "off": (Handlers({"": stores[0]}, CHUNK_TOKENS, 4 << 20), stores[0]),
                "on": (
                    Handlers({"bench": stores[1], "other": stores[2]}, CHUNK_TOKENS, 4 << 20, "", tenancy),
                    stores[1],
                ),
            }
            timed: dict[str, Callable[[], object]] = {}
            for mode, (handlers, store) in modes.items():
                caller = handlers.tenancy.of_peer(Peer(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid()))
                ns = store.connect(page).id
                keys = chunk_keys(ns, tokens, CHUNK_TOKENS)
                store.commit(ns, store.reserve(ns, keys).lease_id)
                request = pb.LookupRequest(namespace=ns, keys=pack_keys(keys))
                if handlers.Lookup(request, caller).hit_chunks != len(keys):
                    raise RuntimeError(f"handler lookup, tenants {mode}: not every key hit")
                timed[mode] = functools.partial(handlers.Lookup, request, caller)
            samples: dict[str, list[float]] = {mode: [] for mode in timed}
            for _ in range(10):
                for mode, call in timed.items():
                    samples[mode] += time_calls(call, max(calls // 10, 10))
        finally:
            for arena in arenas:
                arena.close(unlink=True)
    result = {f"{mode}_p50_us": Latency.of(values).p50_us for mode, values in samples.items()}
    result["ratio"] = result["on_p50_us"] / result["off_p50_us"]
    return result


def report_tenants(results: dict[str, Any]) -> None:
    print(
        f"\nLookup latency with tenants ({', '.join(results['tenants'])}) and without "
        "(p50 / p99 µs; on / off p50)"
    )
    print_table(
        ["call", "tenants on", "tenants off", "ratio"],
        [
            [
                call,
                f"{results[f'on/{call}']['p50_us']:.0f} / {results[f'on/{call}']['p99_us']:.0f}",
                f"{results[f'off/{call}']['p50_us']:.0f} / {results[f'off/{call}']['p99_us']:.0f}",
                f"{ratio:.3f}",
            ]
            for call, ratio in results["p50_ratio"].items()
        ],
    )
    handler = results["handler_lookup"]
    print(
        f"the daemon's work per Lookup of 512 keys (Handlers.Lookup, in-process): "
        f"{handler['on_p50_us']:.1f} µs with tenants, {handler['off_p50_us']:.1f} µs without "
        f"(ratio {handler['ratio']:.3f}); {results['rounds']} rounds of fresh daemons, samples pooled"
    )


def report_event_loops(results: dict[str, Any]) -> None:
    base, other = EVENT_LOOPS
    print(f"\nLookup latency by the daemon's event loop (p50 / p99 µs; {base} / {other} p50)")
    print_table(
        ["call", base, other, "ratio"],
        [
            [
                call,
                f"{results[f'{base}/{call}']['p50_us']:.0f} / {results[f'{base}/{call}']['p99_us']:.0f}",
                f"{results[f'{other}/{call}']['p50_us']:.0f} / {results[f'{other}/{call}']['p99_us']:.0f}",
                f"{ratio:.2f}",
            ]
            for call, ratio in results["p50_ratio"].items()
        ],
    )


TARGET_POLICY_HIT_512_US = 50.0
TARGET_STORM_PER_S = 40_000
TARGET_STORM_P99_US = 1000.0
TARGET_INDEX_BYTES = 256


def report_host(host: dict[str, Any]) -> None:
    keys = [
        ("policy_hit_512", f"policy hit accounting, 512 pages (<= {TARGET_POLICY_HIT_512_US:.0f})"),
        ("leased_lookup_512", "leased Lookup + Release, 512 keys"),
        ("plain_lookup_512", "plain Lookup, 512 keys"),
        ("respond_lookup_64", "local channel answer, 64-key Lookup"),
        ("index_bytes_per_page", f"index bytes per page (<= {TARGET_INDEX_BYTES})"),
    ]
    medians = host["medians"]
    names = list(medians)
    rows = [[label] + [_figure(medians[name].get(key)) for name in names] for key, label in keys]
    print("\nthe daemon's own work (p50 µs, median of the rounds) and index size")
    print_table(["figure"] + names, rows)


def report_storm(storm: dict[str, Any]) -> None:
    rows = []
    for name, runs in storm["runs"].items():
        for index, run in enumerate(runs):
            rows.append(
                [
                    f"{name} {index}",
                    round(run["calls_per_s"]),
                    round(run["p50_us"]),
                    round(run["p99_us"]),
                    round(run["daemon_cpu_us_per_call"], 1),
                    round(run["daemon_user_us_per_call"], 1),
                ]
            )
    print(f"\n64-key Lookups from {storm['runs'][next(iter(storm['runs']))][0]['processes']} processes")
    print_table(
        [
            "tree, round",
            f"calls/s (>= {TARGET_STORM_PER_S})",
            "p50 µs",
            f"p99 µs (<= {TARGET_STORM_P99_US:.0f})",
            "daemon CPU µs/call",
            "of which user",
        ],
        rows,
    )


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import kvstore_kernels  # both parts store pages through the client, which copies with it

    if not hasattr(kvstore_kernels, "gather"):
        raise SystemExit(
            "kvstore_kernels has no gather(): the client cannot copy pages. If "
            "kernels/__init__.py exists, reinstall the package (pip install -e .): an "
            "editable install made before it existed maps kvstore_kernels to a namespace"
        )
    config = daemon_config(args)
    started = time.perf_counter()
    lookup = moved = None
    if "lookup" in args.parts or "throughput" in args.parts:
        with running_daemon(config) as daemon:
            lookup = bench_lookup(daemon, args) if "lookup" in args.parts else None
            moved = bench_throughput(daemon, args) if "throughput" in args.parts else None
    goals = targets(lookup, moved)
    report(lookup, moved, goals)
    event_loops = bench_event_loops(config, args) if "event_loop" in args.parts else None
    if event_loops is not None:
        report_event_loops(event_loops)
    tenants = bench_tenants(args) if "tenants" in args.parts else None
    if tenants is not None:
        report_tenants(tenants)
    metrics = bench_metrics(args) if "metrics" in args.parts else None
    if metrics is not None:
        report_metrics(metrics)
    scrape_turns = bench_scrape_turns(args) if "scrape_turns" in args.parts else None
    if scrape_turns is not None:
        report_scrape_turns(scrape_turns)
    host = storm = None
    this_tree = Path(__file__).resolve().parents[1]
    if "host" in args.parts:
        host = compare_host(this_tree, args.baseline, args.rounds, args.lookup_calls, args.index_pages)
        report_host(host)
    if "storm" in args.parts:
        storm = compare_storm(
            this_tree, args.baseline, args.storm_processes, args.storm_seconds, 64, args.rounds, False
        )
        report_storm(storm)
    against = None
    if "against" in args.parts:
        calls = 200 if args.quick else 3000
        against = compare_trees(Path(__file__).resolve().parents[1], args.against, args.rounds, calls)
        report_against(against)
    parameters = {
        key: getattr(args, key)
        for key in (
            "quick",
            "tokens",
            "layers",
            "kv_heads",
            "head_dim",
            "arena",
            "repeats",
            "lookup_calls",
            "warmup",
            "parts",
        )
    }
    parameters |= {
        "chunk_tokens": CHUNK_TOKENS,
        "block_size": BLOCK_SIZE,
        "dtype": "bfloat16",
        "layout": "flash_attn",
        "daemon_config": config,
    }
    path = write_results(
        args.name,
        {
            "benchmark": "control_plane",
            "parameters": parameters,
            "lookup": lookup,
            "throughput": moved,
            "event_loops": event_loops,
            "tenants": tenants,
            "metrics": metrics,
            "scrape_turns": scrape_turns,
            "targets": goals,
            "against": against,
            "host": host,
            "storm": storm,
            "elapsed_s": time.perf_counter() - started,
            "note": "KV caches on the CPU: pages move with kvstore_kernels' torch reference, not Triton",
        },
    )
    print(f"\nwrote {path} ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
