"""Every RPC on both channels, and the local channel's Query, fed thousands of messages built to
be wrong (random bytes, valid requests with their bytes flipped, cut or stretched, and valid
requests with random field values): every reply is a clear status (never UNKNOWN or INTERNAL), the
daemon's RSS stays within RSS_GROWTH_MIB, its log holds no internal error, and a page stored before
loads back byte-identical after. Clear is left out: it drops pages by design (an admin's call)."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.wire import LOCAL_IDS
from tests.harness import Daemon
from tests.test_limits import load_page, rss_mib, store_page

RSS_GROWTH_MIB = 48
METHODS = [name for name in LOCAL_IDS if name != "Clear"] + ["Put", "Get"]
REFUSED = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


def valid_requests(ns: bytes, keys: bytes) -> dict[str, bytes]:
    """A well-formed request of each method, for the mutations to start from."""
    spec = pb.PageSpec(model="fuzz", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16")
    lease = pb.LeaseRequest(namespace=ns, lease_id=12345, epoch=1)
    messages: dict[str, Any] = {
        "Connect": pb.ConnectRequest(spec=spec, client_name="fuzz"),
        "Lookup": pb.LookupRequest(namespace=ns, keys=keys, lease=True, acquire=True),
        "Reserve": pb.ReserveRequest(namespace=ns, keys=keys),
        "Commit": lease,
        "Abort": lease,
        "Acquire": lease,
        "Release": lease,
        "Stats": pb.StatsRequest(),
        "Pin": pb.PinRequest(namespace=ns, keys=keys, ttl_ms=1000),
        "Renew": pb.RenewRequest(namespace=ns, lease_ids=[1, 2, 3]),
        "ArenaSlabs": pb.ArenaSlabsRequest(epoch=1, first=0, count=4),
        "Lend": pb.LendRequest(
            namespace=ns,
            keys=keys,
            blocks=bytes(4 * (len(keys) // 16)),
            cache=b"{}",
            device_pci_bus_id="0000:01:00.0",
        ),
        "Lends": pb.LendsRequest(namespace=ns, lend_ids=[1, 2, 3], withdraw=True),
        "Returned": pb.ReturnedRequest(namespace=ns, read_id=5),
        "Put": pb.PutRequest(header=pb.PutHeader(namespace=ns, lease_id=12345)),
        "Get": lease,
    }
    return {name: message.SerializeToString() for name, message in messages.items()} | {"Query": ns + keys}


@st.composite
def payloads(draw: st.DrawFn, base: bytes) -> bytes:
    kind = draw(st.sampled_from(["random", "flipped", "cut", "stretched", "fields"]))
    if kind == "random" or not base:
        return draw(st.binary(max_size=2048))
    if kind == "flipped":
        data = bytearray(base)
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
        return bytes(data)
    if kind == "cut":
        return base[: draw(st.integers(0, len(base)))]
    if kind == "stretched":
        return base + draw(st.binary(min_size=1, max_size=512))
    # A valid message with a random varint field appended: an unknown or retyped field.
    field = draw(st.integers(1, 31))
    value = draw(st.integers(0, (1 << 64) - 1))
    varint = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        varint.append(byte | (0x80 if value else 0))
        if not value:
            break
    return base + bytes([field << 3]) + bytes(varint)


class LocalLine:
    """A raw local-channel connection, opened again when the daemon closes it (a refused frame)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock: socket.socket | None = None

    def call(self, method: str, payload: bytes) -> int:
        for _ in range(2):
            if self.sock is None:
                self.sock = socket.socket(socket.AF_UNIX)
                self.sock.settimeout(30)
                self.sock.connect(self.path)
            try:
                self.sock.sendall(struct.pack("<IB", len(payload), LOCAL_IDS[method]) + payload)
                header = self.sock.recv(5, socket.MSG_WAITALL)
                if len(header) == 5:
                    length, status = struct.unpack("<IB", header)
                    self.sock.recv(length, socket.MSG_WAITALL)
                    return int(status)
            except OSError:
                pass
            self.sock.close()
            self.sock = None
        raise AssertionError(f"{method}: the local channel closed twice in a row")


@pytest.fixture
def target(daemon: Daemon) -> Iterator[tuple[Daemon, bytes, list[bytes], bytes, grpc.Channel, LocalLine]]:
    ns, keys, page = store_page(daemon)
    with grpc.insecure_channel(daemon.address) as channel:
        line = LocalLine(str(daemon.socket_path) + ".local")
        yield daemon, ns, keys, page, channel, line
        if line.sock is not None:
            line.sock.close()


def grpc_status(channel: grpc.Channel, method: str, payload: bytes) -> grpc.StatusCode:
    path = f"/kvstore.v1.KVStore/{method}"
    try:
        if method == "Put":
            channel.stream_unary(path)(iter([payload]), timeout=30)
        elif method == "Get":
            list(channel.unary_stream(path)(payload, timeout=30))
        else:
            channel.unary_unary(path)(payload, timeout=30)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_every_rpc_on_both_channels_survives_malformed_messages(target: Any) -> None:
    daemon, ns, keys, page, channel, line = target
    from kvstore.shared.keys import pack_keys

    bases = valid_requests(ns, pack_keys(keys))
    before = rss_mib(daemon)
    seen: dict[str, set[Any]] = {}

    @settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        method = data.draw(st.sampled_from(METHODS))
        payload = data.draw(payloads(bases[method]))
        if method != "Query":  # the local channel's alone
            code = grpc_status(channel, method, payload)
            assert code not in REFUSED, (method, payload.hex(), code)
            seen.setdefault(method, set()).add(code.name)
        if method in LOCAL_IDS:
            status = line.call(method, payload)
            assert status not in (2, 13), (method, payload.hex(), status)
            seen.setdefault(method, set()).add(status)

    one()
    assert set(seen) == set(METHODS)
    assert rss_mib(daemon) - before < RSS_GROWTH_MIB
    assert "internal error" not in daemon.log() and "Traceback" not in daemon.log()
    assert load_page(daemon, ns, keys) == page
