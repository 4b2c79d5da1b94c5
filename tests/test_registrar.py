"""Registering the arena slab by slab in the background: the order, a transfer's wait for exactly
its slabs, the unpinned path when they are not ready, and the client's counters; through a
registrar that records what it pins and registers only when the test lets it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvstore_client import KVStoreClient
from kvstore_client.registrar import SlabRegistrar
from tests.harness import Daemon
from tests.test_client import assert_blocks_equal, empty_cache, make_spec, random_cache, tokens_of

SLAB = 1 << 20  # the daemon's slab_bytes below: 4 pages of make_spec() (256 KiB) each


class GatedRegistrar:
    """Records the slabs it registers, in order; each registration waits for a permit (`allow`),
    and those of slabs in `failing` raise."""

    def __init__(self, base: int, slab_bytes: int, failing: frozenset[int] = frozenset()) -> None:
        self.base, self.slab_bytes, self.failing = base, slab_bytes, failing
        self.order: list[int] = []
        self.unregistered: list[int] = []
        self.sizes: list[int] = []
        self._permits = threading.Semaphore(0)

    def allow(self, count: int) -> None:
        for _ in range(count):
            self._permits.release()

    def register(self, address: int, size: int) -> None:
        self._permits.acquire(timeout=30)  # a failed test must not hang the client's close
        slab = (address - self.base) // self.slab_bytes
        if slab in self.failing:
            raise RuntimeError("cudaHostRegister failed: out of memory")
        self.order.append(slab)
        self.sizes.append(size)

    def unregister(self, address: int) -> None:
        self.unregistered.append((address - self.base) // self.slab_bytes)


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(call()))
    thread.start()
    return thread, result


def until_waiting(registrar: SlabRegistrar | None) -> None:
    """Returns once a transfer waits for slabs."""
    deadline = time.monotonic() + 30
    while registrar is None or not registrar.stats()["transfers_waiting"]:
        assert time.monotonic() < deadline, "no transfer came to wait"
        time.sleep(0.005)


def test_slabs_are_registered_in_order_and_a_waiter_goes_first() -> None:
    host = GatedRegistrar(base=1 << 30, slab_bytes=SLAB)
    registrar = SlabRegistrar(host, 1 << 30, 8 * SLAB - 4096, SLAB)  # the last slab is short
    thread, ready = in_thread(lambda: registrar.ready({0, 5}, wait_s=30.0))
    until_waiting(registrar)
    host.allow(2)  # slab 0 (already taken in order), then the one the transfer waits for
    thread.join(10)
    assert ready == [True]
    assert host.order == [0, 5]
    assert registrar.stats() | {"wait_s": 0} == {
        "slabs": 8,
        "slabs_registered": 2,
        "slabs_failed": 0,
        "slabs_pending": 6,
        "transfers_waiting": 0,
        "transfers_waited": 1,
        "wait_s": 0,
        "transfers_unpinned": 0,
    }
    assert registrar.stats()["wait_s"] > 0
    assert registrar.ready({5}, wait_s=0.0)  # registered: no wait counted
    host.allow(6)
    assert registrar.ready(range(8), wait_s=30.0)
    assert host.order == [0, 5, 1, 2, 3, 4, 6, 7]
    assert host.sizes == [SLAB] * 7 + [SLAB - 4096]
    registrar.stop()
    assert sorted(host.unregistered) == list(range(8))
    assert registrar.stats()["transfers_waited"] == 2


def test_a_slab_not_ready_in_time_or_failed_sends_the_transfer_unpinned() -> None:
    host = GatedRegistrar(base=0, slab_bytes=SLAB, failing=frozenset({1}))
    registrar = SlabRegistrar(host, 0, 4 * SLAB, SLAB)
    assert not registrar.ready({2}, wait_s=0.05)  # slab 0 is still being registered
    host.allow(2)  # slab 0, then slab 2 (asked for), both pinned
    assert registrar.ready({0, 2}, wait_s=30.0)
    host.allow(1)  # slab 1 fails
    assert not registrar.ready({1}, wait_s=30.0)
    assert not registrar.ready({1, 2}, wait_s=30.0)  # failed: no wait at all
    stats = registrar.stats()
    assert (stats["slabs_registered"], stats["slabs_failed"], stats["slabs_pending"]) == (2, 1, 1)
    assert (stats["transfers_waited"], stats["transfers_unpinned"]) == (1, 3)
    host.allow(1)
    assert registrar.ready({3}, wait_s=30.0)
    registrar.stop()
    assert host.order == [0, 2, 3] and sorted(host.unregistered) == [0, 2, 3]


def test_slabs_no_transfer_asked_for_wait_while_transfers_keep_coming() -> None:
    """The driver serialises registrations with the worker's transfers: while transfers come less
    than quiet_s apart, only the slabs they need are registered; the rest follow once they pause."""
    host = GatedRegistrar(base=0, slab_bytes=SLAB)
    registrar = SlabRegistrar(host, 0, 6 * SLAB, SLAB, quiet_s=0.3)
    thread, ready = in_thread(lambda: registrar.ready({0}, wait_s=30.0))  # slab 0 is in progress
    until_waiting(registrar)
    host.allow(1)
    thread.join(10)
    assert ready == [True]
    host.allow(5)  # permits for every other slab: only the pause holds them back now
    stop = time.monotonic() + 0.9
    while time.monotonic() < stop:
        assert registrar.ready({0}, wait_s=0.0)  # a transfer every 50 ms
        assert host.order == [0]
        time.sleep(0.05)
    assert registrar.ready({4}, wait_s=30.0)  # one a transfer needs goes at once
    assert host.order == [0, 4]
    assert registrar.ready(range(6), wait_s=30.0)  # this one waits for the rest: they go now
    assert host.order == [0, 4, 1, 2, 3, 5]
    registrar.stop()


def test_populating_a_shared_mapping_keeps_its_bytes(tmp_path: Any) -> None:
    import mmap
    import os

    from kvstore_client.registrar import populate

    data = os.urandom(4 * SLAB)
    path = tmp_path / "arena"
    path.write_bytes(data)
    with path.open("r+b") as file:
        mapping = mmap.mmap(file.fileno(), len(data), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    view = torch.frombuffer(mapping, dtype=torch.uint8)
    done = populate(view.data_ptr() + SLAB, 2 * SLAB)  # False on a kernel before 5.14
    assert isinstance(done, bool)
    assert bytes(mapping) == data
    del view
    mapping.close()


def test_an_arena_of_one_slab_when_the_daemon_names_none() -> None:
    host = GatedRegistrar(base=0, slab_bytes=3 * SLAB)
    registrar = SlabRegistrar(host, 0, 3 * SLAB, 0)
    host.allow(1)
    assert registrar.ready(registrar.slabs_of([0, 2 * SLAB + 4096]), wait_s=30.0)
    assert host.sizes == [3 * SLAB] and registrar.stats()["slabs"] == 1
    registrar.stop()


@pytest.fixture
def small_slabs(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory(tiers__cpu={"bytes": "16MiB", "slab_bytes": "1MiB"})


def gated_client(
    daemon: Daemon, failing: frozenset[int] = frozenset()
) -> tuple[KVStoreClient, GatedRegistrar]:
    client = KVStoreClient.connect(daemon.address, make_spec(), shared_memory=True, pin_arena=False)
    mapped = client._mapped
    assert mapped.tensor is not None and mapped.slab_bytes == SLAB
    host = GatedRegistrar(mapped.tensor.data_ptr(), SLAB, failing)
    return client, host


def test_a_store_waits_for_exactly_its_slab_and_every_byte_is_right(small_slabs: Daemon) -> None:
    spec = make_spec()
    source = random_cache(spec, 300, seed=21)
    first, second = tokens_of(16 * 256, seed=22), tokens_of(4 * 256, seed=23)
    first_blocks, second_blocks = torch.arange(0, 256), torch.arange(256, 300).repeat(2)[:64]
    client, host = gated_client(small_slabs)
    with client:
        assert client.store(first, source, first_blocks) == 16  # slabs 0-3, nothing registered yet
        client._mapped.start_registrar(host)
        thread, stored = in_thread(lambda: client.store(second, source, second_blocks))
        until_waiting(client._mapped.registrar)
        host.allow(2)  # slab 0, in progress when the store asked, then the store's slab 4
        thread.join(30)
        assert stored == [4]
        assert host.order == [0, 4]
        arena = client.stats()["client"]["arena"]
        assert (arena["slabs_registered"], arena["slabs_pending"], arena["slabs"]) == (2, 14, 16)
        assert (arena["transfers_waited"], arena["transfers_unpinned"]) == (1, 0)
        target = empty_cache(spec, 64)
        target_blocks = torch.randperm(64, generator=torch.Generator().manual_seed(24))
        assert client.load(second, target, target_blocks) == 4 * 256  # slabs 0 and 4: no wait
        assert_blocks_equal(target, target_blocks, source, second_blocks)
        assert client.stats()["client"]["arena"]["transfers_waited"] == 1
        host.allow(14)
        assert client._mapped.registrar is not None and client._mapped.registrar.ready(range(16), 30.0)
    assert sorted(host.unregistered) == list(range(16))  # close unregisters every slab


def test_pages_in_slabs_not_registered_move_unpinned_and_every_byte_is_right(small_slabs: Daemon) -> None:
    spec = make_spec()
    source = random_cache(spec, 128, seed=31)
    tokens = tokens_of(8 * 256, seed=32)
    blocks = torch.randperm(128, generator=torch.Generator().manual_seed(33))
    client, host = gated_client(small_slabs, failing=frozenset({1}))
    with client:
        client._mapped.start_registrar(host)
        client._mapped.wait_s = 0.05  # slab 0 stays in progress: nothing is ready in time
        assert client.store(tokens, source, blocks) == 8  # slabs 0 and 1
        host.allow(2)  # slab 0 pinned, slab 1 fails
        client._mapped.wait_s = 30.0
        target = empty_cache(spec, 128)
        target_blocks = torch.randperm(128, generator=torch.Generator().manual_seed(34))
        assert client.load(tokens, target, target_blocks) == 8 * 256  # slab 1 failed: unpinned
        assert_blocks_equal(target, target_blocks, source, blocks)
        arena = client.stats()["client"]["arena"]
        assert (arena["transfers_waited"], arena["transfers_unpinned"]) == (0, 2)
        assert (arena["slabs_registered"], arena["slabs_failed"]) == (1, 1)
        first_half = empty_cache(spec, 128)
        assert client.load(tokens[:1024], first_half, target_blocks) == 1024  # slab 0 only: pinned
        assert_blocks_equal(first_half, target_blocks[:64], source, blocks[:64])
        assert client.stats()["client"]["arena"]["transfers_unpinned"] == 2
        host.allow(14)
