"""A store lease committed in parts (`LeaseRequest.commit_count`), against a real daemon.

A writer that copies a long prompt's pages commits those whose copies have ended while the
last ones still copy: each Commit with a count makes the lease's next pages visible at once
and keeps the lease open for the rest; a count of 0 (an older client's Commit) or one that
reaches the last page ends it. Expiry and Abort end only what was not committed. The chain
a store links in parts is the one a whole Commit links (checked in-process, entry by entry).

Every scenario writes each page's bytes into the slot its Reserve gave, and reads what is
visible back: a second client loads it into a poisoned cache and compares byte for byte.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.domain import Tier
from kvstore.shared.errors import FailedPrecondition, NotFound
from kvstore.shared.keys import chunk_keys
from kvstore.store.policy import make_policy
from kvstore.store.store import Store
from kvstore.store.store_settings import StoreSettings
from kvstore.tiers.cpu import Arena, CpuTier
from kvstore_client import KVSpec, KVStoreClient
from tests.harness import Daemon, wait_flushed
from tests.test_events import Follower, sequence_now
from tests.test_store import PAGE as UNIT_PAGE
from tests.test_store import SPEC as UNIT_SPEC
from tests.test_store import Clock, page_bytes

CHUNK = 16
CHUNKS = 8
SPEC = KVSpec(
    model="partial-commit",
    num_layers=2,
    num_kv_heads=2,
    head_dim=32,
    dtype=torch.float16,
    block_size=16,
    chunk_tokens=CHUNK,
)  # 8 KiB pages
PAGE = 8192
WAIT_S = 30.0  # the longest a condition may take to hold, on a slow machine


def prompt(seed: int, chunks: int = CHUNKS) -> list[int]:
    return [seed * 1000 + t for t in range(chunks * CHUNK)]


def cache_for(seed: int, chunks: int = CHUNKS) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, chunks, 16, 2, 32, generator=gen).half() for _ in range(2)]


def page_of(cache: list[torch.Tensor], chunk: int) -> torch.Tensor:
    """Chunk `chunk`'s page as the daemon stores it: [layer][k|v][token][kv_head][head_dim]."""
    return torch.stack([layer[:, chunk] for layer in cache]).contiguous().view(torch.uint8).reshape(-1)


def reserve_and_write(client: KVStoreClient, keys: Sequence[bytes], cache: list[torch.Tensor]) -> Any:
    """Reserves `keys` (the chunks of `cache`, in order) and writes each new page into its slot."""
    reply = client._stores._reserve(keys)
    assert reply is not None and len(reply.offsets) == len(keys)
    assert client.arena is not None
    for chunk, offset in enumerate(reply.offsets):
        if offset >= 0:
            client.arena[offset : offset + PAGE] = page_of(cache, chunk)
    return reply


def lease_request(client: KVStoreClient, lease_id: int, count: int = 0) -> pb.LeaseRequest:
    return pb.LeaseRequest(
        namespace=client.namespace, lease_id=lease_id, epoch=client.epoch, commit_count=count
    )


def commit(client: KVStoreClient, lease_id: int, count: int = 0) -> int:
    committed: int = client._conn.rpc("Commit", lease_request(client, lease_id, count)).committed
    return committed


def load_and_compare(reader: KVStoreClient, seed: int, cache: list[torch.Tensor]) -> int:
    """Chunks the reader loads of prompt `seed` into a poisoned cache; each equals `cache`'s, and
    the blocks past them stay poisoned."""
    target = [torch.full((2, CHUNKS, 16, 2, 32), -9.0).half() for _ in range(2)]
    chunks = reader.load(prompt(seed), target, torch.arange(CHUNKS)) // CHUNK
    for got, want in zip(target, cache, strict=True):
        assert torch.equal(got[:, :chunks].view(torch.uint8), want[:, :chunks].view(torch.uint8))
        assert bool((got[:, chunks:] == -9.0).all())
    return chunks


def visible(reader: KVStoreClient, keys: Sequence[bytes]) -> list[bool]:
    """Whether a Lookup finds each key on its own."""
    return [tier != 0 for tier in reader.lookup_each(keys)]


def follow_from_now(daemon: Daemon) -> Follower:
    """A consumer of the events after the last one logged so far."""
    stats = daemon.stub().Stats(pb.StatsRequest())
    return Follower(daemon, since=int(stats.counters["event_sequence"]), epoch=stats.event_epoch)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s"
        time.sleep(0.02)


@pytest.fixture
def clients(daemon_factory: Callable[..., Daemon]) -> Iterator[tuple[Daemon, KVStoreClient, KVStoreClient]]:
    """A daemon, its writer and a second client that reads."""
    daemon = daemon_factory(chunk_tokens=CHUNK)
    with (
        KVStoreClient.connect(daemon.address, SPEC) as writer,
        KVStoreClient.connect(daemon.address, SPEC) as reader,
    ):
        yield daemon, writer, reader


@pytest.mark.parametrize("local_channel", [True, False], ids=["local-channel", "grpc"])
def test_three_parts_each_visible_at_its_commit_and_the_rest_not(
    daemon_factory: Callable[..., Daemon], local_channel: bool
) -> None:
    daemon = daemon_factory(chunk_tokens=CHUNK)
    cache = cache_for(1)
    with (
        KVStoreClient.connect(daemon.address, SPEC, local_channel=local_channel) as writer,
        KVStoreClient.connect(daemon.address, SPEC) as reader,
    ):
        keys = writer.keys(prompt(1))
        lease_id = reserve_and_write(writer, keys, cache).lease_id
        assert reader.lookup_chunks(keys) == 0
        done = 0
        for count, expected in [(2, 2), (3, 3), (0, 3)]:  # the last: every page left
            assert commit(writer, lease_id, count) == expected
            done += expected
            assert reader.lookup_chunks(keys) == done
            assert visible(reader, keys) == [i < done for i in range(CHUNKS)]
            assert load_and_compare(reader, 1, cache) == done
            stats = reader.stats()
            assert stats["counters"]["stored_chunks"] == done
            assert stats["counters"]["active_store_leases"] == (0 if done == CHUNKS else 1)
        with pytest.raises(NotFound):
            commit(writer, lease_id, 1)


@pytest.mark.parametrize(
    "last_count", [0, 5, 6, 1000], ids=["zero", "exactly-the-rest", "one-more", "many-more"]
)
def test_a_count_of_zero_or_reaching_the_last_page_ends_the_lease(
    clients: tuple[Daemon, KVStoreClient, KVStoreClient], last_count: int
) -> None:
    _, writer, reader = clients
    cache = cache_for(2)
    keys = writer.keys(prompt(2))
    lease_id = reserve_and_write(writer, keys, cache).lease_id
    assert commit(writer, lease_id, 3) == 3
    assert commit(writer, lease_id, last_count) == 5
    assert reader.stats()["counters"]["active_store_leases"] == 0
    for count in (0, 1):
        with pytest.raises(NotFound):
            commit(writer, lease_id, count)
    with pytest.raises(NotFound):
        writer._conn.rpc("Abort", lease_request(writer, lease_id))
    assert load_and_compare(reader, 2, cache) == CHUNKS


def test_a_commit_without_a_count_commits_every_page_as_before(
    clients: tuple[Daemon, KVStoreClient, KVStoreClient],
) -> None:
    _, writer, reader = clients
    cache = cache_for(3)
    keys = writer.keys(prompt(3))
    lease_id = reserve_and_write(writer, keys, cache).lease_id
    old_request = pb.LeaseRequest(namespace=writer.namespace, lease_id=lease_id, epoch=writer.epoch)
    assert writer._conn.rpc("Commit", old_request).committed == CHUNKS
    assert load_and_compare(reader, 3, cache) == CHUNKS
    with pytest.raises(NotFound):
        writer._conn.rpc("Commit", old_request)


def test_a_count_names_no_other_lease(clients: tuple[Daemon, KVStoreClient, KVStoreClient]) -> None:
    """A count on a load lease, or on a lease that does not exist, gets the errors it always got."""
    _, writer, reader = clients
    cache = cache_for(4)
    keys = writer.keys(prompt(4))
    assert commit(writer, reserve_and_write(writer, keys, cache).lease_id, 0) == CHUNKS
    looked_up = reader._conn.rpc(
        "Lookup", pb.LookupRequest(namespace=reader.namespace, keys=b"".join(keys), lease=True)
    )
    assert looked_up.hit_chunks == CHUNKS
    with pytest.raises(FailedPrecondition, match="load lease"):
        commit(reader, looked_up.lease_id, 2)
    assert reader._conn.rpc("Release", lease_request(reader, looked_up.lease_id)).pages == CHUNKS
    with pytest.raises(NotFound):
        commit(writer, 12345, 2)
    assert load_and_compare(reader, 4, cache) == CHUNKS


def test_an_expired_lease_keeps_its_committed_pages_and_fences_the_rest(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """The writer renews its lease while it writes and commits part of it, then stops: at expiry
    the committed pages stay (visible, byte for byte), the others leave the index and their slots
    stay fenced; its late Commit is refused and stores nothing more."""
    daemon = daemon_factory(chunk_tokens=CHUNK, leases__ttl_s=2.0)
    cache = cache_for(5)
    with (
        KVStoreClient.connect(daemon.address, SPEC) as writer,
        KVStoreClient.connect(daemon.address, SPEC) as reader,
    ):
        keys = writer.keys(prompt(5))
        lease_id = reserve_and_write(writer, keys, cache).lease_id
        renew = pb.RenewRequest(namespace=writer.namespace, lease_ids=[lease_id], epoch=writer.epoch)
        assert list(writer._conn.rpc("Renew", renew).renewed) == [lease_id]
        assert commit(writer, lease_id, 3) == 3
        assert list(writer._conn.rpc("Renew", renew).renewed) == [lease_id]  # the same lease, still open

        wait_for(lambda: reader.stats()["counters"].get("fenced_leases") == 1, "the lease expires")
        counters = reader.stats()["counters"]
        assert counters["active_store_leases"] == 0
        assert counters["quarantined_pages"] == 5
        assert visible(reader, keys) == [i < 3 for i in range(CHUNKS)]
        assert load_and_compare(reader, 5, cache) == 3

        with pytest.raises(FailedPrecondition, match="the 3 page"):
            commit(writer, lease_id, 2)
        assert reader.stats()["counters"]["quarantined_pages"] == 0  # its Commit ended the fence
        assert load_and_compare(reader, 5, cache) == 3
        # What expired is stored again through the ordinary path: only those pages are new.
        assert writer.store(prompt(5), cache, torch.arange(CHUNKS)) == 5
        assert load_and_compare(reader, 5, cache) == CHUNKS


def test_abort_after_a_partial_commit_drops_only_what_was_not_committed(
    clients: tuple[Daemon, KVStoreClient, KVStoreClient],
) -> None:
    _, writer, reader = clients
    cache = cache_for(6)
    keys = writer.keys(prompt(6))
    lease_id = reserve_and_write(writer, keys, cache).lease_id
    assert commit(writer, lease_id, 3) == 3
    assert writer._conn.rpc("Abort", lease_request(writer, lease_id)).pages == 5
    with pytest.raises(NotFound):
        commit(writer, lease_id, 1)
    stats = reader.stats()
    assert stats["counters"]["aborted_chunks"] == 5
    assert stats["counters"]["active_store_leases"] == 0
    assert stats["tiers"]["cpu"]["pages"] == 3
    assert visible(reader, keys) == [i < 3 for i in range(CHUNKS)]
    assert load_and_compare(reader, 6, cache) == 3
    assert writer.store(prompt(6), cache, torch.arange(CHUNKS)) == 5
    assert load_and_compare(reader, 6, cache) == CHUNKS


def test_a_store_with_keys_already_present_commits_its_new_pages_in_parts(
    clients: tuple[Daemon, KVStoreClient, KVStoreClient],
) -> None:
    """Chunks 2, 3 and 6 are stored before (in two stores of their own); the counts count the new
    pages only, a part carries the present keys up to its last new one, the last part those after
    it, and each new page's STORED event names the chunk before it as a whole Commit would."""
    daemon, writer, reader = clients
    cache = cache_for(7)
    keys = writer.keys(prompt(7))
    for present in ([2, 3], [6]):
        reply = writer._stores._reserve([keys[i] for i in present])
        for chunk, offset in zip(present, reply.offsets, strict=True):
            writer.arena[offset : offset + PAGE] = page_of(cache, chunk)
        assert commit(writer, reply.lease_id) == len(present)
    follower = follow_from_now(daemon)
    try:
        reply = reserve_and_write(writer, keys, cache)
        assert [offset < 0 for offset in reply.offsets] == [i in (2, 3, 6) for i in range(CHUNKS)]
        for count, committed, prefix in [(2, 2, 4), (2, 2, 7), (5, 1, 8)]:  # new pages: 0 1 | 4 5 | 7
            assert commit(writer, reply.lease_id, count) == committed
            assert reader.lookup_chunks(keys) == prefix
            assert load_and_compare(reader, 7, cache) == prefix
        events = follower.until(sequence_now(daemon))
    finally:
        follower.close()
    stored = [(e.key, e.parent) for e in events if e.kind == pb.KVEvent.STORED and e.tier == Tier.CPU]
    assert stored == [(keys[i], keys[i - 1] if i else b"") for i in (0, 1, 4, 5, 7)]


def test_the_events_report_each_committed_page_once_in_order(
    clients: tuple[Daemon, KVStoreClient, KVStoreClient],
) -> None:
    daemon, writer, reader = clients
    cache = cache_for(8)
    keys = writer.keys(prompt(8))
    follower = follow_from_now(daemon)
    try:
        lease_id = reserve_and_write(writer, keys, cache).lease_id
        seen = 0
        for count, done in [(2, 2), (3, 5), (0, 8)]:
            assert commit(writer, lease_id, count) == done - seen
            events = follower.until(sequence_now(daemon))
            new = [e for e in events if e.kind == pb.KVEvent.STORED]
            assert [(e.key, e.parent, e.tier, e.reason) for e in new] == [
                (keys[i], keys[i - 1] if i else b"", Tier.CPU, "committed") for i in range(done)
            ]
            seen = done
        assert [e.sequence for e in events] == list(
            range(events[0].sequence, events[0].sequence + len(events))
        )
    finally:
        follower.close()
    assert load_and_compare(reader, 8, cache) == CHUNKS


def test_the_disk_tier_written_through_receives_exactly_the_committed_pages(
    tmp_path: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    """With `tiers.disk.write: through`, each part reaches the disk as it is committed and nothing
    else does; a daemon started again on that disk serves those pages, byte for byte."""
    disk = {
        "chunk_tokens": CHUNK,
        "tiers__disk__enabled": True,
        "tiers__disk__path": str(tmp_path / "disk"),
        "tiers__disk__bytes": "64MiB",
        "tiers__disk__write": "through",
    }
    daemon = daemon_factory("first", **disk)
    cache = cache_for(9)
    with KVStoreClient.connect(daemon.address, SPEC) as writer:
        keys = writer.keys(prompt(9))
        lease_id = reserve_and_write(writer, keys, cache).lease_id
        for count, done in [(3, 3), (2, 5)]:
            assert commit(writer, lease_id, count) == count
            assert wait_flushed(writer)["pages"] == done
            assert writer.stats()["counters"]["stored_chunks"] == done
        assert writer._conn.rpc("Abort", lease_request(writer, lease_id)).pages == 3
        assert wait_flushed(writer)["pages"] == 5
    assert daemon.stop() == 0

    again = daemon_factory("second", **disk)
    with KVStoreClient.connect(again.address, SPEC) as reader:
        assert reader.lookup_each(keys) == bytes([Tier.DISK]) * 5 + bytes(3)
        assert load_and_compare(reader, 9, cache) == 5


# -- in-process: what a Commit in parts leaves in the index -------------------------------


def unit_store(tmp_path: Path, name: str) -> Store:
    pages = 64
    arena = Arena(tmp_path / name, pages * UNIT_PAGE, prefault=False)
    return Store(
        CpuTier(arena, pages * UNIT_PAGE),
        make_policy("lru"),
        StoreSettings(lease_ttl_s=10.0, max_lease_ttl_s=60.0),
        clock=Clock(),
    )


def stored_in_parts(store: Store, counts: Sequence[int]) -> tuple[bytes, list[bytes]]:
    """12 chunks, of which 2, 3, 6 and 11 were stored before (by stores of their own), stored by
    one lease committed in parts of `counts` (the pages each Commit names); every page written."""
    ns = store.connect(UNIT_SPEC).id
    keys = chunk_keys(ns, list(range(12 * 16)), 16)
    for present in ([2, 3], [6], [11]):
        reserved = store.reserve(ns, [keys[i] for i in present])
        for i, offset in zip(present, reserved.offsets, strict=True):
            store.cpu.write(offset, memoryview(page_bytes(keys[i])), 0)
        store.commit(ns, reserved.lease_id)
    reserved = store.reserve(ns, keys)
    for key, offset in zip(keys, reserved.offsets, strict=True):
        if offset >= 0:
            store.cpu.write(offset, memoryview(page_bytes(key)), 0)
    committed = [store.commit(ns, reserved.lease_id, count) for count in counts]
    assert sum(committed) == 8
    assert store.leases.get(reserved.lease_id) is None
    return ns, keys


@pytest.mark.parametrize("counts", [[1, 1, 1, 1, 1, 1, 1, 1], [2, 2, 4], [3, 0], [7, 9], [5, 3]])
def test_a_chain_committed_in_parts_is_linked_as_a_whole_commit_links_it(
    tmp_path: Path, counts: list[int]
) -> None:
    whole, parts = unit_store(tmp_path, "whole"), unit_store(tmp_path, "parts")
    ns, keys = stored_in_parts(whole, [0])
    assert stored_in_parts(parts, counts) == (ns, keys)

    def links(store: Store) -> list[tuple[bytes, bytes, int]]:
        entries = [store.namespaces[ns].entries[key] for key in keys]
        return [(e.key, e.parent.key if e.parent is not None else b"", e.children) for e in entries]

    assert links(parts) == links(whole)
    assert [parent for _, parent, _ in links(parts)] == [b"", *keys[:-1]]  # one chain, head to tail
    for store in (whole, parts):
        found = store.lookup(ns, keys, lease=True)
        assert found.hit_chunks == 12
        ready = store.acquire_now(ns, found.lease_id)
        assert ready is not None
        assert [bytes(store.cpu.read(offset, UNIT_PAGE)) for offset in ready.offsets] == [
            page_bytes(key) for key in keys
        ]
        store.release(ns, found.lease_id)
    # The policy heard of the same pages in the same order.
    assert [e.key for e in parts.policy.candidates()] == [e.key for e in whole.policy.candidates()]


def test_a_put_is_refused_after_a_partial_commit_and_a_partial_commit_during_a_put(tmp_path: Path) -> None:
    """A Put writes every page of its lease: after a partial Commit it would rewrite visible pages.
    A Commit, with a count or not, waits for a Put to end, and a broken lease commits nothing."""
    store = unit_store(tmp_path, "arena")
    ns = store.connect(UNIT_SPEC).id
    keys = chunk_keys(ns, list(range(4 * 16)), 16)
    lease_id = store.reserve(ns, keys).lease_id
    lease, slots = store.begin_put(ns, lease_id)
    with pytest.raises(FailedPrecondition, match="a Put is still writing"):
        store.commit(ns, lease_id, 1)
    for key, offset in zip(keys, slots.offsets, strict=True):
        store.write_leased(lease, offset, memoryview(page_bytes(key)), 0)
    store.end_put(lease)
    assert store.commit(ns, lease_id, 1) == 1
    with pytest.raises(FailedPrecondition, match="must come before"):
        store.begin_put(ns, lease_id)
    assert store.lookup(ns, keys).hit_chunks == 1
    broken = store.reserve(ns, chunk_keys(ns, list(range(1000, 1000 + 2 * 16)), 16)).lease_id
    lease, _ = store.begin_put(ns, broken)
    store.end_put(lease, "the stream ended early")
    with pytest.raises(FailedPrecondition, match="ended early"):
        store.commit(ns, broken, 1)
    assert store.abort(ns, broken) == 2
    assert store.commit(ns, lease_id, 0) == 3
    found = store.lookup(ns, keys, lease=True)
    ready = store.acquire_now(ns, found.lease_id)
    assert ready is not None and found.hit_chunks == 4
    assert [bytes(store.cpu.read(offset, UNIT_PAGE)) for offset in ready.offsets] == [
        page_bytes(k) for k in keys
    ]
    store.release(ns, found.lease_id)
