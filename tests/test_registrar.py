"""Registering the arena slab by slab in the background: the order, a transfer's wait for exactly
its slabs, the unpinned path when they are not ready, and the client's counters; through a
registrar that records what it pins and registers only when the test lets it. Faulting slabs in
ahead of need: the order, the threads working at once, and that they work while transfers keep
coming; one mapping per process for every client of an arena."""

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
        self.faulted: list[int] = []
        self.taken: list[int] = []  # registrations begun, permitted or not
        self._permits = threading.Semaphore(0)

    def fault(self, address: int, size: int) -> None:
        self.faulted.append((address - self.base) // self.slab_bytes)

    def allow(self, count: int) -> None:
        for _ in range(count):
            self._permits.release()

    def register(self, address: int, size: int) -> None:
        slab = (address - self.base) // self.slab_bytes
        self.taken.append(slab)
        self._permits.acquire(timeout=30)  # a failed test must not hang the client's close
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


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def until_waiting(registrar: SlabRegistrar | None) -> None:
    """Returns once a transfer waits for slabs."""
    deadline = time.monotonic() + 30
    while registrar is None or not registrar.stats()["transfers_waiting"]:
        assert time.monotonic() < deadline, "no transfer came to wait"
        time.sleep(0.005)


def test_slabs_are_registered_in_order_and_a_waiter_goes_first() -> None:
    host = GatedRegistrar(base=1 << 30, slab_bytes=SLAB)
    registrar = SlabRegistrar(host, 1 << 30, 8 * SLAB - 4096, SLAB, fault=host.fault)  # the last is short
    until(lambda: host.taken == [0], "slab 0 was not taken first")
    thread, ready = in_thread(lambda: registrar.ready({0, 5}, wait_s=30.0))
    until_waiting(registrar)
    host.allow(2)  # slab 0 (already taken in order), then the one the transfer waits for
    thread.join(10)
    assert ready == [True]
    assert host.order == [0, 5]
    assert registrar.stats() | {"wait_s": 0, "slabs_faulted": 0} == {  # faulting: tests below
        "slabs": 8,
        "slabs_faulted": 0,
        "slabs_registered": 2,
        "slabs_failed": 0,
        "slabs_pending": 6,
        "transfers_waiting": 0,
        "transfers_waited": 1,
        "wait_s": 0,
        "transfers_unpinned": 0,
        "transfers_bounced": 0,
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
    registrar = SlabRegistrar(host, 0, 4 * SLAB, SLAB, fault=host.fault)
    until(lambda: host.taken == [0], "slab 0 was not taken first")
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
    than quiet_s apart (and with no duty share), only the slabs they need are registered; the rest
    follow once they pause."""
    host = GatedRegistrar(base=0, slab_bytes=SLAB)
    registrar = SlabRegistrar(host, 0, 6 * SLAB, SLAB, quiet_s=0.3, fault=host.fault, duty=0.0)
    until(lambda: host.taken == [0], "slab 0 was not taken first")
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


class TimedRegistrar:
    """Registrations that take `seconds` each, with their start and end times."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.spans: list[tuple[float, float]] = []

    def register(self, address: int, size: int) -> None:
        started = time.perf_counter()
        time.sleep(self.seconds)
        self.spans.append((started, time.perf_counter()))

    def unregister(self, address: int) -> None:
        pass


def test_while_transfers_keep_coming_slabs_are_registered_within_the_duty_share() -> None:
    """A worker that never pauses still gets its arena registered: a slab no transfer asked for
    at most every d * (1 - duty) / duty seconds after a registration of d seconds."""
    host = TimedRegistrar(0.02)
    registrar = SlabRegistrar(
        host, 0, 64 * SLAB, SLAB, quiet_s=0.3, faulters=0, fault=lambda a, s: None, duty=0.25
    )
    registrar.registered_now({0})  # transfers from the start: no full-speed registration
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        registrar.registered_now({0})  # a bounced transfer every 10 ms
        time.sleep(0.01)
    spans = list(host.spans)  # the transfers' pause (quiet_s) has not begun yet
    registered = registrar.stats()["slabs_registered"]
    assert 2 <= registered < 64, registered
    for (started, ended), (next_started, _) in zip(spans, spans[1:], strict=False):
        assert next_started - ended >= 3 * (ended - started) * 0.99, (next_started - ended, ended - started)
    assert registrar.ready(range(64), wait_s=30.0)  # they pause: the rest go at full speed
    registrar.stop()


def test_once_every_slab_is_registered_the_callback_waits_for_a_pause_on_the_registration_thread() -> None:
    """What is undone once the arena is registered (the bounce ring's unpinning holds the driver
    as a registration does) runs on the registration thread, and only once transfers pause."""
    host = GatedRegistrar(base=0, slab_bytes=SLAB)
    registrar = SlabRegistrar(host, 0, 3 * SLAB, SLAB, quiet_s=0.3, fault=host.fault, duty=0.0)
    ran: list[str] = []
    registrar.after_registered(lambda: ran.append(threading.current_thread().name))
    registrar.registered_now({0})  # a transfer: the pause begins later
    host.allow(3)
    assert registrar.ready(range(3), wait_s=30.0)
    stop = time.monotonic() + 0.9
    while time.monotonic() < stop:  # transfers every 50 ms, less than quiet_s apart
        assert registrar.registered_now({1})
        assert ran == []
        time.sleep(0.05)
    until(lambda: ran == ["kvstore-register"], "the callback did not run once the transfers paused")
    registrar.after_registered(lambda: ran.append("later"))  # added after: run at the next pause
    until(lambda: ran == ["kvstore-register", "later"], "a callback added later did not run")
    registrar.stop()


def test_a_registrar_stopped_before_its_slabs_are_registered_runs_no_callback() -> None:
    host = GatedRegistrar(base=0, slab_bytes=SLAB)
    registrar = SlabRegistrar(host, 0, 3 * SLAB, SLAB, quiet_s=0.0, fault=host.fault, duty=0.0)
    ran: list[int] = []
    registrar.after_registered(lambda: ran.append(1))
    host.allow(1)
    until(lambda: registrar.stats()["slabs_registered"] == 1, "slab 0 was not registered")
    host.allow(1)  # the slab in progress ends; stop() takes no more
    registrar.stop()
    assert ran == []


def test_populating_a_shared_mapping_keeps_its_bytes(tmp_path: Any) -> None:
    import mmap
    import os

    from kvstore_client.faulting import populate

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
    registrar = SlabRegistrar(host, 0, 3 * SLAB, 0, fault=host.fault)
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


class GatedFaults:
    """A `fault` that records the slabs it is asked for, in order, and how many are in progress at
    once; each waits until the test allows that slab."""

    def __init__(self, base: int, slab_bytes: int) -> None:
        self.base, self.slab_bytes = base, slab_bytes
        self.started: list[int] = []
        self.most_at_once = 0
        self._at_once = 0
        self._lock = threading.Lock()
        self._allowed: dict[int, threading.Event] = {}

    def _gate(self, slab: int) -> threading.Event:
        with self._lock:
            return self._allowed.setdefault(slab, threading.Event())

    def allow(self, *slabs: int) -> None:
        for slab in slabs:
            self._gate(slab).set()

    def __call__(self, address: int, size: int) -> None:
        slab = (address - self.base) // self.slab_bytes
        with self._lock:
            self.started.append(slab)
            self._at_once += 1
            self.most_at_once = max(self.most_at_once, self._at_once)
        self._gate(slab).wait(30)
        with self._lock:
            self._at_once -= 1

    def until_started(self, count: int) -> None:
        deadline = time.monotonic() + 30
        while len(self.started) < count:
            assert time.monotonic() < deadline, f"only {self.started} started"
            time.sleep(0.002)


def test_slabs_are_faulted_in_ahead_in_order_on_parallel_threads_while_transfers_keep_coming() -> None:
    host = GatedRegistrar(base=0, slab_bytes=SLAB)
    faults = GatedFaults(base=0, slab_bytes=SLAB)
    registrar = SlabRegistrar(host, 0, 8 * SLAB, SLAB, quiet_s=0.3, faulters=3, fault=faults, duty=0.0)
    faults.until_started(3)  # three threads at once, on the first three slabs handed out
    assert sorted(faults.started) == [0, 1, 2] and faults.most_at_once == 3
    # A transfer needs slabs 0 and 6: 0 is a faulter's already, 6 is faulted in by the registration
    # thread itself rather than after the faulters' queue.
    thread, ready = in_thread(lambda: registrar.ready({0, 6}, wait_s=30.0))
    faults.until_started(4)
    assert faults.started[3] == 6 and faults.most_at_once == 4
    faults.allow(6, 0)
    host.allow(2)
    thread.join(10)
    assert ready == [True] and host.order == [6, 0]
    # Transfers keep coming every 50 ms, less than quiet_s apart: the faulting goes on, in order,
    # the registration of slabs no transfer asked for does not (no duty share here).
    host.allow(6)
    faults.until_started(5)
    assert faults.started[4] == 3  # the thread that had slab 0 goes on with the next one
    for slab, then in [(1, 4), (2, 5), (3, 7)]:
        faults.allow(slab)
        faults.until_started(len(faults.started) + 1)
        assert faults.started[-1] == then
        assert registrar.ready({0, 6}, wait_s=0.0)
    faults.allow(4, 5, 7)
    until(lambda: registrar.stats()["slabs_faulted"] == 8, "not every slab was faulted in")
    for _ in range(8):
        assert registrar.ready({0, 6}, wait_s=0.0)
        assert host.order == [6, 0]
        time.sleep(0.05)
    assert faults.started[4:] == [3, 4, 5, 7] and len(faults.started) == 8  # each slab faulted once
    assert registrar.ready(range(8), wait_s=30.0)  # the transfers paused: the rest in order
    assert host.order == [6, 0, 1, 2, 3, 4, 5, 7]
    registrar.stop()
    assert sorted(host.unregistered) == list(range(8))


def test_a_slab_a_transfer_needs_waits_for_the_faulter_that_has_it_not_for_the_queue() -> None:
    host = GatedRegistrar(base=0, slab_bytes=SLAB)
    faults = GatedFaults(base=0, slab_bytes=SLAB)
    registrar = SlabRegistrar(host, 0, 4 * SLAB, SLAB, faulters=1, fault=faults)
    faults.until_started(1)  # the faulter is on slab 0
    thread, ready = in_thread(lambda: registrar.ready({0}, wait_s=30.0))
    until_waiting(registrar)
    host.allow(4)
    assert faults.started == [0]  # the registration thread waits for the faulter: no second fault
    faults.allow(0, 1, 2, 3)
    thread.join(10)
    assert ready == [True]
    assert registrar.ready(range(4), wait_s=30.0)
    assert sorted(faults.started) == [0, 1, 2, 3] and host.order == [0, 1, 2, 3]
    registrar.stop()


def test_a_client_faults_its_arena_in_ahead_of_its_transfers_and_every_byte_is_right(
    small_slabs: Daemon,
) -> None:
    """The real faulting (MADV_POPULATE_WRITE, or reading where the kernel refuses it) on the
    daemon's arena: every slab faulted in while the transfers come, pages stored before and
    after it loaded byte-exact."""
    spec = make_spec()
    source = random_cache(spec, 256, seed=41)
    prompts = [tokens_of(8 * 256, seed=42 + i) for i in range(3)]
    blocks = [torch.arange(i * 128, (i + 1) * 128) % 256 for i in range(3)]
    client, host = gated_client(small_slabs)
    with client:
        assert client.store(prompts[0], source, blocks[0]) == 8  # before any faulting
        client._mapped.start_registrar(host, faulters=2)
        registrar = client._mapped.registrar
        assert registrar is not None
        host.allow(16)
        assert client.store(prompts[1], source, blocks[1]) == 8
        until(lambda: registrar.stats()["slabs_faulted"] == 16, "the arena was not faulted in")
        assert client.store(prompts[2], source, blocks[2]) == 8
        for prompt, prompt_blocks in zip(prompts, blocks, strict=True):
            target = empty_cache(spec, 128)
            target_blocks = torch.randperm(128, generator=torch.Generator().manual_seed(43))
            assert client.load(prompt, target, target_blocks) == 8 * 256
            assert_blocks_equal(target, target_blocks, source, prompt_blocks)
        assert client.stats()["client"]["arena"]["transfers_unpinned"] == 0


def test_clients_of_one_process_share_one_mapping_and_its_registration(small_slabs: Daemon) -> None:
    """A second pinned mapping of a large arena cannot pin on the GPU hosts (the driver counts each
    registration in full): clients of one process share the first."""
    spec = make_spec()
    source = random_cache(spec, 128, seed=51)
    tokens = tokens_of(8 * 256, seed=52)
    blocks = torch.randperm(128, generator=torch.Generator().manual_seed(53))
    first, host = gated_client(small_slabs)
    second = KVStoreClient.connect(small_slabs.address, spec, shared_memory=True, pin_arena=False)
    try:
        assert first.arena is not None and second.arena is not None
        assert first.arena.data_ptr() == second.arena.data_ptr()  # one mapping
        first._mapped.start_registrar(host)
        assert second._mapped.registrar is first._mapped.registrar  # one registration
        host.allow(16)
        assert first.store(tokens, source, blocks) == 8
        first.close()
        assert host.unregistered == []  # the second client still uses it
        target = empty_cache(spec, 128)
        assert second.load(tokens, target, blocks) == 8 * 256
        assert_blocks_equal(target, blocks, source, blocks)
        assert second.stats()["client"]["arena"]["slabs_failed"] == 0
    finally:
        first.close()
        second.close()
    assert sorted(host.unregistered) == sorted(set(host.order))  # the last user ends it
