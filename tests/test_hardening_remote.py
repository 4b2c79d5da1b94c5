"""Attacks on the remote tier from whoever can write to the Redis servers or answer as one
(issue #30, items 3 and 4), each run against a real redis-server or a scripted one:

- a record forged under a victim's key, with a valid header and checksums over other bytes, is
  a miss, deleted from the server and counted, and the victim's real pages load byte-identical;
- records of a daemon with another record key, or with none, are misses on a daemon with one;
- one server (not a cluster) that answers MOVED or ASK sends the daemon nowhere: nothing connects
  to the address it names, and no node appears in Stats;
- a cluster node that redirects to an address no CLUSTER SLOTS announced is not followed, and one
  that a fresh map announces is.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("redis", reason="the remote tier needs the redis package (a kvstore dependency)")

from kvstore.config.root import RemoteTierConfig  # noqa: E402
from kvstore.tiers.codec import Codec  # noqa: E402
from kvstore.tiers.records import FLAG_MAC, HEADER_BYTES, MAC_BYTES, pack_header  # noqa: E402
from kvstore.tiers.remote import RemoteTier  # noqa: E402
from kvstore_client import KVStoreClient  # noqa: E402
from tests.harness import Daemon, RedisServer  # noqa: E402
from tests.test_remote_tier import (  # noqa: E402
    CHUNK,
    KIB,
    NS,
    SPEC,
    cache_for,
    key,
    load_and_compare,
    page,
    prompt,
    read,
    remote_overrides,
    remote_stats,
    wait_written,
    write,
)


def secret_file(path: Path, seed: int) -> str:
    path.write_bytes(bytes((seed + i) % 256 for i in range(32)))
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def keys(tmp_path: Path) -> tuple[str, str]:
    """Two fleets' record key files."""
    return secret_file(tmp_path / "fleet-a.key", 1), secret_file(tmp_path / "fleet-b.key", 2)


def record_name(namespace: bytes, chunk_key: bytes) -> bytes:
    return f"kvstore:{namespace.hex()}:{chunk_key.hex()}".encode()


def forge(namespace: bytes, chunk_key: bytes, payload: bytes, fake_mac: bool) -> bytes:
    """What someone without the fleet's key can write: a valid header and checksums over their own
    bytes, and at best a MAC of their choosing."""
    if not fake_mac:
        return pack_header(namespace, chunk_key, Codec.NONE, len(payload), payload) + payload
    header = pack_header(namespace, chunk_key, Codec.NONE, len(payload), payload, FLAG_MAC)
    return header + os.urandom(MAC_BYTES) + payload


def settled(client: KVStoreClient) -> dict[str, float]:
    """The reader's remote figures once no read or write is queued or running."""
    deadline = time.monotonic() + 10
    while (stats := remote_stats(client))["jobs"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.01)
    return stats


# -- item 3: authenticated records ---------------------------------------------------------------


def test_a_forged_record_under_a_victims_key_is_a_miss_deleted_and_counted(
    redis_server: RedisServer, daemon_factory: Callable[..., Daemon], keys: tuple[str, str]
) -> None:
    fleet = remote_overrides(redis_server, record_key_file=keys[0])
    victim = daemon_factory("victim", **fleet)
    other_host = daemon_factory("other-host", **fleet)
    server = redis_server.client()
    with KVStoreClient.connect(victim.address, SPEC) as writer:
        for i in (0, 1):
            assert writer.store(prompt(i, 4), cache_for(i, 4), torch.arange(4)) == 4
        wait_written(writer, 8)
        namespace = writer.namespace
        last = [writer.keys(prompt(i, 4))[3] for i in (0, 1)]
    # The attacker overwrites each prompt's last record: prompt 0's with a plain record, prompt
    # 1's with one that claims a MAC; both with a valid header and checksums over other bytes.
    page_bytes = len(server.get(record_name(namespace, last[0]))) - HEADER_BYTES - MAC_BYTES
    for i, fake_mac in ((0, False), (1, True)):
        planted = forge(namespace, last[i], bytes([0x41]) * page_bytes, fake_mac)
        server.set(record_name(namespace, last[i]), planted)

    with KVStoreClient.connect(other_host.address, SPEC) as reader:
        assert reader.lookup(prompt(0, 4)) == 4 * CHUNK  # a name is there: only reading it tells
        for i in (0, 1):
            assert load_and_compare(reader, i, 4) == 3 * CHUNK  # bytes compared inside; never the forged
        stats = settled(reader)
        assert (stats["forged_records"], stats["corrupted_records"], stats["promotions"]) == (2, 0, 6)
        assert server.exists(*(record_name(namespace, k) for k in last)) == 0  # deleted
        # The host computes the missing chunk itself and stores it: a record of the fleet again.
        for i in (0, 1):  # its first three chunks are in its arena now: one chunk stored each
            assert reader.store(prompt(i, 4), cache_for(i, 4), torch.arange(4)) == 1
        assert wait_written(reader, 2)["written"] == 2
    with KVStoreClient.connect(victim.address, SPEC) as writer:
        assert all(load_and_compare(writer, i, 4) == 4 * CHUNK for i in (0, 1))  # its own, untouched
    third_host = daemon_factory("third-host", **fleet)
    with KVStoreClient.connect(third_host.address, SPEC) as reader:
        assert all(load_and_compare(reader, i, 4) == 4 * CHUNK for i in (0, 1))  # all from the server
        assert settled(reader)["forged_records"] == 0
    assert "fails authentication" in other_host.log()


def test_records_of_a_daemon_with_another_key_file_are_misses(
    redis_server: RedisServer, daemon_factory: Callable[..., Daemon], keys: tuple[str, str]
) -> None:
    fleet_a = daemon_factory("fleet-a", **remote_overrides(redis_server, record_key_file=keys[0]))
    fleet_b = daemon_factory("fleet-b", **remote_overrides(redis_server, record_key_file=keys[1]))
    with KVStoreClient.connect(fleet_a.address, SPEC) as writer:
        assert writer.store(prompt(0, 4), cache_for(0, 4), torch.arange(4)) == 4
        wait_written(writer, 4)
    with KVStoreClient.connect(fleet_b.address, SPEC) as reader:
        assert load_and_compare(reader, 0, 4) == 0
        stats = settled(reader)
        assert (stats["forged_records"], stats["promotions"]) == (4, 0)
    assert redis_server.client().dbsize() == 0  # every one of them deleted


def test_mac_records_round_trip_and_fail_under_another_key_or_none(
    redis_server: RedisServer, keys: tuple[str, str]
) -> None:
    """At the tier: raw and lz4 records with a MAC read back byte-identical under the key that
    wrote them; under another key, or a keyless writer's records under a key, they are misses. A
    keyless reader trusts the server as before and reads MAC records too (a fleet turns keys on
    host by host)."""
    opened: list[RemoteTier] = []

    def tier(key_file: str | None, **settings: Any) -> RemoteTier:
        config = RemoteTierConfig(enabled=True, url=redis_server.url, record_key_file=key_file, **settings)
        opened.append(RemoteTier(config))
        return opened[-1]

    try:
        a, a_lz4, b, keyless = tier(keys[0]), tier(keys[0], codec="lz4"), tier(keys[1]), tier(None)
        pages = {i: page(i) for i in range(4)}
        compressible = {i: bytes(32 * KIB) + page(i, 32 * KIB) for i in range(10, 14)}
        write(a, NS, pages)
        write(a_lz4, NS, compressible)
        assert a.stats()["written_bytes"] == 4 * (HEADER_BYTES + MAC_BYTES + 64 * KIB)
        assert all(read(a, NS, i) == data for i, data in (pages | compressible).items())
        assert all(read(keyless, NS, i) == data for i, data in (pages | compressible).items())
        assert read(b, NS, 0) is None and read(b, NS, 10) is None  # and deleted
        assert a.present(NS, [key(0), key(10)]) == 0
        write(keyless, NS, {20: page(20)})
        assert read(a, NS, 20) is None
        assert (b.stats()["forged_records"], a.stats()["forged_records"]) == (2, 1)
        assert a.stats()["corrupted_records"] == 0
    finally:
        for opened_tier in opened:
            opened_tier.close(timeout_s=5)


def test_a_payload_changed_under_a_valid_mac_header_is_a_miss(
    redis_server: RedisServer, keys: tuple[str, str]
) -> None:
    """The attacker keeps a real record's header and MAC and swaps the payload, fixing up the
    header's checksums: the MAC no longer checks out."""
    tier = RemoteTier(RemoteTierConfig(enabled=True, url=redis_server.url, record_key_file=keys[0]))
    try:
        write(tier, NS, {1: page(1)})
        server = redis_server.client()
        name = tier.record_key(NS, key(1))
        real = server.get(name)
        other = page(2)
        header = pack_header(NS, key(1), Codec.NONE, len(other), other, FLAG_MAC)
        server.set(name, header + real[HEADER_BYTES : HEADER_BYTES + MAC_BYTES] + other)
        assert read(tier, NS, 1) is None
        assert server.exists(name) == 0 and tier.stats()["forged_records"] == 1
    finally:
        tier.close(timeout_s=5)


# -- item 4: redirects -----------------------------------------------------------------------------


class FakeRedis:
    """A scripted RESP server on a unix socket or 127.0.0.1: each command (a list of its parts) is
    answered with `answer(parts)`'s bytes; any number of connections."""

    def __init__(self, answer: Callable[[list[bytes]], bytes], path: str | None = None) -> None:
        self.answer = answer
        family = socket.AF_UNIX if path else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.bind(path or ("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = 0 if path else self.listener.getsockname()[1]
        self.commands: list[list[bytes]] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        with conn, contextlib.suppress(OSError):
            while True:
                parts, buffer = self._command(conn, buffer)
                if parts is None:
                    return
                self.commands.append(parts)
                conn.sendall(self.answer(parts))

    @staticmethod
    def _command(conn: socket.socket, buffer: bytes) -> tuple[list[bytes] | None, bytes]:
        def need(n: int) -> bytes:
            nonlocal buffer
            while len(buffer) < n:
                more = conn.recv(1 << 20)
                if not more:
                    raise EOFError
                buffer += more
            taken, buffer = buffer[:n], buffer[n:]
            return taken

        def line() -> bytes:
            nonlocal buffer
            while b"\r\n" not in buffer:
                more = conn.recv(1 << 20)
                if not more:
                    raise EOFError
                buffer += more
            taken, _, buffer = buffer.partition(b"\r\n")
            return taken

        try:
            count = int(line()[1:])
            parts = []
            for _ in range(count):
                length = int(line()[1:])
                parts.append(need(length + 2)[:-2])
        except EOFError:
            return None, buffer
        return parts, buffer

    def close(self) -> None:
        self._stop = True
        self.listener.close()


@pytest.fixture
def trap() -> Iterator[socket.socket]:
    """An address a hostile server names: listening, so that a connection would be made (the
    kernel completes it without an accept), and checked for one afterwards."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.setblocking(False)
    yield listener
    listener.close()


def connections_to(listener: socket.socket) -> int:
    count = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


def port_of(listener: socket.socket) -> int:
    return int(listener.getsockname()[1])


@pytest.mark.parametrize("kind", ["MOVED", "ASK"])
def test_one_server_answering_a_redirect_sends_the_daemon_nowhere(
    tmp_path: Path, trap: socket.socket, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    redirect = b"-%s 866 127.0.0.1:%d\r\n" % (kind.encode(), port_of(trap))

    def answer(parts: list[bytes]) -> bytes:
        return {b"PING": b"+PONG\r\n", b"AUTH": b"+OK\r\n"}.get(parts[0], redirect)

    fake = FakeRedis(answer, str(tmp_path / "fake.sock"))
    now = [1000.0]
    config = RemoteTierConfig(
        enabled=True, url=f"unix://:hunter2@{tmp_path}/fake.sock", timeout_s=0.5, lookup_timeout_s=1.0
    )
    tier = RemoteTier(config, clock=lambda: now[0])
    try:
        tier.start()
        assert tier.present(NS, [key(1), key(2)]) == 0  # a Lookup: both records misses
        assert tier.submit_write(NS, key(1), page(1))
        assert tier.wait_idle(10)
        now[0] += config.retry_s  # the write's refusal took the server down for retry_s
        assert read(tier, NS, 1) is None
        stats = tier.stats()
        assert connections_to(trap) == 0
        assert [node.address for node in tier.node_usage()] == [str(tmp_path / "fake.sock")]
        assert stats["refused_redirects"] == 4 and stats["promotions"] == stats["written"] == 0
        assert "tiers.remote.cluster is false" in caplog.text and "hunter2" not in caplog.text
    finally:
        tier.close(timeout_s=5)
        fake.close()
    # The password went to the server the config names, and nowhere else.
    assert [parts[0] for parts in fake.commands].count(b"AUTH") >= 1


def cluster_slots(*masters: int) -> bytes:
    """CLUSTER SLOTS with the slots cut evenly among masters at these ports on 127.0.0.1."""
    share = 16384 // len(masters)
    entries = []
    for i, port in enumerate(masters):
        first, last = i * share, 16383 if i == len(masters) - 1 else (i + 1) * share - 1
        entries.append(
            b"*3\r\n:%d\r\n:%d\r\n*3\r\n$9\r\n127.0.0.1\r\n:%d\r\n$2\r\nid\r\n" % (first, last, port)
        )
    return b"*%d\r\n" % len(entries) + b"".join(entries)


@pytest.mark.parametrize("kind", ["MOVED", "ASK"])
def test_a_cluster_redirect_to_an_address_no_slot_map_announced_is_not_followed(
    trap: socket.socket, kind: str
) -> None:
    ports: list[int] = []

    def answer(parts: list[bytes]) -> bytes:
        if parts[:2] == [b"CLUSTER", b"SLOTS"]:
            return cluster_slots(ports[0])
        return b"-%s 866 127.0.0.1:%d\r\n" % (kind.encode(), port_of(trap))

    seed = FakeRedis(answer)
    ports.append(seed.port)
    config = RemoteTierConfig(
        enabled=True, cluster=True, url=f"redis://127.0.0.1:{seed.port}", timeout_s=0.5, lookup_timeout_s=1.0
    )
    tier = RemoteTier(config)
    try:
        tier.start()
        assert tier.present(NS, [key(1), key(2)]) == 0
        assert tier.submit_write(NS, key(1), page(1))
        assert tier.wait_idle(10)
        assert read(tier, NS, 1) is None
        assert connections_to(trap) == 0
        assert [node.address for node in tier.node_usage()] == [f"127.0.0.1:{seed.port}"]
        stats = tier.stats()
        assert stats["refused_redirects"] == 4 and stats["nodes"] == 1
        assert stats["up"] == 1  # the redirecting node is not taken down: only its redirect is refused
    finally:
        tier.close(timeout_s=5)
        seed.close()


def test_a_cluster_redirect_to_a_node_a_fresh_map_announces_is_followed() -> None:
    """A slot moved to a node that joined after the last map: the redirect asks for a fresh map,
    finds the node there, and the read is served by it."""
    record = pack_header(NS, key(1), Codec.NONE, 4 * KIB, page(1, 4 * KIB)) + page(1, 4 * KIB)
    ports: list[int] = []
    joined = threading.Event()

    def old_node(parts: list[bytes]) -> bytes:
        if parts[:2] == [b"CLUSTER", b"SLOTS"]:
            return cluster_slots(*ports) if joined.is_set() else cluster_slots(ports[0])
        joined.set()
        return b"-MOVED 866 127.0.0.1:%d\r\n" % ports[1]

    def new_node(parts: list[bytes]) -> bytes:
        if parts[0] in (b"GET", b"GETEX"):
            return b"$%d\r\n%s\r\n" % (len(record), record)
        return cluster_slots(*ports) if parts[0] == b"CLUSTER" else b"-ERR not scripted\r\n"

    old, new = FakeRedis(old_node), FakeRedis(new_node)
    ports += [old.port, new.port]
    config = RemoteTierConfig(enabled=True, cluster=True, url=f"redis://127.0.0.1:{old.port}", timeout_s=2.0)
    tier = RemoteTier(config)
    try:
        tier.start()
        assert read(tier, NS, 1, size=4 * KIB) == page(1, 4 * KIB)
        stats = tier.stats()
        assert (stats["redirects"], stats["refused_redirects"], stats["promotions"]) == (1, 0, 1)
        assert {node.address for node in tier.node_usage()} == {f"127.0.0.1:{p}" for p in ports}
    finally:
        tier.close(timeout_s=5)
        old.close()
        new.close()


def test_a_slot_map_naming_more_nodes_than_the_cap_is_not_used(caplog: pytest.LogCaptureFixture) -> None:
    from kvstore.tiers.remote_nodes import MAX_NODES

    ports: list[int] = []

    def answer(parts: list[bytes]) -> bytes:
        if parts[:2] == [b"CLUSTER", b"SLOTS"]:
            return cluster_slots(*ports, *range(20000, 20000 + MAX_NODES))
        return b":0\r\n"

    seed = FakeRedis(answer)
    ports.append(seed.port)
    config = RemoteTierConfig(enabled=True, cluster=True, url=f"redis://127.0.0.1:{seed.port}", timeout_s=2.0)
    tier = RemoteTier(config)
    try:
        tier.start()
        assert tier.nodes.nodes() == [] and tier.stats()["up"] == 0
        assert f"names {MAX_NODES + 1} nodes, more than the {MAX_NODES}" in caplog.text
    finally:
        tier.close(timeout_s=5)
        seed.close()
