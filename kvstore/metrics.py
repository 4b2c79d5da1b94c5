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

Whoever reaches the port is not trusted: the helper's HTTP server (one asyncio loop, `_Http`)
bounds the connections open at once (the oldest still sending its request makes room), the
request line and headers (`MAX_REQUEST_LINE_BYTES`, `MAX_HEADER_BYTES`: 414, 431) and the time a
client has to send its request and take the reply (`HttpLimits`), and answers /healthz on its
loop at once, whatever scrapes wait for.

RPC latency: `stats.RpcTimings`, which both transports feed for every call, copied into the
snapshot.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import gzip
import json
import logging
import math
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
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from kvstore import __version__
from kvstore.index import NodeUsage, StoreStats, server_totals
from kvstore.stats import RPC_BUCKETS, combined

if TYPE_CHECKING:
    from kvstore.config import ServerConfig
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


@dataclass(frozen=True)
class HttpLimits:
    """What the helper grants its clients (`server.metrics_*` keys)."""

    max_connections: int = 64  # open at once; past it the oldest still reading its request is closed
    read_timeout_s: float = 5.0  # to send a whole request, and to take the whole reply
    snapshot_reuse_s: float = 1.0  # a snapshot younger than this answers further scrapes

    @classmethod
    def of(cls, server: ServerConfig) -> HttpLimits:
        return cls(
            server.metrics_max_connections, server.metrics_read_timeout_s, server.metrics_snapshot_reuse_s
        )


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


# -- the helper process: the HTTP server --------------------------------------------------

MAX_REQUEST_LINE_BYTES = 4 * 1024  # "GET /metrics?name[]=... HTTP/1.1"; longer: 414
MAX_HEADER_BYTES = 16 * 1024  # the request line and headers together; more: 431
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    414: "URI Too Long",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def serve(
    address: str, probes: Connection, snapshots: Connection, daemon_pid: int, limits: HttpLimits
) -> None:
    """The helper process: the HTTP server, fed snapshots and probes by the daemon."""
    _die_with(daemon_pid)
    asyncio.run(_Http(address, probes, snapshots, daemon_pid, limits).run())


def _die_with(daemon_pid: int) -> None:
    """The helper gets SIGTERM when the daemon dies, however it dies (Linux prctl)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != daemon_pid:  # it died before prctl took effect
        os._exit(0)


class _Asker:
    """One question at a time to the daemon over a pipe (from a thread of its own), shared by
    every request that asks meanwhile; an answer younger than `reuse_s` answers them too."""

    def __init__(self, conn: Connection, reuse_s: float) -> None:
        self._conn = conn
        self._reuse_s = reuse_s
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "kvstore-metrics-pipe")
        self._pending: asyncio.Future[Any] | None = None
        self._answer: Any = None
        self._answered_at = -math.inf

    async def ask(self) -> Any:
        if self._answer is not None and time.monotonic() - self._answered_at < self._reuse_s:
            return self._answer
        if self._pending is None:
            asked_at = time.monotonic()
            pending = asyncio.get_running_loop().run_in_executor(self._thread, self._round_trip)
            self._pending = pending

            def done(future: asyncio.Future[Any]) -> None:
                self._pending = None
                if not future.cancelled() and future.exception() is None:
                    self._answer, self._answered_at = future.result(), asked_at

            pending.add_done_callback(done)
        return await asyncio.shield(self._pending)  # a request closed meanwhile leaves it to the others

    def _round_trip(self) -> Any:
        self._conn.send(None)
        kind, value = self._conn.recv()
        if kind != "ok":
            raise TimeoutError(value)
        return value


class _Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


@dataclass(eq=False)
class _Client:
    task: asyncio.Task[None] | None
    answering: bool = False  # its request is read: no longer the first to go at the cap


class _Http:
    """The helper's HTTP server on one event loop: bounded connections, request size and time.

    /healthz is answered on the loop at once; /readyz waits for the daemon's probe (shared by
    concurrent probes); /metrics renders in a thread from a snapshot (shared by concurrent
    scrapes, reused for `snapshot_reuse_s`). At `max_connections`, a new connection closes the
    oldest one still sending its request, so that idle or slow clients cannot keep a probe out.
    """

    def __init__(
        self, address: str, probes: Connection, snapshots: Connection, daemon_pid: int, limits: HttpLimits
    ) -> None:
        self.address = address
        self.limits = limits
        self._listening = snapshots
        self._probes = _Asker(probes, 0.0)
        self._snapshots = _Asker(snapshots, limits.snapshot_reuse_s)
        self._renderers = concurrent.futures.ThreadPoolExecutor(2, "kvstore-metrics-render")
        self._clients: dict[_Client, None] = {}  # oldest first
        self.closed: Counter[str] = Counter({reason: 0 for reason in _CLOSE_REASONS})
        self._loop: asyncio.AbstractEventLoop | None = None
        self.registry = CollectorRegistry(support_collectors_without_names=True)  # ?name[]= filters them too
        ProcessCollector(registry=self.registry, pid=lambda: daemon_pid)
        PlatformCollector(registry=self.registry)
        self.registry.register(DaemonCollector(self._snapshot))  # type: ignore[arg-type]
        self.registry.register(_HttpCollector(self))  # type: ignore[arg-type]

    @property
    def open_connections(self) -> int:
        return len(self._clients)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        host, port = self.address.rsplit(":", 1)
        try:
            server = await asyncio.start_server(
                self._serve, host.strip("[]"), int(port), limit=MAX_HEADER_BYTES, backlog=128
            )
        except OSError as exc:
            self._listening.send(("error", (exc.errno, exc.strerror)))
            return
        self._listening.send(("listening", server.sockets[0].getsockname()[1]))
        async with server:
            await server.serve_forever()

    def _snapshot(self) -> Snapshot:
        """For the collector, in a render thread."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(self._snapshots.ask(), self._loop).result()  # type: ignore[no-any-return]

    def _admit(self, client: _Client) -> bool:
        if len(self._clients) >= self.limits.max_connections:
            oldest = next((c for c in self._clients if not c.answering), None)
            if oldest is None:  # every one is being answered: they end within the timeouts
                self.closed["cap"] += 1
                return False
            del self._clients[oldest]
            self.closed["cap"] += 1
            if oldest.task is not None:
                oldest.task.cancel()
        self._clients[client] = None
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = _Client(asyncio.current_task())  # type: ignore[arg-type]
        timeout_s = self.limits.read_timeout_s
        try:
            if not self._admit(client):
                return
            try:
                request = await asyncio.wait_for(_read_request(reader), timeout_s)
                client.answering = True
                reply = await self._route(request)
            except _Refused as refused:
                self.closed["too_large" if refused.status in (414, 431) else "bad_request"] += 1
                request, reply = None, _json(refused.status, {"error": refused.reason})
            writer.write(reply.head() + (reply.body if request is None or request.method != "HEAD" else b""))
            writer.close()  # after what was written is sent
            await asyncio.wait_for(writer.wait_closed(), timeout_s)
        except TimeoutError:
            self.closed["timeout"] += 1
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client went away, or was closed at the cap
        finally:
            self._clients.pop(client, None)
            writer.transport.abort()  # never waits on a client for what is left

    async def _route(self, request: _Request) -> _Reply:
        if request.path == "/healthz":
            return _json(200, {"alive": True})
        if request.path == "/readyz":
            try:
                probe: Probe = await self._probes.ask()
            except TimeoutError as exc:
                return _json(503, {"ready": False, "reason": str(exc)})
            return _json(*readiness(probe))
        if request.path == "/metrics":
            try:
                return await asyncio.get_running_loop().run_in_executor(
                    self._renderers, self._render, request
                )
            except TimeoutError as exc:
                return _json(503, {"ready": False, "reason": str(exc)})
        return _json(404, {"paths": ["/metrics", "/healthz", "/readyz"]})

    def _render(self, request: _Request) -> _Reply:
        """The exposition text as prometheus_client's own WSGI app would write it, in a thread."""
        registry: Any = self.registry
        names = parse_qs(request.query).get("name[]")
        if names:
            registry = registry.restricted_registry(names)
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        body = encoder(registry)
        extra: list[tuple[str, str]] = []
        if "gzip" in request.headers.get("accept-encoding", ""):
            body = gzip.compress(body)
            extra.append(("Content-Encoding", "gzip"))
        return _Reply(200, content_type, body, extra)


_CLOSE_REASONS = ("cap", "timeout", "too_large", "bad_request")


class _HttpCollector:
    """The helper's own figures: connections open, and those it closed, by why."""

    def __init__(self, http: _Http) -> None:
        self._http = http

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "kvstore_metrics_connections",
            "Connections open to this HTTP server.",
            value=self._http.open_connections,
        )
        closed = CounterMetricFamily(
            "kvstore_metrics_closed_connections",
            "Connections this HTTP server closed before answering: at its cap, past its time, "
            "a request too large, or malformed.",
            labels=["reason"],
        )
        for reason, count in sorted(self._http.closed.items()):
            closed.add_metric([reason], count)
        yield closed


class _Request(NamedTuple):
    method: str
    path: str
    query: str
    headers: dict[str, str]


class _Reply(NamedTuple):
    status: int
    content_type: str
    body: bytes
    extra: list[tuple[str, str]] = []

    def head(self) -> bytes:
        lines = [
            f"HTTP/1.1 {self.status} {_REASONS.get(self.status, '')}",
            f"Content-Type: {self.content_type}",
            f"Content-Length: {len(self.body)}",
            "Connection: close",
            *(f"{name}: {value}" for name, value in self.extra),
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _read_request(reader: asyncio.StreamReader) -> _Request:
    """The request line and headers, at most MAX_REQUEST_LINE_BYTES and MAX_HEADER_BYTES (the
    reader's limit stops a line that would be longer before it is buffered whole)."""
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError:
        raise _Refused(414, f"request line over {MAX_REQUEST_LINE_BYTES} bytes") from None
    if len(line) > MAX_REQUEST_LINE_BYTES:
        raise _Refused(414, f"request line over {MAX_REQUEST_LINE_BYTES} bytes")
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise _Refused(400, "expected 'METHOD /path HTTP/1.x'")
    method, target, _ = parts
    size, headers = len(line), {}
    while True:
        try:
            field_line = await reader.readuntil(b"\n")
        except asyncio.LimitOverrunError:
            raise _Refused(431, f"headers over {MAX_HEADER_BYTES} bytes") from None
        size += len(field_line)
        if size > MAX_HEADER_BYTES:
            raise _Refused(431, f"headers over {MAX_HEADER_BYTES} bytes")
        if field_line in (b"\r\n", b"\n"):
            break
        name, _, value = field_line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if method not in ("GET", "HEAD"):
        raise _Refused(405, "GET or HEAD only")
    path, _, query = target.partition("?")
    return _Request(method, path, query, headers)


def readiness(probe: Probe) -> tuple[int, dict[str, Any]]:
    body: dict[str, Any] = {"ready": probe.serving, "tiers": probe.tiers, "version": __version__}
    if not probe.serving:
        body["reason"] = "starting or stopping"
    return (200 if probe.serving else 503), body


def _json(status: int, body: Mapping[str, Any]) -> _Reply:
    return _Reply(status, "application/json", (json.dumps(body) + "\n").encode())
