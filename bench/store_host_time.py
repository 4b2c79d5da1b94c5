"""Where a store's host time goes before its first byte moves: Llama-3.1-8B's pages through the
public client into a daemon, the KV caches registered as the engine adapters pass them.

For each prompt length:
- `prepare`: `kvstore_kernels.prepare` of every chunk into the arena alone (what a store does
  while its Reserve is in flight), median µs over 50 calls back to back, then each after a
  pinned memcpy of the prompt's bytes, then each after a 20 ms sleep;
- `reserve`: a Reserve of the prompt's keys alone, answered and aborted, median µs;
- `store`: the whole store, median ms, against a pinned memcpy of the same bytes in turn;
- cProfile over 200 setups alone, and over 20 stores: the functions with the most own time, and
  the most with callees.

    python bench/store_host_time.py [--tokens 2048 8192] [--name store-host-time]

Prints a table and the profiles; writes bench/results/<name>.json. On CPU (no GPU) it runs the
reference path, whose times say nothing of a GPU host's.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvstore_kernels  # noqa: E402
from bench.common import print_table, running_daemon, write_results  # noqa: E402
from bench.transfer_cases import daemon_config, make_spec, wait_reserved  # noqa: E402
from bench.transfer_model_cases import HostCopy, ModelCache, synchronize  # noqa: E402
from kvstore.proto import kvstore_pb2 as pb  # noqa: E402
from kvstore_client import KVStoreClient  # noqa: E402


def median_us(call: Any, count: int, before: Any = None) -> float:
    """`call`'s median µs over `count` calls, each after `before()` (and a synchronize) where given."""
    took = []
    for _ in range(count):
        if before is not None:
            before()
            synchronize()
        start = time.perf_counter()
        call()
        took.append(time.perf_counter() - start)
        synchronize()
    return statistics.median(took) * 1e6


def wait_registered(client: KVStoreClient, timeout_s: float = 120.0) -> None:
    """Until the client has registered every slab of the arena: a store into a slab not registered
    yet goes through the bounce ring (CPU copies), which is what `bench/connect.py` times."""
    deadline = time.monotonic() + timeout_s
    while client.stats()["client"]["arena"].get("slabs_pending", 0):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the client's arena is still not registered after {timeout_s} s")
        time.sleep(0.05)


def profile_text(profiler: cProfile.Profile, key: str, lines: int) -> str:
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(lines)
    return out.getvalue()


def measure(tokens: int, profiles: int) -> dict[str, Any]:
    spec = make_spec("flash_attn")
    cache = ModelCache(spec, tokens, seed=1)
    moved = cache.num_chunks * spec.page.page_bytes
    copy = HostCopy(moved)
    try:
        with (
            running_daemon(daemon_config(spec.page.page_bytes, cache.num_chunks)) as daemon,
            KVStoreClient.connect(daemon.address, spec) as client,
        ):
            wait_reserved(client)
            wait_registered(client)
            source = client.register_kv_caches(cache.source)
            keys = client.keys(list(range(tokens)))
            arena = client.arena
            assert arena is not None

            def store() -> None:
                if client.store(None, source, cache.table, keys=keys) != cache.num_chunks:
                    raise RuntimeError("store: the daemon took fewer pages than the prompt has")

            def prepare() -> None:
                kvstore_kernels.prepare(
                    client.spec, source, cache.table, range(cache.num_chunks), arena, None, to_page=True
                )

            def reserve() -> float:
                client.clear()
                start = time.perf_counter()
                reply = client._stores._reserve(keys)
                took = time.perf_counter() - start
                lease = pb.LeaseRequest(
                    namespace=client.namespace, lease_id=reply.lease_id, epoch=client.epoch
                )
                client._end_quietly("Abort", lease)
                return took

            for _ in range(3):
                client.clear()
                store()
            prepare_us = median_us(prepare, 50)
            memcpy = copy.run(moved, True)
            after_memcpy = median_us(prepare, 30, before=memcpy)
            after_sleep = median_us(prepare, 30, before=lambda: time.sleep(0.02))
            prepares = cProfile.Profile()
            prepares.enable()
            for _ in range(200):
                prepare()
            prepares.disable()
            synchronize()
            reserve_us = statistics.median(reserve() for _ in range(50)) * 1e6
            stores, copies = [], []
            profiler = cProfile.Profile()
            for round_ in range(20 + profiles):
                client.clear()
                memcpy()
                synchronize()
                start = time.perf_counter()
                memcpy()
                synchronize()
                copies.append(time.perf_counter() - start)
                client.clear()
                synchronize()
                profiling = round_ >= 20
                if profiling:
                    profiler.enable()
                start = time.perf_counter()
                store()
                synchronize()
                if profiling:
                    profiler.disable()
                else:
                    stores.append(time.perf_counter() - start)
    finally:
        copy.release()
    store_ms, memcpy_ms = statistics.median(stores) * 1e3, statistics.median(copies) * 1e3
    return {
        "tokens": tokens,
        "bytes": moved,
        "prepare_us": round(prepare_us, 1),
        "prepare_after_memcpy_us": round(after_memcpy, 1),
        "prepare_after_sleep_us": round(after_sleep, 1),
        "reserve_us": round(reserve_us, 1),
        "store_ms": round(store_ms, 3),
        "memcpy_ms": round(memcpy_ms, 3),
        "x_memcpy": round(memcpy_ms / store_ms, 3),
        "profile_prepare": profile_text(prepares, "tottime", 40),
        "profile_tottime": profile_text(profiler, "tottime", 30),
        "profile_cumtime": profile_text(profiler, "cumulative", 45),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--profiles", type=int, default=20, help="stores under cProfile, after the rest")
    parser.add_argument("--name", default="store-host-time")
    args = parser.parse_args()
    rows = [measure(tokens, args.profiles) for tokens in args.tokens]
    for row in rows:
        print(f"-- {row['tokens']} tokens: own time\n{row['profile_tottime']}")
        print(f"-- {row['tokens']} tokens: with callees\n{row['profile_cumtime']}")
    columns = [
        "tokens",
        "bytes",
        "prepare_us",
        "prepare_after_memcpy_us",
        "prepare_after_sleep_us",
        "reserve_us",
        "store_ms",
        "memcpy_ms",
        "x_memcpy",
    ]
    print_table(columns, [[row[column] for column in columns] for row in rows])
    write_results(args.name, {"rows": rows})


if __name__ == "__main__":
    main()
