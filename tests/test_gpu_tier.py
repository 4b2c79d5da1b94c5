"""The GPU tier: configuration, placement (up on repeated hits or a pin, down for room), and loads.

Three groups:
- no GPU (any machine): the daemon with the tier configured starts, says once why it is off,
  and serves as before;
- placement, in-process: the store's moves between the tiers, with the GPU tier's pools in
  host memory (`HostRuntime` makes the copier's copies memmoves; threads, ordering and the
  store's bookkeeping are the real ones). Every scenario reads the bytes back from where
  Acquire says they are;
- CUDA (skipped without a device): the real daemon's pools, opened by workers over CUDA IPC.
"""

from __future__ import annotations

import asyncio
import ctypes
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.config.root import ConfigError, parse_config
from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.cudart import CudaError
from kvstore.shared.domain import Tier
from kvstore.shared.keys import chunk_keys, pack_keys
from kvstore.shared.spec import PageSpec
from kvstore.store.policy import make_policy
from kvstore.store.store import Store
from kvstore.store.store_settings import StoreSettings
from kvstore.tiers.cpu import Arena, CpuTier
from kvstore.tiers.gpu import GpuPool, GpuTier, _address
from kvstore.tiers.slab import SlabAllocator
from kvstore_client import KVSpec, KVStoreClient
from tests.harness import Daemon, python_env
from tests.test_lookup_prefix import assert_unplain_holds

SPEC = PageSpec(model="gpu-test", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=16)
PAGE = SPEC.page_bytes  # 4 KiB
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (none here): run on the GPU machine")


# -- configuration and a host without a GPU ---------------------------------


def test_the_gpu_tier_is_off_by_default_and_its_settings_are_checked() -> None:
    config = parse_config({})
    assert not config.tiers.gpu.enabled and config.tiers.gpu.devices == (0,)
    gpu = parse_config({"tiers": {"gpu": {"enabled": True, "devices": [1, 0], "bytes": "1GiB"}}}).tiers.gpu
    assert (gpu.devices, gpu.bytes) == ((1, 0), 1 << 30)
    bad = {
        "devices": ([], "tiers.gpu.devices: expected at least one device index"),
        "bytes": ("1MiB", "tiers.gpu.slab_bytes: expected at most tiers.gpu.bytes (1MiB), got 256MiB"),
        "promote_after_hits": (0, "tiers.gpu.promote_after_hits: expected a value >= 1, got 0"),
    }
    for key, (value, message) in bad.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_config({"tiers": {"gpu": {key: value}}})
    for value, message in (("0", "expected a list"), ([0, 0], "listed twice"), ([-1], r"devices\[0\]")):
        with pytest.raises(ConfigError, match=message):
            parse_config({"tiers": {"gpu": {"devices": value}}})


def test_without_a_gpu_the_daemon_says_so_once_and_serves_from_the_cpu_tier(
    daemon_factory: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as env:  # the daemon's environment only: this process keeps its GPUs
        env.setenv("CUDA_VISIBLE_DEVICES", "")  # no device, whatever this machine has
        daemon = daemon_factory(tiers__gpu={"enabled": True, "bytes": "16MiB", "slab_bytes": "16MiB"})
    assert daemon.log().count("GPU tier off:") == 1, daemon.log()
    spec = KVSpec(
        model="no-gpu", num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float16, block_size=16
    )
    cache = [torch.randn(2, 64, 16, 2, 32).half() for _ in range(2)]
    tokens = list(range(1024))
    with KVStoreClient.connect(daemon.address, spec) as client:
        assert client.store(tokens, cache, list(range(64))) == 4
        for _ in range(3):  # hits that would promote with a GPU
            target = [torch.full_like(t, -1.0) for t in cache]
            assert client.load(tokens, target, list(range(64))) == 1024
            assert all(torch.equal(a, b) for a, b in zip(target, cache, strict=True))
        stats = client.stats()
    assert "gpu" not in stats["tiers"] and stats["tiers"]["cpu"]["pages"] == 4
    assert "gpu_promoted_chunks" not in stats["counters"]


# -- placement, in-process ----------------------------------------------------


class HostRuntime:
    """The runtime calls the GPU tier's copier makes, on host memory; `fail` breaks the next copies."""

    fail = False

    def set_device(self, device: int) -> None:
        pass

    def stream_create(self) -> int:
        return 1

    def stream_destroy(self, stream: int) -> None:
        pass

    def memcpy_async(self, dst: int, src: int, size: int, stream: int) -> None:
        if self.fail:
            raise CudaError(
                "cudaMemcpyAsync failed: an illegal memory access was encountered (cudaError 700)"
            )
        ctypes.memmove(dst, src, size)

    def stream_synchronize(self, stream: int) -> None:
        pass

    def free(self, pointer: int) -> None:
        pass


class Rig:
    """A store with a CPU tier of `cpu_pages` and one host-memory "GPU" pool of `gpu_pages`."""

    def __init__(self, tmp_path: Path, cpu_pages: int, gpu_pages: int) -> None:
        self.arena = Arena(tmp_path / "arena", cpu_pages * PAGE, prefault=False)
        self.pool_memory = ctypes.create_string_buffer(gpu_pages * PAGE)
        size = gpu_pages * PAGE
        pool = GpuPool(
            0,
            0,
            "0000:00:00.0",
            ctypes.addressof(self.pool_memory),
            size,
            bytes(64),
            SlabAllocator(size, size),
        )
        self.runtime = HostRuntime()
        self.gpu = GpuTier(self.runtime, [pool], self.arena, _address(self.arena), registered=False)  # type: ignore[arg-type]
        self.now = 1000.0
        self.store = Store(
            CpuTier(self.arena, cpu_pages * PAGE),
            make_policy("lru"),
            StoreSettings(lease_ttl_s=10.0, max_lease_ttl_s=60.0, pin_fraction=1.0),
            clock=lambda: self.now,
            gpu=self.gpu,
            gpu_policy=make_policy("lru"),
        )
        self.ns = self.store.connect(SPEC).id

    def close(self) -> None:
        assert_unplain_holds(self.store)  # what each test did to the pages kept `unplain` exact
        self.gpu.close()
        self.arena.close()

    def store_chain(self, first_token: int, chunks: int) -> list[bytes]:
        keys = chunk_keys(self.ns, list(range(first_token, first_token + chunks * 16)), 16)
        reserved = self.store.reserve(self.ns, keys)
        for key, offset in zip(keys, reserved.offsets, strict=True):
            self.store.cpu.write(offset, page_of(key))
        self.store.commit(self.ns, reserved.lease_id)
        return keys

    async def load(self, keys: list[bytes], pools: tuple[int, ...] = (0,), release: bool = True) -> Loaded:
        """A leased load: where Acquire says each page is, and its bytes read from there."""
        assert_unplain_holds(self.store)
        hit = self.store.lookup(self.ns, keys, lease=True, gpu_pools=pools)
        acquired = await self.store.acquire(self.ns, hit.lease_id)
        pages = [
            self.pool_memory.raw[offset : offset + PAGE]
            if tier == Tier.GPU
            else bytes(self.store.cpu.read(offset, PAGE))
            for offset, tier in zip(acquired.offsets, acquired.tiers, strict=True)
        ]
        if release:
            self.store.release(self.ns, hit.lease_id)
        return Loaded(acquired.tiers, pages, hit.lease_id)

    async def drain(self) -> None:
        """Waits for the copies in flight and their completions on the loop."""
        for _ in range(1000):
            if self.gpu.pending_copies == 0:
                await asyncio.sleep(0.01)
                if self.gpu.pending_copies == 0:
                    return
            await asyncio.sleep(0.005)
        raise TimeoutError("GPU tier copies did not finish")

    def usage(self) -> dict[str, tuple[int, int]]:
        """(pages, bytes used) per tier."""
        return {t.name: (t.pages, t.bytes_used) for t in self.store.stats().tiers}


class Loaded:
    def __init__(self, tiers: bytes, pages: list[bytes], lease_id: int) -> None:
        self.tiers = tiers
        self.pages = pages
        self.lease_id = lease_id


def page_of(key: bytes) -> bytes:
    return (key * (PAGE // len(key)))[:PAGE]


def tiers(*names: Tier) -> bytes:
    return bytes(names)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Callable[[int, int], Rig]]:
    made: list[Rig] = []

    def make(cpu_pages: int, gpu_pages: int) -> Rig:
        made.append(Rig(tmp_path / f"rig{len(made)}", cpu_pages, gpu_pages))
        return made[-1]

    (tmp_path / "rig0").mkdir()
    (tmp_path / "rig1").mkdir()
    yield make
    for r in made:
        r.close()


GPU, CPU = Tier.GPU, Tier.CPU


def test_pages_move_up_on_the_second_leased_hit_and_read_back_exactly(rig: Callable[[int, int], Rig]) -> None:
    async def scenario() -> None:
        r = rig(8, 8)
        keys = r.store_chain(0, 4)
        expected = [page_of(k) for k in keys]
        first = await r.load(keys)
        await r.drain()
        assert (first.tiers, first.pages) == (tiers(CPU, CPU, CPU, CPU), expected)
        assert r.usage() == {"gpu": (0, 0), "cpu": (4, 4 * PAGE)}
        second = await r.load(keys, release=False)  # the second hit: the pages move up
        assert (second.tiers, second.pages) == (tiers(CPU, CPU, CPU, CPU), expected)
        await r.drain()
        # Up, but the lease still reads the arena copies: they stay until it is released.
        assert r.usage() == {"gpu": (4, 4 * PAGE), "cpu": (0, 4 * PAGE)}
        r.store.release(r.ns, second.lease_id)
        assert r.usage() == {"gpu": (4, 4 * PAGE), "cpu": (0, 0)}
        assert r.store.lookup(r.ns, keys).tiers == tiers(GPU, GPU, GPU, GPU)
        third = await r.load(keys)
        assert (third.tiers, third.pages) == (tiers(GPU, GPU, GPU, GPU), expected)
        assert r.store.stats().counters["gpu_promoted_chunks"] == 4

    asyncio.run(scenario())


def test_a_full_gpu_tier_demotes_its_least_recent_pages_into_the_arena(
    rig: Callable[[int, int], Rig],
) -> None:
    async def scenario() -> None:
        r = rig(8, 2)
        a, b = r.store_chain(0, 2), r.store_chain(10_000, 2)
        for keys in (a, a, b, b):
            await r.load(keys)
            await r.drain()
        assert r.store.lookup(r.ns, a).tiers == tiers(CPU, CPU)
        assert r.store.lookup(r.ns, b).tiers == tiers(GPU, GPU)
        loaded_a, loaded_b = await r.load(a), await r.load(b)
        assert (loaded_a.tiers, loaded_a.pages) == (tiers(CPU, CPU), [page_of(k) for k in a])
        assert (loaded_b.tiers, loaded_b.pages) == (tiers(GPU, GPU), [page_of(k) for k in b])
        counters = r.store.stats().counters
        assert (counters["gpu_promoted_chunks"], counters["gpu_demoted_chunks"]) == (4, 2)
        assert r.usage() == {"gpu": (2, 2 * PAGE), "cpu": (2, 2 * PAGE)}

    asyncio.run(scenario())


def test_one_load_mixes_gpu_and_cpu_chunks(rig: Callable[[int, int], Rig]) -> None:
    async def scenario() -> None:
        r = rig(8, 8)
        keys = r.store_chain(0, 4)
        for _ in range(2):
            await r.load(keys[:2])
            await r.drain()
        loaded = await r.load(keys)
        assert (loaded.tiers, loaded.pages) == (tiers(GPU, GPU, CPU, CPU), [page_of(k) for k in keys])

    asyncio.run(scenario())


def test_a_reader_without_the_pool_gets_arena_copies_that_go_when_it_is_done(
    rig: Callable[[int, int], Rig],
) -> None:
    async def scenario() -> None:
        r = rig(8, 8)
        keys = r.store_chain(0, 3)
        for _ in range(2):
            await r.load(keys)
            await r.drain()
        assert r.usage() == {"gpu": (3, 3 * PAGE), "cpu": (0, 0)}
        loaded = await r.load(keys, pools=(), release=False)
        assert (loaded.tiers, loaded.pages) == (tiers(CPU, CPU, CPU), [page_of(k) for k in keys])
        assert r.usage()["cpu"] == (0, 3 * PAGE)
        r.store.release(r.ns, loaded.lease_id)
        assert r.usage() == {"gpu": (3, 3 * PAGE), "cpu": (0, 0)}
        assert r.store.stats().counters["gpu_copied_down_chunks"] == 3

    asyncio.run(scenario())


def test_a_pin_moves_the_chain_up_and_a_clear_frees_both_tiers(rig: Callable[[int, int], Rig]) -> None:
    async def scenario() -> None:
        r = rig(8, 8)
        keys = r.store_chain(0, 3)
        assert r.store.pin(r.ns, keys, ttl_s=60.0).pinned_chunks == 3
        await r.drain()
        loaded = await r.load(keys)
        assert (loaded.tiers, loaded.pages) == (tiers(GPU, GPU, GPU), [page_of(k) for k in keys])
        assert r.store.clear(r.ns) == 3
        assert r.usage() == {"gpu": (0, 0), "cpu": (0, 0)}
        assert r.store.lookup(r.ns, keys).hit_chunks == 0

    asyncio.run(scenario())


def test_an_expired_lease_frees_its_gpu_pages_for_demotion(rig: Callable[[int, int], Rig]) -> None:
    async def scenario() -> None:
        r = rig(8, 2)
        a, b = r.store_chain(0, 2), r.store_chain(10_000, 2)
        for _ in range(2):
            await r.load(a)
            await r.drain()
        held = await r.load(a, release=False)  # a worker that dies holding its lease
        assert held.tiers == tiers(GPU, GPU)
        for _ in range(2):
            await r.load(b)
            await r.drain()
        assert r.store.lookup(r.ns, b).tiers == tiers(CPU, CPU)  # no room: a is leased
        assert r.store.stats().counters["gpu_promotions_refused"] == 2
        r.now += 11.0
        assert r.store.expire() == 1
        await r.load(b)
        await r.drain()
        assert r.store.lookup(r.ns, b).tiers == tiers(GPU, GPU)
        loaded_a = await r.load(a)
        assert (loaded_a.tiers, loaded_a.pages) == (tiers(CPU, CPU), [page_of(k) for k in a])

    asyncio.run(scenario())


def test_a_failed_copy_up_leaves_the_pages_in_the_cpu_tier(rig: Callable[[int, int], Rig]) -> None:
    async def scenario() -> None:
        r = rig(8, 8)
        keys = r.store_chain(0, 2)
        r.runtime.fail = True
        for _ in range(2):
            await r.load(keys)
            await r.drain()
        assert r.store.stats().counters["gpu_copy_failures"] == 2
        assert r.usage() == {"gpu": (0, 0), "cpu": (2, 2 * PAGE)}
        loaded = await r.load(keys)
        assert (loaded.tiers, loaded.pages) == (tiers(CPU, CPU), [page_of(k) for k in keys])

    asyncio.run(scenario())


# -- CUDA: the real daemon's pools over CUDA IPC -----------------------------

CUDA_SPEC = KVSpec(
    model="gpu-tier",
    num_layers=4,
    num_kv_heads=2,
    head_dim=64,
    dtype=torch.bfloat16,
    block_size=16,
    chunk_tokens=16,
)
CUDA_PAGE = 16 * 4 * 2 * 2 * 64 * 2  # 32 KiB


def gpu_daemon(factory: Callable[..., Daemon], gpu_pages: int = 64, **overrides: Any) -> Daemon:
    size = f"{gpu_pages * CUDA_PAGE // 1024}KiB"
    return factory(
        chunk_tokens=16,
        tiers__gpu={"enabled": True, "bytes": size, "slab_bytes": size},
        **overrides,
    )


def cuda_cache(blocks: int, fill: float | None = None) -> list[torch.Tensor]:
    shape = (2, blocks, 16, 2, 64)
    if fill is None:
        return [torch.randn(shape, device="cuda").bfloat16() for _ in range(4)]
    return [torch.full(shape, fill, device="cuda", dtype=torch.bfloat16) for _ in range(4)]


def load_exact(client: KVStoreClient, tokens: list[int], source: list[torch.Tensor]) -> None:
    chunks = len(tokens) // 16
    target = cuda_cache(chunks + 4, fill=-7.0)
    blocks = list(range(4, chunks + 4))
    assert client.load(tokens, target, blocks) == len(tokens)
    for got, want in zip(target, source, strict=True):
        assert torch.equal(got[:, 4:], want[:, :chunks])
        assert bool((got[:, :4] == -7.0).all())  # nothing else written


def chunk_tiers(daemon: Daemon, client: KVStoreClient, tokens: list[int]) -> bytes:
    reply = daemon.stub().Lookup(
        pb.LookupRequest(namespace=client.namespace, keys=pack_keys(client.keys(tokens)))
    )
    return bytes(reply.tiers)


def wait_for(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.02)


@needs_cuda
def test_cuda_pages_move_up_and_load_from_the_pool_byte_exact(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = gpu_daemon(daemon_factory)
    assert "GPU tier:" in daemon.log()
    tokens = list(range(8 * 16))
    source = cuda_cache(8)
    with KVStoreClient.connect(daemon.address, CUDA_SPEC) as client:
        assert client._gpu_pools.readable(torch.device("cuda", torch.cuda.current_device())) == [0]
        assert client.store(tokens, source, list(range(8))) == 8
        load_exact(client, tokens, source)
        load_exact(client, tokens, source)  # second hit: up
        wait_for(lambda: chunk_tiers(daemon, client, tokens) == bytes([Tier.GPU]) * 8)
        load_exact(client, tokens, source)
        stats = client.stats()
    assert stats["tiers"]["gpu"]["pages"] == 8 and stats["tiers"]["cpu"]["bytes_used"] == 0
    assert stats["tiers"]["gpu"]["arena_registered"] == 1


@needs_cuda
def test_cuda_demotion_promotion_and_a_mixed_load(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = gpu_daemon(daemon_factory, gpu_pages=4)
    a, b = list(range(4 * 16)), list(range(10_000, 10_000 + 4 * 16))
    source_a, source_b = cuda_cache(4), cuda_cache(4)
    with KVStoreClient.connect(daemon.address, CUDA_SPEC) as client:
        client.store(a, source_a, list(range(4)))
        client.store(b, source_b, list(range(4)))
        for _ in range(2):
            load_exact(client, a[:32], source_a)
        wait_for(lambda: chunk_tiers(daemon, client, a) == bytes([Tier.GPU, Tier.GPU, Tier.CPU, Tier.CPU]))
        load_exact(client, a, source_a)  # a mixed load: 2 chunks from the pool, 2 from the arena
        for _ in range(2):
            load_exact(client, b, source_b)  # b moves up: a's pages move down
        wait_for(lambda: chunk_tiers(daemon, client, b) == bytes([Tier.GPU]) * 4)
        assert chunk_tiers(daemon, client, a) == bytes([Tier.CPU]) * 4
        counters = client.stats()["counters"]
        assert counters["gpu_demoted_chunks"] == 2 and counters["gpu_promoted_chunks"] == 6
        load_exact(client, a, source_a)
        load_exact(client, b, source_b)


@needs_cuda
def test_cuda_a_pinned_chain_moves_up(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = gpu_daemon(daemon_factory)
    tokens, source = list(range(4 * 16)), cuda_cache(4)
    with KVStoreClient.connect(daemon.address, CUDA_SPEC) as client:
        client.store(tokens, source, list(range(4)))
        pin = pb.PinRequest(namespace=client.namespace, keys=pack_keys(client.keys(tokens)), ttl_ms=60_000)
        assert daemon.stub().Pin(pin).pinned_chunks == 4
        wait_for(lambda: chunk_tiers(daemon, client, tokens) == bytes([Tier.GPU]) * 4)
        load_exact(client, tokens, source)


WORKER = textwrap.dedent(
    """
    import sys, time, torch
    from tests.test_gpu_tier import CUDA_SPEC, cuda_cache
    from kvstore_client import KVStoreClient
    client = KVStoreClient.connect(sys.argv[1], CUDA_SPEC)
    tokens = list(range(8 * 16))
    handle = client.load_async(tokens, cuda_cache(8, fill=0.0), list(range(8)))
    print("loading", handle.tokens, flush=True)
    time.sleep(600)
    """
)


@needs_cuda
def test_cuda_a_worker_killed_mid_load_leaves_nothing_after_its_ttl(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = gpu_daemon(daemon_factory, leases={"ttl_s": 1.0, "reap_interval_s": 0.05})
    tokens, source = list(range(8 * 16)), cuda_cache(8)
    with KVStoreClient.connect(daemon.address, CUDA_SPEC) as client:
        client.store(tokens, source, list(range(8)))
        for _ in range(2):
            load_exact(client, tokens, source)
        wait_for(lambda: chunk_tiers(daemon, client, tokens) == bytes([Tier.GPU]) * 8)
        worker = subprocess.Popen(
            [sys.executable, "-c", WORKER, daemon.address], stdout=subprocess.PIPE, env=python_env()
        )
        try:
            assert worker.stdout is not None
            assert worker.stdout.readline().split() == [b"loading", b"128"]
            assert client.stats()["counters"]["active_load_leases"] == 1
            worker.send_signal(signal.SIGKILL)
            assert worker.wait(10) == -signal.SIGKILL
        finally:
            worker.kill()
        load_exact(client, tokens, source)  # the daemon serves on meanwhile
        wait_for(lambda: client.stats()["counters"]["active_load_leases"] == 0)
        assert client.stats()["counters"]["expired_leases"] == 1
        load_exact(client, tokens, source)
    assert daemon.process.poll() is None
