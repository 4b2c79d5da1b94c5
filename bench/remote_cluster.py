"""Remote tier: one Redis server against a three-master Redis Cluster on the same machine.

Starts a redis-server on TCP and a cluster of six (three masters, one replica each, made by
`redis-cli --cluster create`, as `tests/redis_cluster.py` does), both on 127.0.0.1, and opens
the remote tier (`kvstore.tiers.remote.RemoteTier`, the daemon's own code) on each. It stores
512 small records (for Lookups: EXISTS does not depend on a record's size) and 64 pages of
`--page-mib` MiB, then, in turns (the order random in each round):

- Lookup of 512 keys (and of 1): `present`, as a daemon's Lookup calls it on its event loop.
  One server gets one pipeline; the cluster one pipeline per master, sent to all three at once.
  p50 and p99 over `--lookups` calls each;
- read of 64 pages: `submit_read` of all 64 into buffers of their size, poisoned first, on the
  tier's `--threads` read workers, until the last is in: GB/s, and every byte compared after.

The acceptance asks the cluster's p99 of a 512-key Lookup within 1.5x of one server's.

    python bench/remote.py --parts cluster [--lookups 2000] [--page-mib 8] [--rounds 10]
"""

from __future__ import annotations

import random
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common import print_table, write_results
from kvstore.config.root import RemoteTierConfig
from kvstore.tiers.remote import RemoteTier
from tests.redis_cluster import RedisCluster, cluster_tools, free_ports

LOOKUP_NS, READ_NS = bytes(range(16)), bytes(range(1, 17))
SETUPS = ("one server", "cluster of 3")


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


@contextmanager
def one_server(directory: Path) -> Iterator[str]:
    executable = shutil.which("redis-server") or shutil.which("valkey-server")
    assert executable is not None
    port = free_ports(1)[0]
    process = subprocess.Popen(
        [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=directory,
    )
    try:
        RedisCluster._wait(lambda: _ping(port), f"redis-server on {port}")
        yield f"redis://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


def _ping(port: int) -> bool:
    import redis

    return bool(redis.Redis(host="127.0.0.1", port=port, socket_timeout=2).ping())


@contextmanager
def cluster_of_three(directory: Path) -> Iterator[str]:
    cluster = RedisCluster(directory)
    try:
        cluster.start()
        yield cluster.seed_url
    finally:
        cluster.stop()


def fill(tier: RemoteTier, pages: dict[int, bytes]) -> None:
    for i in range(512):
        assert tier.submit_write(LOOKUP_NS, key(i), b"%d" % i * 64)
    assert tier.wait_idle(120)
    for i, data in pages.items():
        assert tier.submit_write(READ_NS, key(i), data)
        assert tier.wait_idle(120)  # one at a time: queue_bytes stays small
    assert tier.stats()["written"] == 512 + len(pages), tier.stats()


def read_all(tier: RemoteTier, buffers: list[bytearray]) -> float:
    """Seconds to read every page into its (poisoned) buffer; raises if one is missing."""
    for buffer in buffers:
        buffer[:] = b"\xa5" * len(buffer)
    missing: list[int] = []
    left = [len(buffers)]
    finished = threading.Event()
    lock = threading.Lock()

    def done_for(i: int) -> Any:
        def done(page: object) -> None:
            with lock:
                if page is None:
                    missing.append(i)
                left[0] -= 1
                if not left[0]:
                    finished.set()

        return done

    started = time.perf_counter()
    for i, buffer in enumerate(buffers):
        assert tier.submit_read(READ_NS, key(i), done_for(i), memoryview(buffer))
    assert finished.wait(120)
    seconds = time.perf_counter() - started
    if missing:
        raise AssertionError(f"pages {missing} were misses")
    return seconds


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(lookups: int, page_mib: float, rounds: int, threads: int) -> None:
    if cluster_tools() is None:
        raise SystemExit("bench/remote.py --parts cluster needs redis-server and redis-cli on PATH")
    page_bytes = int(page_mib * (1 << 20))
    pages = {i: random.Random(i).randbytes(page_bytes) for i in range(64)}
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-cluster-") as directory:
        root = Path(directory)
        (root / "one").mkdir()
        (root / "cluster").mkdir()
        with one_server(root / "one") as single_url, cluster_of_three(root / "cluster") as seed_url:
            settings: dict[str, Any] = {
                "enabled": True,
                "lookup_timeout_s": 5.0,  # measured, not cut short
                "threads": threads,
                "queue_bytes": 2 * page_bytes,
            }
            tiers = {
                "one server": RemoteTier(RemoteTierConfig(url=single_url, **settings)),
                "cluster of 3": RemoteTier(RemoteTierConfig(cluster=True, urls=(seed_url,), **settings)),
            }
            try:
                for tier in tiers.values():
                    tier.start()
                    fill(tier, pages)
                results = measure(tiers, pages, lookups, rounds, rng)
                results["slot_map"] = {
                    "masters": sum(node.role == "master" for node in tiers["cluster of 3"].node_usage()),
                    "records_per_master": [
                        node.keys for node in tiers["cluster of 3"].node_usage() if node.role == "master"
                    ],
                }
            finally:
                for tier in tiers.values():
                    tier.close(timeout_s=10)
    report(results, lookups, page_bytes, rounds, threads)


def measure(
    tiers: dict[str, RemoteTier], pages: dict[int, bytes], lookups: int, rounds: int, rng: random.Random
) -> dict[str, Any]:
    lookup_keys = [key(i) for i in range(512)]
    latency: dict[tuple[str, int], list[float]] = {(setup, n): [] for setup in SETUPS for n in (1, 512)}
    for _ in range(lookups + 50):  # the first 50 warm up and are not counted
        order = list(SETUPS)
        rng.shuffle(order)
        for setup in order:
            for n in (512, 1):
                started = time.perf_counter_ns()
                found = tiers[setup].present(LOOKUP_NS, lookup_keys[:n])
                latency[(setup, n)].append((time.perf_counter_ns() - started) / 1e3)
                assert found == n, (setup, n, found, tiers[setup].stats())
    buffers = [bytearray(len(pages[i])) for i in range(len(pages))]
    reads: dict[str, list[float]] = {setup: [] for setup in SETUPS}
    for round_ in range(rounds + 1):  # round 0 warms up
        order = list(SETUPS)
        rng.shuffle(order)
        for setup in order:
            seconds = read_all(tiers[setup], buffers)
            if any(bytes(buffer) != pages[i] for i, buffer in enumerate(buffers)):
                raise AssertionError(f"{setup}: a page read back differs from the one stored")
            if round_:
                reads[setup].append(seconds)
    total = sum(len(page) for page in pages.values())
    return {
        "lookup_us": {
            f"{setup}, {n} keys": {
                "p50": statistics.median(values[50:]),
                "p99": percentile(values[50:], 0.99),
                "calls": len(values) - 50,
            }
            for (setup, n), values in latency.items()
        },
        "read_64_pages": {
            setup: {
                "ms": statistics.median(values) * 1e3,
                "gb_s": total / statistics.median(values) / 1e9,
                "rounds_ms": [v * 1e3 for v in values],
            }
            for setup, values in reads.items()
        },
        "bytes_per_read": total,
    }


def report(results: dict[str, Any], lookups: int, page_bytes: int, rounds: int, threads: int) -> None:
    lookup = results["lookup_us"]
    rows = []
    for n in (512, 1):
        one, cluster = lookup[f"one server, {n} keys"], lookup[f"cluster of 3, {n} keys"]
        rows.append([f"Lookup, {n} keys", one["p50"], cluster["p50"], one["p99"], cluster["p99"]])
        results[f"cluster_p99_over_one_server_{n}_keys"] = cluster["p99"] / one["p99"]
        results[f"cluster_p50_over_one_server_{n}_keys"] = cluster["p50"] / one["p50"]
    print(f"Lookup latency (µs), {lookups} calls each, in turns")
    print_table(("what", "one p50", "cluster p50", "one p99", "cluster p99"), rows)
    for n in (512, 1):
        print(
            f"cluster p99 / one server p99, {n} keys: {results[f'cluster_p99_over_one_server_{n}_keys']:.2f}"
        )
    reads = results["read_64_pages"]
    print(f"\nread of 64 pages of {page_bytes >> 20} MiB on {threads} workers, {rounds} rounds in turns")
    print_table(
        ("setup", "ms (median)", "GB/s", "x one server"),
        [
            [setup, reads[setup]["ms"], reads[setup]["gb_s"], reads["one server"]["ms"] / reads[setup]["ms"]]
            for setup in SETUPS
        ],
    )
    path = write_results(
        "remote-cluster",
        {
            "parameters": {
                "lookups": lookups,
                "page_bytes": page_bytes,
                "rounds": rounds,
                "threads": threads,
            },
            "results": results,
        },
    )
    print(f"wrote {path}")
