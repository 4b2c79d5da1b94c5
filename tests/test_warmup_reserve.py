"""A Reserve that arrives while a just-started daemon is still reserving its arena waits for the
room instead of failing, up to a bound; one that the arena cannot serve after that bound, or
while the daemon stops, gets the warm-up error by name. Real Store and CPU tier, the handlers'
own Reserve, driven on an event loop; every page written, committed and read back."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import pytest

from kvstore.proto import kvstore_pb2 as pb
from kvstore.server import handlers as handlers_module
from kvstore.server.handlers import Handlers
from kvstore.shared.errors import ArenaWarmingUp, Code, status_of
from kvstore.shared.keys import chunk_keys, pack_keys
from kvstore.shared.spec import PageSpec
from kvstore.store.policy import make_policy
from kvstore.store.store import Store
from kvstore.store.store_settings import StoreSettings
from kvstore.tiers.cpu import Arena, CpuTier

SPEC = PageSpec(model="test", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=16)
PAGE = SPEC.page_bytes  # 4 KiB


def warming_daemon(tmp_path: Path) -> tuple[Handlers, Store, bytes]:
    """Handlers over a store whose arena has 1 of 4 slabs (4 pages each) reserved so far."""
    arena = Arena(tmp_path / "arena", 16 * PAGE, prefault=False)
    store = Store(
        CpuTier(arena, 4 * PAGE, reserved_slabs=1),
        make_policy("lru"),
        StoreSettings(lease_ttl_s=10.0, max_lease_ttl_s=60.0),
    )
    handlers = Handlers({"": store}, chunk_tokens=16, max_message_bytes=1 << 20)
    return handlers, store, store.connect(SPEC).id


def page_of(key: bytes) -> bytes:
    return (key * (PAGE // len(key) + 1))[:PAGE]


def write_and_commit(store: Store, namespace: bytes, keys: list[bytes], reply: pb.ReserveResponse) -> None:
    for key, offset in zip(keys, reply.offsets, strict=True):
        store.cpu.write(offset, page_of(key))
    assert store.commit(namespace, reply.lease_id) == len(keys)


def test_a_reserve_during_warm_up_waits_for_the_arena_and_stores_every_page(tmp_path: Path) -> None:
    handlers, store, namespace = warming_daemon(tmp_path)
    keys = chunk_keys(namespace, list(range(16 * 12)), 16)  # 12 pages: 3 slabs, 1 reserved so far
    request = pb.ReserveRequest(namespace=namespace, keys=pack_keys(keys))
    pending = handlers.Reserve(request)
    assert inspect.isawaitable(pending)  # no room yet: the reply waits

    async def reserve_meanwhile() -> pb.ReserveResponse:
        waiting = asyncio.ensure_future(pending)
        await asyncio.sleep(0)  # the Reserve is waiting now
        store.cpu.add_reserved(1)  # the reservation goes on behind, a slab at a time
        await asyncio.sleep(0.02)
        assert not waiting.done()  # 2 slabs hold 8 pages: still waiting
        store.cpu.add_reserved(1)
        return await waiting

    reply = asyncio.run(reserve_meanwhile())
    assert len(reply.offsets) == 12 and all(offset >= 0 for offset in reply.offsets)
    write_and_commit(store, namespace, keys, reply)
    assert store.lookup(namespace, keys).hit_chunks == 12
    entries = store.namespaces.registered(namespace).entries
    assert [bytes(store.cpu.read(entries[key].offset, PAGE)) for key in keys] == [
        page_of(key) for key in keys
    ]
    assert handlers.counters["reserves_waited_for_arena"] == 1


def test_a_reserve_the_arena_never_makes_room_for_fails_by_name_after_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(handlers_module, "WARMUP_WAIT_S", 0.05)
    handlers, _, namespace = warming_daemon(tmp_path)
    keys = chunk_keys(namespace, list(range(16 * 8)), 16)
    pending = handlers.Reserve(pb.ReserveRequest(namespace=namespace, keys=pack_keys(keys)))
    with pytest.raises(ArenaWarmingUp, match=r"still being reserved \(16384 of 65536 bytes so far") as error:
        asyncio.run(_awaited(pending))
    assert status_of(error.value)[0] == Code.RESOURCE_EXHAUSTED  # type: ignore[index]


def test_a_reserve_waiting_when_the_daemon_stops_is_answered_at_once(tmp_path: Path) -> None:
    handlers, _, namespace = warming_daemon(tmp_path)
    keys = chunk_keys(namespace, list(range(16 * 8)), 16)
    pending = handlers.Reserve(pb.ReserveRequest(namespace=namespace, keys=pack_keys(keys)))

    async def stop_meanwhile() -> None:
        waiting = asyncio.ensure_future(_awaited(pending))
        await asyncio.sleep(0)
        handlers.stopping = True
        await waiting

    with pytest.raises(ArenaWarmingUp):
        asyncio.run(asyncio.wait_for(stop_meanwhile(), timeout=5))


def test_a_reserve_that_fits_the_reserved_slabs_is_answered_at_once(tmp_path: Path) -> None:
    handlers, store, namespace = warming_daemon(tmp_path)
    keys = chunk_keys(namespace, list(range(16 * 4)), 16)  # 4 pages: the first slab
    reply = handlers.Reserve(pb.ReserveRequest(namespace=namespace, keys=pack_keys(keys)))
    assert isinstance(reply, pb.ReserveResponse)
    write_and_commit(store, namespace, keys, reply)
    assert handlers.counters["reserves_waited_for_arena"] == 0


async def _awaited(pending: object) -> object:
    return await pending  # type: ignore[misc]
