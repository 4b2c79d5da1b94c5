"""Read slots (`kvstore.shared.read_slots`): a reader of lent blocks learns in shared memory, without
waiting for Returned's answer, whether its read still holds its lend. Against a real kvstored over
its local channel: the slot says so exactly while the lend holds, and says otherwise before the
lender can learn the lend is done, whatever ends it (Returned, a revoke, the lender's exit, a
Clear, the daemon's death). The copy that reads them is in `test_lends_cuda.py`."""

from __future__ import annotations

import mmap
import os
import signal
import socket
from collections.abc import Callable
from typing import Any

import pytest

from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.handlers_lends import MAX_SLOTS_SENT
from kvstore.shared.errors import InvalidArgument, Unavailable
from kvstore.shared.keys import pack_keys
from kvstore.shared.peers import Peer
from kvstore.shared.read_slots import SLOTS, SlotView
from kvstore.store.lends import MAX_READS
from kvstore_client import KVStoreClient
from tests.harness import Daemon
from tests.test_lends import BUS, SPEC, blocks_of, done, lend, returned, wait_until


def lend_request(client: KVStoreClient, keys: list[bytes], nonce: int) -> pb.LendRequest:
    """A Lend of `keys` at blocks 100 on, with the lender's `nonce` (test_lends' descriptor and GPU)."""
    return pb.LendRequest(
        namespace=client.namespace,
        keys=pack_keys(keys),
        blocks=blocks_of(len(keys)),
        cache=b'{"version":1}',
        device_pci_bus_id=BUS,
        nonce=nonce,
    )


class Reader:
    """A reader's connection and the read slots its daemon sent it."""

    def __init__(self, client: KVStoreClient) -> None:
        self.client = client
        self.local = client._conn.local
        assert self.local is not None
        self.slots: SlotView | None = None

    def lookup(self, keys: list[bytes]) -> Any:
        request = pb.LookupRequest(
            namespace=self.client.namespace,
            keys=pack_keys(keys),
            lease=True,
            lent_devices=[BUS],
            read_slots=self.slots is None,
        )
        fds: list[int] = []
        reply = self.local.call("Lookup", request, fds=fds)
        assert reply.lent.read_slots_sent == (self.slots is None and reply.HasField("lent"))
        assert len(fds) == int(reply.lent.read_slots_sent)
        if fds:
            self.slots = self.local.read_slots = SlotView(fds[0])
        return reply

    def holds(self, reply: Any) -> bool:
        assert reply.lent.slot, "a local-channel read has a slot"
        return bool(self.local.holds(reply.lent.slot - 1, reply.lent.read_id))


def test_a_slot_holds_the_read_until_it_is_returned_and_comes_once(daemon: Daemon) -> None:
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as c,
    ):
        reader = Reader(c)
        keys = lender.keys(list(range(2 * SPEC.chunk_tokens)))
        lend_id = lend(lender, keys)
        first, second = reader.lookup(keys), reader.lookup(keys)  # the second asks for no slots
        assert reader.holds(first) and reader.holds(second)
        assert first.lent.slot != second.lent.slot
        assert returned(c, first.lent.read_id) == 1
        assert not reader.holds(first) and reader.holds(second)
        assert returned(c, second.lent.read_id) == 1
        assert not reader.holds(second)
        assert done(lender, [lend_id]) == [lend_id]


@pytest.mark.parametrize("end", ["revoke", "lender exits", "clear"])
def test_whatever_ends_a_lend_empties_its_slots_before_anyone_learns_it(daemon: Daemon, end: str) -> None:
    with KVStoreClient.connect(daemon.address, SPEC) as c:
        reader = Reader(c)
        lender = KVStoreClient.connect(daemon.address, SPEC)
        keys = lender.keys(list(range(2 * SPEC.chunk_tokens)))
        lend_id = lend(lender, keys)
        reply = reader.lookup(keys)
        assert reader.holds(reply)
        if end == "revoke":
            request = pb.LendsRequest(namespace=lender.namespace, lend_ids=[lend_id], revoke=True)
            assert list(lender._conn.rpc("Lends", request).done) == [lend_id]
            assert not reader.holds(reply)  # written before the lender was told it may reuse the blocks
        elif end == "lender exits":
            lender.close()
            wait_until(lambda: done(c, [lend_id]) == [lend_id])
            assert not reader.holds(reply)
        else:
            c.clear()
            assert not reader.holds(reply)
        if end != "lender exits":
            lender.close()
        assert returned(c, reply.lent.read_id) == 0


def test_a_slot_of_a_daemon_that_died_holds_nothing(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory("dies")
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as c,
    ):
        reader = Reader(c)
        keys = lender.keys(list(range(SPEC.chunk_tokens)))
        lend(lender, keys)
        reply = reader.lookup(keys)
        assert reader.holds(reply)
        daemon.process.send_signal(signal.SIGKILL)
        daemon.process.wait(timeout=60)
        # The dead daemon's table still holds the read's id; the closed connection says it is void.
        assert reader.slots is not None and reader.slots.holds(reply.lent.slot - 1, reply.lent.read_id)
        assert not reader.holds(reply)
    daemon_factory("dies")  # started again where it died: it replaces what the dead one left


def test_each_connection_sees_its_own_slots_and_cannot_write_them(daemon: Daemon) -> None:
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as a,
        KVStoreClient.connect(daemon.address, SPEC) as b,
    ):
        keys = lender.keys(list(range(SPEC.chunk_tokens)))
        lend(lender, keys)
        first, second = Reader(a), Reader(b)
        mine, theirs = first.lookup(keys), second.lookup(keys)
        assert first.holds(mine) and second.holds(theirs)
        assert first.slots is not None and second.slots is not None
        assert not second.slots.holds(mine.lent.slot - 1, mine.lent.read_id)
        fds: list[int] = []
        request = pb.LookupRequest(
            namespace=a.namespace, keys=pack_keys(keys), lease=True, lent_devices=[BUS], read_slots=True
        )
        again = first.local.call("Lookup", request, fds=fds)
        assert again.lent.read_slots_sent and len(fds) == 1  # asked again: the same table
        try:
            with pytest.raises(PermissionError):  # sealed: only the daemon writes it
                mmap.mmap(fds[0], SLOTS * 8)
            view = SlotView(os.dup(fds[0]))
            assert view.holds(again.lent.slot - 1, again.lent.read_id)
            view.close()
        finally:
            os.close(fds[0])
        for reply in (again, mine):
            assert returned(a, reply.lent.read_id) == 1
        assert returned(b, theirs.lent.read_id) == 1


def read_many(lender: KVStoreClient, reader: Reader, lends: int) -> tuple[list[Any], bytes]:
    """`lends` one-chunk lends, each read MAX_READS times by `reader` (the replies), and one more
    key, not lent."""
    *keys, spare = lender.keys(list(range((lends + 1) * SPEC.chunk_tokens)))
    for i, key in enumerate(keys):
        lend(lender, [key], first=100 + i * SPEC.blocks_per_chunk)
    return [reader.lookup([key]) for key in keys for _ in range(MAX_READS)], spare


def test_reads_past_the_slots_are_answered_by_returned(daemon: Daemon) -> None:
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as c,
    ):
        reader = Reader(c)
        replies, spare = read_many(lender, reader, SLOTS // MAX_READS + 1)
        with_slots = [r for r in replies if r.lent.slot]
        assert len(with_slots) == SLOTS and all(reader.holds(r) for r in with_slots)
        assert len({r.lent.slot for r in with_slots}) == SLOTS
        assert all(r.HasField("lent") and not r.lent.slot for r in replies[SLOTS:])
        assert all(returned(c, r.lent.read_id) == 1 for r in replies)
        assert not any(reader.holds(r) for r in with_slots)
        lend(lender, [spare])
        freed = reader.lookup([spare])  # a returned read's slot serves the next read
        assert freed.lent.slot and reader.holds(freed)
        assert returned(c, freed.lent.read_id) == 1


def test_a_begun_call_is_answered_in_order_around_other_calls(daemon: Daemon) -> None:
    """`LocalChannel.begin`: the reply is taken when asked for, whether a later call read it
    first or not; an error comes out of `result()`; a channel closed meanwhile says so."""
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as c,
    ):
        keys = lender.keys(list(range(SPEC.chunk_tokens)))
        lend(lender, keys)
        local = c._conn.local
        request = pb.LookupRequest(
            namespace=c.namespace, keys=pack_keys(keys), lease=True, lent_devices=[BUS]
        )
        first = local.begin("Lookup", request)
        refused = local.begin("Lend", pb.LendRequest(namespace=c.namespace))
        second = local.begin("Lookup", request)
        assert c.stats()["counters"]["lent_reads"] == 2  # a later call read the three replies first
        reads = [first.result(), second.result()]
        assert [r.lent.blocks for r in reads] == [blocks_of(1)] * 2
        assert reads[0].lent.read_id != reads[1].lent.read_id
        with pytest.raises(InvalidArgument, match="no keys"):
            refused.result()
        last = local.begin("Lookup", request)
        assert last.result().HasField("lent")  # read by result() itself
        for reply in (*reads, last.result()):
            assert returned(c, reply.lent.read_id) == 1
        lost = local.begin("Stats", pb.StatsRequest())
        local.close()
        with pytest.raises(Unavailable):
            lost.result()


def test_a_lends_nonce_comes_with_each_of_its_reads(daemon: Daemon) -> None:
    """The lender's number for a lend (what its ticket carries) names that lend to its readers,
    and a later lend of the same keys and blocks carries its own."""
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as c,
    ):
        reader = Reader(c)
        keys = lender.keys(list(range(SPEC.chunk_tokens)))
        nonces = []
        for nonce in (7, 2**63 + 1):
            lend_id = lender._conn.rpc("Lend", lend_request(lender, keys, nonce)).lend_id
            reply = reader.lookup(keys)
            nonces.append(reply.lent.nonce)
            assert returned(c, reply.lent.read_id) == 1
            assert done(lender, [lend_id]) == [lend_id]
        assert nonces == [7, 2**63 + 1]


def test_a_lenders_exit_frees_the_slots_of_its_reads_in_flight(daemon: Daemon) -> None:
    """Reads of a lend that ended (here: its lender gone) give their slots back at once, so a
    reader that never returned them is not left without slots for later lends."""
    lends = SLOTS // MAX_READS + 1
    with KVStoreClient.connect(daemon.address, SPEC) as c:
        reader = Reader(c)
        lender = KVStoreClient.connect(daemon.address, SPEC)
        *keys, spare = lender.keys(list(range((lends + 1) * SPEC.chunk_tokens)))
        for i, key in enumerate(keys):
            lend(lender, [key], first=100 + i * SPEC.blocks_per_chunk)
        replies = [reader.lookup([key]) for key in keys for _ in range(MAX_READS)]
        assert sum(1 for r in replies if r.lent.slot) == SLOTS  # every slot taken, none returned
        lender.close()
        with KVStoreClient.connect(daemon.address, SPEC) as second:
            lend(second, [spare])
            fresh = wait_until(lambda: reader.lookup([spare]))
            assert fresh.lent.slot and reader.holds(fresh)
            assert not any(reader.holds(r) for r in replies if r.lent.slot)
            assert returned(c, fresh.lent.read_id) == 1


def test_the_slots_descriptor_goes_with_a_few_replies_at_most(daemon: Daemon) -> None:
    """A worker that asks for its read slots again and again, never keeping them, gets them with
    `MAX_SLOTS_SENT` replies: the daemon's descriptors in flight stay bounded."""
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as c,
    ):
        keys = lender.keys(list(range(SPEC.chunk_tokens)))
        request = pb.LookupRequest(
            namespace=c.namespace, keys=pack_keys(keys), lease=True, lent_devices=[BUS], read_slots=True
        )
        sent = 0
        for _ in range(MAX_SLOTS_SENT + 4):
            lend(lender, keys)
            fds: list[int] = []
            reply = c._conn.local.call("Lookup", request, fds=fds)
            assert reply.HasField("lent") and len(fds) == int(reply.lent.read_slots_sent)
            sent += len(fds)
            for fd in fds:
                os.close(fd)
            assert returned(c, reply.lent.read_id) == 1
        assert sent == MAX_SLOTS_SENT


def test_a_closed_connection_is_seen_before_the_event_loop_sees_it() -> None:
    """`Peer.hung_up`: a lender that gave up on its call closed its channel before reusing its
    blocks; the daemon refuses its Lend and grants no read of its lends from then on, even with
    its last frames still unread."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        peer = Peer(connected=True)
        peer.socket_fd = mine.fileno()
        assert not peer.hung_up()
        theirs.sendall(b"a Lend frame, not read yet")
        assert not peer.hung_up()
        theirs.close()
        assert peer.hung_up()
        peer.connected = False
        assert peer.hung_up()
    finally:
        mine.close()


def test_a_ticket_handed_over_by_a_callback_that_fails_leaves_no_lend(daemon: Daemon) -> None:
    """`lend(meanwhile=...)`: the Lend is sent before the callback runs (outside the channel, so
    the callback may call the daemon itself); if it raises, the recorded lend is revoked before
    the error reaches the lender, which may then reuse its blocks at once."""
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as c,
    ):
        reader = Reader(c)
        keys = lender.keys(list(range(2 * SPEC.chunk_tokens)))

        def request() -> pb.LendRequest:
            return lend_request(lender, keys, nonce=5)

        def failing(ticket: bytes) -> None:
            assert pb.LentRead.FromString(ticket).nonce == 5
            assert lender.stats()["counters"]["lends"] >= 1  # a call of its own, on the same channel
            raise RuntimeError("the router is gone")

        with pytest.raises(RuntimeError, match="router"):
            lender._lends._told(
                lender._conn.local, request(), failing, pb.LentRead(nonce=5).SerializeToString()
            )
        assert not reader.lookup(keys).HasField("lent")  # revoked before the error came out

        seen: list[int] = []
        reply = lender._lends._told(
            lender._conn.local,
            request(),
            lambda ticket: seen.append(lender.stats()["counters"]["lends"]),
            b"",
        )
        assert seen == [2] and reply.lend_id
        got = reader.lookup(keys)
        assert got.lent.nonce == 5 and reader.holds(got)
        assert returned(c, got.lent.read_id) == 1
        assert done(lender, [reply.lend_id]) == [reply.lend_id]


def test_a_ticketed_lend_after_a_daemon_restart_connects_again(daemon_factory: Callable[..., Daemon]) -> None:
    """The lender's channel broke with the daemon it was made to: the Lend is sent on a new one,
    and the ticket handed over once."""
    daemon = daemon_factory("restarts")
    with KVStoreClient.connect(daemon.address, SPEC) as lender:
        keys = lender.keys(list(range(SPEC.chunk_tokens)))
        assert daemon.stop() == 0
        daemon = daemon_factory("restarts")
        told: list[bytes] = []
        request = lend_request(lender, keys, nonce=8)
        broken = lender._conn.local
        reply = lender._lends._told(broken, request, told.append, b"the ticket")
        assert told == [b"the ticket"] and reply.lend_id
        assert lender._conn.local is not broken  # sent on a new channel
        with KVStoreClient.connect(daemon.address, SPEC) as c:
            got = Reader(c).lookup(keys)
            assert got.lent.nonce == 8
            assert returned(c, got.lent.read_id) == 1
        assert done(lender, [reply.lend_id]) == [reply.lend_id]
