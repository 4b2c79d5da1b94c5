"""Remote tier: a prefix stored on one host, loaded on another, against the Redis transport alone.

Starts a redis-server (unix socket, no persistence), two daemons pointed at it (A and B,
`tiers.remote.write: through`) and one without a remote tier (C). Each round stores a new
prompt through A (its pages are written through to the server; the round waits until they
are), then times, in turn:

- load on B, remote tier: `client.load` on B of a prompt B has never seen (Lookup finds the
  records, B's workers GET and check them into its arena, the client copies them into a CPU
  KV cache);
- load on B, CPU tier: the same load again (the pages are in B's arena now);
- raw GET, one pipeline: the same records fetched with one pipelined GET per page from this
  process (no checks, no copies): what the transport gives;
- store on A (write-through) against store on C, a third daemon without a remote tier: what
  writing through costs the storing worker (the pages are sent from their arena slots by A's
  workers after Commit; the store itself only hands them over).

GB/s of page bytes; ratios are medians of per-round ratios. Page sizes default to an 8-layer
slice of Llama-3.1-8B geometry (8 MiB pages of 256 tokens); loads land in CPU tensors, so the
figures are the host's (no GPU needed). Needs redis-server (or valkey-server) on PATH.

    python bench/remote.py [--tokens 4096] [--layers 8] [--rounds 7] [--threads 4]

`--parts cluster` (`bench/remote_cluster.py`) compares one server with a three-master Redis
Cluster instead: Lookup latency for 512 keys and the read of 64 pages.

`--parts mac` times the remote read path itself with authenticated records off and on
(`tiers.remote.record_key_file`): the tier's workers GET the same number of pages into slots of
one buffer, from records written without and with a MAC, in alternating order each round
against the same server; the ratio is the median of per-round read rates, on over off. It also
times HMAC-SHA256 and keyed BLAKE2b alone on one core (`bench/results/remote-mac.json`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

from bench.common import print_table, running_daemon, write_results  # noqa: E402
from kvstore_client import KVSpec, KVStoreClient  # noqa: E402

CHUNK, BLOCK, HEADS, HEAD_DIM = 256, 16, 8, 128


@contextlib.contextmanager
def running_redis() -> Iterator[tuple[str, Any]]:
    """A redis-server on a unix socket in a temporary directory: (url, client)."""
    import redis

    executable = shutil.which("redis-server") or shutil.which("valkey-server")
    if executable is None:
        raise SystemExit("bench/remote.py needs redis-server or valkey-server on PATH")
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-redis-") as directory:
        sock = Path(directory) / "redis.sock"
        process = subprocess.Popen(
            [executable, "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=directory,
        )
        client = redis.Redis(unix_socket_path=str(sock), socket_timeout=30)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
            yield f"unix://{sock}", client
        finally:
            client.close()
            process.kill()
            process.wait()


def wait_written(client: KVStoreClient, pages: int) -> None:
    deadline = time.monotonic() + 120
    while True:
        remote = client.stats()["tiers"]["remote"]
        if remote["written"] + remote["duplicate_writes"] >= pages and not remote["jobs"]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the remote tier did not write {pages} pages: {remote}")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=4, help="tiers.remote.threads of both daemons")
    parser.add_argument(
        "--parts", default="transfer", help="transfer, cluster, mac, or several (comma-separated)"
    )
    parser.add_argument("--lookups", type=int, default=2000, help="cluster: Lookups timed per setup")
    parser.add_argument(
        "--page-mib", type=float, default=8.0, help="cluster: the size of each of the 64 pages"
    )
    args = parser.parse_args()
    parts = args.parts.split(",")
    if unknown := set(parts) - {"transfer", "cluster", "mac"}:
        parser.error(f"--parts: unknown {sorted(unknown)}; expected transfer, cluster and/or mac")
    if "transfer" in parts:
        transfer(args)
    if "mac" in parts:
        record_macs(args)
    if "cluster" in parts:
        from bench import remote_cluster

        remote_cluster.run(args.lookups, args.page_mib, args.rounds, args.threads)


def transfer(args: argparse.Namespace) -> None:
    spec = KVSpec("bench/remote", args.layers, HEADS, HEAD_DIM, torch.bfloat16, block_size=BLOCK)
    chunks, blocks = args.tokens // CHUNK, args.tokens // BLOCK
    page_bytes = spec.with_chunk_tokens(CHUNK).page.page_bytes
    total = chunks * page_bytes
    arena = max(4 * total, 256 << 20)
    with running_redis() as (url, server):
        cpu = {"bytes": arena, "slab_bytes": max(page_bytes, 16 << 20)}
        remote = {"enabled": True, "url": url, "threads": args.threads, "queue_bytes": 2 * total}
        config: dict[str, Any] = {"chunk_tokens": CHUNK, "tiers": {"cpu": cpu, "remote": remote}}
        local_only: dict[str, Any] = {"chunk_tokens": CHUNK, "tiers": {"cpu": cpu}}
        with (
            running_daemon(config) as first,
            running_daemon(config) as second,
            running_daemon(local_only) as third,
            KVStoreClient.connect(first.address, spec) as writer,
            KVStoreClient.connect(second.address, spec) as reader,
            KVStoreClient.connect(third.address, spec) as plain,
        ):
            source = [torch.randn(2, blocks, BLOCK, HEADS, HEAD_DIM).bfloat16() for _ in range(args.layers)]
            target = [torch.zeros_like(layer) for layer in source]
            block_ids = torch.arange(blocks)
            samples: dict[str, list[float]] = {"remote": [], "cpu": [], "raw": [], "store": [], "plain": []}
            for round_ in range(args.rounds + 1):  # round 0 warms up and is not counted
                tokens = [round_ * 1_000_000 + t for t in range(args.tokens)]
                started = time.perf_counter()
                assert writer.store(tokens, source, block_ids) == chunks
                store_s = time.perf_counter() - started
                wait_written(writer, chunks * (round_ + 1))
                started = time.perf_counter()
                assert plain.store(tokens, source, block_ids) == chunks
                plain_s = time.perf_counter() - started
                names = [
                    f"kvstore:{reader.namespace.hex()}:{key.hex()}".encode() for key in reader.keys(tokens)
                ]
                timed: dict[str, float] = {}
                for row in ("remote", "cpu", "raw"):
                    for layer in target:
                        layer.zero_()
                    started = time.perf_counter()
                    if row == "raw":
                        pipe = server.pipeline(transaction=False)
                        for name in names:
                            pipe.get(name)
                        got = pipe.execute()
                        assert all(record is not None and len(record) > page_bytes for record in got)
                    else:
                        assert reader.load(tokens, target, block_ids) == args.tokens
                    timed[row] = time.perf_counter() - started
                    if row != "raw" and not all(
                        torch.equal(a, b) for a, b in zip(target, source, strict=True)
                    ):
                        raise AssertionError(f"{row}: loaded bytes differ from the stored ones")
                timed.update(store=store_s, plain=plain_s)
                if round_:
                    for row, seconds in timed.items():
                        samples[row].append(seconds)
            stats = reader.stats()["tiers"]["remote"]
    rows, results = [], {}
    labels = {
        "remote": "load on B, remote tier",
        "cpu": "load on B, CPU tier",
        "raw": "raw GET, one pipeline",
    }
    for row, values in samples.items():
        if row in ("store", "plain"):
            continue
        median = statistics.median(values)
        x_raw = statistics.median(r / v for v, r in zip(values, samples["raw"], strict=True))
        x_cpu = statistics.median(c / v for v, c in zip(values, samples["cpu"], strict=True))
        rows.append([labels[row], median * 1e3, total / median / 1e9, x_raw, x_cpu])
        results[row] = {
            "label": labels[row],
            "ms": median * 1e3,
            "gb_s": total / median / 1e9,
            "x_raw_get_speed": x_raw,
            "x_cpu_tier_speed": x_cpu,
            "rounds_ms": [v * 1e3 for v in values],
        }
    stores = {
        row: {"ms": statistics.median(samples[row]) * 1e3, "rounds_ms": [v * 1e3 for v in samples[row]]}
        for row in ("store", "plain")
    }
    store_ratio = statistics.median(s / p for s, p in zip(samples["store"], samples["plain"], strict=True))
    results["store_write_through"] = stores["store"] | {"x_no_remote_time": store_ratio}
    results["store_no_remote"] = stores["plain"]
    print(f"{args.tokens} tokens, {args.layers} layers: {chunks} pages of {page_bytes >> 20} MiB per load")
    print_table(("what", "ms", "GB/s", "x raw GET speed", "x CPU-tier speed"), rows)
    print_table(
        ("store (one worker's call)", "ms", "x time without a remote tier"),
        [
            ["store on A, remote write-through", stores["store"]["ms"], store_ratio],
            ["store on C, no remote tier", stores["plain"]["ms"], 1.0],
        ],
    )
    path = write_results(
        "remote",
        {
            "parameters": vars(args) | {"page_bytes": page_bytes, "bytes_per_load": total},
            "results": results,
            "reader_remote_tier": stats,
        },
    )
    print(f"wrote {path}")


def record_macs(args: argparse.Namespace) -> None:
    """The remote tier's read rate with record MACs off and on, same server, same run."""
    from kvstore.config.root import RemoteTierConfig
    from kvstore.tiers.remote import RemoteTier

    spec = KVSpec("bench/remote", args.layers, HEADS, HEAD_DIM, torch.bfloat16, block_size=BLOCK)
    page_bytes = spec.with_chunk_tokens(CHUNK).page.page_bytes
    count = args.tokens // CHUNK
    total = count * page_bytes
    namespace = bytes(16)
    keys = [i.to_bytes(16, "big") for i in range(count)]
    pages = [os.urandom(page_bytes) for _ in range(count)]
    slots = mmap.mmap(-1, total)  # an arena's stand-in: reads land in its slots, as in the daemon
    views = [memoryview(slots)[i * page_bytes : (i + 1) * page_bytes] for i in range(count)]
    samples: dict[str, list[float]] = {"off": [], "on": []}
    load_before = os.getloadavg()  # a shared machine's other work shows in both rows, not in the ratio alone
    with running_redis() as (url, _), tempfile.TemporaryDirectory() as directory:
        key_file = Path(directory) / "record.key"
        key_file.write_bytes(os.urandom(32))
        key_file.chmod(0o600)
        base = {"enabled": True, "url": url, "threads": args.threads, "queue_bytes": 2 * total}
        tiers = {
            "off": RemoteTier(RemoteTierConfig(**base, key_prefix="off:")),
            "on": RemoteTier(RemoteTierConfig(**base, key_prefix="on:", record_key_file=str(key_file))),
        }
        try:
            for tier in tiers.values():
                for key, page in zip(keys, pages, strict=True):
                    assert tier.submit_write(namespace, key, page)
                assert tier.wait_idle(120)
            for round_ in range(args.rounds + 1):  # round 0 warms up and is not counted
                for setting in ("off", "on") if round_ % 2 else ("on", "off"):
                    seconds = _read_all(tiers[setting], namespace, keys, views)
                    if any(view != page for view, page in zip(views, pages, strict=True)):
                        raise AssertionError(f"MAC {setting}: read bytes differ from the written ones")
                    if round_:
                        samples[setting].append(seconds)
            figures = {setting: tier.stats() for setting, tier in tiers.items()}
        finally:
            for tier in tiers.values():
                tier.close()
    ratio = statistics.median(off / on for off, on in zip(samples["off"], samples["on"], strict=True))
    rows: list[list[Any]] = []
    results: dict[str, Any] = {}
    for setting, values in samples.items():
        median = statistics.median(values)
        rows.append([f"remote reads, MAC {setting}", median * 1e3, total / median / 1e9])
        results[f"mac_{setting}"] = {
            "ms": median * 1e3,
            "gb_s": total / median / 1e9,
            "rounds_ms": [v * 1e3 for v in values],
        }
    results["read_rate_on_over_off"] = ratio
    results["one_core_gb_s"] = _mac_rates(page_bytes)
    print(f"{count} pages of {page_bytes >> 20} MiB per read, {args.threads} read workers")
    print_table(("what", "ms", "GB/s"), rows)
    print(f"read rate, MAC on / off: {ratio:.3f} (median of {len(samples['on'])} rounds)")
    print(
        "one core, GB/s: "
        + ", ".join(f"{name} {rate:.2f}" for name, rate in results["one_core_gb_s"].items())
    )
    path = write_results(
        "remote-mac",
        {
            "parameters": vars(args) | {"page_bytes": page_bytes, "bytes_per_read": total},
            "results": results,
            "load_average_before_after": [load_before, os.getloadavg()],
            "remote_tier": figures,
        },
    )
    print(f"wrote {path}")


def _read_all(tier: Any, namespace: bytes, keys: list[bytes], views: list[memoryview]) -> float:
    """Seconds for the tier's workers to read every page into its slot (all submitted at once)."""
    left = [len(keys)]
    finished = threading.Event()
    failed: list[bytes] = []
    lock = threading.Lock()

    def done(page: object, key: bytes) -> None:
        with lock:
            if page is None:
                failed.append(key)
            left[0] -= 1
            if not left[0]:
                finished.set()

    started = time.perf_counter()
    for key, view in zip(keys, views, strict=True):
        if not tier.submit_read(namespace, key, lambda page, key=key: done(page, key), into=view):
            raise RuntimeError("the remote tier refused a read")
    if not finished.wait(120):
        raise RuntimeError("reads did not finish in 120 s")
    seconds = time.perf_counter() - started
    if failed:
        raise RuntimeError(f"{len(failed)} reads were misses: {tier.stats()}")
    return seconds


def _mac_rates(size: int) -> dict[str, float]:
    """GB/s of HMAC-SHA256, keyed BLAKE2b and (for scale) nothing else, one page at a time."""
    data, secret = os.urandom(size), os.urandom(32)
    candidates = {
        "hmac_sha256": lambda: hmac.digest(secret, data, "sha256"),
        "blake2b_keyed": lambda: hashlib.blake2b(data, key=secret).digest(),
    }
    rates = {}
    for name, run in candidates.items():
        run()
        started = time.perf_counter()
        for _ in range(5):
            run()
        rates[name] = 5 * size / (time.perf_counter() - started) / 1e9
    return rates


if __name__ == "__main__":
    main()
