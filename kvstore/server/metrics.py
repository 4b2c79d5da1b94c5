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

This module holds `Probe` and both ends of the helper (`MetricsServer` in the daemon, `serve` in
the helper); the figures (`Snapshot`, `DaemonCollector`, the families) are
`kvstore.server.metrics_families`, and the HTTP server itself, bounded against whoever reaches the port,
is `kvstore.server.metrics_http`.

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
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

from kvstore import __version__
from kvstore.server.metrics_families import MAX_MODEL_LABELS, DaemonCollector, Snapshot, families
from kvstore.server.metrics_http import Asker, HttpLimits, HttpServer

if TYPE_CHECKING:
    from kvstore.server.handlers import Handlers

__all__ = [  # the figures live in kvstore.server.metrics_families; importable from here as before
    "MAX_MODEL_LABELS",
    "DaemonCollector",
    "HELPER_START_S",
    "HttpLimits",
    "MetricsServer",
    "PROBE_TIMEOUT_S",
    "Probe",
    "Snapshot",
    "families",
    "on_loop",
    "readiness",
    "serve",
]

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0  # the event loop must answer a scrape or a readiness probe within this
HELPER_START_S = 60.0  # the helper process imports its modules and binds the address within this
_PR_SET_PDEATHSIG = 1


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
