"""The KV-event stream of a real daemon: a consumer rebuilds, from the events alone, exactly the
pages each tier holds; one that reconnects (with its last event's sequence and epoch) loses
nothing; one that falls behind is told to resync. A restart's epoch: tests/test_hardening_events.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.shared.domain import Tier
from tests.harness import Daemon
from tests.test_cli import kvctl
from tests.test_protocol import SMALL_ARENA, Conn, chain, connect, random_pages, store

STORED, REMOVED, RESYNC = pb.KVEvent.STORED, pb.KVEvent.REMOVED, pb.KVEvent.RESYNC


class Follower:
    """A consumer of the stream, reading in a thread of its own."""

    def __init__(self, daemon: Daemon, **request: Any) -> None:
        self.channel = grpc.insecure_channel(daemon.address)
        self.call = pb_grpc.KVStoreStub(self.channel).Events(pb.EventsRequest(**request))
        self.events: list[pb.KVEvent] = []
        self.ended: BaseException | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.events.extend(batch.events)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.ended = exc

    def until(self, sequence: int, timeout_s: float = 10.0) -> list[pb.KVEvent]:
        deadline = time.monotonic() + timeout_s
        while not (self.events and self.events[-1].sequence >= sequence):
            assert self.ended is None, self.ended
            assert time.monotonic() < deadline, f"no event {sequence} in {timeout_s} s: {self.events[-3:]}"
            time.sleep(0.01)
        return self.events

    def close(self) -> None:
        self.call.cancel()
        self._thread.join(5)
        self.channel.close()


def sequence_now(daemon: Daemon) -> int:
    return int(daemon.stub().Stats(pb.StatsRequest()).counters["event_sequence"])


def settled(daemon: Daemon) -> int:
    """The last event's sequence once the disk tier has written everything queued."""
    stub = daemon.stub()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        disk = {t.name: t for t in stub.Stats(pb.StatsRequest()).tiers}["disk"].extra
        if not disk["queue_depth"] and not disk["writing"]:
            return sequence_now(daemon)
        time.sleep(0.02)
    raise AssertionError("the disk tier did not finish writing")


def rebuild(events: list[pb.KVEvent]) -> dict[int, set[tuple[bytes, bytes]]]:
    """Each tier's pages, from the events alone; every REMOVED must find its page."""
    tiers: dict[int, set[tuple[bytes, bytes]]] = {}
    for event in events:
        assert event.kind != RESYNC
        held = tiers.setdefault(event.tier, set())
        page = (event.namespace, event.key)
        if event.kind == STORED:
            assert page not in held, event
            held.add(page)
        else:
            assert page in held, event
            held.remove(page)
    return tiers


@pytest.fixture
def daemon_with_disk(daemon_factory: Callable[..., Daemon], tmp_path: Any) -> Daemon:
    return daemon_factory(tiers__disk__enabled=True, tiers__disk__path=str(tmp_path / "disk"), **SMALL_ARENA)


def check_against_the_daemon(daemon: Daemon, tiers: dict[int, set[tuple[bytes, bytes]]], chains: Any) -> None:
    """The rebuilt tiers against Stats, `kvctl ls`, and a Lookup of each key alone (which says
    the tier it finds the page in: the arena first)."""
    stub = daemon.stub()
    cpu, disk = tiers.get(Tier.CPU, set()), tiers.get(Tier.DISK, set())
    pages = {t.name: t.pages for t in stub.Stats(pb.StatsRequest()).tiers}
    assert (len(cpu), len(disk)) == (pages["cpu"], pages["disk"])
    listed = {n["namespace"]: n["pages"] for n in json.loads(kvctl(daemon, "ls", "--json").stdout)}
    for conn, keys in chains:
        assert listed.get(conn.ns.hex(), 0) == sum(1 for ns, _ in cpu if ns == conn.ns)
        for key in keys:
            reply = stub.Lookup(pb.LookupRequest(namespace=conn.ns, keys=key))
            page = (conn.ns, key)
            expected = (
                (1, bytes([Tier.CPU]))
                if page in cpu
                else (1, bytes([Tier.DISK]))
                if page in disk
                else (0, b"")
            )
            assert (reply.hit_chunks, reply.tiers) == expected, key.hex()


def test_the_events_rebuild_exactly_what_each_tier_holds(daemon_with_disk: Daemon) -> None:
    daemon = daemon_with_disk
    follower = Follower(daemon, since=0)
    stub = daemon.stub()
    a, b = connect(stub, model="a"), connect(stub, model="b")
    keys_a, keys_b = chain(a, 12), chain(b, 8, first_token=500)
    chains = [(a, keys_a), (b, keys_b)]
    store(a, keys_a, random_pages(12, a.page_bytes, seed=1))
    store(b, keys_b, random_pages(8, b.page_bytes, seed=2))  # 20 pages into 16 slots: 4 evicted to disk
    settled(daemon)
    loading = stub.Lookup(pb.LookupRequest(namespace=a.ns, keys=b"".join(keys_a), lease=True))
    assert loading.hit_chunks == 12  # what was evicted of it is read back up from disk
    stub.Acquire(pb.LeaseRequest(namespace=a.ns, lease_id=loading.lease_id))
    stub.Release(pb.LeaseRequest(namespace=a.ns, lease_id=loading.lease_id))
    events = follower.until(settled(daemon))
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))  # each once, in order
    tiers = rebuild(events)
    check_against_the_daemon(daemon, tiers, chains)
    reasons = {(e.kind, e.tier, e.reason) for e in events}
    assert {
        (STORED, Tier.CPU, "committed"),
        (REMOVED, Tier.CPU, "evicted"),
        (STORED, Tier.DISK, "written"),
    } <= reasons
    assert (STORED, Tier.CPU, "promoted") in reasons
    assert {e.model for e in events} == {"a", "b"} and all(e.key for e in events)
    assert any(e.parent == keys_a[0] for e in events if e.key == keys_a[1] and e.kind == STORED)

    on_disk = next(conn for conn in (a, b) if any(ns == conn.ns for ns, _ in tiers[Tier.DISK]))
    assert stub.Clear(pb.ClearRequest(namespace=on_disk.ns)).pages > 0
    events = follower.until(settled(daemon))
    follower.close()
    tiers = rebuild(events)
    check_against_the_daemon(daemon, tiers, chains)
    assert {(REMOVED, Tier.CPU, "cleared"), (REMOVED, Tier.DISK, "cleared")} <= {
        (e.kind, e.tier, e.reason) for e in events
    }
    assert not any(ns == on_disk.ns for held in tiers.values() for ns, _ in held)


def test_a_consumer_that_reconnects_loses_nothing(daemon: Daemon) -> None:
    stub = daemon.stub()
    conn = connect(stub)
    first = Follower(daemon, since=0)
    store(conn, chain(conn, 4), random_pages(4, conn.page_bytes, seed=3))
    last = first.until(4)[-1]
    seen, epoch = last.sequence, last.epoch  # a consumer keeps both: numbers restart with the daemon
    first.close()
    store(conn, chain(conn, 4, first_token=1000), random_pages(4, conn.page_bytes, seed=4))  # while away
    again = Follower(daemon, since=seen, epoch=epoch)
    more = chain(conn, 2, first_token=2000)
    store(conn, more, random_pages(2, conn.page_bytes, seed=5))
    events = again.until(sequence_now(daemon))
    again.close()
    assert [e.sequence for e in events] == list(range(seen + 1, seen + 7))
    assert [e.key for e in events[-2:]] == more and {e.kind for e in events} == {STORED}
    assert {e.epoch for e in events} == {epoch} == {daemon.stub().Stats(pb.StatsRequest()).event_epoch}


def test_a_consumer_that_fell_behind_is_told_to_resync(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(server__events_buffer=16)
    conn = connect(daemon.stub())
    store(conn, chain(conn, 40), random_pages(40, conn.page_bytes, seed=6))
    follower = Follower(daemon, since=0)
    events = follower.until(40)
    follower.close()
    assert events[0].kind == RESYNC and events[0].sequence == 24  # events 1-24 are gone
    assert [e.sequence for e in events[1:]] == list(range(25, 41))
    now = Follower(daemon, from_now=True)  # from now on only: nothing of the past
    store(conn, chain(conn, 1, first_token=9000), random_pages(1, conn.page_bytes, seed=7))
    assert [e.sequence for e in now.until(41)] == [41]
    now.close()


def test_kvctl_follows_the_events_as_json_lines(daemon: Daemon) -> None:
    conn: Conn = connect(daemon.stub(), model="m")
    keys = chain(conn, 3)
    store(conn, keys, random_pages(3, conn.page_bytes, seed=8))
    listed = kvctl(daemon, "events", "--json", "--count", "3", "--namespace", conn.ns.hex())
    assert listed.returncode == 0, listed.stderr
    lines = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(e["sequence"], e["kind"], e["tier"], e["model"], e["key"]) for e in lines] == [
        (i + 1, "stored", "cpu", "m", key.hex()) for i, key in enumerate(keys)
    ]
    assert lines[1]["parent"] == keys[0].hex() and lines[0]["namespace"] == conn.ns.hex()


@pytest.mark.parametrize("capacity", [1, 3, 7, 16])
def test_the_ring_keeps_the_last_events_in_order_whatever_the_batches(capacity: int) -> None:
    """Batches of events of every size (one, a few, more than the ring holds) wrapping around a
    small ring: reading from the start gives a RESYNC, then exactly the last `capacity` events
    added, each with its own sequence, key and parent, as one at a time would leave them."""
    import random

    from kvstore.store.events import EventKind, EventLog

    rng = random.Random(capacity)
    log = EventLog(capacity)
    added: list[tuple[int, bytes, bytes]] = []
    for batch in range(60):
        size = rng.choice([1, 2, capacity, 3 * capacity + 1])
        pages = [(bytes([batch, k]), bytes([k])) for k in range(size)]
        log.add_many(EventKind.STORED, Tier.CPU, b"ns", pages, "committed")
        added += [(len(added) + 1 + i, key, parent) for i, (key, parent) in enumerate(pages)]
        events, last = log.read(0, 10 * capacity)
        assert last == log.sequence == len(added)
        kept = [(e.sequence, e.key, e.parent) for e in events if e.kind == EventKind.STORED]
        assert kept == added[-capacity:]
        assert events[0].kind == EventKind.RESYNC or len(added) <= capacity
