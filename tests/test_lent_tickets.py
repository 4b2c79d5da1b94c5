"""What a ticket's copy counts (`kvstore_client.lent_tickets`), decided once the copy is done from
the daemon's answer to the reader's Lookup and the read's slot, against a real kvstored over its
local channel. The copy itself needs GPUs (`test_lends_cuda.py`); here the answer alone is judged,
for every way it can fail: another lend of the same blocks, other blocks, a lend ended during the
copy, a read past its TTL, no lend at all (the tiers' lease is released), a read without a slot.
Also: calls begun, sent and made on one channel from several threads stay in step."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.keys import pack_keys
from kvstore.shared.read_slots import SLOTS
from kvstore.store.lends import MAX_READS
from kvstore_client import KVStoreClient
from kvstore_client.lent_tickets import _answered, _Asking
from tests.harness import Daemon
from tests.test_lend_slots import Reader, lend_request, read_many
from tests.test_lends import BUS, SPEC, blocks_of, done, lend

CACHE = b'{"version":1}'  # test_lends' lend() sends this descriptor


def lend_with_nonce(client: KVStoreClient, keys: list[bytes], nonce: int) -> int:
    return client._conn.rpc("Lend", lend_request(client, keys, nonce)).lend_id


def ticket(keys: list[bytes], nonce: int, blocks: bytes | None = None) -> Any:
    return pb.LentRead(
        cache=CACHE,
        device_pci_bus_id=BUS,
        blocks=blocks_of(len(keys)) if blocks is None else blocks,
        nonce=nonce,
    )


def judged(reader: KVStoreClient, keys: list[bytes], lent: Any, asked: float | None = None) -> int:
    """The tokens a ticket's copy of `keys` counts (the copy taken as done now)."""
    local = reader._conn.local
    asking = _Asking(local, reader.namespace, keys, [BUS])
    asking.ask()  # what the handle's wait() does before it blocks on the copy
    return _answered(reader, local, asking, lent, len(keys), time.monotonic() if asked is None else asked)


def test_a_ticket_counts_for_its_own_lend_only(daemon: Daemon) -> None:
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as c,
    ):
        Reader(c).lookup([b"\0" * 16])  # no lend: this asks for the read slots, which come with a lent reply
        keys = lender.keys(list(range(2 * SPEC.chunk_tokens)))
        warm = lend_with_nonce(lender, keys, nonce=1)
        Reader(c).lookup(keys)  # the connection's read slots come with this reply
        c._conn.rpc("Lends", pb.LendsRequest(namespace=c.namespace, lend_ids=[warm], revoke=True))
        assert c._conn.local.read_slots is not None

        first = lend_with_nonce(lender, keys, nonce=11)
        assert judged(c, keys, ticket(keys, nonce=11)) == 2 * SPEC.chunk_tokens
        assert done(lender, [first]) == [first]  # read once: done

        second = lend_with_nonce(lender, keys, nonce=12)
        assert judged(c, keys, ticket(keys, nonce=11)) == 0  # an earlier lend's ticket
        other = np.frombuffer(blocks_of(2), dtype="<i4").copy()
        other[0] += 1
        assert judged(c, keys, ticket(keys, nonce=12, blocks=other.tobytes())) == 0  # other blocks
        assert done(lender, [second]) == []  # both given back unused: the lend waits for its reader
        old = time.monotonic() - 2 * daemon_ttl_s(c)
        assert judged(c, keys, ticket(keys, nonce=12), asked=old) == 0  # past its TTL on this clock
        assert judged(c, keys, ticket(keys, nonce=12)) == 2 * SPEC.chunk_tokens
        assert done(lender, [second]) == [second]


def daemon_ttl_s(client: KVStoreClient) -> float:
    return float(client.lease_ttl_s)


def test_a_ticket_whose_lend_ended_or_is_not_there_counts_nothing(daemon: Daemon) -> None:
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as c,
    ):
        keys = lender.keys(list(range(2 * SPEC.chunk_tokens)))
        lend_with_nonce(lender, keys, nonce=3)
        Reader(c).lookup(keys)
        assert c._conn.local.read_slots is not None
        lend_id = lend_with_nonce(lender, keys, nonce=4)
        local = c._conn.local
        asking = _Asking(local, c.namespace, keys, [BUS])
        asking.ask()  # the read is taken during the copy ...
        revoke = pb.LendsRequest(namespace=lender.namespace, lend_ids=[lend_id], revoke=True)
        assert list(lender._conn.rpc("Lends", revoke).done) == [lend_id]  # ... and the lend revoked
        assert _answered(c, local, asking, ticket(keys, nonce=4), 2, time.monotonic()) == 0

        # No lend: the tiers answer the Lookup (here they hold the prompt) and their lease is let go.
        cache = [torch.randn(2, 64, 16, 2, 16, dtype=torch.float16) for _ in range(SPEC.num_layers)]
        assert c.store(list(range(2 * SPEC.chunk_tokens)), cache, list(range(32))) == 2  # chunks
        assert judged(c, keys, ticket(keys, nonce=4)) == 0
        assert c.stats()["counters"]["active_load_leases"] == 0  # its Release went before this call
        assert c.load(
            list(range(2 * SPEC.chunk_tokens)), [torch.zeros_like(t) for t in cache], list(range(32))
        ) == (2 * SPEC.chunk_tokens)


def test_a_ticket_read_without_a_slot_waits_for_returned(daemon: Daemon) -> None:
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as c,
    ):
        taken, last = read_many(lender, Reader(c), SLOTS // MAX_READS)
        assert all(r.lent.slot for r in taken)  # every slot is taken now
        lend_with_nonce(lender, [last], nonce=9)
        assert judged(c, [last], ticket([last], nonce=9)) == SPEC.chunk_tokens


def test_calls_begun_sent_and_made_from_threads_stay_in_step(daemon: Daemon) -> None:
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as c,
    ):
        prompts = [lender.keys([7 * n + t for t in range((n % 3 + 1) * SPEC.chunk_tokens)]) for n in range(8)]
        for n, keys in enumerate(prompts):
            lend(lender, keys, first=100 + 64 * n)
        local, failures = c._conn.local, []

        def worker(n: int) -> None:
            keys = prompts[n]
            query = pb.LookupRequest(namespace=c.namespace, keys=pack_keys(keys), lent_devices=[BUS])
            try:
                for _ in range(50):
                    begun = local.begin("Lookup", query)
                    local.send("Stats", pb.StatsRequest())
                    made = local.call("Lookup", query)
                    assert begun.result().hit_chunks == made.hit_chunks == len(keys), (n, len(keys))
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not failures, failures[0]
