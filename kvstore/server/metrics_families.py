"""The daemon's figures at one moment, and the `kvstore_*` Prometheus families made from them.

- `Snapshot`: the stores' stats, the RPC timings, whether the daemon serves, its uptime (taken on
  the event loop by `Snapshot.take`), and the remote tier's servers (asked for off it).
- `DaemonCollector(snapshot)`: a `prometheus_client` collector, one snapshot per scrape.
- `families(snapshot)`: every `kvstore_*` family, present from the first scrape (a counter that
  has not moved reads 0): the daemon's own, the tiers' traffic and fill, pages per tenant and
  model (at most `MAX_MODEL_LABELS` models), the remote tier's nodes, leases and pins, and the
  RPC latency histogram.

Names follow Prometheus's rules: `kvstore_` prefix, `_total` counters, `_bytes`, `_seconds`.
The metrics helper process (`kvstore.server.metrics`) collects them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from kvstore import __version__
from kvstore.server.stats import RPC_BUCKETS, combined
from kvstore.store.index import NodeUsage, StoreStats, TierUsage, server_totals

if TYPE_CHECKING:
    from kvstore.server.handlers import Handlers

MAX_MODEL_LABELS = 64  # distinct model names labelled in kvstore_namespace_pages; the rest are "other"


@dataclass
class Snapshot:
    """The daemon's figures at one moment, taken on the event loop."""

    stats: StoreStats
    per_tenant: dict[str, StoreStats]
    rpc: dict[tuple[str, str], tuple[list[int], float]]
    serving: bool
    uptime_s: float
    remote_nodes: list[NodeUsage] | None = None  # the remote tier's servers (a cluster's nodes)
    number: int = 0  # snapshots taken for the metrics helper, this one included

    @classmethod
    def take(cls, handlers: Handlers) -> Snapshot:
        per_tenant = {name: store.stats(server_usage=False) for name, store in handlers.stores.items()}
        stats = combined(list(per_tenant.values()))
        stats.counters.update(handlers.counters)
        return cls(
            stats, per_tenant, handlers.timings.copy(), handlers.serving, time.monotonic() - handlers.started
        )


class DaemonCollector:
    """The `kvstore_*` families, from a snapshot per scrape."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[Metric]:
        return []  # families depend on the tiers configured: collected, not described

    def collect(self) -> Iterator[Metric]:
        yield from families(self._snapshot())


def families(snap: Snapshot) -> Iterator[Metric]:
    counters = snap.stats.counters
    tiers = {tier.name: tier for tier in snap.stats.tiers}
    yield from _daemon_families(snap)
    if "remote" in tiers:
        yield from _remote_record_families(tiers["remote"].extra or {})
    yield from _tier_flow_families(_tier_flows(tiers, counters))
    yield from _tier_fill_families(tiers, snap.remote_nodes)
    yield from _namespace_families(snap)
    yield from _remote_node_families(snap.remote_nodes or [])
    yield from _lease_and_pin_families(counters)
    yield _rpc_family(snap.rpc)
    yield _counter(
        "metrics_snapshots",
        "Snapshots of these figures taken on the event loop (concurrent scrapes share one).",
        snap.number,
    )


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"kvstore_{name}", doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"kvstore_{name}", doc, value=value)


def _by_tier(kind: type, name: str, doc: str, values: Mapping[str, float]) -> Metric:
    family = kind(f"kvstore_{name}", doc, labels=["tier"])
    for tier, value in values.items():
        family.add_metric([tier], value)
    return family


def _daemon_families(snap: Snapshot) -> Iterator[Metric]:
    """The daemon's version, uptime and state, its lookups and its leases' and channels' fates."""
    counters = snap.stats.counters
    info = GaugeMetricFamily("kvstore_build_info", "The daemon's version (value 1).", labels=["version"])
    info.add_metric([__version__], 1)
    yield info
    yield _gauge("uptime_seconds", "Seconds since the daemon started.", snap.uptime_s)
    yield _gauge(
        "serving", "1 while the daemon serves calls, 0 while it starts or stops.", float(snap.serving)
    )
    yield _counter("lookups", "Lookup calls.", counters.get("lookups", 0))
    yield _counter(
        "lookup_hit_chunks", "Chunks Lookups found stored (the leading run).", counters.get("hit_chunks", 0)
    )
    yield _counter(
        "lookup_missed_chunks", "Chunks Lookups asked for and did not find.", counters.get("missed_chunks", 0)
    )
    yield _counter("cleared_pages", "Pages removed by Clear.", counters.get("cleared_chunks", 0))
    yield _counter(
        "expired_leases",
        "Leases whose client did not finish them in time.",
        counters.get("expired_leases", 0),
    )
    yield _counter(
        "fenced_leases", "Expired store leases whose slots were fenced.", counters.get("fenced_leases", 0)
    )
    yield _counter(
        "refused_local_connections",
        "Local-channel connections refused at the connection caps.",
        counters.get("refused_local_connections", 0),
    )


def _remote_record_families(remote_extra: Mapping[str, float]) -> Iterator[Metric]:
    """What the remote tier refused to trust: forged records, redirects to unannounced servers."""
    yield _counter(
        "remote_forged_records",
        "Remote records whose MAC did not verify (tiers.remote.record_key_file): misses, deleted.",
        remote_extra.get("forged_records", 0),
    )
    yield _counter(
        "remote_refused_redirects",
        "Redirects from a remote server to an address no seed announced, not followed.",
        remote_extra.get("refused_redirects", 0),
    )


@dataclass
class _TierFlows:
    """Per tier: the pages that moved in and out of it, and how the tier fared."""

    stored: dict[str, float]
    evicted: dict[str, float]
    promoted: dict[str, float]  # read up from disk or remote into the arena
    demoted: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    outages: dict[str, float] = field(default_factory=dict)
    up: dict[str, float] = field(default_factory=lambda: {"cpu": 1.0})


def _tier_flows(tiers: Mapping[str, TierUsage], counters: Mapping[str, float]) -> _TierFlows:
    """The CPU tier's flows from the store's counters; the other tiers' from their own figures."""
    extra = {name: tier.extra or {} for name, tier in tiers.items()}
    flows = _TierFlows(
        stored={"cpu": counters.get("stored_chunks", 0)},
        evicted={"cpu": counters.get("evicted_chunks", 0)},
        promoted={"cpu": counters.get("promoted_chunks", 0)},
    )
    if "gpu" in tiers:
        flows.promoted["gpu"] = extra["gpu"].get("promoted_chunks", 0)
        flows.evicted["gpu"] = flows.demoted["cpu"] = extra["gpu"].get("demoted_chunks", 0)
        flows.up["gpu"] = 1.0
    if "disk" in tiers:
        disk = extra["disk"]
        flows.stored["disk"], flows.evicted["disk"] = disk.get("written", 0), disk.get("evicted", 0)
        flows.demoted["disk"] = counters.get("demoted_chunks", 0)
        flows.dropped["disk"], flows.errors["disk"] = disk.get("dropped_writes", 0), disk.get("errors", 0)
        flows.outages["disk"], flows.up["disk"] = disk.get("outages", 0), disk.get("enabled", 0)
    if "remote" in tiers:
        remote = extra["remote"]
        flows.stored["remote"] = remote.get("written", 0)
        flows.demoted["remote"] = counters.get("demoted_remote_chunks", 0)
        flows.dropped["remote"], flows.errors["remote"] = (
            remote.get("dropped_writes", 0),
            remote.get("errors", 0),
        )
        flows.outages["remote"], flows.up["remote"] = remote.get("outages", 0), remote.get("up", 0)
    return flows


def _tier_flow_families(flows: _TierFlows) -> Iterator[Metric]:
    yield _by_tier(CounterMetricFamily, "stored_pages", "Pages stored into each tier.", flows.stored)
    yield _by_tier(
        CounterMetricFamily, "evicted_pages", "Pages each tier evicted to make room.", flows.evicted
    )
    yield _by_tier(CounterMetricFamily, "promoted_pages", "Pages moved up into each tier.", flows.promoted)
    yield _by_tier(CounterMetricFamily, "demoted_pages", "Pages written down into each tier.", flows.demoted)
    yield _by_tier(
        CounterMetricFamily,
        "dropped_writes",
        "Pages a lower tier did not write (its queue full).",
        flows.dropped,
    )
    yield _by_tier(CounterMetricFamily, "tier_errors", "I/O errors of each lower tier.", flows.errors)
    yield _by_tier(
        CounterMetricFamily, "tier_outages", "Times a lower tier went out of service.", flows.outages
    )
    yield _by_tier(
        GaugeMetricFamily, "tier_up", "1 while the tier serves, 0 while it is off or down.", flows.up
    )


def _tier_fill_families(
    tiers: Mapping[str, TierUsage], remote_nodes: list[NodeUsage] | None
) -> Iterator[Metric]:
    """Each tier's bytes used, capacity and pages; the remote tier's as its servers count them."""
    used = {name: float(tier.bytes_used) for name, tier in tiers.items()}
    capacity = {name: float(tier.bytes_capacity) for name, tier in tiers.items()}
    pages = {name: float(tier.pages) for name, tier in tiers.items()}
    if remote_nodes is not None and "remote" in tiers:
        used["remote"], capacity["remote"], pages["remote"] = (float(v) for v in server_totals(remote_nodes))
    yield _by_tier(
        GaugeMetricFamily, "tier_used_bytes", "Bytes each tier holds (remote: the server's).", used
    )
    yield _by_tier(
        GaugeMetricFamily,
        "tier_capacity_bytes",
        "Bytes each tier may hold (remote: maxmemory, 0: none).",
        capacity,
    )
    yield _by_tier(
        GaugeMetricFamily, "tier_pages", "Pages each tier holds (remote: keys of its database).", pages
    )


def _lease_and_pin_families(counters: Mapping[str, float]) -> Iterator[Metric]:
    """Leases held now by kind, the pinned pages and bytes, the arena bytes fenced."""
    leases = GaugeMetricFamily("kvstore_active_leases", "Leases held now, by kind.", labels=["kind"])
    leases.add_metric(["store"], counters.get("active_store_leases", 0))
    leases.add_metric(["load"], counters.get("active_load_leases", 0))
    yield leases
    yield _gauge("pinned_pages", "Pages pinned against eviction.", counters.get("pinned_pages", 0))
    yield _gauge("pinned_bytes", "Bytes of the pinned pages.", counters.get("pinned_bytes", 0))
    yield _gauge(
        "quarantined_bytes",
        "Arena bytes fenced after a writer's lease expired.",
        counters.get("quarantined_bytes", 0),
    )


def _remote_node_families(nodes: list[NodeUsage]) -> Iterator[Metric]:
    """The remote tier's servers, one label value each (a cluster's nodes: a handful)."""
    if not nodes:
        return
    up = GaugeMetricFamily(
        "kvstore_remote_node_up",
        "1 while the tier uses the server, by role in the slot map.",
        labels=["node", "role"],
    )
    used = GaugeMetricFamily("kvstore_remote_node_used_bytes", "The server's used_memory.", labels=["node"])
    keys = GaugeMetricFamily("kvstore_remote_node_keys", "Keys in the server's database.", labels=["node"])
    errors = CounterMetricFamily(
        "kvstore_remote_node_errors", "This daemon's failed requests to the server.", labels=["node"]
    )
    for node in nodes:
        up.add_metric([node.address, node.role], float(node.up))
        used.add_metric([node.address], node.bytes_used)
        keys.add_metric([node.address], node.keys)
        errors.add_metric([node.address], node.errors)
    yield from (up, used, keys, errors)


def _namespace_families(snap: Snapshot) -> Iterator[Metric]:
    """Pages per (tenant, model): model names, not namespace digests, at most MAX_MODEL_LABELS of
    them (the rest summed as "other"), so the label set stays bounded whatever clients send."""
    pages: Counter[tuple[str, str]] = Counter()
    models: set[str] = set()
    namespaces = 0
    for tenant, stats in sorted(snap.per_tenant.items()):
        for ns in stats.namespaces:
            namespaces += 1
            model = ns.model
            if model not in models and len(models) >= MAX_MODEL_LABELS:
                model = "other"
            else:
                models.add(model)
            pages[(tenant, model)] += ns.pages
    family = GaugeMetricFamily(
        "kvstore_namespace_pages",
        f"Pages stored per tenant and model (at most {MAX_MODEL_LABELS} models; the rest as 'other').",
        labels=["tenant", "model"],
    )
    for (tenant, model), count in sorted(pages.items()):
        family.add_metric([tenant, model], count)
    yield family
    yield GaugeMetricFamily("kvstore_namespaces", "Namespaces registered.", value=namespaces)


def _rpc_family(rpc: Mapping[tuple[str, str], tuple[list[int], float]]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        "kvstore_rpc_duration_seconds",
        "Time the daemon took to answer a call, by channel and method.",
        labels=["channel", "method"],
    )
    for (channel, method), (counts, total) in sorted(rpc.items()):
        if method != "Lookup" and not any(counts):
            continue  # a method never called has no series (Lookup's are there from the start)
        cumulative, buckets = 0, []
        for bound, count in zip((*RPC_BUCKETS, float("inf")), counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        family.add_metric([channel, method], buckets, total)
    return family
