"""Bounded cost: a request the daemon refuses costs it no memory, on either channel, and every
refusal is a clear status. Each test stores a page first and loads it back byte-identical after
the abuse."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

import grpc
import pytest

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.domain import MAX_KEYS_PER_REQUEST
from kvstore.shared.keys import chunk_keys, pack_keys
from kvstore.shared.wire import MAX_REQUEST_BYTES, METHOD_IDS
from tests.harness import Daemon

SPEC = pb.PageSpec(
    model="limits", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=16
)
PAGE_BYTES = 2 * 2 * 16 * 2 * 16 * 2
RSS_GROWTH_MIB = 48  # the most a run of refused requests may add to the daemon's RSS


def rss_mib(daemon: Daemon) -> float:
    for line in Path(f"/proc/{daemon.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def store_page(daemon: Daemon) -> tuple[bytes, list[bytes], bytes]:
    """A committed page of random bytes: (namespace, its keys, its bytes)."""
    stub = daemon.stub()
    ns = stub.Connect(pb.ConnectRequest(spec=SPEC)).namespace
    keys = chunk_keys(ns, list(range(16)), 16)
    page = os.urandom(PAGE_BYTES)
    lease = stub.Reserve(pb.ReserveRequest(namespace=ns, keys=pack_keys(keys))).lease_id

    def messages():  # type: ignore[no-untyped-def]
        yield pb.PutRequest(header=pb.PutHeader(namespace=ns, lease_id=lease))
        yield pb.PutRequest(data=page)

    stub.Put(messages())
    stub.Commit(pb.LeaseRequest(namespace=ns, lease_id=lease))
    return ns, keys, page


def load_page(daemon: Daemon, ns: bytes, keys: list[bytes]) -> bytes:
    stub = daemon.stub()
    lease = stub.Lookup(pb.LookupRequest(namespace=ns, keys=pack_keys(keys), lease=True)).lease_id
    assert lease
    data = b"".join(m.data for m in stub.Get(pb.LeaseRequest(namespace=ns, lease_id=lease)))
    stub.Release(pb.LeaseRequest(namespace=ns, lease_id=lease))
    return data


def code_of(call, *args) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as caught:
        call(*args)
    return caught.value.code(), caught.value.details()


def local_call(daemon: Daemon, method: str, payload: bytes) -> tuple[int, bytes]:
    """One frame on the local channel and its reply. A frame over the limit is refused on its
    header and the connection closed: what the daemon never reads is not sent."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(str(daemon.socket_path) + ".local")
        header = struct.pack("<IB", len(payload), METHOD_IDS[method])
        sock.sendall(header if len(payload) > MAX_REQUEST_BYTES else header + payload)
        length, status = struct.unpack("<IB", sock.recv(5, socket.MSG_WAITALL))
        return status, sock.recv(length, socket.MSG_WAITALL)


def test_oversized_lookups_cost_no_memory_on_either_channel(daemon: Daemon) -> None:
    """Lookups of ~250k keys over gRPC (4 MB: refused by their length) and of ~1M keys on the
    local channel (refused by the frame header, the body never read), 128 and 64 of them, the
    gRPC ones 8 at a time; before these limits, 256 of the gRPC ones grew the daemon by ~400 MiB."""
    ns, keys, page = store_page(daemon)
    stub = daemon.stub()
    before = rss_mib(daemon)
    big = pb.LookupRequest(namespace=ns, keys=os.urandom(16 * 250_000))
    for _ in range(128 // 8):  # one at a time, a 4 MB call takes ~0.2 s on a 2-core machine
        for call in [stub.Lookup.future(big) for _ in range(8)]:
            code, details = code_of(call.result)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details
    huge = pb.LookupRequest(namespace=ns, keys=os.urandom(16 * ((1 << 20) - 8))).SerializeToString()
    for _ in range(64):
        status, body = local_call(daemon, "Lookup", huge)
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert f"at most {MAX_REQUEST_BYTES}" in body.decode()
    assert rss_mib(daemon) - before < RSS_GROWTH_MIB
    assert load_page(daemon, ns, keys) == page


def test_one_key_over_the_limit_is_invalid_argument_on_both_channels(daemon: Daemon) -> None:
    ns, keys, page = store_page(daemon)
    request = pb.LookupRequest(namespace=ns, keys=os.urandom(16 * (MAX_KEYS_PER_REQUEST + 1)))
    code, details = code_of(daemon.stub().Lookup, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"at most {MAX_KEYS_PER_REQUEST}" in details
    status, body = local_call(daemon, "Lookup", request.SerializeToString())
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert f"at most {MAX_KEYS_PER_REQUEST}" in body.decode()
    assert load_page(daemon, ns, keys) == page


@pytest.mark.parametrize("method", ["Connect", "Lookup", "Reserve", "Commit", "Stats", "Pin", "Renew", "Get"])
def test_an_undecodable_request_is_invalid_argument_not_unknown(daemon: Daemon, method: str) -> None:
    ns, keys, page = store_page(daemon)
    garbage = b"\xff\xff\xff\xff\x0f"  # a field tag with no valid wire type
    with grpc.insecure_channel(daemon.address) as channel:
        if method == "Get":
            call = channel.unary_stream(f"/kvstore.v1.KVStore/{method}")
            code, details = code_of(lambda payload: list(call(payload)), garbage)
        else:
            code, details = code_of(channel.unary_unary(f"/kvstore.v1.KVStore/{method}"), garbage)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "the request is not a" in details
    if method != "Get":
        status, body = local_call(daemon, method, garbage)
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"the request is not a" in body
    assert "Traceback" not in daemon.log()
    assert load_page(daemon, ns, keys) == page


def test_an_undecodable_put_message_is_invalid_argument(daemon: Daemon) -> None:
    ns, keys, page = store_page(daemon)
    with grpc.insecure_channel(daemon.address) as channel:
        put = channel.stream_unary("/kvstore.v1.KVStore/Put")
        code, details = code_of(put, iter([b"\xff\xff\xff\xff\x0f"]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a PutRequest" in details
    assert load_page(daemon, ns, keys) == page


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("model", "m" * (1 << 20), "model: 1048576 bytes; at most 256"),
        ("salt", "s" * 257, "salt: 257 bytes; at most 256"),
        ("num_layers", 4_000_000_000, "num_layers: 4000000000 is over 4096"),
        ("chunk_tokens", 1 << 21, "chunk_tokens: 2097152 is over 1048576"),
        ("head_dim", 1 << 17, "head_dim: 131072 is over 65536"),
    ],
    ids=["model", "salt", "num_layers", "chunk_tokens", "head_dim"],
)
def test_a_connect_that_names_too_much_is_refused(
    daemon: Daemon, field: str, value: object, message: str
) -> None:
    ns, keys, page = store_page(daemon)
    spec = pb.PageSpec()
    spec.CopyFrom(SPEC)
    setattr(spec, field, value)
    code, details = code_of(daemon.stub().Connect, pb.ConnectRequest(spec=spec))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details
    stats = daemon.stub().Stats(pb.StatsRequest())
    assert [n.model for n in stats.namespaces] == ["limits"]
    assert load_page(daemon, ns, keys) == page


def test_leases_naming_one_page_over_and_over_are_capped(daemon: Daemon) -> None:
    """A Lookup may name a stored page 65,536 times; its lease then holds as many entries. All
    leases together hold at most MAX_LEASED_ENTRIES: past it RESOURCE_EXHAUSTED, not memory."""
    from kvstore.store.leases import MAX_LEASED_ENTRIES

    ns, keys, page = store_page(daemon)
    stub = daemon.stub()
    flood = pb.LookupRequest(namespace=ns, keys=pack_keys(keys * MAX_KEYS_PER_REQUEST), lease=True)
    leases = [stub.Lookup(flood).lease_id for _ in range(MAX_LEASED_ENTRIES // MAX_KEYS_PER_REQUEST)]
    code, details = code_of(stub.Lookup, flood)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "release leases" in details
    for lease in leases:
        stub.Release(pb.LeaseRequest(namespace=ns, lease_id=lease))
    assert load_page(daemon, ns, keys) == page
