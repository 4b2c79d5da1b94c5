"""The metrics port's HTTP server: /healthz, /readyz and /metrics, bounded against whoever reaches it.

Whoever reaches the port is not trusted. `HttpServer` (one asyncio loop, in the metrics helper
process) bounds the connections open at once (the oldest still sending its request makes room),
the request line and headers (`MAX_REQUEST_LINE_BYTES`, `MAX_HEADER_BYTES`: 414, 431) and the
time a client has to send its request and take the reply (`HttpLimits`), answers /healthz on its
loop at once whatever scrapes wait for, and counts what it closed and why
(`kvstore_metrics_connections`, `kvstore_metrics_closed_connections_total{reason}`).

It knows nothing of the daemon's figures: it is given a readiness check and a registry to
render. `Asker` lets concurrent requests share one question to the daemon (and reuse a recent
answer), so a storm of probes or scrapes costs the daemon one answer at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gzip
import json
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

if TYPE_CHECKING:
    from kvstore.config.root import ServerConfig

MAX_REQUEST_LINE_BYTES = 4 * 1024  # "GET /metrics?name[]=... HTTP/1.1"; longer: 414
MAX_HEADER_BYTES = 16 * 1024  # the request line and headers together; more: 431
_CLOSE_REASONS = ("cap", "timeout", "too_large", "bad_request")
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    414: "URI Too Long",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}

Readiness = Callable[[], Awaitable[tuple[int, dict[str, Any]]]]  # /readyz: (status, JSON body)


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


class Asker:
    """One question at a time to the daemon over a pipe (from a thread of its own), shared by
    every request that asks meanwhile; an answer younger than `reuse_s` answers them too.
    The daemon answers ("ok", value), or ("timeout", why): TimeoutError here."""

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


class HttpServer:
    """The helper's HTTP server on one event loop: bounded connections, request size and time.

    /healthz is answered on the loop at once; /readyz awaits `ready` (which shares concurrent
    probes); /metrics renders `registry` in a thread (its collectors share snapshots). A
    TimeoutError from either answers 503. At `max_connections`, a new connection closes the
    oldest one still sending its request, so that idle or slow clients cannot keep a probe out.
    The server's own figures join `registry`.
    """

    def __init__(
        self, address: str, limits: HttpLimits, registry: CollectorRegistry, ready: Readiness
    ) -> None:
        self.address = address
        self.limits = limits
        self.registry = registry
        self._ready = ready
        self._renderers = concurrent.futures.ThreadPoolExecutor(2, "kvstore-metrics-render")
        self._clients: dict[_Client, None] = {}  # oldest first
        self.closed: Counter[str] = Counter({reason: 0 for reason in _CLOSE_REASONS})
        self._server: asyncio.Server | None = None
        registry.register(_HttpCollector(self))  # type: ignore[arg-type]

    @property
    def open_connections(self) -> int:
        return len(self._clients)

    async def listen(self) -> int:
        """Binds the address (OSError if it cannot); returns the port."""
        host, port = self.address.rsplit(":", 1)
        self._server = await asyncio.start_server(
            self._serve, host.strip("[]"), int(port), limit=MAX_HEADER_BYTES, backlog=128
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def serve_forever(self) -> None:
        if self._server is None:
            raise RuntimeError("HttpServer.listen() first")
        async with self._server:
            await self._server.serve_forever()

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
        try:
            if request.path == "/readyz":
                return _json(*await self._ready())
            if request.path == "/metrics":
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


class _HttpCollector:
    """The server's own figures: connections open, and those it closed, by why."""

    def __init__(self, http: HttpServer) -> None:
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


def _json(status: int, body: Mapping[str, Any]) -> _Reply:
    return _Reply(status, "application/json", (json.dumps(body) + "\n").encode())
