"""Reserving the arena's memory slab by slab after the daemon serves: the order, slabs handed to
the allocator only once reserved, a reservation that fails, and a real daemon that serves a
store and a load while it reserves, every byte right."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest
import torch

from kvstore.tiers.reserve import ArenaReserver
from kvstore_client import KVStoreClient
from tests.harness import Daemon
from tests.test_client import assert_blocks_equal, empty_cache, make_spec, random_cache, tokens_of

SLAB = 1 << 20


class SlowShm:
    """Records each reservation; waits `delay_s` in each, and fails from slab `full_at` on."""

    def __init__(self, delay_s: float = 0.0, full_at: int | None = None) -> None:
        self.delay_s, self.full_at = delay_s, full_at
        self.reserved: list[int] = []
        self.handed: list[int] = []  # what the allocator was given, each time
        self.lock = threading.Lock()

    def reserve(self, start: int, length: int) -> None:
        assert length == SLAB
        time.sleep(self.delay_s)
        if self.full_at is not None and start // SLAB >= self.full_at:
            raise OSError(28, "tiers.cpu.bytes: cannot reserve 1048576 bytes: No space left on device")
        with self.lock:
            self.reserved.append(start // SLAB)

    def on_reserved(self, count: int) -> None:
        with self.lock:
            assert sum(self.handed) + count <= len(self.reserved), "a slab handed out before reserved"
            self.handed.append(count)


def wait_for(done: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_slabs_are_reserved_in_order_and_handed_out_once_reserved() -> None:
    shm = SlowShm(delay_s=0.01)
    reserver = ArenaReserver(shm.reserve, SLAB, 12, 1, shm.on_reserved, "arena test")
    wait_for(lambda: reserver.done)
    reserver.stop()
    assert shm.reserved == list(range(1, 12))  # slab 0 was reserved before serving
    assert sum(shm.handed) == 11 and len(shm.handed) > 1  # in runs, as they became reserved
    assert reserver.failure is None and reserver.num_reserved == 12


def test_a_full_shm_stops_the_reservation_with_an_error(caplog: pytest.LogCaptureFixture) -> None:
    shm = SlowShm(full_at=5)
    with caplog.at_level(logging.ERROR, logger="kvstore.tiers.reserve"):
        reserver = ArenaReserver(shm.reserve, SLAB, 12, 2, shm.on_reserved, "arena test")
        wait_for(lambda: reserver.done)
        reserver.stop()
    assert shm.reserved == [2, 3, 4] and sum(shm.handed) == 3
    assert reserver.num_reserved == 5 and reserver.failure is not None
    assert "No space left on device" in reserver.failure
    assert "arena test: only 5 of 12 slabs could be reserved" in caplog.text


def test_stop_ends_the_reservation_after_the_slab_in_progress() -> None:
    shm = SlowShm(delay_s=0.05)
    reserver = ArenaReserver(shm.reserve, SLAB, 1000, 1, shm.on_reserved, "arena test")
    time.sleep(0.12)
    reserver.stop()
    assert 1 <= len(shm.reserved) < 10 and sum(shm.handed) == len(shm.reserved)


def test_the_daemon_serves_while_it_reserves_and_every_byte_is_right(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = daemon_factory(tiers__cpu={"bytes": "64MiB", "slab_bytes": "1MiB"})
    spec = make_spec()
    source = random_cache(spec, 128, seed=41)
    tokens = tokens_of(8 * 256, seed=42)
    blocks = torch.randperm(128, generator=torch.Generator().manual_seed(43))
    with KVStoreClient.connect(daemon.address, spec) as client:
        assert client.store(tokens, source, blocks) == 8
        target = empty_cache(spec, 128)
        assert client.load(tokens, target, blocks.flip(0)) == 8 * 256
        assert_blocks_equal(target, blocks.flip(0), source, blocks)
        wait_for(lambda: client.stats()["counters"]["arena_reserved_bytes"] == 64 * SLAB)
    wait_for(lambda: "all 64 slabs reserved" in daemon.log())
