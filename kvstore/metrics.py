"""Prometheus metrics and HTTP probes on `server.metrics_address` (off by default).

`GET /metrics` is Prometheus text format written by `prometheus_client` from a collector that,
at each scrape, takes a snapshot of the daemon's figures on the event loop (`Snapshot.take`:
the stores' stats, a few dict copies, no I/O). The HTTP server and the text are in a helper
process (`MetricsServer`), so that building a scrape never holds the daemon's GIL; the remote
server's memory and key count (a round trip to it) are asked for off the event loop. Every
family is present from the first scrape: a counter that has not moved reads 0. Names follow
Prometheus's rules: `kvstore_` prefix, `_total` counters, `_bytes`, `_seconds`.

`GET /healthz` answers 200 while the process serves HTTP; `GET /readyz` answers 200 once the
daemon serves (arenas mapped, the event loop answering within `PROBE_TIMEOUT_S`) and 503 while
it starts or stops. A disk tier that turned itself off or a remote server that is down is
reported in the body (JSON), not counted as not ready: the daemon still serves from the tiers
it has. A probe costs the event loop one attribute read, never a snapshot; concurrent scrapes
share one snapshot, and one younger than `HttpLimits.snapshot_reuse_s` answers later ones too.

This module holds the figures (`Snapshot`, the families, `Probe`) and both ends of the helper
(`MetricsServer` in the daemon, `serve` in the helper); the HTTP server itself, bounded against
whoever reaches the port, is `kvstore.metrics_http`.

RPC latency: `stats.RpcTimings`, which both transports feed for every call, copied into the
snapshot.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from kvstore import __version__
from kvstore.index import NodeUsage, StoreStats, server_totals
from kvstore.metrics_http import Asker, HttpLimits, HttpServer
from kvstore.stats import RPC_BUCKETS, combined

if TYPE_CHECKING:
    from kvstore.handlers import Handlers

log = logging.getLogger(__name__)

MAX_MODEL_LABELS = 64  # distinct model names labelled in kvstore_namespace_pages; the rest are "other"
PROBE_TIMEOUT_S = 2.0  # the event loop must answer a scrape or a readiness probe within this
HELPER_START_S = 60.0  # the helper process imports its modules and binds the address within this
_PR_SET_PDEATHSIG = 1


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


def on_loop(loop: asyncio.AbstractEventLoop, work: Callable[[], Any], timeout_s: float) -> Any:
    """`work()` run on the event loop, from another thread; TimeoutError if the loop does not get
    to it within `timeout_s`."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(work())
            except BaseException as exc:
                future.set_exception(exc)

    loop.call_soon_threadsafe(run)
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"the event loop did not answer within {timeout_s:g} s") from None


class DaemonCollector:
    """The `kvstore_*` families, from a snapshot per scrape."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[Metric]:
        return []  # families depend on the tiers configured: collected, not described

    def collect(self) -> Iterator[Metric]:
        yield from families(self._snapshot())


def families(snap: Snapshot) -> Iterator[Metric]:
    stats, counters = snap.stats, snap.stats.counters
    tiers = {tier.name: tier for tier in stats.tiers}
    extra = {name: tier.extra or {} for name, tier in tiers.items()}

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        return CounterMetricFamily(f"kvstore_{name}", doc, value=value)

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"kvstore_{name}", doc, value=value)

    def by_tier(kind: type, name: str, doc: str, values: Mapping[str, float]) -> Metric:
        family = kind(f"kvstore_{name}", doc, labels=["tier"])
        for tier, value in values.items():
            family.add_metric([tier], value)
        return family

    info = GaugeMetricFamily("kvstore_build_info", "The daemon's version (value 1).", labels=["version"])
    info.add_metric([__version__], 1)
    yield info
    yield gauge("uptime_seconds", "Seconds since the daemon started.", snap.uptime_s)
    yield gauge(
        "serving", "1 while the daemon serves calls, 0 while it starts or stops.", float(snap.serving)
    )
    yield counter("lookups", "Lookup calls.", counters.get("lookups", 0))
    yield counter(
        "lookup_hit_chunks", "Chunks Lookups found stored (the leading run).", counters.get("hit_chunks", 0)
    )
    yield counter(
        "lookup_missed_chunks", "Chunks Lookups asked for and did not find.", counters.get("missed_chunks", 0)
    )
    yield counter("cleared_pages", "Pages removed by Clear.", counters.get("cleared_chunks", 0))
    yield counter(
        "expired_leases",
        "Leases whose client did not finish them in time.",
        counters.get("expired_leases", 0),
    )
    yield counter(
        "fenced_leases", "Expired store leases whose slots were fenced.", counters.get("fenced_leases", 0)
    )
    yield counter(
        "refused_local_connections",
        "Local-channel connections refused at the connection caps.",
        counters.get("refused_local_connections", 0),
    )
    stored = {"cpu": counters.get("stored_chunks", 0)}
    evicted = {"cpu": counters.get("evicted_chunks", 0)}
    promoted = {"cpu": counters.get("promoted_chunks", 0)}  # read up from disk or remote into the arena
    demoted: dict[str, float] = {}
    dropped: dict[str, float] = {}
    errors: dict[str, float] = {}
    outages: dict[str, float] = {}
    up: dict[str, float] = {"cpu": 1.0}
    if "gpu" in tiers:
        promoted["gpu"] = extra["gpu"].get("promoted_chunks", 0)
        evicted["gpu"] = demoted["cpu"] = extra["gpu"].get("demoted_chunks", 0)
        up["gpu"] = 1.0
    if "disk" in tiers:
        disk = extra["disk"]
        stored["disk"], evicted["disk"] = disk.get("written", 0), disk.get("evicted", 0)
        demoted["disk"] = counters.get("demoted_chunks", 0)
        dropped["disk"], errors["disk"] = disk.get("dropped_writes", 0), disk.get("errors", 0)
        outages["disk"], up["disk"] = disk.get("outages", 0), disk.get("enabled", 0)
    if "remote" in tiers:
        remote_extra = extra["remote"]
        stored["remote"] = remote_extra.get("written", 0)
        demoted["remote"] = counters.get("demoted_remote_chunks", 0)
        dropped["remote"], errors["remote"] = (
            remote_extra.get("dropped_writes", 0),
            remote_extra.get("errors", 0),
        )
        outages["remote"], up["remote"] = remote_extra.get("outages", 0), remote_extra.get("up", 0)
        yield counter(
            "remote_forged_records",
            "Remote records whose MAC did not verify (tiers.remote.record_key_file): misses, deleted.",
            remote_extra.get("forged_records", 0),
        )
        yield counter(
            "remote_refused_redirects",
            "Redirects from a remote server to an address no seed announced, not followed.",
            remote_extra.get("refused_redirects", 0),
        )
    yield by_tier(CounterMetricFamily, "stored_pages", "Pages stored into each tier.", stored)
    yield by_tier(CounterMetricFamily, "evicted_pages", "Pages each tier evicted to make room.", evicted)
    yield by_tier(CounterMetricFamily, "promoted_pages", "Pages moved up into each tier.", promoted)
    yield by_tier(CounterMetricFamily, "demoted_pages", "Pages written down into each tier.", demoted)
    yield by_tier(
        CounterMetricFamily, "dropped_writes", "Pages a lower tier did not write (its queue full).", dropped
    )
    yield by_tier(CounterMetricFamily, "tier_errors", "I/O errors of each lower tier.", errors)
    yield by_tier(CounterMetricFamily, "tier_outages", "Times a lower tier went out of service.", outages)
    yield by_tier(GaugeMetricFamily, "tier_up", "1 while the tier serves, 0 while it is off or down.", up)
    used = {name: float(tier.bytes_used) for name, tier in tiers.items()}
    capacity = {name: float(tier.bytes_capacity) for name, tier in tiers.items()}
    pages = {name: float(tier.pages) for name, tier in tiers.items()}
    if snap.remote_nodes is not None and "remote" in tiers:
        used["remote"], capacity["remote"], pages["remote"] = (
            float(v) for v in server_totals(snap.remote_nodes)
        )
    yield by_tier(GaugeMetricFamily, "tier_used_bytes", "Bytes each tier holds (remote: the server's).", used)
    yield by_tier(
        GaugeMetricFamily,
        "tier_capacity_bytes",
        "Bytes each tier may hold (remote: maxmemory, 0: none).",
        capacity,
    )
    yield by_tier(
        GaugeMetricFamily, "tier_pages", "Pages each tier holds (remote: keys of its database).", pages
    )
    yield from _namespace_families(snap)
    yield from _remote_node_families(snap.remote_nodes or [])
    leases = GaugeMetricFamily("kvstore_active_leases", "Leases held now, by kind.", labels=["kind"])
    leases.add_metric(["store"], counters.get("active_store_leases", 0))
    leases.add_metric(["load"], counters.get("active_load_leases", 0))
    yield leases
    yield gauge("pinned_pages", "Pages pinned against eviction.", counters.get("pinned_pages", 0))
    yield gauge("pinned_bytes", "Bytes of the pinned pages.", counters.get("pinned_bytes", 0))
    yield gauge(
        "quarantined_bytes",
        "Arena bytes fenced after a writer's lease expired.",
        counters.get("quarantined_bytes", 0),
    )
    yield _rpc_family(snap.rpc)
    yield counter(
        "metrics_snapshots",
        "Snapshots of these figures taken on the event loop (concurrent scrapes share one).",
        snap.number,
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


# -- the daemon's side: answers to the helper -------------------------------------------


class Probe(NamedTuple):
    """What /readyz reports: whether the daemon serves, and each tier's state."""

    serving: bool
    tiers: dict[str, dict[str, Any]]


class MetricsServer:
    """`/metrics`, `/healthz` and `/readyz` on `address` ("host:port"), served by a helper process.

    The helper (`serve`, started with `spawn`) runs the HTTP server and builds the exposition
    text. It asks this process over two pipes: for a snapshot (a scrape; a thread here takes it on
    the event loop, `Snapshot.take`) and for a probe (readiness: one O(1) call on the event loop,
    the tiers' state read off it). Text building, the costly part of a scrape, so never holds the
    daemon's GIL. The helper reports the daemon's process metrics (its /proc), and dies with it.
    """

    def __init__(
        self,
        address: str,
        handlers: Handlers,
        loop: asyncio.AbstractEventLoop,
        limits: HttpLimits | None = None,
    ) -> None:
        self.address = address
        self.limits = limits or HttpLimits()
        self._handlers = handlers
        self._loop = loop
        self._conns: list[Connection] = []
        self._process: multiprocessing.process.BaseProcess | None = None
        self.snapshots_taken = 0
        self.port = 0

    def snapshot(self) -> Snapshot:
        snap: Snapshot = on_loop(self._loop, lambda: Snapshot.take(self._handlers), PROBE_TIMEOUT_S)
        self.snapshots_taken += 1
        snap.number = self.snapshots_taken
        for store in self._handlers.stores.values():  # one server, shared: asked once, off the loop
            if store.lower is not None and store.lower.remote is not None:
                snap.remote_nodes = store.lower.remote.node_usage()
                break
        return snap

    def probe(self) -> Probe:
        """Readiness: the event loop answers one attribute read; the tiers (their own locks) are
        read from this thread."""
        serving = bool(on_loop(self._loop, lambda: self._handlers.serving, PROBE_TIMEOUT_S))
        tiers: dict[str, dict[str, Any]] = {}
        lower: dict[str, list[float]] = {}  # tier -> [serving, outages], summed over the tenants
        for store in self._handlers.stores.values():
            if store.gpu_placement is not None:
                tiers["gpu"] = {"serving": True}
            if store.lower is None:
                continue
            for name, tier in (("disk", store.lower.disk), ("remote", store.lower.remote)):
                if tier is not None:
                    figures = tier.stats()
                    summed = lower.setdefault(name, [0.0, 0.0])
                    summed[0] += figures.get("enabled" if name == "disk" else "up", 0)
                    summed[1] += figures.get("outages", 0)
        tiers["cpu"] = {"serving": True}
        for name, (serving_, outages) in lower.items():
            tiers[name] = {"serving": bool(serving_), "outages": int(outages)}
        return Probe(serving, tiers)

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        probes, their_probes = context.Pipe()
        snapshots, their_snapshots = context.Pipe()
        self._process = context.Process(
            target=serve,
            args=(self.address, their_probes, their_snapshots, os.getpid(), self.limits),
            name="kvstore-metrics",
            daemon=True,
        )
        self._process.start()
        their_probes.close()
        their_snapshots.close()
        self._conns = [probes, snapshots]
        if not snapshots.poll(HELPER_START_S):
            self.stop()
            raise OSError(errno.ETIMEDOUT, f"the metrics process did not start within {HELPER_START_S:g} s")
        kind, detail = snapshots.recv()
        if kind != "listening":
            self.stop()
            raise OSError(*detail)
        self.port = int(detail)
        for conn, work in ((probes, self.probe), (snapshots, self.snapshot)):
            threading.Thread(target=_answer, args=(conn, work), name="kvstore-metrics", daemon=True).start()

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.join(5)
            self._process = None
        for conn in self._conns:
            conn.close()
        self._conns = []


def _answer(conn: Connection, work: Callable[[], Any]) -> None:
    """Answers the helper's questions on `conn`, one at a time, until the pipe closes."""
    while True:
        try:
            conn.recv()
            try:
                reply: tuple[str, Any] = ("ok", work())
            except TimeoutError as exc:
                reply = ("timeout", str(exc))
            conn.send(reply)
        except (EOFError, OSError):  # the helper or the pipe is gone: the daemon stops
            return


# -- the helper process: the HTTP server, fed by the daemon ------------------------------


def serve(
    address: str, probes: Connection, snapshots: Connection, daemon_pid: int, limits: HttpLimits
) -> None:
    """The helper process: the HTTP server, fed snapshots and probes by the daemon."""
    _die_with(daemon_pid)
    asyncio.run(_serve_http(address, probes, snapshots, daemon_pid, limits))


def _die_with(daemon_pid: int) -> None:
    """The helper gets SIGTERM when the daemon dies, however it dies (Linux prctl)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != daemon_pid:  # it died before prctl took effect
        os._exit(0)


async def _serve_http(
    address: str, probes: Connection, snapshots: Connection, daemon_pid: int, limits: HttpLimits
) -> None:
    """The registry (the daemon's process, the platform, its figures), /readyz from its probe,
    and the bound port (or why not) sent back on the snapshot pipe before any scrape uses it."""
    loop = asyncio.get_running_loop()
    probe_asker = Asker(probes, 0.0)
    snapshot_asker = Asker(snapshots, limits.snapshot_reuse_s)

    def snapshot() -> Snapshot:  # for the collector, in a render thread
        return asyncio.run_coroutine_threadsafe(snapshot_asker.ask(), loop).result()  # type: ignore[no-any-return]

    async def ready() -> tuple[int, dict[str, Any]]:
        return readiness(await probe_asker.ask())

    registry = CollectorRegistry(support_collectors_without_names=True)  # ?name[]= filters them too
    ProcessCollector(registry=registry, pid=lambda: daemon_pid)
    PlatformCollector(registry=registry)
    registry.register(DaemonCollector(snapshot))  # type: ignore[arg-type]
    http = HttpServer(address, limits, registry, ready)
    try:
        port = await http.listen()
    except OSError as exc:
        snapshots.send(("error", (exc.errno, exc.strerror)))
        return
    snapshots.send(("listening", port))
    await http.serve_forever()


def readiness(probe: Probe) -> tuple[int, dict[str, Any]]:
    body: dict[str, Any] = {"ready": probe.serving, "tiers": probe.tiers, "version": __version__}
    if not probe.serving:
        body["reason"] = "starting or stopping"
    return (200 if probe.serving else 503), body
