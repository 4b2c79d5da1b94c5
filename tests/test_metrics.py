"""Prometheus metrics and HTTP probes of a real daemon, scraped over HTTP and parsed with
prometheus_client's own parser."""

from __future__ import annotations

import contextlib
import gzip
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.proto import kvstore_pb2 as pb
from tests.harness import Daemon
from tests.test_protocol import SMALL_ARENA, chain, connect, random_pages, store

FAMILIES = {  # every family the issue names, present at the first scrape: name -> type
    "kvstore_build_info": "gauge",
    "kvstore_uptime_seconds": "gauge",
    "kvstore_serving": "gauge",
    "kvstore_lookups": "counter",
    "kvstore_lookup_hit_chunks": "counter",
    "kvstore_lookup_missed_chunks": "counter",
    "kvstore_stored_pages": "counter",
    "kvstore_evicted_pages": "counter",
    "kvstore_promoted_pages": "counter",
    "kvstore_demoted_pages": "counter",
    "kvstore_dropped_writes": "counter",
    "kvstore_tier_errors": "counter",
    "kvstore_tier_outages": "counter",
    "kvstore_tier_up": "gauge",
    "kvstore_tier_used_bytes": "gauge",
    "kvstore_tier_capacity_bytes": "gauge",
    "kvstore_tier_pages": "gauge",
    "kvstore_namespace_pages": "gauge",
    "kvstore_namespaces": "gauge",
    "kvstore_active_leases": "gauge",
    "kvstore_expired_leases": "counter",
    "kvstore_cleared_pages": "counter",
    "kvstore_pinned_pages": "gauge",
    "kvstore_refused_local_connections": "counter",
    "kvstore_rpc_duration_seconds": "histogram",
    "kvstore_metrics_snapshots": "counter",
    "kvstore_metrics_connections": "gauge",
    "kvstore_metrics_closed_connections": "counter",
    "process_cpu_seconds": "counter",
    "process_resident_memory_bytes": "gauge",
    "process_open_fds": "gauge",
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample by (name, sorted labels)."""
    status, text = get(port, "/metrics")
    assert status == 200, text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def families(port: int) -> dict[str, str]:
    return {family.name: family.type for family in text_string_to_metric_families(get(port, "/metrics")[1])}


@pytest.fixture
def metered(daemon_factory: Callable[..., Daemon], tmp_path: Any) -> tuple[Daemon, int]:
    port = free_port()
    daemon = daemon_factory(
        server__metrics_address=f"127.0.0.1:{port}",
        tiers__disk__enabled=True,
        tiers__disk__path=str(tmp_path / "disk"),
        tiers__disk__bytes="1MiB",
        **SMALL_ARENA,
    )
    return daemon, port


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_every_family_is_present_at_the_first_scrape(metered: tuple[Daemon, int]) -> None:
    daemon, port = metered
    found = families(port)
    assert {name: found.get(name) for name in FAMILIES} == FAMILIES
    samples = scrape(port)
    for tier in ("cpu", "disk"):
        for name in ("kvstore_stored_pages_total", "kvstore_tier_capacity_bytes", "kvstore_tier_up"):
            assert (name, (("tier", tier),)) in samples, (name, tier)
    assert value(samples, "kvstore_lookups_total") == 0
    assert value(samples, "kvstore_tier_capacity_bytes", tier="cpu") == 64 * 1024
    assert value(samples, "kvstore_tier_capacity_bytes", tier="disk") == 1 << 20
    assert value(samples, "kvstore_serving") == 1
    assert value(samples, "kvstore_rpc_duration_seconds_count", channel="grpc", method="Lookup") == 0


def test_counters_move_by_exactly_what_was_done(metered: tuple[Daemon, int]) -> None:
    daemon, port = metered
    conn = connect(daemon.stub())
    before = scrape(port)
    keys = chain(conn, 16)
    pages = random_pages(16, conn.page_bytes, seed=1)
    store(conn, keys, pages)  # fills the 16-slot arena
    reply = conn.stub.Lookup(pb.LookupRequest(namespace=conn.ns, keys=b"".join([*keys[:5], b"\0" * 16])))
    assert reply.hit_chunks == 5
    more = chain(conn, 4, first_token=10_000)
    store(conn, more, random_pages(4, conn.page_bytes, seed=2))  # evicts 4, written behind to disk
    deadline = time.monotonic() + 10
    while value(scrape(port), "kvstore_stored_pages_total", tier="disk") < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    after = scrape(port)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("kvstore_lookups_total") == 1
    assert moved("kvstore_lookup_hit_chunks_total") == 5
    assert moved("kvstore_lookup_missed_chunks_total") == 1
    assert moved("kvstore_stored_pages_total", tier="cpu") == 20
    assert moved("kvstore_evicted_pages_total", tier="cpu") == 4
    assert moved("kvstore_demoted_pages_total", tier="disk") == 4
    assert moved("kvstore_stored_pages_total", tier="disk") == 4
    assert moved("kvstore_dropped_writes_total", tier="disk") == 0
    assert value(after, "kvstore_tier_pages", tier="cpu") == 16
    assert value(after, "kvstore_tier_pages", tier="disk") == 4
    assert value(after, "kvstore_tier_used_bytes", tier="cpu") == 16 * conn.page_bytes
    assert value(after, "kvstore_namespace_pages", tenant="", model="test") == 16
    assert moved("kvstore_rpc_duration_seconds_count", channel="grpc", method="Lookup") == 1
    assert moved("kvstore_rpc_duration_seconds_count", channel="grpc", method="Reserve") == 2
    assert moved("kvstore_rpc_duration_seconds_count", channel="grpc", method="Commit") == 2
    assert value(after, "kvstore_active_leases", kind="load") == 0
    assert value(after, "process_resident_memory_bytes") > 0


def test_probes_say_alive_and_ready_with_the_tiers(metered: tuple[Daemon, int]) -> None:
    daemon, port = metered
    assert get(port, "/healthz") == (200, '{"alive": true}\n')
    status, body = get(port, "/readyz")
    assert status == 200
    assert json.loads(body)["tiers"] == {
        "cpu": {"serving": True},
        "disk": {"serving": True, "outages": 0},
    }
    assert get(port, "/nothing")[0] == 404


def test_a_model_name_flood_keeps_the_label_set_bounded(
    daemon_factory: Callable[..., Daemon],
) -> None:
    port = free_port()
    daemon = daemon_factory(server__metrics_address=f"127.0.0.1:{port}")
    stub = daemon.stub()
    for i in range(80):
        conn = connect(stub, model=f"model-{i:03d}")
        store(conn, chain(conn, 1), random_pages(1, conn.page_bytes, seed=i))
    samples = scrape(port)
    models = {dict(labels)["model"] for name, labels in samples if name == "kvstore_namespace_pages"}
    assert len(models) == 65 and "other" in models  # 64 named, the rest summed
    assert sum(v for (name, _), v in samples.items() if name == "kvstore_namespace_pages") == 80
    assert value(samples, "kvstore_namespace_pages", tenant="", model="other") == 16
    assert value(samples, "kvstore_namespaces") == 80


def test_a_metrics_address_that_cannot_be_bound_names_the_key(
    daemon_factory: Callable[..., Daemon],
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=r"server\.metrics_address: cannot listen on 127\.0\.0\.1"):
            daemon_factory(server__metrics_address=f"127.0.0.1:{port}")


def test_a_scrape_in_the_reuse_window_shares_the_snapshot_and_readiness_takes_none(
    metered: tuple[Daemon, int],
) -> None:
    daemon, port = metered
    first = value(scrape(port), "kvstore_metrics_snapshots_total")
    assert first >= 1
    for _ in range(20):
        assert get(port, "/readyz")[0] == 200
    assert value(scrape(port), "kvstore_metrics_snapshots_total") - first <= 1  # this one, at most


def test_requests_past_the_size_limits_are_refused_with_their_status(metered: tuple[Daemon, int]) -> None:
    daemon, port = metered

    def status_of(request: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(request)
            with contextlib.suppress(ConnectionResetError):
                return conn.recv(4096).split(b"\r\n", 1)[0]
        return b"reset"

    long_target = b"GET /metrics?" + b"a" * 5000 + b" HTTP/1.1\r\n\r\n"
    many_headers = b"GET /healthz HTTP/1.1\r\n" + b"X-A: " + b"b" * 8000 + b"\r\n" + b"X-B: " + b"c" * 9000
    assert status_of(long_target) in (b"HTTP/1.1 414 URI Too Long", b"reset")
    assert status_of(many_headers + b"\r\n\r\n") in (
        b"HTTP/1.1 431 Request Header Fields Too Large",
        b"reset",
    )
    assert status_of(b"POST /metrics HTTP/1.1\r\n\r\n") == b"HTTP/1.1 405 Method Not Allowed"
    assert status_of(b"nonsense\r\n\r\n") == b"HTTP/1.1 400 Bad Request"
    assert get(port, "/healthz")[0] == 200
    samples = scrape(port)
    assert value(samples, "kvstore_metrics_closed_connections_total", reason="too_large") == 2
    assert value(samples, "kvstore_metrics_closed_connections_total", reason="bad_request") == 2


def test_a_gzip_scrape_and_a_name_filter_work_as_prometheus_client_s_own(metered: tuple[Daemon, int]) -> None:
    daemon, port = metered
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics?name[]=kvstore_lookups_total", headers={"Accept-Encoding": "gzip"}
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.headers["Content-Encoding"] == "gzip"
        text = gzip.decompress(reply.read()).decode()
    assert [family.name for family in text_string_to_metric_families(text)] == ["kvstore_lookups"]


def test_the_remote_tiers_forged_records_and_refused_redirects_are_exported(
    redis_server: Any, daemon_factory: Callable[..., Daemon], tmp_path: Any
) -> None:
    pytest.importorskip("redis", reason="the remote tier needs the redis package")
    import torch

    from kvstore_client import KVStoreClient
    from tests.test_hardening_remote import secret_file, settled
    from tests.test_remote_tier import (
        SPEC,
        cache_for,
        load_and_compare,
        prompt,
        remote_overrides,
        wait_written,
    )

    writer = daemon_factory(
        "fleet-a", **remote_overrides(redis_server, record_key_file=secret_file(tmp_path / "a", 1))
    )
    port = free_port()
    reader = daemon_factory(
        "fleet-b",
        server__metrics_address=f"127.0.0.1:{port}",
        **remote_overrides(redis_server, record_key_file=secret_file(tmp_path / "b", 2)),
    )
    samples = scrape(port)
    assert value(samples, "kvstore_remote_forged_records_total") == 0
    assert ("kvstore_remote_refused_redirects_total", ()) in samples
    with KVStoreClient.connect(writer.address, SPEC) as client:
        assert client.store(prompt(0, 4), cache_for(0, 4), torch.arange(4)) == 4
        wait_written(client, 4)
    with KVStoreClient.connect(reader.address, SPEC) as client:
        assert load_and_compare(client, 0, 4) == 0  # another fleet's records: misses
        stats = settled(client)
    samples = scrape(port)  # a snapshot younger than the reuse window may answer: wait for the figure
    deadline = time.monotonic() + 10
    while value(samples, "kvstore_remote_forged_records_total") < 4 and time.monotonic() < deadline:
        samples = scrape(port)
    assert stats["forged_records"] == value(samples, "kvstore_remote_forged_records_total") == 4
    assert value(samples, "kvstore_remote_refused_redirects_total") == stats["refused_redirects"] == 0


def test_a_refused_redirect_is_exported(daemon_factory: Callable[..., Daemon], tmp_path: Any) -> None:
    pytest.importorskip("redis", reason="the remote tier needs the redis package")
    from tests.test_hardening_remote import FakeRedis

    def answer(parts: list[bytes]) -> bytes:  # one server, not a cluster, sending every read elsewhere
        return {b"PING": b"+PONG\r\n"}.get(parts[0], b"-MOVED 866 127.0.0.1:1\r\n")

    fake = FakeRedis(answer, str(tmp_path / "fake.sock"))
    port = free_port()
    try:
        daemon = daemon_factory(
            server__metrics_address=f"127.0.0.1:{port}",
            tiers__remote__enabled=True,
            tiers__remote__url=f"unix://{tmp_path}/fake.sock",
            tiers__remote__lookup_timeout_s=1.0,
        )
        conn = connect(daemon.stub())
        keys = chain(conn, 2)
        assert conn.stub.Lookup(pb.LookupRequest(namespace=conn.ns, keys=b"".join(keys))).hit_chunks == 0
        deadline = time.monotonic() + 10
        while value(samples := scrape(port), "kvstore_remote_refused_redirects_total") < 1:
            assert time.monotonic() < deadline, "no refused redirect counted"
        (remote,) = [tier for tier in daemon.stub().Stats(pb.StatsRequest()).tiers if tier.name == "remote"]
        assert value(samples, "kvstore_remote_refused_redirects_total") <= remote.extra["refused_redirects"]
    finally:
        fake.close()
