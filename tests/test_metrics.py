"""Prometheus metrics and HTTP probes of a real daemon, scraped over HTTP and parsed with
prometheus_client's own parser."""

from __future__ import annotations

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
