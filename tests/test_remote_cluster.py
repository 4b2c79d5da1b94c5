"""The remote tier on a real Redis Cluster (three masters, one replica each, on localhost):
records spread over every master and read back byte for byte, a prompt shared between two
daemons through it, a master killed mid-load (misses until its replica takes over, then hits,
never a wrong byte), a reshard while pages are written and read, ACL users, and a cluster that
speaks TLS only."""

from __future__ import annotations

import json
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

from redis.crc import key_slot  # noqa: E402

from kvstore.config.root import RemoteTierConfig  # noqa: E402
from kvstore.shared.domain import Tier  # noqa: E402
from kvstore.tiers.remote import RemoteTier  # noqa: E402
from kvstore_client import KVStoreClient  # noqa: E402
from tests.harness import Daemon  # noqa: E402
from tests.pki import make_pki  # noqa: E402
from tests.redis_cluster import RedisCluster, cluster_tools  # noqa: E402
from tests.test_cli import kvctl  # noqa: E402
from tests.test_metrics import free_port, scrape  # noqa: E402
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
    tiers_of,
    wait_written,
    write,
)

PAGE = 16 * KIB


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    if cluster_tools() is None:
        pytest.skip("needs redis-server and redis-cli on PATH (apt-get install redis-server; .ci/run does)")
    cluster = RedisCluster(tmp_path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def open_tier(cluster: RedisCluster) -> Iterator[Callable[..., RemoteTier]]:
    opened: list[RemoteTier] = []

    def open_(**overrides: Any) -> RemoteTier:
        settings: dict[str, Any] = {
            "enabled": True,
            "cluster": True,
            "urls": (cluster.seed_url,),
            "lookup_timeout_s": 1.0,  # a deadline a loaded CI machine meets
        }
        tier = RemoteTier(RemoteTierConfig(**(settings | overrides)))
        tier.start()
        opened.append(tier)
        return tier

    yield open_
    for tier in opened:
        tier.close(timeout_s=5)


def owner(cluster: RedisCluster, tier: RemoteTier, i: int) -> int:
    return cluster.slot_owner(key_slot(tier.record_key(NS, key(i))))


def test_records_round_trip_across_slots_on_every_master(
    cluster: RedisCluster, open_tier: Callable[..., RemoteTier]
) -> None:
    tier = open_tier()
    pages = {i: page(i, PAGE) for i in range(48)}
    write(tier, NS, pages)
    held = {port: cluster.client(port).dbsize() for port in cluster.masters()}
    assert sum(held.values()) == 48 and all(count > 0 for count in held.values()), held
    assert tier.present(NS, [key(i) for i in range(48)]) == 48  # one round trip per master
    assert tier.present(NS, [key(0), key(1), key(999), key(2)]) == 2
    assert all(read(tier, NS, i, PAGE) == data for i, data in pages.items())
    stats = tier.stats()
    assert (stats["written"], stats["promotions"], stats["errors"], stats["redirects"]) == (48, 48, 0, 0)
    cluster.replicate()
    nodes = tier.node_usage()
    assert sorted(node.role for node in nodes) == ["master"] * 3 + ["replica"] * 3
    assert sum(node.keys for node in nodes if node.role == "master") == 48
    assert sum(node.keys for node in nodes if node.role == "replica") == 48
    assert all(node.up and node.bytes_used > 0 and node.errors == 0 for node in nodes)
    assert tier.server_usage()[2] == 48  # the cluster's keys, replicas not counted again


def test_a_prompt_on_every_master_is_shared_by_two_daemons(
    cluster: RedisCluster, daemon_factory: Callable[..., Daemon]
) -> None:
    overrides = remote_overrides(cluster, cluster=True)
    metrics = free_port()
    first = daemon_factory("first", **overrides)
    second = daemon_factory("second", server__metrics_address=f"127.0.0.1:{metrics}", **overrides)
    chunks = 12
    with KVStoreClient.connect(first.address, SPEC) as writer:
        assert writer.store(prompt(0, chunks), cache_for(0, chunks), torch.arange(chunks)) == chunks
        assert wait_written(writer, chunks)["written"] == chunks
        names = [
            f"kvstore:{writer.namespace.hex()}:{k.hex()}".encode() for k in writer.keys(prompt(0, chunks))
        ]
    assert {cluster.slot_owner(key_slot(name)) for name in names} == set(cluster.masters())
    with KVStoreClient.connect(second.address, SPEC) as reader:
        assert reader.lookup(prompt(0, chunks)) == chunks * CHUNK
        assert tiers_of(reader, prompt(0, chunks)) == bytes([Tier.REMOTE]) * chunks
        assert load_and_compare(reader, 0, chunks) == chunks * CHUNK
    cluster.replicate()
    shown = kvctl(second, "stats")
    assert shown.returncode == 0, shown.stderr
    for port in cluster.ports:
        assert f"127.0.0.1:{port}" in shown.stdout
    assert shown.stdout.count(" master ") == 3 and shown.stdout.count(" replica ") == 3
    as_json = kvctl(second, "stats", "--json")
    remote = json.loads(as_json.stdout)["tiers"]["remote"]
    assert remote["pages"] == chunks and len(remote["nodes"]) == 6
    assert sum(node["keys"] for node in remote["nodes"] if node["role"] == "master") == chunks
    samples = scrape(metrics)
    up = {labels: value for (name, labels), value in samples.items() if name == "kvstore_remote_node_up"}
    assert sorted(dict(labels)["role"] for labels in up) == ["master"] * 3 + ["replica"] * 3
    assert all(value == 1 for value in up.values())
    keys = {
        dict(labels)["node"]: value
        for (name, labels), value in samples.items()
        if name == "kvstore_remote_node_keys"
    }
    assert sum(keys[f"127.0.0.1:{master}"] for master in cluster.masters()) == chunks
    assert samples[("kvstore_tier_pages", (("tier", "remote"),))] == chunks  # the masters' keys


def test_a_master_killed_mid_load_is_misses_until_failover_then_hits(
    cluster: RedisCluster, open_tier: Callable[..., RemoteTier], caplog: pytest.LogCaptureFixture
) -> None:
    tier = open_tier(retry_s=1.0)
    pages = {i: page(i, PAGE) for i in range(60)}
    write(tier, NS, pages)
    cluster.replicate()
    victim = owner(cluster, tier, 0)
    on_victim = {i for i in pages if owner(cluster, tier, i) == victim}
    reads: list[tuple[float, int, bool]] = []
    wrong: list[int] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            for i, data in pages.items():
                got = read(tier, NS, i, PAGE)
                if got is not None and got != data:
                    wrong.append(i)
                reads.append((time.monotonic(), i, got is not None))

    readers = [threading.Thread(target=reader) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.remote"):
        for thread in readers:
            thread.start()
        time.sleep(0.3)
        killed = time.monotonic()
        cluster.kill(victim)
        cluster.wait_failover(victim)
        deadline = time.monotonic() + 30
        while not all(read(tier, NS, i, PAGE) == data for i, data in pages.items()):
            assert time.monotonic() < deadline, "the pages of the failed master were not served again"
            time.sleep(0.1)
        served_again = time.monotonic()
        time.sleep(0.3)
        stop.set()
        for thread in readers:
            thread.join(30)
    assert not wrong  # never a wrong byte
    before = [hit for at, _, hit in reads if at < killed]
    assert before and all(before)
    during = [(i, hit) for at, i, hit in reads if killed < at < served_again]
    assert any(not hit for i, hit in during if i in on_victim)  # its pages were misses for a while
    assert all(hit for i, hit in during if i not in on_victim)  # the other masters kept serving
    assert tier.present(NS, [key(i) for i in pages]) == len(pages)
    assert caplog.text.count(f"node 127.0.0.1:{victim} of cluster") == 1  # one warning per outage
    stats = tier.stats()
    assert stats["outages"] == 1 and stats["errors"] >= 1 and stats["up"] == 1
    nodes = {node.address: node for node in tier.node_usage()}
    assert f"127.0.0.1:{victim}" not in nodes or nodes[f"127.0.0.1:{victim}"].role == "absent"


def test_a_daemon_loading_while_a_master_is_killed_serves_misses_then_hits(
    cluster: RedisCluster, daemon_factory: Callable[..., Daemon]
) -> None:
    """Through two real daemons: B loads prompts A stored (clearing its own copies each time, so
    every load reads the cluster) while a master is SIGKILLed; loads fall short, never wrong,
    and are whole again after the failover, with no daemon restart."""
    overrides = remote_overrides(cluster, cluster=True, retry_s=1.0)
    first, second = daemon_factory("first", **overrides), daemon_factory("second", **overrides)
    chunks = 8
    with KVStoreClient.connect(first.address, SPEC) as writer:
        for i in range(3):
            assert writer.store(prompt(i, chunks), cache_for(i, chunks), torch.arange(chunks)) == chunks
        wait_written(writer, 3 * chunks)
    cluster.replicate()
    loaded: list[int] = []
    with KVStoreClient.connect(second.address, SPEC) as reader:

        def load_all() -> int:
            reader.clear()  # this host's copies: the next load reads the cluster again
            return sum(load_and_compare(reader, i, chunks) for i in range(3))  # bytes compared

        assert load_all() == 3 * chunks * CHUNK
        cluster.kill(owner_of_chunk(cluster, reader, 0))
        deadline = time.monotonic() + 60
        while (got := load_all()) < 3 * chunks * CHUNK:  # misses while the master is down
            loaded.append(got)
            assert time.monotonic() < deadline, loaded
            time.sleep(0.2)
        assert loaded  # the first load after the kill fell short; whole again after the failover
        assert remote_stats(reader)["outages"] == 1


def owner_of_chunk(cluster: RedisCluster, client: KVStoreClient, i: int) -> int:
    """The master holding chunk 0 of prompt `i`'s record."""
    name = f"kvstore:{client.namespace.hex()}:{client.keys(prompt(i, 1))[0].hex()}".encode()
    return cluster.slot_owner(key_slot(name))


def test_a_reshard_while_pages_are_written_and_read_gives_misses_only(
    cluster: RedisCluster, open_tier: Callable[..., RemoteTier]
) -> None:
    tier = open_tier()
    first = {i: page(i, PAGE) for i in range(40)}
    write(tier, NS, first)
    source, target = list(cluster.masters())[:2]
    moving = {i for i in first if owner(cluster, tier, i) == source}
    resharding = cluster.reshard(source, target, 3000)
    written: dict[int, bool] = {}
    wrong: list[int] = []
    stop = threading.Event()

    def writer() -> None:
        i = 1000
        while not stop.is_set():
            finished = threading.Event()

            def done(stored: bool, i: int = i, finished: threading.Event = finished) -> None:
                written[i] = stored
                finished.set()

            # A write may be refused or fail: a node a loaded machine made too slow is out for
            # retry_s (its pages misses). What is written must read back exactly.
            if tier.submit_write(NS, key(i), page(i, PAGE), done):
                assert finished.wait(30)
            else:
                written[i] = False
                stop.wait(0.05)
            i += 1

    def reader() -> None:
        while not stop.is_set():
            for i, data in list(first.items()) + [
                (i, page(i, PAGE)) for i, ok in list(written.items()) if ok
            ]:
                got = read(tier, NS, i, PAGE)
                if got is not None and got != data:
                    wrong.append(i)

    threads = [
        threading.Thread(target=writer),
        threading.Thread(target=reader),
        threading.Thread(target=reader),
    ]
    for thread in threads:
        thread.start()
    try:
        _, errors = resharding.communicate(timeout=180)
        assert resharding.returncode == 0, errors.decode(errors="replace")
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not wrong
    assert any(written.values())
    moved = {i for i in moving if owner(cluster, tier, i) == target}
    assert moved  # some of the first pages' slots moved: read now through MOVED
    everything = first | {i: page(i, PAGE) for i, ok in written.items() if ok}
    # Every page reads back: a read a loaded machine made too slow is a miss, and a run of them
    # takes the node out for retry_s, so a miss is read again until the deadline; a wrong byte never.
    deadline = time.monotonic() + 60
    for i, data in everything.items():
        got = read(tier, NS, i, PAGE)
        while got is None and time.monotonic() < deadline:
            time.sleep(0.1)
            got = read(tier, NS, i, PAGE)
        assert got == data, (i, None if got is None else "wrong bytes")
    assert tier.present(NS, [key(i) for i in first]) == len(first)
    # Redirects were followed. A call that timed out on a loaded machine counts as an error
    # and was a miss, never wrong bytes (checked above).
    assert tier.stats()["redirects"] > 0


def test_an_acl_user_and_password_on_every_node(
    cluster: RedisCluster, open_tier: Callable[..., RemoteTier]
) -> None:
    for port in cluster.ports:
        cluster.client(port).execute_command("ACL", "SETUSER", "kv", "on", ">s3cret", "~*", "+@all")
    url = cluster.seed_url.replace("redis://", "redis://kv:s3cret@")
    tier = open_tier(urls=(url,))
    pages = {i: page(i, PAGE) for i in range(12)}
    write(tier, NS, pages)
    assert all(read(tier, NS, i, PAGE) == data for i, data in pages.items())
    assert tier.present(NS, [key(i) for i in pages]) == 12
    wrong = open_tier(urls=(cluster.seed_url.replace("redis://", "redis://kv:nope@"),))
    assert wrong.present(NS, [key(0)]) == 0 and read(wrong, NS, 0, PAGE) is None  # refused: misses
    assert wrong.stats()["up"] == 0  # no slot map: nothing answered


def test_a_cluster_over_tls(tmp_path: Path) -> None:
    """rediss:// seeds: the nodes the slot map names are reached with the same CA, through the
    same zero-copy reader."""
    if cluster_tools() is None:
        pytest.skip("needs redis-server and redis-cli on PATH (apt-get install redis-server; .ci/run does)")
    (tmp_path / "pki").mkdir()
    files = make_pki(tmp_path / "pki")
    cluster = RedisCluster(tmp_path, tls=files)
    tier = None
    try:
        try:
            cluster.start()
        except (RuntimeError, subprocess.CalledProcessError):
            pytest.skip("this redis-server or redis-cli was built without TLS")
        tier = RemoteTier(
            RemoteTierConfig(enabled=True, cluster=True, urls=(cluster.seed_url,), lookup_timeout_s=1.0)
        )
        tier.start()
        pages = {i: page(i, PAGE) for i in range(24)}
        write(tier, NS, pages)
        assert {owner(cluster, tier, i) for i in pages} == set(cluster.masters())
        assert tier.present(NS, [key(i) for i in pages]) == 24
        assert all(read(tier, NS, i, PAGE) == data for i, data in pages.items())
        assert (tier.stats()["errors"], tier.stats()["written"]) == (0, 24)
    finally:
        if tier is not None:
            tier.close(timeout_s=5)
        cluster.stop()


@pytest.mark.parametrize(
    ("remote", "message"),
    [
        pytest.param(
            {"urls": ["redis://a:7000"]},
            r"tiers\.remote\.urls: lists a cluster's seed nodes: set tiers\.remote\.cluster: true",
            id="urls-without-cluster",
        ),
        pytest.param(
            {"cluster": True, "url": "unix:///run/redis.sock"},
            r"tiers\.remote\.url: a cluster is reached over TCP",
            id="unix-seed",
        ),
        pytest.param(
            {"cluster": True, "urls": ["redis://a:7000", "redis://b:7000/2"]},
            r"tiers\.remote\.urls\[1\]: a cluster has database 0 only",
            id="database",
        ),
        pytest.param(
            {"cluster": True, "urls": ["redis://u:p@a:7000", "rediss://u:p@b:7000"]},
            r"tiers\.remote\.urls\[1\]: every seed node takes the same scheme, credentials and TLS",
            id="mixed-seeds",
        ),
    ],
)
def test_cluster_config_errors_name_the_key(remote: dict[str, Any], message: str) -> None:
    from kvstore.config.root import ConfigError, parse_config

    with pytest.raises(ConfigError, match=message):
        parse_config({"tiers": {"remote": {"enabled": True, **remote}}})


def test_slots_are_the_cluster_specs_crc16_with_hash_tags() -> None:
    from kvstore.tiers.remote_nodes import slot

    assert slot(b"123456789") == 0x31C3 % 16384  # the CRC16/XMODEM check value
    assert slot(b"user{1000}.following") == slot(b"user{1000}.followers") == slot(b"1000")
    assert slot(b"foo{}{bar}") == key_slot(b"foo{}{bar}")  # an empty tag: the whole key
    names = [bytes(random.Random(i).randbytes(i % 40)) for i in range(5000)] + [b"a{b", b"{a}}", b"}{a}"]
    assert [slot(name) for name in names] == [key_slot(name) for name in names]
