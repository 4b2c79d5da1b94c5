"""The remote tier against a real redis-server: records written and read back byte for byte,
corrupt records read as misses, an unreachable server as misses (never a hang), and two
daemons sharing prefixes through one server."""

from __future__ import annotations

import contextlib
import logging
import random
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("redis", reason="the remote tier needs the redis package (a kvstore dependency)")

from kvstore.config.root import ConfigError, RemoteTierConfig, parse_config  # noqa: E402
from kvstore.shared.domain import Tier  # noqa: E402
from kvstore.tiers.records import HEADER_BYTES  # noqa: E402
from kvstore.tiers.remote import RemoteTier  # noqa: E402
from kvstore.tiers.remote_resp import Endpoint, RecordConnection  # noqa: E402
from kvstore_client import KVSpec, KVStoreClient  # noqa: E402
from tests.harness import Daemon, RedisServer  # noqa: E402
from tests.pki import make_pki  # noqa: E402
from tests.redis_cluster import RedisCluster  # noqa: E402
from tests.test_tls import free_port  # noqa: E402

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
KIB = 1 << 10


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def page(i: int, size: int = 64 * KIB) -> bytes:
    return random.Random(i).randbytes(size)


@pytest.fixture
def open_tier(redis_server: RedisServer) -> Iterator[Callable[..., RemoteTier]]:
    opened: list[RemoteTier] = []

    def open_(**overrides: Any) -> RemoteTier:
        clock = overrides.pop("clock", time.monotonic)
        # A deadline that a loaded CI machine meets; the slow-lookup test sets its own.
        settings: dict[str, Any] = {"enabled": True, "url": redis_server.url, "lookup_timeout_s": 1.0}
        tier = RemoteTier(RemoteTierConfig(**(settings | overrides)), clock=clock)
        opened.append(tier)
        return tier

    yield open_
    for tier in opened:
        tier.close(timeout_s=5)


def read(tier: RemoteTier, namespace: bytes, i: int, size: int = 64 * KIB) -> bytes | None:
    """Reads page i into a poisoned buffer the size of a page; its bytes, or None for a miss."""
    into = bytearray(b"\xa5" * size)
    result: list[object] = []
    finished = threading.Event()

    def done(got: object) -> None:
        result.append(got)
        finished.set()

    if not tier.submit_read(namespace, key(i), done, into=memoryview(into)):
        return None
    assert finished.wait(10)
    return None if result[0] is None else bytes(into)


def write(tier: RemoteTier, namespace: bytes, pages: dict[int, bytes]) -> None:
    for i, data in pages.items():
        assert tier.submit_write(namespace, key(i), data)
    assert tier.wait_idle(10)


def test_pages_round_trip_and_lookups_count_the_leading_run(open_tier: Callable[..., RemoteTier]) -> None:
    tier = open_tier()
    pages = {i: page(i) for i in range(8)}
    write(tier, NS, pages)
    assert all(read(tier, NS, i) == data for i, data in pages.items())
    assert tier.present(NS, [key(i) for i in range(8)]) == 8
    assert tier.present(NS, [key(0), key(1), key(99), key(2)]) == 2  # a chain ends at its first miss
    assert tier.present(OTHER_NS, [key(0)]) == 0  # another namespace's pages are not this one's
    assert read(tier, NS, 99) is None
    write(tier, NS, {3: pages[3]})  # stored already: not written again
    stats = tier.stats()
    assert (stats["written"], stats["duplicate_writes"], stats["promotions"], stats["read_misses"]) == (
        8,
        1,
        8,
        1,
    )
    assert stats["written_bytes"] == 8 * (HEADER_BYTES + 64 * KIB)


@pytest.fixture
def tls_server(redis_server: RedisServer, tmp_path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """A redis-server that speaks TLS only, on a port of its own, with a certificate from a test CA."""
    files = make_pki(tmp_path)
    port = free_port()
    process = subprocess.Popen(
        [
            redis_server.executable,
            "--port", "0",
            "--tls-port", str(port),
            "--bind", "127.0.0.1",
            "--tls-cert-file", files["server_cert"],
            "--tls-key-file", files["server_key"],
            "--tls-ca-cert-file", files["ca"],
            "--tls-auth-clients", "no",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    endpoint = Endpoint.parse(f"rediss://127.0.0.1:{port}?ssl_ca_certs={files['ca']}")
    deadline = time.monotonic() + 30
    while True:
        try:
            RecordConnection.open(endpoint, 1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.skip("this redis-server was built without TLS")
            time.sleep(0.05)
    yield port, files
    process.kill()
    process.wait()


def test_records_round_trip_over_tls_and_a_wrong_ca_is_refused(
    tls_server: tuple[int, dict[str, str]],
) -> None:
    """rediss:// goes through the same zero-copy reader: the same bytes and the same checks."""
    port, files = tls_server
    url = f"rediss://127.0.0.1:{port}?ssl_ca_certs={files['ca']}"
    tier = RemoteTier(RemoteTierConfig(enabled=True, url=url, lookup_timeout_s=1.0))
    wrong = RemoteTier(
        RemoteTierConfig(enabled=True, url=f"rediss://127.0.0.1:{port}?ssl_ca_certs={files['other_ca']}")
    )
    try:
        pages = {i: page(i) for i in range(4)}
        write(tier, NS, pages)
        assert tier.present(NS, [key(i) for i in range(5)]) == 4
        assert all(read(tier, NS, i) == data for i, data in pages.items())
        assert read(tier, NS, 9) is None and read(tier, NS, 1, size=32 * KIB) is None
        assert (tier.stats()["promotions"], tier.stats()["corrupted_records"]) == (4, 1)
        assert read(wrong, NS, 0) is None  # the server's certificate is not from this CA: a miss
        assert (wrong.stats()["errors"], wrong.stats()["up"]) == (1, 0)
    finally:
        tier.close(timeout_s=5)
        wrong.close(timeout_s=5)


def test_a_password_and_a_database_from_the_url(redis_server: RedisServer) -> None:
    admin = redis_server.client()
    admin.config_set("requirepass", "s3cret")
    url = f"unix://:s3cret@{redis_server.socket_path}?db=3"
    tier = RemoteTier(RemoteTierConfig(enabled=True, url=url))
    try:
        write(tier, NS, {1: page(1)})
        assert read(tier, NS, 1) == page(1)
        admin.execute_command("AUTH", "s3cret")
        assert admin.execute_command("SELECT", 3) and admin.dbsize() == 1
        wrong = RemoteTier(
            RemoteTierConfig(enabled=True, url=f"unix://:nope@{redis_server.socket_path}?db=3")
        )
        try:
            assert read(wrong, NS, 1) is None  # refused: a miss, and the tier down for a while
            assert wrong.stats()["errors"] == 1 and wrong.stats()["up"] == 0
        finally:
            wrong.close(timeout_s=5)
    finally:
        tier.close(timeout_s=5)


def test_lz4_records_read_back_byte_identical(open_tier: Callable[..., RemoteTier]) -> None:
    tier = open_tier(codec="lz4")
    compressible = {i: bytes(32 * KIB) + page(i, 32 * KIB) for i in range(4)}
    write(tier, NS, compressible)
    assert all(read(tier, NS, i) == data for i, data in compressible.items())
    assert tier.stats()["written_bytes"] < 4 * (HEADER_BYTES + 64 * KIB)


def test_a_corrupt_record_is_a_miss_and_is_deleted(
    open_tier: Callable[..., RemoteTier], redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    tier = open_tier()
    write(tier, NS, {1: page(1), 2: page(2), 3: page(3)})
    server = redis_server.client()
    flipped = tier.record_key(NS, key(1))
    server.setrange(flipped, HEADER_BYTES + 100, bytes([page(1)[100] ^ 0x01]))  # one bit of the payload
    server.set(tier.record_key(NS, key(2)), server.get(tier.record_key(NS, key(3))))  # page 3 under 2's name
    with caplog.at_level(logging.WARNING):
        assert read(tier, NS, 1) is None
        assert read(tier, NS, 2) is None
    assert read(tier, NS, 3) == page(3)
    assert server.exists(flipped) == 0 and server.exists(tier.record_key(NS, key(2))) == 0
    assert tier.stats()["corrupted_records"] == 2
    assert "payload checksum mismatch" in caplog.text and "names another page" in caplog.text


def test_a_record_of_another_size_is_a_miss(open_tier: Callable[..., RemoteTier]) -> None:
    tier = open_tier()
    write(tier, NS, {5: page(5, 32 * KIB)})
    assert read(tier, NS, 5, size=64 * KIB) is None  # a slot of 64 KiB: the record holds 32
    assert tier.stats()["corrupted_records"] == 1


def test_an_unreachable_server_is_misses_then_is_tried_again(
    open_tier: Callable[..., RemoteTier], redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1000.0]
    tier = open_tier(retry_s=5, clock=lambda: now[0])
    write(tier, NS, {1: page(1)})
    assert read(tier, NS, 1) == page(1)  # this worker's connection is open now
    redis_server.stop()
    with caplog.at_level(logging.WARNING):
        started = time.monotonic()
        assert tier.present(NS, [key(1)]) == 0
        assert tier.present(NS, [key(1)]) == 0  # down: answered without asking the server
        assert not tier.submit_write(NS, key(2), page(2))
        assert read(tier, NS, 1) is None
        assert time.monotonic() - started < 2.0
    assert caplog.text.count("its pages are misses for 5.0 s") == 1  # one warning per outage
    stats = tier.stats()
    assert stats["up"] == 0 and stats["errors"] == 1 and stats["dropped_writes"] == 1
    redis_server.start()  # empty again: no persistence
    now[0] += 5
    write(tier, NS, {2: page(2)})
    assert read(tier, NS, 2) == page(2) and tier.stats()["up"] == 1


def test_a_worker_connection_the_server_dropped_is_replaced(
    open_tier: Callable[..., RemoteTier], redis_server: RedisServer
) -> None:
    """A restart (or an idle timeout) closes the workers' connections: the next read opens
    another and succeeds; the tier never goes down."""
    tier = open_tier(threads=1)
    write(tier, NS, {1: page(1)})
    assert read(tier, NS, 1) == page(1)
    redis_server.stop()
    redis_server.start()
    write(tier, NS, {2: page(2)})
    assert read(tier, NS, 2) == page(2)
    stats = tier.stats()
    assert (stats["up"], stats["errors"], stats["promotions"]) == (1, 0, 2)


def test_a_value_of_another_type_under_a_record_name_is_a_miss(
    open_tier: Callable[..., RemoteTier], redis_server: RedisServer
) -> None:
    tier = open_tier()
    redis_server.client().hset(tier.record_key(NS, key(4)), "field", "value")
    assert tier.present(NS, [key(4)]) == 1  # a name is there
    assert read(tier, NS, 4) is None
    assert redis_server.client().exists(tier.record_key(NS, key(4))) == 0
    stats = tier.stats()
    assert (stats["corrupted_records"], stats["up"], stats["errors"]) == (1, 1, 0)


def test_a_url_without_a_port_takes_the_default_one() -> None:
    from redis.connection import parse_url

    from kvstore.tiers.remote_resp import address_of

    assert address_of(parse_url("redis://cache/0")) == ("cache", 6379)
    assert address_of(parse_url("redis://cache:7000")) == ("cache", 7000)
    assert address_of(parse_url("unix:///run/redis.sock?db=2")) == "/run/redis.sock"


def test_a_slow_lookup_is_a_miss_and_a_run_of_them_takes_the_tier_down(
    open_tier: Callable[..., RemoteTier], redis_server: RedisServer
) -> None:
    tier = open_tier(retry_s=60, lookup_timeout_s=0.1)
    write(tier, NS, {1: page(1)})
    admin = redis_server.client()
    admin.client_pause(600)  # every command waits 600 ms: past the lookup's deadline
    assert tier.present(NS, [key(1)]) == 0
    assert (tier.stats()["lookup_timeouts"], tier.stats()["up"]) == (1, 1)  # one slow answer: still up
    admin.client_unpause()
    deadline = time.monotonic() + 10
    while tier.present(NS, [key(1)]) != 1:  # answered again (a loaded machine may be slow once more)
        assert time.monotonic() < deadline and tier.stats()["up"] == 1
    admin.client_pause(1000)
    assert [tier.present(NS, [key(1)]) for _ in range(3)] == [0, 0, 0]
    stats = tier.stats()
    assert (stats["up"], stats["errors"]) == (0, 1)  # three in a row: down
    admin.client_unpause()
    lookups = stats["lookups"]
    assert tier.present(NS, [key(1)]) == 0  # down for retry_s: not asked
    assert tier.stats()["lookups"] == lookups


def test_ttl_sets_an_expiry_that_use_renews(
    open_tier: Callable[..., RemoteTier], redis_server: RedisServer
) -> None:
    tier = open_tier(ttl_s=100)
    write(tier, NS, {1: page(1)})
    server, name = redis_server.client(), tier.record_key(NS, key(1))
    assert 90 < server.ttl(name) <= 100
    server.expire(name, 5)
    assert read(tier, NS, 1) == page(1)  # a read renews it
    assert server.ttl(name) > 90
    server.expire(name, 5)
    write(tier, NS, {1: page(1)})  # and so does storing it again
    assert server.ttl(name) > 90


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"tiers\.remote\.url: expected a redis://"):
        parse_config({"tiers": {"remote": {"enabled": True, "url": "http://cache:6379"}}})
    with pytest.raises(ConfigError, match=r"tiers\.remote\.write"):
        parse_config({"tiers": {"remote": {"write": "sometimes"}}})
    with pytest.raises(ConfigError, match=r"tiers\.remote\.ttl_s"):
        parse_config({"tiers": {"remote": {"ttl_s": 0.5}}})


# -- two daemons, one server ----------------------------------------------------------------------

SPEC = KVSpec(
    model="remote-test", num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float16, block_size=16
)  # 16-token chunks: 8 KiB pages
CHUNK = 16


def prompt(i: int, chunks: int) -> list[int]:
    return [i * 1000 + t for t in range(chunks * CHUNK)]


def cache_for(i: int, chunks: int) -> list[torch.Tensor]:
    """Prompt i's KV, block c = chunk c; each chunk's values depend on (i, c) only."""
    gens = [torch.Generator().manual_seed(i * 1000 + c) for c in range(chunks)]
    return [
        torch.cat([torch.randn(2, 1, 16, 2, 32, generator=gen) for gen in gens], dim=1).half()
        for _ in range(2)
    ]


def load_and_compare(client: KVStoreClient, i: int, chunks: int) -> int:
    target = [torch.full((2, chunks, 16, 2, 32), -9.0).half() for _ in range(2)]
    loaded = client.load(prompt(i, chunks), target, torch.arange(chunks))
    blocks = loaded // CHUNK
    for got, want in zip(target, cache_for(i, chunks), strict=True):
        assert torch.equal(got[:, :blocks].view(torch.uint8), want[:, :blocks].view(torch.uint8)), (
            f"prompt {i}"
        )
        assert bool((got[:, blocks:] == -9.0).all())
    return loaded


def remote_overrides(redis_server: RedisServer | RedisCluster, **settings: Any) -> dict[str, Any]:
    overrides = {
        "chunk_tokens": CHUNK,
        "tiers__remote__enabled": True,
        "tiers__remote__url": redis_server.url,
        "tiers__remote__lookup_timeout_s": 1.0,  # a deadline a loaded CI machine meets
    }
    return overrides | {f"tiers__remote__{name}": value for name, value in settings.items()}


def remote_stats(client: KVStoreClient) -> dict[str, float]:
    return dict(client.stats()["tiers"]["remote"])


def wait_written(client: KVStoreClient, pages: int) -> dict[str, float]:
    deadline = time.monotonic() + 10
    while (stats := remote_stats(client))["written"] + stats["duplicate_writes"] < pages or stats["jobs"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)
    return stats


def tiers_of(client: KVStoreClient, tokens: list[int]) -> bytes:
    from kvstore.proto import kvstore_pb2 as pb
    from kvstore.shared.keys import pack_keys

    reply = client._rpc(
        "Lookup", pb.LookupRequest(namespace=client.namespace, keys=pack_keys(client.keys(tokens)))
    )
    return bytes(reply.tiers)


def test_a_prefix_stored_on_one_host_is_loaded_on_another(
    redis_server: RedisServer, daemon_factory: Callable[..., Daemon]
) -> None:
    first = daemon_factory("first", **remote_overrides(redis_server))
    second = daemon_factory("second", **remote_overrides(redis_server))
    with KVStoreClient.connect(first.address, SPEC) as writer:
        assert writer.store(prompt(0, 6), cache_for(0, 6), torch.arange(6)) == 6
        assert wait_written(writer, 6)["written"] == 6  # written through at commit
    with KVStoreClient.connect(second.address, SPEC) as reader:
        assert reader.lookup(prompt(0, 6)) == 6 * CHUNK
        assert tiers_of(reader, prompt(0, 6)) == bytes([Tier.REMOTE]) * 6
        assert load_and_compare(reader, 0, 6) == 6 * CHUNK
        assert tiers_of(reader, prompt(0, 6)) == bytes([Tier.CPU]) * 6  # promoted into this host's arena
        assert load_and_compare(reader, 0, 6) == 6 * CHUNK
        stats = remote_stats(reader)
        assert (stats["promotions"], stats["written"]) == (6, 0)
        assert stats["pages"] == 6 and stats["bytes_used"] > 6 * 8 * KIB  # the server's own figures
        # A longer prompt: its first 6 chunks are here now, the next 2 nowhere.
        assert load_and_compare(reader, 0, 8) == 6 * CHUNK
        assert reader.clear() == 6  # this host's copies; the shared records stay for every host
        assert tiers_of(reader, prompt(0, 6)) == bytes([Tier.REMOTE]) * 6
        assert load_and_compare(reader, 0, 6) == 6 * CHUNK


def test_a_chain_continues_from_the_cpu_tier_into_the_remote_tier(
    redis_server: RedisServer, daemon_factory: Callable[..., Daemon]
) -> None:
    first = daemon_factory("first", **remote_overrides(redis_server))
    second = daemon_factory("second", **remote_overrides(redis_server))
    with KVStoreClient.connect(second.address, SPEC) as local:
        assert local.store(prompt(3, 2), cache_for(3, 2), torch.arange(2)) == 2  # the head, here too
        wait_written(local, 2)
    with KVStoreClient.connect(first.address, SPEC) as writer:
        assert writer.store(prompt(3, 5), cache_for(3, 5), torch.arange(5)) == 5
        wait_written(writer, 5)
    with KVStoreClient.connect(second.address, SPEC) as reader:
        assert tiers_of(reader, prompt(3, 5)) == bytes([Tier.CPU] * 2 + [Tier.REMOTE] * 3)
        assert load_and_compare(reader, 3, 5) == 5 * CHUNK


def test_write_through_sends_pages_from_their_slots_intact_while_the_cpu_tier_turns_over(
    redis_server: RedisServer, daemon_factory: Callable[..., Daemon]
) -> None:
    """Write-through sends each page from its arena slot, which stays pinned until it is sent
    (at most a quarter of the CPU tier at a time; past it, a copy is sent): however fast the
    small CPU tier turns over, every store succeeds, every record on the server holds its
    page's bytes, and no page stays pinned once the writes are done."""
    small = {"tiers__cpu__bytes": "400KiB", "tiers__cpu__slab_bytes": "400KiB"}  # 50 pages
    first = daemon_factory("first", **remote_overrides(redis_server), **small)
    second = daemon_factory("second", **remote_overrides(redis_server))
    stored = 0
    with KVStoreClient.connect(first.address, SPEC) as writer:
        for i in range(20):  # 200 pages through a 50-page CPU tier, back to back
            stored += writer.store(prompt(i, 10), cache_for(i, 10), torch.arange(10))
        stats = wait_written(writer, stored)
        assert stored == 200 and stats["written"] == 200 and stats["dropped_writes"] == 0
        # The last pages' slots are unpinned on the daemon's loop just after their writes end.
        deadline = time.monotonic() + 10
        while (sending := writer.stats()["counters"]["remote_sending_bytes"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sending == 0
    with KVStoreClient.connect(second.address, SPEC) as reader:
        loaded = [load_and_compare(reader, i, 10) for i in range(20)]  # bytes compared inside
        assert sum(loaded) == stored * CHUNK


def test_write_behind_sends_pages_as_they_leave_the_cpu_tier(
    redis_server: RedisServer, daemon_factory: Callable[..., Daemon]
) -> None:
    small = {"tiers__cpu__bytes": "400KiB", "tiers__cpu__slab_bytes": "400KiB"}  # 50 pages
    first = daemon_factory("first", **remote_overrides(redis_server, write="behind"), **small)
    second = daemon_factory("second", **remote_overrides(redis_server))
    with KVStoreClient.connect(first.address, SPEC) as writer:
        assert writer.store(prompt(0, 10), cache_for(0, 10), torch.arange(10)) == 10
        time.sleep(0.2)
        assert remote_stats(writer)["written"] == 0  # nothing evicted yet: nothing sent
        for i in range(1, 10):  # 100 pages through a 50-page CPU tier
            assert writer.store(prompt(i, 10), cache_for(i, 10), torch.arange(10)) == 10
        stats = wait_written(writer, 50)
        assert (
            stats["written"] >= 50 and writer.stats()["counters"]["demoted_remote_chunks"] == stats["written"]
        )
    with KVStoreClient.connect(second.address, SPEC) as reader:
        assert load_and_compare(reader, 0, 10) == 10 * CHUNK  # evicted on the first host, read here


def test_a_stopped_server_leaves_the_local_tiers_serving(
    redis_server: RedisServer, daemon_factory: Callable[..., Daemon]
) -> None:
    first = daemon_factory("first", **remote_overrides(redis_server, retry_s=60))
    second = daemon_factory("second", **remote_overrides(redis_server, retry_s=60))
    with KVStoreClient.connect(first.address, SPEC) as writer:
        assert writer.store(prompt(0, 4), cache_for(0, 4), torch.arange(4)) == 4
        wait_written(writer, 4)
    redis_server.stop()
    with (
        KVStoreClient.connect(second.address, SPEC) as reader,
        KVStoreClient.connect(first.address, SPEC) as writer,
    ):
        started = time.monotonic()
        assert reader.lookup(prompt(0, 4)) == 0  # only the server had it: a miss, at once
        assert load_and_compare(reader, 0, 4) == 0
        assert load_and_compare(writer, 0, 4) == 4 * CHUNK  # the first host's own copy still serves
        assert writer.store(prompt(1, 3), cache_for(1, 3), torch.arange(3)) == 3
        assert load_and_compare(writer, 1, 3) == 3 * CHUNK
        assert time.monotonic() - started < 5
        assert remote_stats(reader)["up"] == 0 and remote_stats(reader)["errors"] >= 1
        deadline = time.monotonic() + 10  # a write that found the server gone unpins its page
        while writer.stats()["counters"]["remote_sending_bytes"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert "its pages are misses for 60.0 s" in second.log()


def test_a_daemon_starts_with_its_server_unreachable_and_serves(
    tmp_path: Any, daemon_factory: Callable[..., Daemon]
) -> None:
    missing = f"unix://{tmp_path}/no-redis.sock"
    daemon = daemon_factory(chunk_tokens=CHUNK, tiers__remote__enabled=True, tiers__remote__url=missing)
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        assert client.store(prompt(0, 2), cache_for(0, 2), torch.arange(2)) == 2
        assert load_and_compare(client, 0, 2) == 2 * CHUNK
        assert client.lookup(prompt(1, 2)) == 0
        assert remote_stats(client)["up"] == 0
    assert "the first PING failed" in daemon.log()


# -- the RESP reader against scripted replies -------------------------------------------------------


def scripted_server(path: str, reply_chunks: list[bytes]) -> threading.Thread:
    """Accepts one connection on `path`, reads one request, sends `reply_chunks` one by one, closes."""
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, listener, contextlib.suppress(OSError):  # the reader may close first
            conn.recv(65536)
            for chunk in reply_chunks:
                conn.sendall(chunk)
                time.sleep(0.001)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def record_of(i: int, size: int = 4 * KIB) -> bytes:
    from kvstore.tiers.codec import Codec
    from kvstore.tiers.records import pack_header

    data = page(i, size)
    return pack_header(NS, key(i), Codec.NONE, size, data) + data


@pytest.mark.parametrize(
    ("reply", "outcome"),
    [
        pytest.param([b"$-1\r\n"], None, id="nil"),
        pytest.param([b"$%d\r\n" % (HEADER_BYTES + 4096), record_of(1), b"\r\n"], "page", id="whole"),
        pytest.param(
            [bytes([b]) for b in b"$%d\r\n" % (HEADER_BYTES + 4096) + record_of(1)[:100]]
            + [record_of(1)[100:], b"\r", b"\n"],
            "page",
            id="bytewise",
        ),
        pytest.param(
            [b"$%d\r\n" % (HEADER_BYTES + 4096), record_of(1)[:2000]], ConnectionError, id="cut-short"
        ),
        pytest.param([b"$%d\r\n" % (HEADER_BYTES + 4096), record_of(1), b"xx"], "RespError", id="no-crlf"),
        pytest.param([b"$10\r\n0123456789\r\n"], "CorruptRecord", id="shorter-than-a-header"),
        pytest.param(
            [b"$%d\r\n" % (HEADER_BYTES + 4096), record_of(2), b"\r\n"], "CorruptRecord", id="other-key"
        ),
        pytest.param([b"-ERR boom\r\n"], "RespError", id="error"),
        pytest.param([b"+OK\r\n"], "RespError", id="not-a-bulk-string"),
    ],
)
def test_the_record_reader_takes_only_a_whole_checked_reply(
    tmp_path: Any, reply: list[bytes], outcome: Any
) -> None:
    from kvstore.tiers.records import CorruptRecord
    from kvstore.tiers.remote_resp import RespError

    path = str(tmp_path / "s.sock")
    server = scripted_server(path, reply)
    reader = RecordConnection.open(Endpoint.parse(f"unix://{path}"), timeout_s=5)
    into = memoryview(bytearray(b"\xa5" * 4096))
    errors = {"RespError": RespError, "CorruptRecord": CorruptRecord, ConnectionError: ConnectionError}
    if outcome in errors:
        with pytest.raises(errors[outcome]):
            reader.get(b"name", NS, key(1), into)
        assert reader._sock.fileno() == -1  # closed: a half-read reply is never parsed again
    else:
        got = reader.get(b"name", NS, key(1), into)
        assert (None if got is None else bytes(got)) == (page(1, 4096) if outcome == "page" else None)
        reader.close()
    server.join(5)


@pytest.mark.parametrize(
    ("reply", "call", "outcome"),
    [
        pytest.param(
            [b"*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$9\r\n127.0.0.1\r\n:7000\r\n$2\r\nid\r\n"],
            "call",
            [[0, 16383, [b"127.0.0.1", 7000, b"id"]]],
            id="cluster-slots",
        ),
        pytest.param([b":1\r\n:0\r\n+OK\r\n-MOVED 7 10.0.0.2:7001\r\n"], "lines", "mixed", id="lines"),
        pytest.param([b"-ASK 12 10.0.0.3:7002\r\n"], "call", "ASK", id="ask"),
        pytest.param([b"$999999999\r\n"], "call", "RespError", id="a-huge-bulk"),
        pytest.param([b"*99999999\r\n"], "call", "RespError", id="a-huge-array"),
        pytest.param([b"$3\r\nabc\r\n"], "lines", "RespError", id="a-bulk-among-lines"),
        pytest.param([b":1\r\n:"], "lines", ConnectionError, id="cut-short"),
    ],
)
def test_the_reader_parses_replies_and_refuses_ones_it_did_not_ask_for(
    tmp_path: Any, reply: list[bytes], call: str, outcome: Any
) -> None:
    from kvstore.tiers.remote_resp import Redirect, RespError

    path = str(tmp_path / "s.sock")
    server = scripted_server(path, reply)
    reader = RecordConnection.open(Endpoint.parse(f"unix://{path}"), timeout_s=5)

    def run() -> Any:
        if call == "call":
            return reader.call(b"CLUSTER", b"SLOTS")
        reader.send([b"PING\r\n"])
        return reader.line_replies(4 if outcome == "mixed" else 2)

    if outcome in ("RespError", ConnectionError):
        with pytest.raises(RespError if outcome == "RespError" else ConnectionError):
            run()
        assert reader._sock.fileno() == -1  # closed: never parsed again from the middle
    elif outcome == "ASK":
        with pytest.raises(Redirect) as redirect:
            run()
        assert (redirect.value.ask, redirect.value.slot, redirect.value.address) == (
            True,
            12,
            ("10.0.0.3", 7002),
        )
        assert reader._sock.fileno() != -1  # a whole reply: the connection stays usable
    elif outcome == "mixed":
        one, zero, ok, moved = run()
        assert (one, zero, ok) == (1, 0, b"OK")
        assert isinstance(moved, Redirect) and (moved.ask, moved.slot, moved.address) == (
            False,
            7,
            ("10.0.0.2", 7001),
        )
    else:
        assert run() == outcome
    reader.close()
    server.join(5)


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        pytest.param([b":1", b":0", b":1"], [1, 0, 1], id="integers"),
        pytest.param(
            [b":1", b"-MOVED 7 10.0.0.2:7001", b":1"], ["1", "MOVED", "1"], id="an-error-among-them"
        ),
        pytest.param([b":1", b"+OK", b":0"], ["1", "OK", "0"], id="a-status-among-them"),
        pytest.param([b":1", b":x", b":0"], "RespError", id="not-a-number"),
    ],
)
def test_one_line_replies_in_bulk_match_them_one_by_one(
    tmp_path: Any, lines: list[bytes], expected: Any
) -> None:
    from kvstore.tiers.remote_resp import Redirect, RespError

    path = str(tmp_path / "s.sock")
    server = scripted_server(path, [b"".join(line + b"\r\n" for line in lines)])
    reader = RecordConnection.open(Endpoint.parse(f"unix://{path}"), timeout_s=5)
    reader.send([b"PING\r\n"])
    if expected == "RespError":
        with pytest.raises(RespError):
            reader.line_replies(len(lines))
    else:
        got = reader.line_replies(len(lines))
        shown = [
            "MOVED" if isinstance(r, Redirect) else r.decode() if isinstance(r, bytes) else str(r)
            for r in got
        ]
        assert shown == [str(e) for e in expected]
    reader.close()
    server.join(5)


def test_a_server_whose_figures_are_not_numbers_shows_zeros(tmp_path: Any) -> None:
    """kvctl stats and the metrics ask each server for INFO memory and DBSIZE: a reply that does
    not parse is counted and shown as zeros, never an error out of Stats."""
    path = str(tmp_path / "s.sock")
    info = b"# Memory\r\nused_memory:lots\r\nmaxmemory:0\r\n"
    server = scripted_server(path, [b"$%d\r\n%s\r\n:5\r\n" % (len(info), info)])
    tier = RemoteTier(RemoteTierConfig(enabled=True, url=f"unix://{path}", lookup_timeout_s=5.0))
    try:
        (node,) = tier.node_usage()
        assert (node.bytes_used, node.bytes_capacity, node.keys) == (0, 0, 0)
        assert tier.stats()["stats_failures"] == 1 and tier.stats()["up"] == 1
    finally:
        tier.close(timeout_s=5)
        server.join(5)
