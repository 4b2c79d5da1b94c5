"""The daemon's listeners, started in order and stopped together.

- `Servers()`: `start(config, handlers, socket_path, local_path, loop)` starts the metrics
  server (where `server.metrics_address` is set: /readyz says 503 until the daemon serves), the
  gRPC server on the unix socket and, with `server.tcp`, one on TCP (health and the
  token-checked service, no reflection; TLS where `server.tls` is set), and the local channel
  first of those, so that a worker that connects over gRPC finds it at once.
  `set_serving()` / `enter_graceful_shutdown()` turn health SERVING and NOT_SERVING;
  `stop(grace_s)` lets the calls in flight finish on every channel, up to `grace_s`; `close()`
  stops at once whatever is still running (each part set once made, so exactly those).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2

from kvstore.config.root import Config, ConfigError, ServerConfig, TlsConfig
from kvstore.server.daemon_shutdown import cleanup
from kvstore.server.handlers import Handlers
from kvstore.server.local import LocalChannelServer
from kvstore.server.metrics import HttpLimits, MetricsServer
from kvstore.server.server import SERVICE_NAME, KVStoreServicer, create_server


class Servers:
    """The metrics server, the gRPC servers (unix socket, TCP) and the local channel."""

    def __init__(self) -> None:
        self.metrics: MetricsServer | None = None
        self.health = health.aio.HealthServicer()  # shared by the unix socket's server and TCP's
        self.grpc: grpc.aio.Server | None = None
        self.tcp: grpc.aio.Server | None = None
        self.local: LocalChannelServer | None = None

    async def start(
        self,
        config: Config,
        handlers: Handlers,
        socket_path: Path,
        local_path: Path | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """Every listener the config asks for, serving `handlers`; the socket gets its mode."""
        server_config = config.server
        if server_config.metrics_address is not None:
            await self._start_metrics(server_config.metrics_address, server_config, handlers, loop)
        servicer = KVStoreServicer(handlers, server_config.token)
        self.grpc = create_server(servicer, self.health)
        self.grpc.add_insecure_port(f"unix://{socket_path}")
        if server_config.tcp:
            self.tcp = create_server(servicer, self.health, reflection=False)
            _add_tcp_port(self.tcp, server_config.tcp, server_config.tls)
        if local_path is not None:
            self.local = LocalChannelServer(
                handlers,
                local_path,
                server_config.local_poll_ms / 1000,
                server_config.max_local_connections,
                server_config.max_local_connections_per_uid,
            )
            await self.local.start(server_config.socket_mode)
        await self.grpc.start()
        if self.tcp is not None:
            await self.tcp.start()
        os.chmod(socket_path, server_config.socket_mode)

    async def _start_metrics(
        self, address: str, server_config: ServerConfig, handlers: Handlers, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.metrics = MetricsServer(address, handlers, loop, HttpLimits.of(server_config))
        try:
            await asyncio.to_thread(self.metrics.start)  # the helper process starts and binds
        except OSError as exc:
            self.metrics = None
            raise ConfigError(
                "server.metrics_address",
                f"cannot listen on {address}: {exc.strerror}",
            ) from None

    async def set_serving(self) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def enter_graceful_shutdown(self) -> None:
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace_s: float) -> None:
        """The gRPC servers and the local channel stop, their calls in flight given `grace_s`."""
        closing = [server.stop(grace_s) for server in (self.grpc, self.tcp) if server is not None]
        if self.local is not None:
            closing.append(self.local.stop(grace_s))
        await asyncio.gather(*closing)
        self.grpc, self.tcp, self.local = None, None, None

    async def close(self) -> None:
        """Stops at once what still runs: start-up stopped after a server started, or the stop
        failed. Each step on its own: one that fails is logged and the rest still run."""
        if self.grpc is not None:
            await cleanup("the gRPC server", self.grpc.stop(0))
        if self.tcp is not None:
            await cleanup("the TCP gRPC server", self.tcp.stop(0))
        if self.local is not None:
            await cleanup("the local channel", self.local.stop())
        if self.metrics is not None:
            await cleanup("the metrics server", asyncio.to_thread(self.metrics.stop))


def _add_tcp_port(server: grpc.aio.Server, address: str, tls: TlsConfig) -> None:
    """`server.tcp` on `server`: with TLS where `server.tls` is set (mutual with a client CA)."""
    if tls.enabled:
        cert, key, client_ca = tls.credentials()
        credentials = grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )
        server.add_secure_port(address, credentials)
    else:
        server.add_insecure_port(address)
