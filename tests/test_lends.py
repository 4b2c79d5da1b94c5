"""Lent blocks (`kvstore.store.lends`), the protocol against a real kvstored over its local channel:
what a Lend makes visible to whom, when its blocks may be reused, and what a read is worth when the
lender went away, the hold ended or the daemon restarted. The device-to-device copy itself is in
`test_lends_cuda.py`."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.shared.domain import Tier
from kvstore.shared.errors import FailedPrecondition, InvalidArgument, NotFound
from kvstore.shared.keys import pack_keys
from kvstore_client import KVSpec, KVStoreClient
from tests.harness import Daemon

SPEC = KVSpec(
    model="lend-test",
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    dtype=torch.float16,
    block_size=16,
    chunk_tokens=256,
)
BUS, OTHER_BUS = "0000:19:00.0", "0000:3b:00.0"
CACHE = b'{"version":1}'  # the daemon hands the descriptor over as sent
PER_CHUNK = SPEC.blocks_per_chunk


def wait_until(condition: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)
    return value


def blocks_of(chunks: int, first: int = 100) -> bytes:
    return np.arange(first, first + chunks * PER_CHUNK, dtype="<i4").tobytes()


def lend(client: KVStoreClient, keys: list[bytes], hold_ms: int = 0, first: int = 100) -> int:
    request = pb.LendRequest(
        namespace=client.namespace,
        keys=pack_keys(keys),
        blocks=blocks_of(len(keys), first),
        cache=CACHE,
        device_pci_bus_id=BUS,
        hold_ms=hold_ms,
    )
    return client._conn.rpc("Lend", request).lend_id


def lookup(client: KVStoreClient, keys: list[bytes], devices: tuple[str, ...] = (BUS,)) -> Any:
    request = pb.LookupRequest(
        namespace=client.namespace, keys=pack_keys(keys), lease=True, lent_devices=devices
    )
    return client._conn.rpc("Lookup", request)


def returned(client: KVStoreClient, read_id: int) -> int:
    return client._conn.rpc("Returned", pb.ReturnedRequest(namespace=client.namespace, read_id=read_id)).pages


def done(client: KVStoreClient, ids: list[int], withdraw: bool = False) -> list[int]:
    request = pb.LendsRequest(namespace=client.namespace, lend_ids=ids, withdraw=withdraw)
    return list(client._conn.rpc("Lends", request).done)


def release(client: KVStoreClient, reply: Any) -> None:
    if reply.lease_id:
        client._conn.rpc("Release", pb.LeaseRequest(namespace=client.namespace, lease_id=reply.lease_id))


def test_a_lend_is_read_once_then_done(daemon: Daemon) -> None:
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, SPEC) as reader,
    ):
        keys = lender.keys(list(range(4 * SPEC.chunk_tokens)))
        lend_id = lend(lender, keys)
        assert done(lender, [lend_id]) == []  # held: no read yet
        reply = lookup(reader, keys)
        assert reply.HasField("lent") and reply.hit_chunks == 4 and reply.lease_id == 0
        assert reply.tiers == bytes([Tier.LENT]) * 4
        assert reply.lent.blocks == blocks_of(4) and reply.lent.cache == CACHE
        assert reply.lent.device_pci_bus_id == BUS and reply.lent.ttl_ms == 30_000
        assert done(lender, [lend_id]) == []  # a read in flight holds it
        assert returned(reader, reply.lent.read_id) == 1
        assert done(lender, [lend_id]) == [lend_id]
        assert returned(reader, reply.lent.read_id) == 0  # once only
        again = lookup(reader, keys)  # done: the tiers answer, and they hold nothing
        assert not again.HasField("lent") and again.hit_chunks == 0
        counters = reader.stats()["counters"]
        assert counters["lends"] == 1 and counters["lent_reads_returned"] == 1


def test_a_query_counts_lent_chunks_and_holds_nothing(daemon: Daemon) -> None:
    """A scheduler's Lookup (no lease) counts lent chunks where they are more than the stored ones,
    from any GPU; it takes no read, so the lend ends with its hold as if unasked."""
    tokens = list(range(3 * SPEC.chunk_tokens))
    cache = [torch.randn(2, 48, 16, 2, 16).half() for _ in range(2)]
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        keys = client.keys(tokens)
        assert client.store(tokens[: SPEC.chunk_tokens], cache, torch.arange(16)) == 1
        lend_id = lend(client, keys, hold_ms=500)
        assert client.lookup(tokens) == 3 * SPEC.chunk_tokens
        query = pb.LookupRequest(namespace=client.namespace, keys=pack_keys(keys), lent_devices=[OTHER_BUS])
        assert client._conn.rpc("Lookup", query).hit_chunks == 1  # lent on another GPU: the stored one
        wait_until(lambda: done(client, [lend_id]) == [lend_id])
        assert client.lookup(tokens) == SPEC.chunk_tokens
        assert client.stats()["counters"]["lent_reads"] == 0


def test_a_read_covers_the_lent_run_from_the_first_key(daemon: Daemon) -> None:
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        keys = client.keys(list(range(6 * SPEC.chunk_tokens)))
        lend(client, keys[1:4])
        assert not lookup(client, keys).HasField("lent")  # the first key is not lent
        reply = lookup(client, keys[1:])  # keys 1..3 lent, 4.. not
        assert reply.hit_chunks == 3 and reply.lent.blocks == blocks_of(3)
        returned(client, reply.lent.read_id)


def test_only_readers_of_the_lenders_gpu_and_namespace_get_lent_blocks(daemon: Daemon) -> None:
    other_spec = KVSpec(
        model="lend-other", num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, block_size=16
    )
    with (
        KVStoreClient.connect(daemon.address, SPEC) as lender,
        KVStoreClient.connect(daemon.address, other_spec) as other,
    ):
        keys = lender.keys(list(range(2 * SPEC.chunk_tokens)))
        lend(lender, keys)
        for reply in (lookup(lender, keys, (OTHER_BUS,)), lookup(lender, keys, ())):
            assert not reply.HasField("lent") and reply.hit_chunks == 0
        other_keys = [key for key in keys]  # the same bytes named in another namespace
        reply = lookup(other, other_keys)
        assert not reply.HasField("lent") and reply.hit_chunks == 0


def test_the_tiers_answer_where_they_hold_a_longer_prefix(daemon: Daemon) -> None:
    tokens = list(range(4 * SPEC.chunk_tokens))
    cache = [torch.randn(2, 64, 16, 2, 16).half() for _ in range(2)]
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        assert client.store(tokens, cache, torch.arange(64)) == 4
        keys = client.keys(tokens)
        lend(client, keys[:2])
        reply = lookup(client, keys)
        assert not reply.HasField("lent") and reply.hit_chunks == 4 and reply.lease_id
        release(client, reply)
        target = [torch.full_like(t, float("nan")) for t in cache]
        assert client.load(tokens, target, torch.arange(64)) == 4 * SPEC.chunk_tokens  # CPU: no lent read
        assert all(torch.equal(got, want) for got, want in zip(target, cache, strict=True))


def test_the_hold_ends_a_lend_nobody_reads(daemon: Daemon) -> None:
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        keys = client.keys(list(range(2 * SPEC.chunk_tokens)))
        lend_id = lend(client, keys, hold_ms=300)
        wait_until(lambda: done(client, [lend_id]) == [lend_id])
        assert not lookup(client, keys).HasField("lent")


def test_a_read_in_flight_holds_the_lend_past_its_hold(daemon: Daemon) -> None:
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        keys = client.keys(list(range(2 * SPEC.chunk_tokens)))
        lend_id = lend(client, keys, hold_ms=200)
        reply = lookup(client, keys)
        started = time.monotonic()
        wait_until(lambda: time.monotonic() > started + 0.5)
        assert done(client, [lend_id]) == []
        assert not lookup(client, keys).HasField("lent")  # past the hold: no new read
        assert returned(client, reply.lent.read_id) == 1  # within its TTL: the copy counts
        assert done(client, [lend_id]) == [lend_id]


def test_a_read_returned_after_its_ttl_is_worth_nothing(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(leases__ttl_s=0.3)
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        keys = client.keys(list(range(2 * SPEC.chunk_tokens)))
        lend_id = lend(client, keys, hold_ms=100)
        reply = lookup(client, keys)
        wait_until(lambda: done(client, [lend_id]) == [lend_id])  # the read lapsed, then the hold ended
        assert returned(client, reply.lent.read_id) == 0


def test_withdraw_waits_for_the_read_in_flight(daemon: Daemon) -> None:
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        keys = client.keys(list(range(2 * SPEC.chunk_tokens)))
        lend_id = lend(client, keys)
        reply = lookup(client, keys)
        assert done(client, [lend_id], withdraw=True) == []
        assert not lookup(client, keys).HasField("lent")  # withdrawn: no new read
        assert returned(client, reply.lent.read_id) == 1
        assert done(client, [lend_id]) == [lend_id]
        unread = lend(client, keys)
        assert done(client, [unread], withdraw=True) == [unread]


def _lend_and_exit(address: str, keys: list[bytes], ready: Any) -> None:
    with KVStoreClient.connect(address, SPEC) as client:
        ready.put(lend(client, keys))
        ready.close()
        ready.join_thread()  # the id is in the pipe before the process ends
    os._exit(0)  # noqa: SLF001 - the process ends with its lends still held


def test_a_lenders_exit_ends_its_lends_and_their_reads(daemon: Daemon) -> None:
    context = mp.get_context("spawn")
    with KVStoreClient.connect(daemon.address, SPEC) as reader:
        keys = reader.keys(list(range(3 * SPEC.chunk_tokens)))
        ready = context.Queue()
        lender = context.Process(target=_lend_and_exit, args=(daemon.address, keys[:2], ready))
        lender.start()
        lend_id = ready.get(timeout=60)
        reply = wait_until(lambda: lookup(reader, keys[:2]))
        lender.join(timeout=60)
        assert lender.exitcode == 0
        if reply.HasField("lent"):  # read before the exit was seen: worth nothing now
            wait_until(lambda: not lookup(reader, keys[:2]).HasField("lent"))
            assert returned(reader, reply.lent.read_id) == 0
        assert done(reader, [lend_id]) == [lend_id]


def test_clear_and_restart_end_lends(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory("lends")
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        keys = client.keys(list(range(2 * SPEC.chunk_tokens)))
        lend_id = lend(client, keys)
        reply = lookup(client, keys)
        client.clear()
        assert returned(client, reply.lent.read_id) == 0
        assert not lookup(client, keys).HasField("lent")
        assert done(client, [lend_id]) == [lend_id]
        lend_id = lend(client, keys)
        reply = lookup(client, keys)
        assert daemon.stop() == 0
        daemon_factory("lends")  # the same socket
        wait_until(lambda: _serves(client))
        assert returned(client, reply.lent.read_id) == 0
        assert done(client, [lend_id]) == [lend_id]  # a lend of another daemon run: unknown, done
        assert not lookup(client, keys).HasField("lent")


def _serves(client: KVStoreClient) -> bool:
    try:
        client.stats()
    except Exception:  # noqa: BLE001 - still restarting
        return False
    return True


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"blocks": b"\x00" * 6}, InvalidArgument, "blocks must hold the same number"),
        ({"blocks": b""}, InvalidArgument, "blocks must hold the same number"),
        ({"cache": b""}, InvalidArgument, "cache must be 1..262144 bytes"),
        ({"cache": b"x" * (256 * 1024 + 1)}, InvalidArgument, "cache must be 1..262144 bytes"),
        ({"device_pci_bus_id": ""}, InvalidArgument, "device_pci_bus_id must name"),
        ({"hold_ms": 600_001}, InvalidArgument, "hold_ms must be at most 600000"),
        ({"keys": b""}, InvalidArgument, "no keys"),
        ({"keys": b"k" * 17}, InvalidArgument, "16-byte keys"),
        ({"namespace": b"n" * 16}, NotFound, "namespace"),
    ],
)
def test_bad_lends_are_refused(daemon: Daemon, change: dict[str, Any], error: type, message: str) -> None:
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        keys = client.keys(list(range(2 * SPEC.chunk_tokens)))
        fields = dict(
            namespace=client.namespace,
            keys=pack_keys(keys),
            blocks=blocks_of(2),
            cache=CACHE,
            device_pci_bus_id=BUS,
        )
        fields.update(change)
        with pytest.raises(error, match=message):
            client._conn.rpc("Lend", pb.LendRequest(**fields))
        assert client.stats()["counters"]["lends_held"] == 0


def test_lend_is_refused_over_grpc(daemon: Daemon) -> None:
    with KVStoreClient.connect(daemon.address, SPEC, local_channel=False) as client:
        keys = client.keys(list(range(SPEC.chunk_tokens)))
        with pytest.raises(FailedPrecondition, match="local channel only"):
            lend(client, keys)
        with grpc.insecure_channel(daemon.address) as channel:  # the status a person sees
            request = pb.LendRequest(namespace=client.namespace, keys=pack_keys(keys), blocks=blocks_of(1),
                                     cache=CACHE, device_pci_bus_id=BUS)  # fmt: skip
            with pytest.raises(grpc.RpcError) as caught:
                pb_grpc.KVStoreStub(channel).Lend(request, timeout=10)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_the_client_lends_only_a_cuda_cache(daemon: Daemon) -> None:
    cache = [torch.zeros(2, 2 * PER_CHUNK, 16, 2, 16).half() for _ in range(2)]
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        with pytest.raises(ValueError, match="one CUDA device"):
            client.lend(list(range(2 * SPEC.chunk_tokens)), cache, torch.arange(2 * PER_CHUNK))
        assert client.lend(list(range(10)), cache, torch.arange(2 * PER_CHUNK)) == (0, 0)  # no whole chunk
        assert client.lend(list(range(2 * SPEC.chunk_tokens)), cache, torch.arange(PER_CHUNK - 1)) == (0, 0)
        assert client.lends_done([]) == []


def test_a_lend_ends_with_the_connection_it_was_made_on(daemon: Daemon) -> None:
    """A lender that closes its client (or whose call timed out, closing the channel) holds nothing
    any more: its lends end, and a read in flight counts 0."""
    with KVStoreClient.connect(daemon.address, SPEC) as reader:
        keys = reader.keys(list(range(2 * SPEC.chunk_tokens)))
        with KVStoreClient.connect(daemon.address, SPEC) as lender:
            lend_id = lend(lender, keys)
            reply = lookup(reader, keys)
            assert reply.HasField("lent")
        wait_until(lambda: not lookup(reader, keys).HasField("lent"))
        assert returned(reader, reply.lent.read_id) == 0
        assert done(reader, [lend_id]) == [lend_id]


def test_revoke_ends_a_lend_at_once_and_its_reads_count_nothing(daemon: Daemon) -> None:
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        keys = client.keys(list(range(2 * SPEC.chunk_tokens)))
        lend_id = lend(client, keys)
        reply = lookup(client, keys)
        request = pb.LendsRequest(namespace=client.namespace, lend_ids=[lend_id], revoke=True)
        assert list(client._conn.rpc("Lends", request).done) == [lend_id]
        assert returned(client, reply.lent.read_id) == 0
        assert not lookup(client, keys).HasField("lent")


def test_a_read_given_back_unused_leaves_the_lend_to_another_reader(daemon: Daemon) -> None:
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        keys = client.keys(list(range(2 * SPEC.chunk_tokens)))
        lend_id = lend(client, keys)
        first = lookup(client, keys)
        unused = pb.ReturnedRequest(namespace=client.namespace, read_id=first.lent.read_id, unused=True)
        assert client._conn.rpc("Returned", unused).pages == 0
        assert done(client, [lend_id]) == []
        second = lookup(client, keys)
        assert second.HasField("lent") and returned(client, second.lent.read_id) == 1
        assert done(client, [lend_id]) == [lend_id]


def test_reads_in_flight_of_one_lend_are_capped(daemon: Daemon) -> None:
    from kvstore.store.lends import MAX_READS

    with KVStoreClient.connect(daemon.address, SPEC) as client:
        keys = client.keys(list(range(2 * SPEC.chunk_tokens)))
        lend(client, keys)
        reads = [lookup(client, keys) for _ in range(MAX_READS)]
        assert all(reply.HasField("lent") for reply in reads)
        assert len({reply.lent.read_id for reply in reads}) == MAX_READS  # random, distinct
        assert not lookup(client, keys).HasField("lent")  # the tiers answer
        assert returned(client, reads[0].lent.read_id) == 1


def test_more_blocks_a_chunk_than_it_has_tokens_are_refused(daemon: Daemon) -> None:
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        keys = client.keys(list(range(SPEC.chunk_tokens)))
        blocks = bytes(4 * (SPEC.chunk_tokens + 1))
        request = pb.LendRequest(
            namespace=client.namespace,
            keys=pack_keys(keys),
            cache=CACHE,
            device_pci_bus_id=BUS,
            blocks=blocks,
        )
        with pytest.raises(InvalidArgument, match="1..256"):
            client._conn.rpc("Lend", request)


def test_a_lender_cut_off_from_its_daemon_frees_its_blocks_only_after_the_hold_and_a_read(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = daemon_factory("cut-off", leases__ttl_s=0.5)
    client = KVStoreClient.connect(daemon.address, SPEC)
    try:
        keys = client.keys(list(range(2 * SPEC.chunk_tokens)))
        client._lends._descriptor = lambda kv_caches: (CACHE, BUS)  # type: ignore[method-assign]  # no GPU here
        table = torch.arange(2 * PER_CHUNK)
        with pytest.raises(ValueError, match="hold_s"):
            client.lend(None, [], table, keys=keys, hold_s=0.0)
        lent_at = time.monotonic()
        lend_id, tokens = client._lends.lend(None, [torch.zeros(1)], table, keys=keys, hold_s=0.3)
        assert tokens == 2 * SPEC.chunk_tokens
        assert daemon.stop() == 0
        assert client.lends_done([lend_id]) == []  # no daemon to ask: not before the hold and a TTL
        wait_until(lambda: client.lends_done([lend_id]) == [lend_id])
        assert time.monotonic() - lent_at >= 0.8
    finally:
        client.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({}, "malformed|not a number"),  # the numbers below, in a descriptor otherwise good
        ({"layout": "flashinfer"}, "another geometry"),
        ({"block_size": 32}, "another geometry"),
        ({"version": 2}, "another form or version"),
        ({"allocations": []}, "0 allocations"),
        (
            {
                "tensors": [
                    {
                        "allocation": 0,
                        "offset": 0,
                        "dtype": "float32",
                        "shape": [2, 4, 16, 2, 16],
                        "stride": [2048, 512, 32, 16, 1],
                    }
                ]
                * 2
            },
            "a tensor of float32",
        ),  # fmt: skip
        (
            {
                "tensors": [
                    {
                        "allocation": 0,
                        "offset": 1 << 20,
                        "dtype": "float16",
                        "shape": [2, 4, 16, 2, 16],
                        "stride": [2048, 512, 32, 16, 1],
                    }
                ]
                * 2
            },
            "outside its allocation",
        ),  # fmt: skip
        (
            {
                "tensors": [
                    {
                        "allocation": 0,
                        "offset": 0,
                        "dtype": "float16",
                        "shape": [2, 4, 16, 2, 16],
                        "stride": [2048, -512, 32, 16, 1],
                    }
                ]
                * 2
            },
            "outside its allocation",
        ),  # fmt: skip
        ({"tensors": "xy"}, "malformed"),
        ({"allocations": [{"handle": "00" * 64, "size": "big"}]}, "invalid literal"),
    ],
)
def test_a_tampered_descriptor_is_refused_before_anything_is_mapped(
    change: dict[str, Any], message: str
) -> None:
    """What a reader checks in a lender's descriptor (another worker of the tenant wrote it)."""
    from kvstore_client.lent import LentCaches

    mine = [torch.zeros(2, 4, 16, 2, 16, dtype=torch.float16) for _ in range(2)]
    good = {"version": 1, "layout": "flash_attn", "dtype": "float16", "block_size": 16, "form": "list",
            "allocations": [{"handle": "00" * 64, "size": 16384}],
            "tensors": [{"allocation": 0, "offset": 0, "dtype": "float16", "shape": [2, 4, 16, 2, 16],
                         "stride": [2048, 512, 32, 16, 1]}] * 2}  # fmt: skip
    descriptor = json.dumps({**good, **change}).encode()
    if change:
        with pytest.raises(ValueError, match=message):
            LentCaches()._opened(SPEC, descriptor, BUS, torch.device("cpu"), mine)
        return
    for number, why in ((b"NaN", "not a number"), (b"1e999", "malformed"), (b"-Infinity", "not a number")):
        with pytest.raises(ValueError, match=why):
            LentCaches()._opened(SPEC, descriptor.replace(b"16384", number), BUS, torch.device("cpu"), mine)
