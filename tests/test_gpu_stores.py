"""Stores that land in the GPU tier: a worker names its GPU in its Reserve (`gpu_bus_id`), the
daemon answers with slots of its pool there, the worker writes the pages device to device and
commits; readers on that GPU, or on another GPU of the host over peer access, read them in place
(prefill to decode on one host without the trip through host memory).

Three groups, as in test_gpu_tier:
- the protocol in-process, with the pool in host memory (`Rig`): slots in the pool, visibility
  at Commit only, room made by evicting the GPU tier's coldest pages without a copy, the arena
  where the pool cannot take the pages (leased, a copy in flight, no such GPU), expiry fenced
  until the writer is gone, Abort; every page read back from where Acquire says it is;
- a real daemon without a GPU: a Reserve naming a GPU gets the arena;
- CUDA (skipped without devices): the real daemon's pools over CUDA IPC, on one GPU and from one
  GPU to another over peer access, a producer killed before its Commit, a daemon restarted.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.domain import Tier
from kvstore.shared.keys import chunk_keys, pack_keys
from kvstore.shared.peers import Peer, process_start_time
from kvstore_client import KVStoreClient
from tests.harness import Daemon, python_env
from tests.test_gpu_tier import (
    CUDA,
    CUDA_SPEC,
    PAGE,
    Rig,
    cuda_cache,
    gpu_daemon,
    page_of,
    tiers,
    wait_for,
)

GPU, CPU = Tier.GPU, Tier.CPU
BUS = "0000:00:00.0"  # the rig's pool
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (none here): run on the GPU machine")
PEERS = CUDA and torch.cuda.device_count() >= 2 and torch.cuda.can_device_access_peer(0, 1)
needs_peers = pytest.mark.skipif(not PEERS, reason="needs two CUDA devices with peer access")


def this_process() -> Peer:
    return Peer(pid=os.getpid(), start_time=process_start_time(os.getpid()) or 0)


def reserve_in_pool(
    r: Rig, first_token: int, chunks: int, writer: Peer | None = None
) -> tuple[list[bytes], Any]:
    keys = chunk_keys(r.ns, list(range(first_token, first_token + chunks * 16)), 16)
    return keys, r.store.reserve(r.ns, keys, writer=writer or this_process(), gpu_bus_id=BUS)


def write(r: Rig, keys: list[bytes], reserved: Any) -> None:
    """Writes each new page where the Reserve put it: the pool, or the arena."""
    for key, offset in zip(keys, reserved.offsets, strict=True):
        if offset < 0:
            continue
        if reserved.pool >= 0:
            ctypes.memmove(ctypes.addressof(r.pool_memory) + offset, page_of(key), PAGE)
        else:
            r.store.cpu.write(offset, page_of(key))


def store_in_pool(r: Rig, first_token: int, chunks: int) -> list[bytes]:
    keys, reserved = reserve_in_pool(r, first_token, chunks)
    assert reserved.pool == 0
    write(r, keys, reserved)
    assert r.store.commit(r.ns, reserved.lease_id) == chunks
    return keys


# -- the protocol, in-process -------------------------------------------------


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Callable[[int, int], Rig]]:
    made: list[Rig] = []

    def make(cpu_pages: int, gpu_pages: int) -> Rig:
        path = tmp_path / f"rig{len(made)}"
        path.mkdir()
        made.append(Rig(path, cpu_pages, gpu_pages))
        return made[-1]

    yield make
    for made_rig in made:
        made_rig.close()


def test_a_store_naming_its_gpu_lands_in_the_pool_visible_at_commit_and_reads_back(
    rig: Callable[[int, int], Rig],
) -> None:
    async def scenario() -> None:
        r = rig(8, 8)
        keys, reserved = reserve_in_pool(r, 0, 3)
        assert reserved.pool == 0 and all(offset >= 0 for offset in reserved.offsets)
        assert r.usage() == {"gpu": (0, 3 * PAGE), "cpu": (0, 0)}  # slots held, nothing stored yet
        write(r, keys, reserved)
        assert r.store.lookup(r.ns, keys).hit_chunks == 0  # invisible before its Commit
        assert r.store.commit(r.ns, reserved.lease_id, 2) == 2  # in parts, as in the arena
        assert r.store.lookup(r.ns, keys).tiers == tiers(GPU, GPU)
        assert r.store.commit(r.ns, reserved.lease_id) == 1
        assert r.usage() == {"gpu": (3, 3 * PAGE), "cpu": (0, 0)}
        loaded = await r.load(keys)
        assert (loaded.tiers, loaded.pages) == (tiers(GPU, GPU, GPU), [page_of(k) for k in keys])
        elsewhere = await r.load(keys, pools=())  # a reader without the pool: copies in the arena
        assert (elsewhere.tiers, elsewhere.pages) == (tiers(CPU, CPU, CPU), [page_of(k) for k in keys])
        assert r.usage() == {"gpu": (3, 3 * PAGE), "cpu": (0, 0)}  # those went at its release
        again = r.store.reserve(r.ns, keys, writer=this_process(), gpu_bus_id=BUS)
        assert (again.lease_id, again.offsets) == (0, [-1, -1, -1])
        counters = r.store.stats().counters
        assert (counters["gpu_stored_chunks"], counters["stored_chunks"]) == (3, 3)
        events = [(e.tier, e.reason) for e in r.store.events.read(0, 1000)[0] if e.key in keys]
        assert events.count((GPU, "committed")) == 3 and (CPU, "committed") not in events

    asyncio.run(scenario())


def test_a_full_pool_evicts_its_coldest_pages_without_a_copy(rig: Callable[[int, int], Rig]) -> None:
    async def scenario() -> None:
        r = rig(8, 4)
        a, b = store_in_pool(r, 0, 2), store_in_pool(r, 10_000, 2)
        await r.load(b)  # b is the more recent
        c = store_in_pool(r, 20_000, 2)
        assert r.gpu.pending_copies == 0
        assert r.store.lookup(r.ns, a).hit_chunks == 0
        for keys in (b, c):
            loaded = await r.load(keys)
            assert (loaded.tiers, loaded.pages) == (tiers(GPU, GPU), [page_of(k) for k in keys])
        assert r.store.stats().counters["gpu_evicted_chunks"] == 2
        assert r.usage() == {"gpu": (4, 4 * PAGE), "cpu": (0, 0)}

    asyncio.run(scenario())


def test_a_pool_that_cannot_take_the_pages_sends_the_store_to_the_arena(
    rig: Callable[[int, int], Rig],
) -> None:
    async def scenario() -> None:
        r = rig(8, 2)
        held_keys = store_in_pool(r, 0, 2)
        held = await r.load(held_keys, release=False)  # a reader holds the whole pool
        keys, reserved = reserve_in_pool(r, 10_000, 2)
        assert reserved.pool == -1
        write(r, keys, reserved)
        assert r.store.commit(r.ns, reserved.lease_id) == 2
        loaded = await r.load(keys)
        assert (loaded.tiers, loaded.pages) == (tiers(CPU, CPU), [page_of(k) for k in keys])
        r.store.release(r.ns, held.lease_id)
        unknown = chunk_keys(r.ns, list(range(20_000, 20_032)), 16)  # a GPU the daemon has no pool on
        other = r.store.reserve(r.ns, unknown, writer=this_process(), gpu_bus_id="0000:ff:00.0")
        assert other.pool == -1 and r.store.abort(r.ns, other.lease_id) == 2
        assert r.store.stats().counters["gpu_reserves_to_arena"] == 2

    asyncio.run(scenario())


def test_a_copy_in_flight_in_the_pool_sends_the_store_to_the_arena(rig: Callable[[int, int], Rig]) -> None:
    """A slot a copy of the daemon's reads out of is reused in that copy's order by the daemon's
    own copies only: a worker's writes are not ordered after it, so it gets no slot meanwhile."""

    async def scenario() -> None:
        r = rig(8, 8)
        gate, copy = threading.Event(), r.runtime.memcpy_async

        def held_copy(dst: int, src: int, size: int, stream: int) -> None:
            assert gate.wait(30)
            copy(dst, src, size, stream)

        r.runtime.memcpy_async = held_copy  # type: ignore[method-assign]
        up = r.store_chain(0, 2)
        for _ in range(2):
            await r.load(up)  # the second hit moves them up: a copy in flight, held
        assert r.gpu.pending_copies == 1
        keys, reserved = reserve_in_pool(r, 10_000, 2)
        assert reserved.pool == -1 and r.store.abort(r.ns, reserved.lease_id) == 2
        gate.set()
        await r.drain()
        keys, reserved = reserve_in_pool(r, 10_000, 2)
        assert reserved.pool == 0
        write(r, keys, reserved)
        r.store.commit(r.ns, reserved.lease_id)
        for chain in (up, keys):
            loaded = await r.load(chain)
            assert (loaded.tiers, loaded.pages) == (tiers(GPU, GPU), [page_of(k) for k in chain])

    asyncio.run(scenario())


def test_an_expired_pool_lease_is_fenced_until_its_writer_is_gone_and_an_abort_frees_at_once(
    rig: Callable[[int, int], Rig],
) -> None:
    async def scenario() -> None:
        r = rig(8, 4)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        try:
            writer = Peer(pid=child.pid, start_time=process_start_time(child.pid) or 0)
            keys, reserved = reserve_in_pool(r, 0, 2, writer)
            assert reserved.pool == 0
            r.now += 11.0
            assert r.store.expire() == 1
            assert r.store.lookup(r.ns, keys).hit_chunks == 0
            assert r.usage()["gpu"] == (0, 2 * PAGE)  # fenced: the writer may still write there
            r.now += 2.0
            r.store.expire()
            assert r.usage()["gpu"] == (0, 2 * PAGE)  # it is alive
        finally:
            child.kill()
            child.wait()
        r.now += 2.0
        r.store.expire()
        assert r.usage()["gpu"] == (0, 0)
        keys, reserved = reserve_in_pool(r, 100, 3)
        assert r.store.abort(r.ns, reserved.lease_id) == 3
        assert r.usage()["gpu"] == (0, 0)
        stored = store_in_pool(r, 100, 3)  # the aborted lease's keys store again
        loaded = await r.load(stored)
        assert loaded.pages == [page_of(k) for k in stored]

    asyncio.run(scenario())


# -- a real daemon without a GPU ------------------------------------------------


def test_without_a_gpu_tier_a_reserve_naming_a_gpu_gets_the_arena(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = daemon_factory(chunk_tokens=16)
    spec = CUDA_SPEC
    tokens = list(range(4 * 16))
    cache = [torch.randn(2, 4, 16, 2, 64).bfloat16() for _ in range(4)]
    with KVStoreClient.connect(daemon.address, spec) as client:
        pid, start = client._writer
        request = pb.ReserveRequest(
            namespace=client.namespace,
            keys=pack_keys(client.keys(tokens)),
            epoch=client.epoch,
            writer_pid=pid,
            writer_start_time=start,
            gpu_bus_id="0000:3b:00.0",
        )
        reply = daemon.stub().Reserve(request)
        assert not reply.in_gpu_pool and len(reply.offsets) == 4 and min(reply.offsets) >= 0
        daemon.stub().Abort(pb.LeaseRequest(namespace=client.namespace, lease_id=reply.lease_id))
        client.store_to_gpu = True  # no pool on this host: the client stores to the arena
        assert client.store(tokens, cache, list(range(4))) == 4
        target = [torch.full_like(t, -3.0) for t in cache]
        assert client.load(tokens, target, list(range(4))) == len(tokens)
        assert all(torch.equal(a, b) for a, b in zip(target, cache, strict=True))


# -- CUDA: the real daemon's pools --------------------------------------------


def gpu_stats(client: KVStoreClient) -> tuple[dict[str, Any], dict[str, Any]]:
    stats = client.stats()
    return stats["tiers"]["gpu"], stats["counters"]


def load_into(
    client: KVStoreClient,
    tokens: list[int],
    source: list[torch.Tensor],
    device: str,
    current: int | None = None,
) -> int:
    """Loads `tokens` into a poisoned cache on `device` (with `current` the caller's current
    device, default `device`); every byte compared where loaded."""
    chunks = len(tokens) // 16
    with torch.cuda.device(device if current is None else current):
        shape = (2, chunks + 4, *source[0].shape[2:])
        target = [torch.full(shape, -7.0, dtype=source[0].dtype, device=device) for _ in source]
        loaded = client.load(tokens, target, list(range(4, chunks + 4)))
        torch.cuda.synchronize(device)
    for got, want in zip(target, source, strict=True):
        assert bool((got[:, :4] == -7.0).all())  # nothing else written
        done = loaded // 16
        assert torch.equal(got[:, 4 : 4 + done].cpu(), want[:, :done].cpu())
        assert bool((got[:, 4 + done :] == -7.0).all())
    return loaded


@needs_cuda
def test_cuda_a_store_lands_in_the_pool_of_its_gpu_and_loads_back_exactly(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = gpu_daemon(daemon_factory)
    tokens, source = list(range(8 * 16)), cuda_cache(8)
    with KVStoreClient.connect(daemon.address, CUDA_SPEC) as producer:
        producer.store_to_gpu = True
        assert producer.store(tokens, source, list(range(8))) == 8
        with KVStoreClient.connect(daemon.address, CUDA_SPEC) as consumer:
            assert load_into(consumer, tokens, source, "cuda:0") == len(tokens)
        tier, counters = gpu_stats(producer)
        assert producer.stats()["tiers"]["cpu"]["bytes_used"] == 0
    assert tier["pages"] == 8 and tier["stored_chunks"] == 8
    assert counters.get("gpu_copied_down_chunks", 0) == 0 and counters.get("gpu_reserves_to_arena", 0) == 0


@needs_peers
def test_cuda_prefill_on_one_gpu_hands_over_to_decode_on_another(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """The producer writes into the pool on its GPU; the consumer on the other GPU reads it there
    over peer access: no page crosses host memory."""
    pools = {"enabled": True, "bytes": "2MiB", "slab_bytes": "2MiB", "devices": [0, 1]}
    daemon = daemon_factory(chunk_tokens=16, tiers__gpu=pools)
    tokens = list(range(16 * 16))
    with torch.cuda.device(0):
        source = cuda_cache(16)
        producer = KVStoreClient.connect(daemon.address, CUDA_SPEC)
    with torch.cuda.device(1):
        consumer = KVStoreClient.connect(daemon.address, CUDA_SPEC)
    try:
        producer.store_to_gpu = True
        with torch.cuda.device(0):
            assert producer.store(tokens, source, list(range(16))) == 16
        assert sorted(consumer._gpu_pools.readable(torch.device("cuda", 1))) == [0, 1]
        assert load_into(consumer, tokens, source, "cuda:1") == len(tokens)
        with torch.cuda.device(0):  # the caller's current device is not the cache's
            assert load_into(consumer, tokens, source, "cuda:1", current=0) == len(tokens)
        tier, counters = gpu_stats(consumer)
        assert tier["stored_chunks"] == 16 and counters.get("gpu_copied_down_chunks", 0) == 0
        assert consumer.stats()["tiers"]["cpu"]["bytes_used"] == 0
    finally:
        consumer.close()
        producer.close()


PRODUCER = textwrap.dedent(
    """
    import os, sys, torch
    from tests.test_gpu_tier import CUDA_SPEC, cuda_cache
    from kvstore_client import KVStoreClient
    client = KVStoreClient.connect(sys.argv[1], CUDA_SPEC)
    client.store_to_gpu = True
    handle = client.store_async(list(range(8 * 16)), cuda_cache(8), list(range(8)))
    torch.cuda.synchronize()
    print("written", handle.chunks, flush=True)
    sys.stdin.readline()
    os._exit(9)  # killed before its Commit
    """
)


@needs_cuda
def test_cuda_a_producer_killed_before_its_commit_hands_over_nothing(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = gpu_daemon(daemon_factory, leases={"ttl_s": 1.0, "reap_interval_s": 0.05})
    tokens, source = list(range(8 * 16)), cuda_cache(8)
    producer = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, daemon.address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=python_env(),
    )
    try:
        assert producer.stdout is not None and producer.stdin is not None
        assert producer.stdout.readline().split() == [b"written", b"8"]
        with KVStoreClient.connect(daemon.address, CUDA_SPEC) as consumer:
            assert gpu_stats(consumer)[0]["bytes_used"] == 8 * 32 * 1024  # its slots, not visible
            assert load_into(consumer, tokens, source, "cuda:0") == 0
            producer.stdin.write(b"\n")
            producer.stdin.flush()
            assert producer.wait(30) == 9
            wait_for(lambda: gpu_stats(consumer)[0]["bytes_used"] == 0, timeout_s=30)  # writer gone
            assert load_into(consumer, tokens, source, "cuda:0") == 0
            consumer.store_to_gpu = True
            assert consumer.store(tokens, source, list(range(8))) == 8
            assert load_into(consumer, tokens, source, "cuda:0") == len(tokens)
    finally:
        producer.kill()
        producer.wait()


@needs_cuda
def test_cuda_a_daemon_restarted_after_a_hand_over_loses_only_the_pool(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """The pool is the daemon's memory: a restart empties it. The consumer then misses (never
    reads the old pool's bytes) and the next hand-over works against the new daemon."""
    daemon = gpu_daemon(daemon_factory)
    tokens, source = list(range(8 * 16)), cuda_cache(8)
    with KVStoreClient.connect(daemon.address, CUDA_SPEC) as producer:
        producer.store_to_gpu = True
        assert producer.store(tokens, source, list(range(8))) == 8
        with KVStoreClient.connect(daemon.address, CUDA_SPEC) as consumer:
            assert load_into(consumer, tokens, source, "cuda:0") == len(tokens)
            assert daemon.stop(signal.SIGKILL) == -signal.SIGKILL
            gpu_daemon(daemon_factory)  # the same socket and arena path
            assert load_into(consumer, tokens, source, "cuda:0") == 0
            wait_for(lambda: producer.store(tokens, source, list(range(8))) == 8, timeout_s=30)
            assert load_into(consumer, tokens, source, "cuda:0") == len(tokens)
            assert gpu_stats(consumer)[0]["stored_chunks"] == 8


@needs_cuda
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_cuda_workers_storing_into_the_pool_see_no_error_and_no_wrong_byte_through_restarts(
    tmp_path: Path, sig: int
) -> None:
    """Workers store into the GPU tier (a small pool: its pages are evicted and its slots reused
    all the time) and load, while the daemon is stopped and started again three times: no
    exception out of a public call, no loaded byte that is not the prompt's."""
    from tests.harness import start_daemon
    from tests.test_integrity import SERVE_AGAIN_S, STARTUP_TIMEOUT_S, Workers

    config = {
        "tiers__cpu__bytes": "1MiB",
        "tiers__cpu__slab_bytes": "256KiB",
        "tiers__gpu": {"enabled": True, "bytes": "512KiB", "slab_bytes": "256KiB"},
    }
    daemon = start_daemon(tmp_path, "restart", **config)
    workers = Workers(tmp_path, daemon.address, 3, "--gpu")
    try:
        workers.wait_served(time.time(), STARTUP_TIMEOUT_S)
        for _ in range(3):
            daemon.stop(sig)
            daemon = start_daemon(tmp_path, "restart", **config)
            workers.wait_served(time.time(), SERVE_AGAIN_S + 5)
        reports = workers.finish()
        stats = daemon.stub().Stats(pb.StatsRequest())
    finally:
        workers.kill()
        if daemon.process.poll() is None:
            assert daemon.stop() == 0, daemon.log()
    for n, report in enumerate(reports):
        assert report["exceptions"] == [], f"worker {n}: {report['exceptions'][:2]}"
        assert report["wrong"] == [], f"worker {n}: {report['wrong'][:3]}"
        assert report["loads"] > 10 and report["hit_tokens"] > 0 and report["stored"] > 0
    assert dict(stats.counters).get("gpu_stored_chunks", 0) > 0  # the last daemon's pool was used
