"""Part 3 of the control-plane benchmark: Lookup latency by the daemon's event loop.

- `bench_event_loops(config, args)`: one daemon on uvloop and one on asyncio's own loop
  (`server.event_loop`), both running, timed in turns: the local channel (1 and 64 keys), gRPC
  (1 key), the client's `lookup_chunks` (8 keys); the ratio of their p50s.
- `report_event_loops(results)`: its table.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Callable
from typing import Any

from bench.common import print_table
from bench.control_plane_setup import (
    lookup_series,
    lookup_spec,
    lookup_tokens,
    store_lookup_pages,
    timed_in_turns,
)
from bench.control_plane_sides import latencies, open_side, side_rows

EVENT_LOOPS = ("uvloop", "asyncio")  # server.event_loop: the default where uvloop is installed, and the other


def bench_event_loops(config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Lookup latency of one daemon on uvloop and one on asyncio's own loop, side by side and timed
    in turns: the local channel (1 and 64 keys), gRPC (1 key), and the client's `lookup_chunks`."""
    spec = lookup_spec()
    tokens = lookup_tokens(64, seed=3)
    series: dict[str, Callable[[], object]] = {}
    with contextlib.ExitStack() as stack:
        for loop in EVENT_LOOPS:
            logged = config | {"log_level": "info", "server": config["server"] | {"event_loop": loop}}
            daemon, client, grpc_client = open_side(stack, logged, spec)
            if f"event loop {loop})" not in daemon.log():
                raise RuntimeError(
                    f"the daemon asked for event loop {loop} did not run on it:\n{daemon.log()}"
                )
            if store_lookup_pages(client, spec, tokens) != 64:
                raise RuntimeError(f"{loop}: the lookup pages were not all stored")
            keys = client.keys(tokens)
            calls = [("rpc", client._rpc, 1), ("rpc", client._rpc, 64), ("grpc", grpc_client._rpc, 1)]
            for name, call in lookup_series(calls, client.namespace, keys, loop).items():
                series[f"{loop}/{name}"] = call
            series[f"{loop}/lookup_chunks_8"] = functools.partial(client.lookup_chunks, keys[:8])
        samples = timed_in_turns(series, args.lookup_calls, args.warmup)
    results = latencies(samples)
    base, other = EVENT_LOOPS
    results["p50_ratio"] = {
        name.split("/", 1)[1]: results[name]["p50_us"] / results[f"{other}/{name.split('/', 1)[1]}"]["p50_us"]
        for name in series
        if name.startswith(f"{base}/")
    }
    return results


def report_event_loops(results: dict[str, Any]) -> None:
    base, other = EVENT_LOOPS
    print(f"\nLookup latency by the daemon's event loop (p50 / p99 µs; {base} / {other} p50)")
    print_table(["call", base, other, "ratio"], side_rows(results, EVENT_LOOPS, digits=2, p99=False))
