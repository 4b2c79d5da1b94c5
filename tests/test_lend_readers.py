"""A lend read by several workers (`LendRequest.readers`: each rank of a TP decode instance reads a
group every rank holds alike, MLA's latent) against a real kvstored over its local channel: the lend
stays until reads of that many readers (connections) returned in time, each reader gets the same
blocks, a read given back unused or lapsed, or a reader's second read, does not count, its hold
still ends it, and a count out of range is refused by name."""

from __future__ import annotations

import time

import pytest

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.errors import InvalidArgument
from kvstore_client import KVStoreClient
from tests.harness import Daemon
from tests.test_lend_slots import Reader, lend_request
from tests.test_lends import SPEC, blocks_of, done, returned

CHUNK = SPEC.chunk_tokens


def lend(client: KVStoreClient, keys: list[bytes], readers: int, hold_ms: int = 0) -> int:
    request = lend_request(client, keys, nonce=0)
    request.readers, request.hold_ms = readers, hold_ms
    return client._conn.rpc("Lend", request).lend_id


def test_a_lend_for_two_readers_is_read_by_each_and_done_after_the_second(daemon: Daemon) -> None:
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as rank0,
        KVStoreClient.connect(daemon.address, SPEC) as rank1,
        KVStoreClient.connect(daemon.address, SPEC) as rank2,
    ):
        keys = lender.keys(list(range(3 * CHUNK)))
        lend_id = lend(lender, keys, readers=2)
        first = Reader(rank0).lookup(keys)
        assert first.hit_chunks == 3 and first.lent.blocks == blocks_of(3)
        assert returned(rank0, first.lent.read_id) == 1
        assert done(lender, [lend_id]) == []  # one of two: still lent
        second = Reader(rank1).lookup(keys)  # after the first returned
        assert second.hit_chunks == 3 and second.lent.blocks == blocks_of(3)
        assert second.lent.read_id != first.lent.read_id
        assert returned(rank1, second.lent.read_id) == 1
        assert done(lender, [lend_id]) == [lend_id]
        assert not Reader(rank2).lookup(keys).HasField("lent")  # a third finds it done


def test_reads_given_back_unused_or_lapsed_or_by_the_same_reader_do_not_count(daemon: Daemon) -> None:
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as c,
    ):
        keys = lender.keys(list(range(2 * CHUNK)))
        lend_id = lend(lender, keys, readers=2)
        reader = Reader(c)
        unused = reader.lookup(keys)
        request = pb.ReturnedRequest(namespace=c.namespace, read_id=unused.lent.read_id, unused=True)
        assert c._conn.rpc("Returned", request).pages == 0
        assert returned(c, 12345) == 0  # no such read
        assert done(lender, [lend_id]) == []
        for _ in range(2):  # one worker (one connection) reading twice, as a rank whose load skips
            reply = reader.lookup(keys)  # the cached part of its first chunk does: one reader
            assert reply.hit_chunks == 2 and returned(c, reply.lent.read_id) == 1
        assert done(lender, [lend_id]) == []
        with KVStoreClient.connect(daemon.address, SPEC) as other:  # the second reader
            reply = Reader(other).lookup(keys)
            assert returned(other, reply.lent.read_id) == 1
        assert done(lender, [lend_id]) == [lend_id]


def test_a_lend_whose_readers_never_all_come_ends_with_its_hold(daemon: Daemon) -> None:
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as c,
    ):
        keys = lender.keys(list(range(CHUNK)))
        lend_id = lend(lender, keys, readers=4, hold_ms=300)
        reply = Reader(c).lookup(keys)
        assert returned(c, reply.lent.read_id) == 1
        deadline = time.monotonic() + 30
        while done(lender, [lend_id]) != [lend_id]:  # one of four read it: the hold ends it
            assert time.monotonic() < deadline, "the lend outlived its hold"
            time.sleep(0.02)


def test_a_reader_count_out_of_range_is_refused_by_name(daemon: Daemon) -> None:
    with KVStoreClient.connect(daemon.address, SPEC) as lender:
        keys = lender.keys(list(range(CHUNK)))
        with pytest.raises(
            InvalidArgument, match=r"readers must be 1\.\.16 \(the ranks that each read the lend\), got 17"
        ):
            lend(lender, keys, readers=17)
        lend_id = lend(lender, keys, readers=0)  # unset: one reader
        with KVStoreClient.connect(daemon.address, SPEC) as c:
            reply = Reader(c).lookup(keys)
            assert returned(c, reply.lent.read_id) == 1
        assert done(lender, [lend_id]) == [lend_id]
