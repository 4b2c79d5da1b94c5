"""`kvstored`: loads the config, claims the socket, runs the server until a signal.

Start: a lock file beside the socket tells a live daemon (refuse to start) from
a dead one (replace its stale socket and arena); nothing another user could plant
at those paths is followed or removed (`claim`). A SIGTERM/SIGINT at any moment
of start-up ends it after the step under way, removing whatever was created.
With `tenants`, each tenant gets tiers of its own: an arena of its cpu_bytes that only its
members can map (a sealed memfd, handed to them over the local channel: `tiers.cpu.Arena`),
a disk directory of its disk_bytes, its own connections to the remote tier, and a store over them
(`kvstore.handlers`, `kvstore.tenants`).
Stop (SIGTERM/SIGINT): health goes NOT_SERVING and calls that start work are
refused (clients count a miss); stores and loads in flight finish (the daemon
waits for their leases, up to `server.grace_s`) on both channels before either
closes; then the socket, arena and lock file are removed and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import resource
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any, get_type_hints

import grpc
import xxhash
from grpc_health.v1 import health, health_pb2

from kvstore import __version__
from kvstore.claim import AlreadyRunning, SocketClaim, check_shared_directory, claim_private_directory
from kvstore.config import Config, ConfigError, TenantConfig, load_config, parse_config
from kvstore.events import EventLog
from kvstore.handlers import Handlers
from kvstore.local import LocalChannelServer
from kvstore.logs import configure as configure_logs
from kvstore.metrics import HttpLimits, MetricsServer
from kvstore.policy import make_policy
from kvstore.progress import progress_reporter
from kvstore.server import SERVICE_NAME, KVStoreServicer, create_server
from kvstore.settings import Mode
from kvstore.store import Store
from kvstore.tenants import Tenancy
from kvstore.tiers.cpu import Arena, CpuTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.remote import RemoteTier, start_remote
from kvstore.tiers.reserve import ArenaReserver

log = logging.getLogger("kvstored")


DRAIN_POLL_S = 0.01
_signalled = False  # a stop signal came before the event loop took the signals over


class StoppedDuringStart(Exception):
    """A stop signal came while the daemon was starting: it exits after cleaning up."""


def _note_signal(signum: int, frame: Any) -> None:
    global _signalled
    _signalled = True


def arena_name(socket_path: Path) -> str:
    """The arena's shm file name: one per socket, so a restarted daemon finds its predecessor's."""
    return "kvstore-" + xxhash.xxh3_64_hexdigest(str(socket_path.resolve()).encode())


class Tiers:
    """What one store is built on (the daemon's, or one tenant's): each part set once open, so
    that `close` closes exactly what was opened, whatever failed after."""

    def __init__(self, tenant: TenantConfig | None, events: EventLog) -> None:
        self.tenant = tenant
        self.events = events
        self.arena: Arena | None = None
        self.reserver: ArenaReserver | None = None
        self.disk: DiskTier | None = None
        self.remote: RemoteTier | None = None
        self.gpu: GpuTier | None = None
        self.store: Store | None = None

    @property
    def label(self) -> str:
        return f" of tenant {self.tenant.name!r}" if self.tenant is not None else ""

    async def open(self, config: Config, socket_path: Path, starting: Callable[[], None]) -> Store:
        tenant, cpu_config = self.tenant, config.tiers.cpu
        name, size, sealed = arena_name(socket_path), cpu_config.bytes, tenant is not None
        disk_config = config.tiers.disk
        if tenant is not None:
            name, size = f"{name}-{tenant.name}", tenant.cpu_bytes
            disk_config = replace(
                disk_config,
                path=str(Path(disk_config.path) / "tenants" / tenant.name),
                bytes=config.tenant_disk_bytes(tenant),
            )
        self.arena = Arena(
            Path(cpu_config.shm_dir) / name, size, cpu_config.file_mode, cpu_config.prefault, sealed
        )
        # With prefault, the first slab's memory is reserved before serving and the rest after
        # (`reserve.py`), each slab handed out once reserved.
        cpu = CpuTier(self.arena, cpu_config.slab_bytes, 1 if cpu_config.prefault else None)
        if cpu_config.prefault:
            self.arena.reserve(0, cpu.slots.slab_bytes)
        starting()
        if disk_config.enabled:
            self.disk = DiskTier(disk_config)
            label = f"recovering the disk tier{self.label}"
            records = await asyncio.to_thread(self.disk.recover, progress_reporter(label))
            log.info("disk tier %s: %d pages recovered", disk_config.path, len(records))
            starting()
        if config.tiers.remote.enabled:
            self.remote = await asyncio.to_thread(start_remote, config.tiers.remote)
            starting()
        gpu_config = config.tiers.gpu
        if gpu_config.enabled:  # never with tenants (Config.validate)
            self.gpu = await asyncio.to_thread(GpuTier.start, gpu_config, self.arena)
            starting()
        self.store = Store(
            cpu,
            make_policy(config.eviction.policy),
            config.leases.ttl_s,
            config.leases.max_ttl_s,
            pin_fraction=config.eviction.pin_fraction,
            max_pin_ttl_s=config.eviction.max_pin_ttl_s,
            disk=self.disk,
            gpu=self.gpu,
            gpu_policy=make_policy(config.eviction.policy),
            promote_after_hits=gpu_config.promote_after_hits,
            remote=self.remote,
            quarantine_s=config.leases.quarantine_s,
            tenant=tenant.name if tenant is not None else "",
            max_namespaces=tenant.max_namespaces if tenant is not None else None,
            events=self.events,
        )
        self.store.counters.update(self.arena.pages.figures())  # kvctl stats says which pages it got
        if cpu.slots.num_reserved < cpu.slots.num_slabs:
            loop = asyncio.get_running_loop()
            self.reserver = ArenaReserver(
                self.arena.reserve,
                cpu.slots.slab_bytes,
                cpu.slots.num_slabs,
                cpu.slots.num_reserved,
                lambda count: loop.call_soon_threadsafe(cpu.add_reserved, count),
                f"arena {self.arena.path}{self.label}",
            )
        return self.store

    async def close(self, grace_s: float) -> None:
        if self.gpu is not None:
            await _cleanup(f"the GPU tier{self.label}", asyncio.to_thread(self.gpu.close))
        if self.disk is not None:
            await _cleanup(f"the disk tier{self.label}", asyncio.to_thread(self.disk.close))
        if self.remote is not None:
            await _cleanup(f"the remote tier{self.label}", asyncio.to_thread(self.remote.close, grace_s))
        if self.reserver is not None:
            await _cleanup(f"the arena's reservation{self.label}", asyncio.to_thread(self.reserver.stop))
        if self.arena is not None:
            await _cleanup(f"the arena{self.label}", asyncio.to_thread(self.arena.close, True))


def _raise_file_limit() -> None:
    """The soft limit on open files up to the hard one (at most 65,536): each local-channel
    connection holds a descriptor, and the caps on them must be reached before this limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1 << 16 if hard == resource.RLIM_INFINITY else min(hard, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


async def serve(config: Config) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if _signalled:
        stop.set()

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
    local: LocalChannelServer | None = None
    metrics: MetricsServer | None = None
    server = None
    tcp_server = None
    reaper: asyncio.Task[None] | None = None
    try:
        starting()
        stores: dict[str, Store] = {}
        events = EventLog(config.server.events_buffer)
        events.bind(loop)
        if config.tenants and config.tiers.disk.enabled:  # the tenants' directories are made in it
            os.close(claim_private_directory(Path(config.tiers.disk.path), "tiers.disk.path"))
        for tenant in config.tenants or (None,):
            tiers = Tiers(tenant, events)
            opened.append(tiers)
            stores[tenant.name if tenant is not None else ""] = await tiers.open(
                config, socket_path, starting
            )
        local_path = config.server.local_socket_path if config.server.local_channel else None
        handlers = Handlers(
            stores,
            config.chunk_tokens,
            config.server.max_message_bytes,
            str(local_path or ""),
            tenancy(config),
            max_event_streams=config.server.max_event_streams,
            max_event_streams_per_tenant=config.server.max_event_streams_per_tenant,
        )
        if config.server.metrics_address is not None:  # /readyz says 503 until the daemon serves
            metrics = MetricsServer(
                config.server.metrics_address, handlers, loop, HttpLimits.of(config.server)
            )
            try:
                await asyncio.to_thread(metrics.start)  # the helper process starts and binds
            except OSError as exc:
                metrics = None
                raise ConfigError(
                    "server.metrics_address",
                    f"cannot listen on {config.server.metrics_address}: {exc.strerror}",
                ) from None
        servicer = KVStoreServicer(handlers, config.server.token)
        health_servicer = health.aio.HealthServicer()
        server = create_server(servicer, health_servicer)
        server.add_insecure_port(f"unix://{socket_path}")
        if config.server.tcp:  # a server of its own: health and the token-checked service, no reflection
            tcp_server = create_server(servicer, health_servicer, reflection=False)
            tls = config.server.tls
            if tls.enabled:
                cert, key, client_ca = tls.credentials()
                credentials = grpc.ssl_server_credentials(
                    [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
                )
                tcp_server.add_secure_port(config.server.tcp, credentials)
            else:
                tcp_server.add_insecure_port(config.server.tcp)
        if local_path is not None:  # first: a worker that connects over gRPC finds it at once
            local = LocalChannelServer(
                handlers,
                local_path,
                config.server.local_poll_ms / 1000,
                config.server.max_local_connections,
                config.server.max_local_connections_per_uid,
            )
            await local.start(config.server.socket_mode)
        await server.start()
        if tcp_server is not None:
            await tcp_server.start()
        os.chmod(socket_path, config.server.socket_mode)
        starting()
        gc.freeze()  # the objects built at start never die: keep them out of every collection
        for service in ("", SERVICE_NAME):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        handlers.serving = True
        gpu = opened[0].gpu
        log.info(
            "kvstored %s serving on unix://%s%s%s (%sCPU tier %d MiB%s, chunk_tokens %d, event loop %s)",
            __version__,
            socket_path,
            f" and tcp {config.server.tcp}{' (TLS)' if config.server.tls.enabled else ''}"
            if config.server.tcp
            else "",
            f", metrics on http://{config.server.metrics_address}/metrics" if metrics is not None else "",
            f"GPU tier {gpu.capacity >> 20} MiB, " if gpu is not None else "",
            sum(store.cpu.capacity for store in stores.values()) >> 20,
            f" in {len(stores)} tenants' arenas" if config.tenants else "",
            config.chunk_tokens,
            type(loop).__module__.split(".")[0],
        )

        reaper = asyncio.create_task(_reap(list(stores.values()), config.leases.reap_interval_s))
        await stop.wait()
        grace_s = config.server.grace_s
        log.info("stopping: draining in-flight calls for up to %.1f s", grace_s)
        handlers.stopping, handlers.serving = True, False
        events.close()  # event streams end: they would hold the servers' stop to its grace
        await health_servicer.enter_graceful_shutdown()
        left = await _drain(list(stores.values()), grace_s)
        closing = [server.stop(left)]
        if tcp_server is not None:
            closing.append(tcp_server.stop(left))
        if local is not None:
            closing.append(local.stop(left))
        await asyncio.gather(*closing)
        server, tcp_server, local = None, None, None
    finally:
        # Each step on its own: one that fails is logged and the rest still run, so the socket,
        # the lock file and the arena go whatever happened before.
        if reaper is not None:
            reaper.cancel()
        if server is not None:  # start-up stopped after the server started
            await _cleanup("the gRPC server", server.stop(0))
        if tcp_server is not None:
            await _cleanup("the TCP gRPC server", tcp_server.stop(0))
        if local is not None:
            await _cleanup("the local channel", local.stop())
        if metrics is not None:
            await _cleanup("the metrics server", asyncio.to_thread(metrics.stop))
        for tiers in opened:
            await tiers.close(config.server.grace_s)
        claim.release()
    log.info("stopped")


async def _cleanup(what: str, step: Awaitable[object]) -> None:
    try:
        await step
    except Exception:
        log.exception("closing %s failed", what)


async def _drain(stores: Sequence[Store], grace_s: float) -> float:
    """Waits until no lease is held (stores committed or aborted, loads released) or `grace_s`
    passed; returns the time left of it."""
    deadline = time.monotonic() + grace_s

    def held() -> int:
        return sum(len(store.leases) for store in stores)

    while held() and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    if held():
        log.warning("%d leases still held after %.1f s: their calls are cut off", held(), grace_s)
    return max(0.0, deadline - time.monotonic())


async def _reap(stores: Sequence[Store], interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        expired = sum(store.expire() for store in stores)
        if expired:
            log.info("expired %d leases whose clients did not finish in time", expired)


def tenancy(config: Config) -> Tenancy:
    """Who callers are, from the config: the tenants, the admins, and every token (read now)."""
    tokens = {t.name: t.tokens(f"tenants[{i}]") for i, t in enumerate(config.tenants)}
    admin_token = config.server.token
    seen: dict[str, str] = {}
    for i, t in enumerate(config.tenants):
        for token in tokens[t.name]:
            if token == admin_token:
                raise ConfigError(f"tenants[{i}].tokens_file", "holds server.auth_token, the admins' token")
            if seen.setdefault(token, t.name) != t.name:
                raise ConfigError(f"tenants[{i}].tokens_file", f"holds a token of tenant {seen[token]!r} too")
    return Tenancy(config.tenants, config.admins, admin_token, tokens)


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


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop `server.event_loop` names: uvloop's where it is installed ("auto", "uvloop"),
    asyncio's own (None) for "asyncio" or where "auto" finds no uvloop."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError(
                "server.event_loop", "uvloop is not installed (pip install uvloop), or set auto or asyncio"
            ) from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def _checked(config: Config) -> Config:
    """Checks what the loader cannot see alone: the policy name, the token file, the event loop,
    the arena's directory on this host."""
    make_policy(config.eviction.policy)
    event_loop_factory(config.server.event_loop)
    _ = config.server.token
    if config.server.tls.enabled:
        config.server.tls.credentials()  # readable now, or an error naming the key
    shm_dir = Path(config.tiers.cpu.shm_dir)
    if not shm_dir.is_dir():
        raise ConfigError(
            "tiers.cpu.shm_dir", f"{shm_dir} is not a directory on this host (a tmpfs: /dev/shm)"
        )
    check_shared_directory(shm_dir, "tiers.cpu.shm_dir")  # no one else can replace the arena there
    tenancy(config)  # the tokens files are readable, private, and each token is one tenant's
    if config.server.max_local_connections_per_uid > config.server.max_local_connections:
        raise ConfigError(
            "server.max_local_connections_per_uid",
            f"expected at most server.max_local_connections ({config.server.max_local_connections}), "
            f"got {config.server.max_local_connections_per_uid}",
        )
    return config


def _naming(path: Path | None, exc: ValueError) -> str:
    """An error in the config file `path` as kvstored reports it: naming the file, as the loader's
    own errors do, also where a check after loading found it (`_checked`)."""
    message = str(exc)
    return message if path is None or message.startswith(f"{path}: ") else f"{path}: {message}"


def effective_config(config: Config) -> dict[str, Any]:
    """The config as `--check-config` prints it: `Config.to_dict`, with file modes in octal as
    strings the loader reads back (`"0o660"`, not 432) and the socket path `auto` stands for."""
    effective = config.to_dict()
    _octal_modes(config, effective)
    effective["server"]["socket_path"] = str(config.server.socket_path)
    return effective


def _octal_modes(node: Any, data: dict[str, Any]) -> None:
    hints = get_type_hints(type(node), include_extras=True)
    for field in fields(node):
        value = getattr(node, field.name)
        if hints[field.name] == Mode:
            data[field.name] = f"0o{value:o}"
        elif is_dataclass(value):
            _octal_modes(value, data[field.name])
        elif isinstance(value, list | tuple):
            for item, item_data in zip(value, data[field.name], strict=True):
                if is_dataclass(item):
                    _octal_modes(item, item_data)


def main(argv: list[str] | None = None) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT):  # until the event loop takes them over
        signal.signal(sig, _note_signal)
    args = _parser().parse_args(argv)
    if args.check_config is not None:
        try:
            config = _checked(load_config(args.check_config))
        except (ConfigError, ValueError) as exc:
            print(f"kvstored: {_naming(args.check_config, exc)}", file=sys.stderr)
            return 1
        try:
            print(json.dumps(effective_config(config), indent=2, default=str))
            print(f"kvstored: {args.check_config} is valid", file=sys.stderr)
        except BrokenPipeError:  # `kvstored --check-config FILE | head`: the reader has what it wanted
            from kvstore.cli import quiet_exit

            return quiet_exit()
        return 0
    try:
        config = _checked(load_config(args.config) if args.config else parse_config({}))
    except (ConfigError, ValueError) as exc:
        print(f"kvstored: {_naming(args.config, exc)}", file=sys.stderr)
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
