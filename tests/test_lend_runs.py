"""A prompt lent a step at a time (chunked prefill: one lend per step, each of the chunks that step
computed) is read whole, in one read of every lend it goes through, against a real kvstored over its
local channel: the blocks of each lend in order, the read holding each lend until returned, and
ending with any of them. A run stops where the keys part, or at a lend of another cache or GPU."""

from __future__ import annotations

import numpy as np

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.keys import pack_keys
from kvstore_client import KVStoreClient
from tests.harness import Daemon
from tests.test_lend_slots import Reader
from tests.test_lends import BUS, OTHER_BUS, PER_CHUNK, SPEC, blocks_of, done, returned

CHUNK = SPEC.chunk_tokens


def lend_step(
    client: KVStoreClient, keys: list[bytes], first: int, cache: bytes = b'{"version":1}', bus: str = BUS
) -> int:
    request = pb.LendRequest(
        namespace=client.namespace,
        keys=pack_keys(keys),
        blocks=blocks_of(len(keys), first),
        cache=cache,
        device_pci_bus_id=bus,
    )
    return client._conn.rpc("Lend", request).lend_id


def query(client: KVStoreClient, keys: list[bytes]) -> int:
    request = pb.LookupRequest(namespace=client.namespace, keys=pack_keys(keys), lent_devices=["*"])
    return client._conn.rpc("Lookup", request).hit_chunks


def test_a_prompt_lent_step_by_step_is_read_whole(daemon: Daemon) -> None:
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as c,
    ):
        reader = Reader(c)
        keys = lender.keys(list(range(7 * CHUNK)))
        steps = [(0, 3, 100), (3, 5, 500), (5, 7, 300)]  # chunks [a, b) lent at blocks from `first`
        ids = [lend_step(lender, keys[a:b], first) for a, b, first in steps]
        assert query(c, keys) == 7
        reply = reader.lookup(keys)
        assert reply.hit_chunks == 7 and reply.lent.cache == b'{"version":1}'
        expected = b"".join(blocks_of(b - a, first) for a, b, first in steps)
        assert reply.lent.blocks == expected
        assert np.frombuffer(reply.lent.blocks, dtype="<i4").size == 7 * PER_CHUNK
        assert reader.holds(reply)
        assert done(lender, ids) == []  # each lend held by the read
        assert returned(c, reply.lent.read_id) == 1
        assert sorted(done(lender, ids)) == sorted(ids)  # read: every one of them done
        later = reader.lookup(keys[3:])  # a reader of the later chunks alone: nothing left lent
        assert not later.HasField("lent")


def test_a_read_across_lends_ends_with_any_of_them(daemon: Daemon) -> None:
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as c,
    ):
        reader = Reader(c)
        keys = lender.keys(list(range(4 * CHUNK)))
        first_id, second_id = lend_step(lender, keys[:2], 100), lend_step(lender, keys[2:], 200)
        reply = reader.lookup(keys)
        assert reply.hit_chunks == 4 and reader.holds(reply)
        revoke = pb.LendsRequest(namespace=lender.namespace, lend_ids=[second_id], revoke=True)
        assert list(lender._conn.rpc("Lends", revoke).done) == [second_id]
        assert not reader.holds(reply)  # emptied before the revoke was answered
        assert returned(c, reply.lent.read_id) == 0
        again = reader.lookup(keys)  # the first lend is not held by the ended read: read alone now
        assert again.hit_chunks == 2 and again.lent.blocks == blocks_of(2, 100)
        assert returned(c, again.lent.read_id) == 1
        assert done(lender, [first_id]) == [first_id]


def test_a_run_stops_where_the_keys_part_or_another_cache_or_gpu_lends(daemon: Daemon) -> None:
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as other,
        KVStoreClient.connect(daemon.address, SPEC) as c,
    ):
        reader = Reader(c)
        keys = lender.keys(list(range(6 * CHUNK)))
        lend_step(lender, keys[:2], 100)
        lend_step(other, keys[2:4], 100, cache=b'{"version":1,"another":1}')  # another worker's cache
        lend_step(lender, keys[4:], 300)
        assert query(c, keys) == 2
        reply = reader.lookup(keys)
        assert reply.hit_chunks == 2 and reply.lent.blocks == blocks_of(2, 100)
        assert returned(c, reply.lent.read_id) == 1

        more = lender.keys(list(range(10_000, 10_000 + 4 * CHUNK)))  # another prompt
        lend_step(lender, more[:2], 600)
        lend_step(lender, more[2:], 700, bus=OTHER_BUS)  # the same cache's descriptor from another GPU
        reply = reader.lookup(more)
        assert reply.hit_chunks == 2 and reply.lent.blocks == blocks_of(2, 600)
        assert returned(c, reply.lent.read_id) == 1
        diverged = [*more[:2], lender.keys(list(range(20_000, 20_000 + CHUNK)))[0]]
        lend_step(lender, more[:2], 800)
        assert query(c, diverged) == 2  # the third key is nobody's: the run ends at two
