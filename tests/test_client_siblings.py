"""Siblings: one worker's clients for several namespaces over one connection and one arena.

A hybrid model has one namespace per KV-cache group. Its clients (`KVStoreClient.sibling`) share
the connection, the local channel, the mapped arena and its registration, against the real
daemon:

- three siblings of different layer counts, page and chunk sizes store and load byte for byte,
  through one mapping of the arena;
- the registrar pins each slab once for all of them, and unpins them when the last one closes;
  closing one sibling leaves the others working, and a sibling the daemon refuses leaves the
  others as they were;
- a restart (SIGTERM, SIGKILL) while they store and load: no exception out of a public call, no
  wrong byte, the new arena mapped once and every sibling served again; the first call after it
  connects every sibling's namespace.
"""

from __future__ import annotations

import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.keys import pack_keys
from kvstore_client import KVSpec, KVStoreClient
from kvstore_client.arena import MappedArena
from kvstore_client.registrar import HostRegistrar
from tests.harness import Daemon, start_daemon
from tests.test_client import tokens_of

BLOCK = 16
TOKENS = 512  # 32 blocks of every spec below
BLOCKS = TOKENS // BLOCK
POISON = -5.0
SERVE_AGAIN_S = 30.0  # generous: a 2-core machine starts a daemon while the worker thread runs


def specs() -> list[KVSpec]:
    """Three KV-cache groups: other layer counts, heads, head dims, dtypes and chunk sizes."""
    return [
        KVSpec(model="full", num_layers=4, num_kv_heads=2, head_dim=32, dtype=torch.float16,
               block_size=BLOCK, layout="flash_attn"),  # the daemon's 256-token chunks: 256 KiB pages
        KVSpec(model="window", num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16,
               block_size=BLOCK, layout="flash_attn", chunk_tokens=64),  # 64 KiB pages
        KVSpec(model="latent", num_layers=6, num_kv_heads=1, head_dim=32, dtype=torch.bfloat16,
               block_size=BLOCK, layout="flash_attn", chunk_tokens=128),  # 96 KiB pages
    ]  # fmt: skip


def cache_of(spec: KVSpec, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, BLOCKS, BLOCK, spec.num_kv_heads, spec.head_dim)
    return [torch.randn(shape, generator=gen).to(getattr(torch, spec.dtype)) for _ in range(spec.num_layers)]


def poisoned(spec: KVSpec) -> list[torch.Tensor]:
    shape = (2, BLOCKS, BLOCK, spec.num_kv_heads, spec.head_dim)
    return [torch.full(shape, POISON, dtype=getattr(torch, spec.dtype)) for _ in range(spec.num_layers)]


def wrong_blocks(
    target: list[torch.Tensor],
    source: list[torch.Tensor],
    table: torch.Tensor,
    valid_tokens: int,
    moved_tokens: int,
) -> list[str]:
    """Every byte checked: the blocks reported valid hold the source's, the blocks the load did not
    move still hold the poison (those it moved but did not report valid may hold anything)."""
    valid, moved = -(-valid_tokens // BLOCK), -(-moved_tokens // BLOCK)
    problems = []
    for layer, (got, want) in enumerate(zip(target, source, strict=True)):
        poison = torch.full_like(want[:, 0], POISON).view(torch.uint8)
        for block in range(BLOCKS):
            if valid <= block < moved:
                continue
            expected = want[:, block].view(torch.uint8) if block < valid else poison
            if not torch.equal(got[:, int(table[block])].view(torch.uint8), expected):
                problems.append(f"layer {layer} block {block} ({'loaded' if block < valid else 'poison'})")
    return problems


def load_checked(client: KVStoreClient, tokens: list[int], source: list[torch.Tensor], seed: int) -> int:
    """Loads `tokens` into a poisoned cache through a shuffled block table; asserts every byte."""
    target = poisoned(client.spec)
    table = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(seed))
    handle = client.load_async(tokens, target, table)
    loaded = handle.wait()
    assert wrong_blocks(target, source, table, loaded, handle.tokens) == []
    return loaded


class RecordingRegistrar:
    """Pins nothing; records the slabs it is asked to register and unregister, and registers at once."""

    made: list[RecordingRegistrar] = []

    def __init__(self, mapped: MappedArena) -> None:
        assert mapped.tensor is not None
        self.base, self.slab_bytes = mapped.tensor.data_ptr(), mapped.slab_bytes
        self.registered: list[int] = []
        self.unregistered: list[int] = []
        RecordingRegistrar.made.append(self)

    def register(self, address: int, size: int) -> None:
        self.registered.append((address - self.base) // self.slab_bytes)

    def unregister(self, address: int) -> None:
        self.unregistered.append((address - self.base) // self.slab_bytes)


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> list[RecordingRegistrar]:
    """Every arena a client maps is registered with a `RecordingRegistrar` (as with CUDA on a GPU host)."""
    made: list[RecordingRegistrar] = []
    monkeypatch.setattr(RecordingRegistrar, "made", made)

    def host_registrar(self: MappedArena) -> HostRegistrar | None:
        return None if self.pin is False else RecordingRegistrar(self)

    monkeypatch.setattr(MappedArena, "host_registrar", host_registrar)
    return made


@pytest.fixture
def maps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the arena mappings made (one entry, the mapping's address, per map that mapped)."""
    made: list[int] = []
    original = MappedArena.map

    def counted(self: MappedArena, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self.tensor is not None:
            made.append(self.tensor.data_ptr())

    monkeypatch.setattr(MappedArena, "map", counted)
    return made


def connect_siblings(address: str, **options: Any) -> list[KVStoreClient]:
    first_spec, *other_specs = specs()
    first = KVStoreClient.connect(address, first_spec, **options)
    clients = [first]
    try:
        for spec in other_specs:
            clients.append(clients[-1].sibling(spec))  # a sibling of a sibling shares the same parts
    except BaseException:
        for client in clients:
            client.close()
        raise
    return clients


def test_siblings_store_and_load_every_byte_through_one_arena_mapping(
    daemon: Daemon, maps: list[int]
) -> None:
    clients = connect_siblings(daemon.address)
    try:
        arena = clients[0].arena
        assert arena is not None and maps == [arena.data_ptr()]  # mapped once, for all three
        for client in clients:
            assert client.arena is not None and client.arena.data_ptr() == arena.data_ptr()
            assert client._local is clients[0]._local is not None and client.epoch == clients[0].epoch
        assert len({client.namespace for client in clients}) == 3
        assert [client.page_bytes for client in clients] == [256 << 10, 64 << 10, 96 << 10]
        assert [client.spec.page.chunk_tokens for client in clients] == [256, 64, 128]
        tokens = tokens_of(TOKENS, seed=1)  # the same tokens: each namespace has its own pages
        sources = [cache_of(client.spec, seed=10 + n) for n, client in enumerate(clients)]
        for n, (client, source) in enumerate(zip(clients, sources, strict=True)):
            assert client.lookup(tokens) == 0
            assert (
                client.store(tokens, source, torch.arange(BLOCKS)) == TOKENS // client.spec.page.chunk_tokens
            )
            assert client.lookup(tokens) == TOKENS
            assert load_checked(client, tokens, source, seed=20 + n) == TOKENS
        for n, (client, source) in enumerate(zip(clients, sources, strict=True)):  # none overwrote another
            assert load_checked(client, tokens, source, seed=30 + n) == TOKENS
        stats = clients[1].stats()
        assert stats["tiers"]["cpu"]["pages"] == 2 + 8 + 4
        assert stats["counters"]["active_leases"] == 0
        assert maps == [arena.data_ptr()]
    finally:
        for client in clients:
            client.close()


@pytest.fixture
def small_slabs(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory(tiers__cpu={"bytes": "16MiB", "slab_bytes": "1MiB"})


def test_the_arena_is_registered_once_for_every_sibling_and_closing_one_leaves_the_others_working(
    small_slabs: Daemon, recording: list[RecordingRegistrar]
) -> None:
    first, second, third = clients = connect_siblings(small_slabs.address)
    try:
        assert len(recording) == 1 and all(client._registered for client in clients)
        registrar = first._mapped.registrar
        assert registrar is not None and all(client._mapped.registrar is registrar for client in clients)
        tokens = tokens_of(TOKENS, seed=2)
        sources = [cache_of(client.spec, seed=40 + n) for n, client in enumerate(clients)]
        for n, (client, source) in enumerate(zip(clients, sources, strict=True)):
            assert client.store(tokens, source, torch.arange(BLOCKS)) > 0
            assert load_checked(client, tokens, source, seed=50 + n) == TOKENS
        assert registrar.ready(range(16), 30.0)
        host = recording[0]
        assert sorted(host.registered) == list(range(16))  # every slab once, whoever asked for it
        assert third.stats()["client"]["arena"]["slabs_registered"] == 16

        first.close()
        assert host.unregistered == [] and second.arena is not None
        for n, (client, source) in enumerate(zip(clients[1:], sources[1:], strict=True)):
            assert load_checked(client, tokens, source, seed=60 + n) == TOKENS
        with pytest.raises(ValueError, match="closed"):
            first.sibling(specs()[0])
        again = second.sibling(specs()[0])  # the first namespace, through the parts still open
        try:
            assert load_checked(again, tokens, sources[0], seed=70) == TOKENS
        finally:
            again.close()
        second.close()
        assert load_checked(third, tokens, sources[2], seed=71) == TOKENS
        assert len(recording) == 1 and host.unregistered == []
    finally:
        for client in clients:
            client.close()
    assert sorted(host.unregistered) == list(range(16))  # the last one to close unpins every slab
    assert first._link.closed and first._conn.local is None


def test_a_sibling_the_daemon_refuses_leaves_the_others_as_they_were(daemon: Daemon) -> None:
    clients = connect_siblings(daemon.address)
    try:
        odd = KVSpec(model="odd", num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float16,
                     block_size=48, layout="flash_attn")  # fmt: skip
        with pytest.raises(ValueError, match="not a multiple of block_size 48"):
            clients[0].sibling(odd)
        assert len(clients[0]._link.members()) == 3 and not clients[0]._link.closed
        tokens = tokens_of(TOKENS, seed=3)
        for n, client in enumerate(clients):
            source = cache_of(client.spec, seed=80 + n)
            assert client.store(tokens, source, torch.arange(BLOCKS)) > 0
            assert load_checked(client, tokens, source, seed=90 + n) == TOKENS
    finally:
        for client in clients:
            client.close()


def test_one_renewer_renews_the_leases_of_every_sibling_in_its_own_namespace(daemon: Daemon) -> None:
    clients = connect_siblings(daemon.address)
    try:
        tokens = tokens_of(TOKENS, seed=5)
        sources = [cache_of(client.spec, seed=120 + n) for n, client in enumerate(clients)]
        assert clients[0].store(tokens, sources[0], torch.arange(BLOCKS)) == 2
        stores = [client.store_async(tokens, source, torch.arange(BLOCKS)) for client, source in
                  zip(clients[1:], sources[1:], strict=True)]  # fmt: skip
        target = poisoned(clients[0].spec)
        table = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(6))
        load = clients[0].load_async(tokens, target, table)
        renewer = clients[0]._renewer
        assert all(client._renewer is renewer for client in clients)
        held = renewer.held()
        assert len(held) == 3
        assert sorted(renewer.by_namespace(held)) == sorted(client.namespace for client in clients)
        assert sorted(clients[0]._link._renew(held)) == sorted(held)  # one Renew per namespace
        assert [handle.wait() for handle in stores] == [8, 4]
        assert wrong_blocks(target, sources[0], table, load.wait(), load.tokens) == []
        assert renewer.held() == [] and clients[2].stats()["counters"]["renewed_leases"] == 3
    finally:
        for client in clients:
            client.close()


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[Callable[[], Daemon]]:
    """Starts the daemon again and again on the same socket; stops the last."""
    current: list[Daemon] = []

    def start() -> Daemon:
        daemon = start_daemon(tmp_path, "restart")
        current[:] = [daemon]
        return daemon

    yield start
    for daemon in current:
        if daemon.process.poll() is None:
            assert daemon.stop() == 0, daemon.log()


def count_connects(client: KVStoreClient) -> list[str]:
    """Records the name of every call the shared connection sends (`rpc`)."""
    calls: list[str] = []
    rpc = client._conn.rpc

    def recording(method: str, request: Any, meanwhile: Any = None, fds: Any = None) -> Any:
        calls.append(method)
        return rpc(method, request, meanwhile, fds)

    client._conn.rpc = recording  # type: ignore[method-assign]
    return calls


def test_the_first_call_after_a_restart_connects_every_sibling_and_maps_the_arena_once(
    restartable: Callable[[], Daemon], maps: list[int]
) -> None:
    daemon = restartable()
    clients = connect_siblings(daemon.address)
    try:
        first, second, third = clients
        tokens = tokens_of(TOKENS, seed=4)
        sources = [cache_of(client.spec, seed=100 + n) for n, client in enumerate(clients)]
        for client, source in zip(clients, sources, strict=True):
            assert client.store(tokens, source, torch.arange(BLOCKS)) > 0
        old_epoch = first.epoch
        daemon.stop(signal.SIGKILL)
        for client, source in zip(clients, sources, strict=True):  # misses while it is down
            assert client.lookup(tokens) == 0 and load_checked(client, tokens, source, seed=1) == 0
        assert first.arena is None  # nothing answered: the dead arena went at once
        daemon = restartable()
        calls = count_connects(first)
        deadline = time.monotonic() + SERVE_AGAIN_S
        while second.lookup(tokens) != 0 or second.epoch == 0:  # the new daemon is empty
            assert time.monotonic() < deadline, "not served again in time"
            time.sleep(0.05)
        assert calls.count("Connect") == 3  # one call of one sibling connected all three
        assert len(maps) == 2 and first.epoch != old_epoch and first.epoch == third.epoch
        stub = daemon.stub()  # the daemon knows every namespace before the others call
        for client in clients:
            request = pb.LookupRequest(namespace=client.namespace, keys=pack_keys(client.keys(tokens)))
            assert stub.Lookup(request).hit_chunks == 0
        for n, (client, source) in enumerate(zip(clients, sources, strict=True)):
            assert client.store(tokens, source, torch.arange(BLOCKS)) > 0
            assert load_checked(client, tokens, source, seed=110 + n) == TOKENS
        assert calls.count("Connect") == 3 and len(maps) == 2
    finally:
        for client in clients:
            client.close()


class SiblingWorker:
    """A thread that stores and loads prompts through every sibling in turn until stopped, checking
    every loaded byte; records exceptions out of public calls, wrong bytes, and for each sibling
    the last generation (the test's count of daemons started) in which it was served."""

    PROMPTS = 6

    def __init__(self, clients: list[KVStoreClient]) -> None:
        self.clients = clients
        self.sources = [
            [cache_of(client.spec, seed=1000 * n + i) for i in range(self.PROMPTS)]
            for n, client in enumerate(clients)
        ]
        self.generation = 0
        self.served = [-1] * len(clients)
        self.rounds = 0
        self.exceptions: list[str] = []
        self.wrong: list[str] = []
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="sibling-worker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            prompt = i % self.PROMPTS
            tokens = tokens_of(TOKENS, seed=500 + prompt)
            for n, client in enumerate(self.clients):
                generation = self.generation
                source = self.sources[n][prompt]
                try:
                    stored = client.store(tokens, source, torch.arange(BLOCKS))
                    hit = client.lookup(tokens)
                    target = poisoned(client.spec)
                    table = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(i))
                    handle = client.load_async(tokens, target, table)
                    loaded = handle.wait()
                except Exception:
                    self.exceptions.append(traceback.format_exc())
                    continue
                wrong = wrong_blocks(target, source, table, loaded, handle.tokens)
                self.wrong.extend(f"sibling {n} prompt {prompt}: {problem}" for problem in wrong)
                if (stored or hit or loaded) and not wrong:
                    with self._cond:
                        self.served[n] = max(self.served[n], generation)
                        self._cond.notify_all()
            i += 1
            with self._cond:
                self.rounds += 1
                self._cond.notify_all()

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        with self._cond:
            assert self._cond.wait_for(condition, SERVE_AGAIN_S), f"{what} within {SERVE_AGAIN_S} s"

    def all_served(self, generation: int) -> None:
        self.wait_for(
            lambda: min(self.served) >= generation, f"every sibling served in generation {generation}"
        )

    def more_rounds(self, count: int) -> None:
        start = self.rounds
        self.wait_for(lambda: self.rounds >= start + count, f"{count} more rounds")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_siblings_see_no_error_and_no_wrong_byte_through_restarts(
    restartable: Callable[[], Daemon], maps: list[int], sig: int
) -> None:
    restarts = 2
    daemon = restartable()
    clients = connect_siblings(daemon.address)
    worker = SiblingWorker(clients)
    try:
        worker.all_served(0)
        for generation in range(1, restarts + 1):
            daemon.stop(sig)
            worker.more_rounds(2)  # calls made while it is down
            daemon = restartable()
            worker.generation = generation
            worker.all_served(generation)
            worker.more_rounds(1)
    finally:
        worker.stop()
        for client in clients:
            client.close()
    assert worker.exceptions == [], worker.exceptions[:2]
    assert worker.wrong == [], worker.wrong[:5]
    assert len(maps) == 1 + restarts  # the new arena mapped once per restart, for all three siblings


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_on_cuda_siblings_pin_each_slab_once_and_move_every_byte_across_a_restart(
    restartable: Callable[[], Daemon], maps: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstore_client.registrar import CudaRegistrar

    registered: list[int] = []  # the addresses cudaHostRegister pinned, for the current arena
    register = CudaRegistrar.register

    def counted(self: CudaRegistrar, address: int, size: int) -> None:
        register(self, address, size)
        registered.append(address)

    monkeypatch.setattr(CudaRegistrar, "register", counted)
    daemon = restartable()
    clients = connect_siblings(daemon.address)
    try:
        for restart in range(2):
            registrar = clients[0]._mapped.registrar
            assert registrar is not None and all(client._mapped.registrar is registrar for client in clients)
            tokens = tokens_of(TOKENS, seed=7 + restart)
            for n, client in enumerate(clients):
                source = cache_of(client.spec, seed=200 + n)
                assert client.store(tokens, [t.cuda() for t in source], torch.arange(BLOCKS)) > 0
                target = [t.cuda() for t in poisoned(client.spec)]
                table = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(n))
                handle = client.load_async(tokens, target, table)
                loaded = handle.wait()
                assert loaded == TOKENS
                assert wrong_blocks([t.cpu() for t in target], source, table, loaded, handle.tokens) == []
            assert registrar.ready(range(registrar.num_slabs), 60.0)
            # The arena's slabs (the bounce ring, pinned beside them, lies outside the arena).
            slabs = [a for a in registered if registrar.base <= a < registrar.base + registrar.size]
            assert sorted(slabs) == sorted(set(slabs)) and len(slabs) == registrar.num_slabs
            if restart == 0:
                old_epoch = clients[0].epoch
                daemon.stop(signal.SIGKILL)
                daemon = restartable()
                registered.clear()
                deadline = time.monotonic() + SERVE_AGAIN_S
                while clients[2].lookup(tokens) != 0 or clients[2].epoch in (0, old_epoch):
                    assert time.monotonic() < deadline, "not served again in time"
                    time.sleep(0.05)
        assert len(maps) == 2
    finally:
        for client in clients:
            client.close()
