"""The local channel's Query (`kvstore.shared.wire.QUERY`): a plain Lookup with no protobuf on
either side, through a real kvstored's socket. It answers what a Lookup answers (the CPU and disk
tiers' pages, every shape of key list), counts as one, is refused with a message where a Lookup
would be, and a client whose daemon has no Query (an older one), or no local channel, asks with
a Lookup instead. Every prompt looked up is loaded back and compared byte for byte."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.channel import LocalChannel
from kvstore.shared.domain import MAX_KEYS_PER_REQUEST, Tier
from kvstore.shared.keys import pack_keys
from kvstore.shared.wire import MAX_REQUEST_BYTES, QUERY, QueryRequest
from kvstore_client import KVStoreClient
from tests.harness import Daemon, wait_flushed
from tests.test_disk_daemon import CHUNK, SPEC, cache_for, disk_overrides, load_and_compare, prompt
from tests.test_local_channel import local_path, raw_call

CHUNKS = 10
MISSING = b"\0" * 16


def counted_lookups(client: KVStoreClient) -> int:
    return int(client.stats()["counters"].get("lookups", 0))


def test_a_query_answers_what_a_lookup_answers(tmp_path: Path, daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(**disk_overrides(tmp_path / "disk"))
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        for i in range(30):  # 300 pages through a 100-page CPU tier: the first prompts are on disk only
            assert client.store(prompt(i, CHUNKS), cache_for(i, CHUNKS), torch.arange(CHUNKS)) == CHUNKS
        wait_flushed(client)
        channel = LocalChannel(local_path(daemon), timeout_s=10)
        ns, tiers_seen = client.namespace, set()
        try:
            for i in (0, 14, 29, 40):  # on disk, either, in the arena, never stored
                keys = client.keys(prompt(i, CHUNKS))
                shapes = [keys, keys[:1], keys[3:], keys[:4] + [MISSING] + keys[4:], [MISSING, *keys], []]
                for shape in shapes:
                    lookups = counted_lookups(client)
                    query = channel.call("Query", QueryRequest(ns, pack_keys(shape)))
                    assert counted_lookups(client) == lookups + 1  # a Query counts as the Lookup it is
                    lookup = channel.call("Lookup", pb.LookupRequest(namespace=ns, keys=pack_keys(shape)))
                    assert (query.hit_chunks, query.tiers) == (lookup.hit_chunks, lookup.tiers), (i, shape)
                    assert len(query.tiers) == query.hit_chunks
                    tiers_seen.update(query.tiers)
                assert client.lookup_chunks(keys) == (0 if i == 40 else CHUNKS)  # the client's own Query
        finally:
            channel.close()
        assert {Tier.CPU, Tier.DISK} <= tiers_seen
        assert client._conn.local is not None and client._conn.local.queries
        for i in (0, 14, 29):
            assert load_and_compare(client, i, CHUNKS) == CHUNKS * CHUNK
    assert "Traceback" not in daemon.log()


def test_a_query_the_daemon_cannot_serve_is_refused_with_why(daemon: Daemon) -> None:
    path = local_path(daemon)
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        assert client.store(prompt(1, 2), cache_for(1, 2), torch.arange(2)) == 2
        ns = client.namespace
        refusals = {
            b"": (3, b"namespace: expected 16 bytes, got 0"),
            ns[:5]: (3, b"namespace: expected 16 bytes, got 5"),
            ns + b"x" * 17: (3, b"keys: expected a concatenation of 16-byte keys, got 17 bytes"),
            b"\1" * 16 + MISSING: (5, b"is not registered with this daemon"),
            ns + MISSING * (MAX_KEYS_PER_REQUEST + 1): (3, f"at most {MAX_KEYS_PER_REQUEST}".encode()),
        }
        for payload, (status, message) in refusals.items():
            answer = raw_call(path, QUERY, payload)
            assert answer[0] == status and message in answer[1], (len(payload), answer)
        with socket.socket(socket.AF_UNIX) as sock:  # a frame too large is refused before it is read
            sock.settimeout(10)
            sock.connect(path)
            sock.sendall(struct.pack("<IB", MAX_REQUEST_BYTES + 1, QUERY))
            length, status = struct.unpack("<IB", sock.recv(5, socket.MSG_WAITALL))
            assert status == 3 and b"split it" in sock.recv(length, socket.MSG_WAITALL)
            assert sock.recv(1) == b""  # and the connection closed
        stored = ns + pack_keys(client.keys(prompt(1, 2)))
        assert raw_call(path, QUERY, stored) == (0, struct.pack("<I", 2) + bytes([Tier.CPU]) * 2)
        assert load_and_compare(client, 1, 2) == 2 * CHUNK
    assert "internal error" not in daemon.log() and "Traceback" not in daemon.log()


class OlderDaemon:
    """A local channel that answers as a daemon from before the Query: a Query is an unknown
    method; every other frame goes to the real daemon's channel and its reply comes back."""

    def __init__(self, upstream: str, path: Path) -> None:
        self.upstream, self.path = upstream, str(path)
        self.queries_refused = 0
        self.methods: list[int] = []
        self._listener = socket.socket(socket.AF_UNIX)
        self._listener.bind(self.path)
        self._listener.listen(1)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):  # the client (or the listener) closed: done
            self._relay()

    def _relay(self) -> None:
        conn, _ = self._listener.accept()
        with conn, socket.socket(socket.AF_UNIX) as upstream:
            upstream.connect(self.upstream)
            while header := conn.recv(5, socket.MSG_WAITALL):
                length, method = struct.unpack("<IB", header)
                payload = conn.recv(length, socket.MSG_WAITALL) if length else b""
                self.methods.append(method)
                if method == QUERY:
                    self.queries_refused += 1
                    body = f"unknown local-channel method {method}".encode()
                    conn.sendall(struct.pack("<IB", len(body), 3) + body)
                    continue
                upstream.sendall(header + payload)
                length, status = struct.unpack("<IB", upstream.recv(5, socket.MSG_WAITALL))
                conn.sendall(struct.pack("<IB", length, status) + upstream.recv(length, socket.MSG_WAITALL))

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def older(daemon: Daemon, tmp_path: Path) -> Iterator[OlderDaemon]:
    older = OlderDaemon(local_path(daemon), tmp_path / "older.local")
    yield older
    older.close()


def test_a_client_asks_with_a_lookup_where_there_is_no_query(daemon: Daemon, older: OlderDaemon) -> None:
    tokens = prompt(3, CHUNKS)
    with (
        KVStoreClient.connect(daemon.address, SPEC) as client,
        KVStoreClient.connect(daemon.address, SPEC, local_channel=False) as remote,
    ):
        assert client.store(tokens, cache_for(3, CHUNKS), torch.arange(CHUNKS)) == CHUNKS
        assert remote.lookup(tokens) == CHUNKS * CHUNK  # over gRPC: a Lookup
        client._conn.open_local(older.path)  # its calls now reach the daemon through the older channel
        lookups = counted_lookups(remote)
        assert client.lookup(tokens) == CHUNKS * CHUNK
        assert client.lookup(tokens[: 4 * CHUNK]) == 4 * CHUNK
        assert older.queries_refused == 1  # asked once; a Lookup from then on
        assert client._conn.local is not None and not client._conn.local.queries
        assert counted_lookups(remote) == lookups + 2
        assert load_and_compare(client, 3, CHUNKS) == CHUNKS * CHUNK
