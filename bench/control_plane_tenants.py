"""Part 5 of the control-plane benchmark: Lookup latency of a daemon with tenants against one without.

- `bench_tenants(args)`: both daemons side by side, timed in turns, `--rounds` rounds
  (`control_plane_sides.on_off_rounds`): the local channel (the caller known by its uid), gRPC
  (the caller known by its tenant's token), `lookup_chunks`; and `handler_lookup_with_tenants`,
  the daemon's own work per 512-key Lookup with tenants and without, in this process.
- `report_tenants(results)`: its table.
"""

from __future__ import annotations

import argparse
import functools
import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import Latency, print_table
from bench.control_plane_setup import (
    CHUNK_TOKENS,
    LOOKUP_SIZES,
    in_process_stores,
    lookup_spec,
    lookup_tokens,
    small_daemon_config,
    timed_in_turns,
)
from bench.control_plane_sides import on_off_rounds, side_rows
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.handlers import Handlers
from kvstore.shared.keys import chunk_keys, pack_keys
from kvstore.shared.spec import PageSpec

TARGET_TENANTS_RATIO = 1.05


def bench_tenants(args: argparse.Namespace) -> dict[str, Any]:
    """Lookup latency of a daemon with two tenants and one without, side by side and timed in
    turns, in `args.rounds` rounds of fresh daemons (which starts first alternates), samples
    pooled; and the daemon's own work per Lookup with and without tenants, in this process."""
    spec = lookup_spec()
    tokens = lookup_tokens(max(LOOKUP_SIZES), seed=4)
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-tenants-") as tmp:
        tokens_file = Path(tmp) / "tokens"
        tokens_file.write_text(token + "\n")
        tokens_file.chmod(0o600)
        tenants = tenant_configs(tokens_file)
        base = small_daemon_config()
        configs = {
            "off": base,
            "on": base | {"tiers": {"cpu": {"bytes": "128MiB", "slab_bytes": "16MiB"}}, "tenants": tenants},
        }
        results, per_round = on_off_rounds(args, lambda: configs, spec, tokens, {"on": token})
    results["p50_ratio_per_round"] = per_round
    results["handler_lookup"] = handler_lookup_with_tenants(spec.page, tokens, args.lookup_calls)
    results["tenants"] = [t["name"] for t in tenants]
    results["rounds"] = args.rounds
    results["target_p50_ratio"] = TARGET_TENANTS_RATIO
    return results


def tenant_configs(tokens_file: Path) -> list[dict[str, Any]]:
    """`bench`, this user's tenant, its gRPC token in `tokens_file`; as root, `other` beside it."""
    tenants: list[dict[str, Any]] = [
        {"name": "bench", "uids": [os.geteuid()], "cpu_bytes": "64MiB", "tokens_file": str(tokens_file)}
    ]
    if os.geteuid() == 0:
        tenants.append({"name": "other", "uids": [40001], "cpu_bytes": "64MiB"})
    return tenants


def handler_lookup_with_tenants(page: PageSpec, tokens: torch.Tensor, calls: int) -> dict[str, float]:
    """The daemon's own work for a Lookup of 512 keys (`Handlers.Lookup`: caller to store, the
    lookup, the reply) with tenants and without, in this process, timed in turns (p50 µs)."""
    from kvstore.config.root import TenantConfig
    from kvstore.server.tenants import Tenancy
    from kvstore.shared.peers import Peer

    with in_process_stores(("", "bench", "other")) as stores:
        tenancy = Tenancy([TenantConfig("bench", uids=(os.geteuid(),)), TenantConfig("other", uids=(40001,))])
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
        samples = timed_in_turns(timed, calls, warmup=0)
    result = {f"{mode}_p50_us": Latency.of(values).p50_us for mode, values in samples.items()}
    result["ratio"] = result["on_p50_us"] / result["off_p50_us"]
    return result


def report_tenants(results: dict[str, Any]) -> None:
    print(
        f"\nLookup latency with tenants ({', '.join(results['tenants'])}) and without "
        "(p50 / p99 µs; on / off p50)"
    )
    print_table(["call", "tenants on", "tenants off", "ratio"], side_rows(results, p99=False))
    handler = results["handler_lookup"]
    print(
        f"the daemon's work per Lookup of 512 keys (Handlers.Lookup, in-process): "
        f"{handler['on_p50_us']:.1f} µs with tenants, {handler['off_p50_us']:.1f} µs without "
        f"(ratio {handler['ratio']:.3f}); {results['rounds']} rounds of fresh daemons, samples pooled"
    )
