"""`kvstored`: loads the config, claims the socket, runs the server until a signal.

Start: a lock file beside the socket tells a live daemon (refuse to start) from
a dead one (replace its stale socket and arena); nothing another user could plant
at those paths is followed or removed (`claim`). A SIGTERM/SIGINT at any moment
of start-up ends it after the step under way, removing whatever was created.
With `tenants`, each tenant gets tiers of its own: an arena of its cpu_bytes that only its
members can map (a sealed memfd, handed to them over the local channel: `tiers.cpu.Arena`),
a disk directory of its disk_bytes, its own connections to the remote tier, and a store over them
(`kvstore.server.handlers`, `kvstore.server.tenants`).
Stop (SIGTERM/SIGINT): health goes NOT_SERVING and calls that start work are
refused (clients count a miss); stores and loads in flight finish (the daemon
waits for their leases, up to `server.grace_s`) on both channels before either
closes; then the socket, arena and lock file are removed and the process exits 0.

- `main(argv)`: the command line (`--config`, `--check-config`, `--log-level`).
- `serve(config)`: start, serve until a signal, stop, in named steps. The parts live beside
  it: one store's tiers in `daemon_tiers` (`Tiers`, `arena_name`), the listeners in
  `daemon_servers`, the drain and the closing steps in `daemon_shutdown`, the checks on the
  config in `daemon_config` (`tenancy`, `event_loop_factory`, `effective_config`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvstore import __version__
from kvstore.config.claim import AlreadyRunning, SocketClaim, claim_private_directory
from kvstore.config.root import Config, ConfigError, load_config, parse_config
from kvstore.server.daemon_config import (
    checked,
    effective_config,
    event_loop_factory,
    naming_the_file,
    tenancy,
)
from kvstore.server.daemon_servers import Servers
from kvstore.server.daemon_shutdown import drain
from kvstore.server.daemon_tiers import Tiers, arena_name
from kvstore.server.handlers import Handlers
from kvstore.server.heap import Heap
from kvstore.server.logs import configure as configure_logs
from kvstore.store.events import EventLog
from kvstore.store.store import Store

__all__ = [
    "StoppedDuringStart",
    "Tiers",
    "arena_name",
    "effective_config",
    "event_loop_factory",
    "main",
    "serve",
    "tenancy",
]

log = logging.getLogger("kvstored")


_signalled = False  # a stop signal came before the event loop took the signals over


class StoppedDuringStart(Exception):
    """A stop signal came while the daemon was starting: it exits after cleaning up."""


def _note_signal(signum: int, frame: Any) -> None:
    global _signalled
    _signalled = True


def _raise_file_limit() -> None:
    """The soft limit on open files up to the hard one (at most 65,536): each local-channel
    connection holds a descriptor, and the caps on them must be reached before this limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1 << 16 if hard == resource.RLIM_INFINITY else min(hard, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


async def serve(config: Config) -> None:
    loop = asyncio.get_running_loop()
    stop = _stop_on_signals(loop)

    def starting() -> None:
        """Between start-up steps: a stop signal ends the start here (the finally cleans up)."""
        if stop.is_set():
            raise StoppedDuringStart

    starting()
    _raise_file_limit()
    os.umask(0o077)  # every socket and file is created private; the sockets then get server.socket_mode
    socket_path = config.server.socket_path
    claim = SocketClaim(socket_path)
    opened: list[Tiers] = []
    servers = Servers()
    reaper: asyncio.Task[None] | None = None
    heap, tending = Heap(config.server.gc_freeze_s, config.server.gc_full_s), None
    try:
        starting()
        events = EventLog(config.server.events_buffer)
        events.bind(loop)
        stores = await _open_stores(config, socket_path, events, opened, starting)
        local_path = config.server.local_socket_path if config.server.local_channel else None
        handlers = _make_handlers(config, stores, local_path)
        await servers.start(config, handlers, socket_path, local_path, loop)
        starting()
        heap.start()  # what was built at start frozen; the index never scanned (`kvstore.server.heap`)
        handlers.heap_figures = heap.figures
        tending = asyncio.create_task(heap.tend()) if heap.tended else None
        await servers.set_serving()
        handlers.serving = True
        _log_serving(config, socket_path, opened[0], stores, servers, loop)
        reaper = asyncio.create_task(_reap(list(stores.values()), config.leases.reap_interval_s))
        await stop.wait()
        await _stop_serving(config.server.grace_s, handlers, events, servers, list(stores.values()))
    finally:
        # Each step on its own: one that fails is logged and the rest still run, so the socket,
        # the lock file and the arena go whatever happened before.
        if reaper is not None:
            reaper.cancel()
        if tending is not None:
            tending.cancel()
        heap.stop()
        await servers.close()
        for tiers in opened:
            await tiers.close(config.server.grace_s)
        claim.release()
    log.info("stopped")


def _stop_on_signals(loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """The event SIGTERM and SIGINT set from now on, already set if one came before."""
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if _signalled:
        stop.set()
    return stop


async def _open_stores(
    config: Config,
    socket_path: Path,
    events: EventLog,
    opened: list[Tiers],
    starting: Callable[[], None],
) -> dict[str, Store]:
    """A store by tenant name ("" without tenants), each over tiers of its own, appended to
    `opened` before they open (so that the caller closes them whatever fails)."""
    stores: dict[str, Store] = {}
    if config.tenants and config.tiers.disk.enabled:  # the tenants' directories are made in it
        os.close(claim_private_directory(Path(config.tiers.disk.path), "tiers.disk.path"))
    for tenant in config.tenants or (None,):
        tiers = Tiers(tenant, events)
        opened.append(tiers)
        stores[tenant.name if tenant is not None else ""] = await tiers.open(config, socket_path, starting)
    return stores


def _make_handlers(config: Config, stores: dict[str, Store], local_path: Path | None) -> Handlers:
    return Handlers(
        stores,
        config.chunk_tokens,
        config.server.max_message_bytes,
        str(local_path or ""),
        tenancy(config),
        max_event_streams=config.server.max_event_streams,
        max_event_streams_per_tenant=config.server.max_event_streams_per_tenant,
    )


def _log_serving(
    config: Config,
    socket_path: Path,
    first: Tiers,
    stores: dict[str, Store],
    servers: Servers,
    loop: asyncio.AbstractEventLoop,
) -> None:
    gpu = first.gpu
    log.info(
        "kvstored %s serving on unix://%s%s%s (%sCPU tier %d MiB%s, chunk_tokens %d, event loop %s)",
        __version__,
        socket_path,
        f" and tcp {config.server.tcp}{' (TLS)' if config.server.tls.enabled else ''}"
        if config.server.tcp
        else "",
        f", metrics on http://{config.server.metrics_address}/metrics" if servers.metrics is not None else "",
        f"GPU tier {gpu.capacity >> 20} MiB, " if gpu is not None else "",
        sum(store.cpu.capacity for store in stores.values()) >> 20,
        f" in {len(stores)} tenants' arenas" if config.tenants else "",
        config.chunk_tokens,
        type(loop).__module__.split(".")[0],
    )


async def _stop_serving(
    grace_s: float, handlers: Handlers, events: EventLog, servers: Servers, stores: Sequence[Store]
) -> None:
    """Health NOT_SERVING and calls that start work refused; the leases drain for up to
    `grace_s`, then the servers stop, their calls in flight given what is left of it."""
    log.info("stopping: draining in-flight calls for up to %.1f s", grace_s)
    handlers.stopping, handlers.serving = True, False
    events.close()  # event streams end: they would hold the servers' stop to its grace
    await servers.enter_graceful_shutdown()
    left = await drain(stores, grace_s)
    await servers.stop(left)


async def _reap(stores: Sequence[Store], interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        expired = sum(store.expire() for store in stores)
        if expired:
            log.info("expired %d leases whose clients did not finish in time", expired)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstored", description="Multi-tier KV-cache daemon.")
    parser.add_argument(
        "--config",
        type=Path,
        help="YAML config (default: the embedded defaults, the same as configs/kvstored.yaml)",
    )
    parser.add_argument(
        "--check-config",
        type=Path,
        metavar="FILE",
        help="validate FILE, print the effective config, exit 0 (valid) or 1",
    )
    parser.add_argument("--log-level", help="override log_level from the config")
    parser.add_argument("--version", action="version", version=f"kvstored {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT):  # until the event loop takes them over
        signal.signal(sig, _note_signal)
    args = _parser().parse_args(argv)
    if args.check_config is not None:
        try:
            config = checked(load_config(args.check_config))
        except (ConfigError, ValueError) as exc:
            print(f"kvstored: {naming_the_file(args.check_config, exc)}", file=sys.stderr)
            return 1
        try:
            print(json.dumps(effective_config(config), indent=2, default=str))
            print(f"kvstored: {args.check_config} is valid", file=sys.stderr)
        except BrokenPipeError:  # `kvstored --check-config FILE | head`: the reader has what it wanted
            from kvstore.ctl.cli import quiet_exit

            return quiet_exit()
        return 0
    try:
        config = checked(load_config(args.config) if args.config else parse_config({}))
    except (ConfigError, ValueError) as exc:
        print(f"kvstored: {naming_the_file(args.config, exc)}", file=sys.stderr)
        return 1
    configure_logs(args.log_level or config.log_level, config.log_format)
    try:
        with asyncio.Runner(loop_factory=event_loop_factory(config.server.event_loop)) as runner:
            runner.run(serve(config))
    except StoppedDuringStart:
        log.info("stopped during start-up")
        return 0
    except (AlreadyRunning, OSError, ConfigError, RuntimeError) as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
