"""Part 1 of the control-plane benchmark: Lookup latency against one daemon.

- `bench_lookup(daemon, args)`: Lookups of 1, 64 and 512 stored keys through the client's local
  channel and through gRPC (the client's own stub call), `client.lookup` end to end, leased
  Lookups with Release (and Acquire), a health check (the gRPC floor); CPU per call of both
  processes; and `server_breakdown`, the daemon's work per Lookup step by step, in this process.
- `report_lookup(lookup)`: its two tables.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common import Daemon, Latency, print_table
from bench.common_timing import time_calls
from bench.control_plane_setup import (
    CHUNK_TOKENS,
    LOOKUP_SIZES,
    Rpc,
    in_process_stores,
    lookup_series,
    lookup_spec,
    lookup_tokens,
    measure,
    store_lookup_pages,
)
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.handlers import Handlers
from kvstore.shared.keys import pack_keys, unpack_keys
from kvstore.shared.spec import PageSpec
from kvstore_client import KVStoreClient


def bench_lookup(daemon: Daemon, args: argparse.Namespace) -> dict[str, Any]:
    spec = lookup_spec()
    max_chunks = max(LOOKUP_SIZES)
    tokens = lookup_tokens(max_chunks, seed=1)
    with (
        KVStoreClient.connect(daemon.address, spec) as client,
        KVStoreClient.connect(daemon.address, spec, local_channel=False) as grpc_client,
    ):
        if client._local is None:
            raise RuntimeError("the client did not open the daemon's local channel")
        stored = store_lookup_pages(client, spec, tokens)
        if stored != max_chunks or client.lookup(tokens) != len(tokens):
            raise RuntimeError(
                f"lookup prefix: stored {stored} of {max_chunks} chunks, "
                f"lookup found {client.lookup(tokens)} of {len(tokens)} tokens"
            )
        keys = client.keys(tokens)
        # The client's own call (`_rpc`: local channel by default, or the gRPC stub), as in `lookup()`.
        calls = [
            (name, rpc, n)
            for n in LOOKUP_SIZES
            for name, rpc in (("rpc", client._rpc), ("grpc", grpc_client._rpc))
        ]
        rpc_series = lookup_series(calls, client.namespace, keys, checked="lookup")
        health = health_pb2_grpc.HealthStub(client._conn.channel)
        rpc_series["health_check"] = functools.partial(
            health.Check, health_pb2.HealthCheckRequest(), timeout=client.timeout_s
        )
        client_series: dict[str, Callable[[], object]] = {
            f"client_lookup_{n}": functools.partial(client.lookup, tokens[: n * CHUNK_TOKENS])
            for n in LOOKUP_SIZES
        }
        results = measure(rpc_series, args.lookup_calls, args.warmup, daemon)
        results |= measure(client_series, max(args.lookup_calls // 4, 50), args.warmup // 4, daemon)
        leased = _leased_series(client, grpc_client, pack_keys(keys))
        results |= measure(leased, max(args.lookup_calls // 2, 50), args.warmup // 2, daemon)
        counters = client.stats()["counters"]
        if counters.get("active_load_leases", 0):
            raise RuntimeError(f"{counters['active_load_leases']} load leases left pinned after Release")
        results["server_breakdown_512"] = server_breakdown(spec.page, keys, args.lookup_calls)
    return results


def _leased_series(
    client: KVStoreClient, grpc_client: KVStoreClient, packed: bytes
) -> dict[str, Callable[[], object]]:
    """A load's control calls for the 512 keys: Lookup(lease) + Release, and with Acquire too."""
    ns = client.namespace

    def lease_release(rpc: Rpc) -> None:
        reply = rpc("Lookup", pb.LookupRequest(namespace=ns, keys=packed, lease=True))
        rpc("Release", pb.LeaseRequest(namespace=ns, lease_id=reply.lease_id))

    def lease_acquire_release(rpc: Rpc) -> None:
        reply = rpc("Lookup", pb.LookupRequest(namespace=ns, keys=packed, lease=True))
        lease = pb.LeaseRequest(namespace=ns, lease_id=reply.lease_id, epoch=client.epoch)
        rpc("Acquire", lease)
        rpc("Release", lease)

    return {
        "lease_release_512": functools.partial(lease_release, client._rpc),
        "lease_acquire_release_512": functools.partial(lease_acquire_release, client._rpc),
        "grpc_lease_acquire_release_512": functools.partial(lease_acquire_release, grpc_client._rpc),
    }


def server_breakdown(page: PageSpec, keys: list[bytes], calls: int) -> dict[str, float]:
    """The daemon's Python work for one Lookup of `keys`, step by step, in this process (p50 µs)."""
    with in_process_stores() as (store,):
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
    breakdown["keys"] = len(keys)
    return breakdown


def report_lookup(lookup: dict[str, Any]) -> None:
    labels = [(f"rpc_{n}", "Lookup, local channel", n) for n in LOOKUP_SIZES]
    labels += [(f"grpc_{n}", "Lookup, gRPC", n) for n in LOOKUP_SIZES]
    labels += [(f"client_lookup_{n}", "client.lookup (+key hashing)", n) for n in LOOKUP_SIZES]
    labels += [
        ("lease_release_512", "Lookup(lease)+Release", 512),
        ("lease_acquire_release_512", "Lookup(lease)+Acquire+Release", 512),
        ("grpc_lease_acquire_release_512", "same, gRPC", 512),
        ("health_check", "Health.Check (gRPC floor)", 0),
    ]
    figures = ("p50_us", "p99_us", "mean_us", "client_cpu_us_per_call", "daemon_cpu_us_per_call", "calls")
    rows = [[label, keys, *(lookup[key][f] for f in figures)] for key, label, keys in labels]
    print("\nControl-plane latency (µs): the client's local channel vs gRPC, unix sockets")
    print_table(["call", "keys", "p50", "p99", "mean", "client CPU", "daemon CPU", "calls"], rows)
    breakdown = lookup["server_breakdown_512"]
    print(f"\nDaemon-side work for one Lookup of {breakdown['keys']} keys, in-process (p50 µs)")
    print_table(["step", "µs"], [[k, v] for k, v in breakdown.items() if k != "keys"])
