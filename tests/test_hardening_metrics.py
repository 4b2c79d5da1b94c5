"""Attacks on the metrics port of a real daemon (issue #30, items 7 and 8), all on 127.0.0.1:

- connections that send megabytes of headers are refused after a bounded prefix: the daemon's
  and its helper's memory stay bounded and /healthz answers meanwhile;
- slowloris connections (a byte every so often, never a whole request) are closed after the
  read timeout, and /healthz answers meanwhile;
- more idle connections than the cap: the oldest are closed, /healthz answers;
- the cap and the read timeout are the daemon's `server.metrics_*` keys, not only the defaults;
- a storm of /readyz probes takes no snapshot of the daemon's figures (counted, not timed), and
  concurrent scrapes share snapshots.
"""

from __future__ import annotations

import math
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from kvstore.server.metrics import HttpLimits
from tests.harness import Daemon
from tests.test_metrics import free_port, get, scrape, value

LIMITS = HttpLimits()  # the daemon's defaults: the attacks below run against them
TIGHT = HttpLimits(max_connections=4, read_timeout_s=1.0)  # the least the config allows, and a short wait
HEALTHZ_BOUND_S = 5.0  # generous: a loaded 2-core machine answers in milliseconds
MiB = 1 << 20


@pytest.fixture
def metered(daemon_factory: Callable[..., Daemon]) -> tuple[Daemon, int]:
    port = free_port()
    return daemon_factory(server__metrics_address=f"127.0.0.1:{port}"), port


def timed_healthz(port: int) -> float:
    """Seconds /healthz took to answer 200."""
    started = time.monotonic()
    status, body = get(port, "/healthz")
    assert (status, body) == (200, '{"alive": true}\n')
    return time.monotonic() - started


def peak_rss(daemon: Daemon) -> dict[str, int]:
    """Peak resident bytes (VmHWM) of the daemon and of each process it started (the helper)."""
    peaks = {}
    for process in [psutil.Process(daemon.pid), *psutil.Process(daemon.pid).children(recursive=True)]:
        for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peaks[f"{process.pid} {process.name()}"] = int(line.split()[1]) * 1024
    return peaks


def open_connections(port: int, count: int) -> list[socket.socket]:
    conns = []
    for _ in range(count):
        conn = socket.create_connection(("127.0.0.1", port), timeout=10)
        conn.setblocking(False)
        conns.append(conn)
    return conns


def socket_wait(conns: list[socket.socket], timeout_s: float) -> None:
    """Until one of `conns` is readable (the server closed it), or `timeout_s`."""
    select.select(conns, [], [], timeout_s)


def closed_by_server(conn: socket.socket) -> bool:
    """Whether the server closed `conn` (EOF or reset); a non-blocking peek."""
    try:
        return conn.recv(65536) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    yield opened
    for conn in opened:
        conn.close()


def send_huge_headers(port: int, header_lines: int, line_bytes: int) -> str:
    """One attacker: a request whose headers are `header_lines` lines of `line_bytes` each (98
    lines of 64 KiB: what http.server parses whole). Returns what became of it."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        try:
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            line = b"X-Pad: " + b"a" * (line_bytes - 9) + b"\r\n"
            for _ in range(header_lines):
                conn.sendall(line)
            conn.sendall(b"\r\n")
            reply = conn.recv(65536)
        except OSError:  # reset or broken pipe: the server closed it mid-request
            return "closed"
    if not reply:
        return "closed"
    return reply.split(b"\r\n", 1)[0].decode("latin-1")


def test_connections_with_megabytes_of_headers_are_refused_with_memory_and_healthz_bounded(
    metered: tuple[Daemon, int],
) -> None:
    daemon, port = metered
    before = peak_rss(daemon)
    with ThreadPoolExecutor(40) as pool:
        attacks = [pool.submit(send_huge_headers, port, 98, 64 * 1024) for _ in range(40)]
        probes: list[float] = []
        while not all(attack.done() for attack in attacks) and len(probes) < 200:
            probes.append(timed_healthz(port))
        outcomes = [attack.result(timeout=120) for attack in attacks]
    assert set(outcomes) <= {"closed", "HTTP/1.1 431 Request Header Fields Too Large"}, outcomes
    assert probes and max(probes) < HEALTHZ_BOUND_S, probes
    after = peak_rss(daemon)
    grown = {name: after[name] - before.get(name, 0) for name in after}
    assert all(growth < 64 * MiB for growth in grown.values()), grown  # 40 x 6 MiB of headers sent
    assert timed_healthz(port) < HEALTHZ_BOUND_S
    samples = scrape(port)
    assert value(samples, "kvstore_metrics_closed_connections_total", reason="too_large") == 40


def test_slowloris_connections_are_closed_after_the_read_timeout_and_healthz_answers(
    metered: tuple[Daemon, int], sockets: list[socket.socket]
) -> None:
    daemon, port = metered
    attackers = 20
    sockets += open_connections(port, attackers)
    opened_at = time.monotonic()
    request = b"GET /healthz HTTP/1.1\r\nX-Slow: " + b"z" * 4096  # never a whole request
    sent = 0
    closed_at: dict[int, float] = {}
    probes = []
    deadline = opened_at + LIMITS.read_timeout_s + 30
    while len(closed_at) < attackers and time.monotonic() < deadline:
        for i, conn in enumerate(sockets):
            if i in closed_at:
                continue
            if closed_by_server(conn):
                closed_at[i] = time.monotonic() - opened_at
                continue
            try:
                conn.send(request[sent : sent + 1])  # one byte each round
            except OSError:
                closed_at[i] = time.monotonic() - opened_at
        sent += 1
        probes.append(timed_healthz(port))
        waiting = [conn for i, conn in enumerate(sockets) if i not in closed_at]
        if waiting:  # a round a second, sooner where the server closes one
            socket_wait(waiting, 1.0)
    assert len(closed_at) == attackers, f"{attackers - len(closed_at)} slow connections still open"
    assert min(closed_at.values()) >= LIMITS.read_timeout_s * 0.9  # the timeout, not something else
    assert sent < len(request) and max(probes) < HEALTHZ_BOUND_S, probes
    assert value(scrape(port), "kvstore_metrics_closed_connections_total", reason="timeout") >= attackers


def test_idle_connections_past_the_cap_close_the_oldest_and_healthz_answers(
    metered: tuple[Daemon, int], sockets: list[socket.socket]
) -> None:
    daemon, port = metered
    idle = 150
    sockets += open_connections(port, idle)
    assert max(timed_healthz(port) for _ in range(5)) < HEALTHZ_BOUND_S
    samples = scrape(port)
    past_cap = idle - LIMITS.max_connections
    assert value(samples, "kvstore_metrics_closed_connections_total", reason="cap") >= past_cap
    assert ("kvstore_metrics_connections", ()) in samples
    assert value(samples, "kvstore_metrics_connections") <= LIMITS.max_connections
    deadline = time.monotonic() + 30
    while sum(map(closed_by_server, sockets)) < past_cap and time.monotonic() < deadline:
        socket_wait(sockets, 0.1)
    assert sum(map(closed_by_server, sockets)) >= past_cap


def close_times(conns: list[socket.socket], since: float, timeout_s: float) -> dict[int, float]:
    """Seconds after `since` at which the server closed each of `conns`, waiting `timeout_s` at most."""
    closed_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(closed_at) < len(conns) and time.monotonic() < deadline:
        for i, conn in enumerate(conns):
            if i not in closed_at and closed_by_server(conn):
                closed_at[i] = time.monotonic() - since
        socket_wait([conn for i, conn in enumerate(conns) if i not in closed_at], 0.1)
    return closed_at


def test_the_configured_cap_and_read_timeout_reach_the_daemon(
    daemon_factory: Callable[..., Daemon], sockets: list[socket.socket]
) -> None:
    port = free_port()
    daemon_factory(
        server__metrics_address=f"127.0.0.1:{port}",
        server__metrics_max_connections=TIGHT.max_connections,
        server__metrics_read_timeout_s=TIGHT.read_timeout_s,
    )
    opened_at = time.monotonic()
    sockets += open_connections(port, TIGHT.max_connections)
    oldest, younger = sockets[0], sockets[1:]
    sockets += open_connections(port, 1)  # one past the cap
    closed_at = close_times([oldest], opened_at, 10.0)
    assert closed_at.get(0, math.inf) < TIGHT.read_timeout_s, f"the cap did not close the oldest: {closed_at}"
    assert not any(map(closed_by_server, sockets[1:])), "the cap closed more than the oldest"

    assert timed_healthz(port) < HEALTHZ_BOUND_S  # a probe at the cap makes room too
    assert close_times([younger[0]], opened_at, 10.0)

    waiting = sockets[2:]  # idle since they opened: closed at the read timeout, not the default's
    closed_at = close_times(waiting, opened_at, LIMITS.read_timeout_s + 10)
    assert len(closed_at) == len(waiting), f"{len(waiting) - len(closed_at)} idle connections still open"
    assert TIGHT.read_timeout_s * 0.9 <= min(closed_at.values()), closed_at
    assert max(closed_at.values()) < LIMITS.read_timeout_s, closed_at
    samples = scrape(port)
    assert value(samples, "kvstore_metrics_closed_connections_total", reason="cap") == 2
    assert value(samples, "kvstore_metrics_closed_connections_total", reason="timeout") == len(waiting)


def snapshots_taken(port: int) -> float:
    samples = scrape(port)
    assert ("kvstore_metrics_snapshots_total", ()) in samples, "snapshots are not counted"
    return samples[("kvstore_metrics_snapshots_total", ())]


def test_a_readiness_probe_storm_takes_no_snapshot(metered: tuple[Daemon, int]) -> None:
    daemon, port = metered
    first = snapshots_taken(port)
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: get(port, "/readyz")[0], range(300)))
    assert replies == [200] * 300
    # The scrape after the storm takes one snapshot at most (or reuses the one before it).
    assert snapshots_taken(port) - first <= 1


def test_concurrent_scrapes_share_snapshots(metered: tuple[Daemon, int]) -> None:
    daemon, port = metered
    first = snapshots_taken(port)
    scrapers = 16
    start = threading.Barrier(scrapers)

    def one_scrape(_: int) -> float:
        start.wait(timeout=30)
        return scrape(port)[("kvstore_metrics_snapshots_total", ())]

    with ThreadPoolExecutor(scrapers) as pool:
        seen = list(pool.map(one_scrape, range(scrapers)))
    assert max(seen) - first <= 3, seen  # one each would be 16
    assert len(set(seen)) <= 3, seen
