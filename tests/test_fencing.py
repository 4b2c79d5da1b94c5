"""Fencing and renewal in-process: expired store leases keep their slots from reuse until their
writer is gone, renewals keep live leases and stop at leases.max_ttl_s, and the client's renewal
thread lets go of leases whose handles were dropped.

Every scenario that stores pages writes distinct bytes into their slots and reads them back.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.shared.errors import FailedPrecondition, NotFound, ResourceExhausted
from kvstore.shared.keys import chunk_keys
from kvstore.shared.peers import Peer, process_start_time
from kvstore.store.policy import make_policy
from kvstore.store.store import Store
from kvstore.store.store_settings import StoreSettings
from kvstore.tiers.cpu import Arena, CpuTier
from kvstore_client.renewal import LeaseRenewer
from tests.test_store import PAGE, SPEC, Clock, page_bytes

TTL_S = 10.0
MAX_TTL_S = 30.0
QUARANTINE_S = 100.0


def make_store(tmp_path: Path, clock: Clock, pages: int) -> Store:
    arena = Arena(tmp_path / "arena", pages * PAGE, prefault=False)
    return Store(
        CpuTier(arena, pages * PAGE),
        make_policy("lru"),
        StoreSettings(lease_ttl_s=TTL_S, max_lease_ttl_s=MAX_TTL_S, quarantine_s=QUARANTINE_S),
        clock=clock,
    )


def stored_bytes(store: Store, ns: bytes, keys: list[bytes]) -> list[bytes]:
    found = store.lookup(ns, keys, lease=True)
    ready = store.acquire_now(ns, found.lease_id)
    assert ready is not None
    pages = [bytes(store.cpu.read(offset, PAGE)) for offset in ready.offsets]
    store.release(ns, found.lease_id)
    return pages


def a_dead_process() -> Peer:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start_time = process_start_time(child.pid)
    child.wait()
    return Peer(pid=child.pid, start_time=start_time or 1)


def test_an_expired_lease_written_in_place_keeps_its_slot_until_its_writer_is_gone(tmp_path: Path) -> None:
    clock = Clock()
    store = make_store(tmp_path, clock, pages=2)
    ns = store.connect(SPEC).id
    stalled_keys = chunk_keys(ns, list(range(16)), 16)
    writer = Peer(pid=os.getpid(), start_time=process_start_time(os.getpid()) or 0)  # alive: us
    stalled = store.reserve(ns, stalled_keys, writer=writer)
    clock.now += TTL_S + 1
    assert store.expire() == 1
    assert store.stats().counters["quarantined_pages"] == 1
    # The key can be stored again, into the other slot; then nothing is left to reserve.
    assert store.reserve(ns, stalled_keys).offsets != stalled.offsets
    other = chunk_keys(ns, list(range(100, 116)), 16)
    with pytest.raises(ResourceExhausted, match="cannot reserve"):
        store.reserve(ns, other)
    clock.now += 5
    store.expire()
    assert store.stats().counters["quarantined_pages"] == 1  # its writer lives: still fenced
    dead = a_dead_process()
    writer.pid, writer.start_time = dead.pid, dead.start_time  # now it is a process that exited
    clock.now += 5  # past the next look at the writer
    store.expire()
    assert store.stats().counters["quarantined_pages"] == 0
    assert store.stats().counters["quarantines_ended"] == 1


def test_a_fence_ends_at_quarantine_s_and_a_commit_of_a_fenced_lease_stores_nothing(tmp_path: Path) -> None:
    clock = Clock()
    store = make_store(tmp_path, clock, pages=4)
    ns = store.connect(SPEC).id
    keys = chunk_keys(ns, list(range(32)), 16)
    unknown = Peer()  # a writer the daemon cannot see: only the time ends its fence
    first = store.reserve(ns, keys[:1], writer=unknown)
    second = store.reserve(ns, keys[1:], writer=unknown)
    clock.now += TTL_S + 1
    store.expire()
    assert store.stats().counters["quarantined_pages"] == 2
    with pytest.raises(FailedPrecondition, match="expired before its Commit"):
        store.commit(ns, first.lease_id)
    assert store.lookup(ns, keys).hit_chunks == 0  # never visible
    assert store.stats().counters["quarantined_pages"] == 1  # the writer said it is done
    clock.now += QUARANTINE_S
    store.expire()
    assert store.stats().counters["quarantined_pages"] == 0
    with pytest.raises(NotFound):  # its fence ended on time: the lease is gone
        store.abort(ns, second.lease_id)
    assert store.cpu.bytes_used == 0


def test_renewal_keeps_a_live_lease_until_max_ttl_and_the_pages_commit(tmp_path: Path) -> None:
    clock = Clock()
    store = make_store(tmp_path, clock, pages=2)
    ns = store.connect(SPEC).id
    keys = chunk_keys(ns, list(range(16)), 16)
    reserved = store.reserve(ns, keys, writer=Peer())
    for _ in range(2):  # two renewals, each before the deadline: 2 x 9 s > the 10 s TTL
        clock.now += TTL_S - 1
        assert store.renew(ns, [reserved.lease_id, 12345]) == [reserved.lease_id]
        assert store.expire() == 0
    store.cpu.write(reserved.offsets[0], page_bytes(keys[0]))
    assert store.commit(ns, reserved.lease_id) == 1
    assert stored_bytes(store, ns, keys) == [page_bytes(keys[0])]

    load = store.lookup(ns, keys, lease=True)
    renewed = 0
    while store.renew(ns, [load.lease_id]):  # renewals stop at max_ttl_s after the lease began
        renewed += 1
        clock.now += TTL_S - 1
        assert renewed < 10
    # From its start at 18 s: deadlines 28 (as it was), 37, 46, then 48 (capped at 18 + 30 s).
    assert renewed == 4
    clock.now = 1000.0 + 2 * (TTL_S - 1) + MAX_TTL_S + 0.1
    assert store.expire() == 1  # the load lease, at its longest


def test_a_declared_grpc_writer_that_is_not_this_hosts_process_is_never_taken_for_gone() -> None:
    me = process_start_time(os.getpid())
    assert me is not None
    assert Peer.declared(os.getpid(), me).pid == os.getpid()
    assert Peer.declared(os.getpid(), me + 1).pid == 0  # wrong start time: unknown
    assert not Peer.declared(os.getpid(), me + 1).gone()
    assert not Peer.declared(4_000_000, 12345).gone()  # no such pid here (another namespace)
    dead = a_dead_process()
    assert Peer.declared(dead.pid, dead.start_time).pid == 0  # already gone when declared: unknown


def test_the_renewal_thread_lets_go_of_leases_whose_handles_were_dropped() -> None:
    asked: list[list[int]] = []

    def renew(lease_ids: object) -> list[int]:
        asked.append(list(lease_ids))  # type: ignore[call-overload]
        return list(lease_ids)  # type: ignore[call-overload]

    class Handle:
        pass

    renewer = LeaseRenewer(renew, ttl_s=0.0)  # every lease is due at once
    renewer.stop()  # no thread: renew_due is called by hand
    kept, dropped = Handle(), Handle()
    renewer.hold(1)
    renewer.hold(2)
    renewer.owned_by(1, kept)
    renewer.owned_by(2, dropped)
    del dropped
    gc.collect()
    assert renewer.renew_due() == [1]
    assert asked == [[1]] and renewer.held() == [1]
    renewer.drop(1)
    assert renewer.renew_due() == [] and asked == [[1]]
