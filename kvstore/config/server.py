"""The daemon's listeners in its config: `server.*` and `server.tls.*`.

- `ServerConfig`: the unix socket (`auto`: `kvstore.shared.paths.default_socket_path()`) and the local
  channel beside it, an optional TCP listener with its bearer token, the event loop, the limits
  on messages, connections and event streams, the metrics address.
- `TlsConfig`: the TCP listener's certificate, key and client CA; `credentials()` reads them.
- `check_token(token, key)`: a bearer token gRPC metadata can carry (tenants' tokens too).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.config.settings import ConfigError, KiB, MiB, Mode, Size, join, setting
from kvstore.shared.paths import LOCAL_SUFFIX, default_socket_path

_HOST_PORT_RE = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(?P<port>\d{1,5})")
_MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path holds 108 bytes, the last one a NUL


def check_token(token: str, key: str) -> None:
    # The token travels as gRPC metadata, which allows printable ASCII only.
    if not (token.isascii() and token.isprintable()) or " " in token:
        raise ConfigError(key, "expected a token of printable ASCII characters without spaces")


_LOOPBACK_HOSTS = ("127.0.0.1", "[::1]", "localhost")


@dataclass(frozen=True)
class TlsConfig:
    """TLS on the TCP listener: the daemon's certificate chain and key (PEM), and optionally the CA
    that client certificates must chain to (mutual TLS)."""

    cert_file: str | None = setting(None, non_empty=True)
    key_file: str | None = setting(None, non_empty=True)
    client_ca_file: str | None = setting(None, non_empty=True)

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None

    def validate(self, path: str) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError(join(path, "key_file"), f"set {join(path, 'cert_file')} and key_file together")
        if self.client_ca_file is not None and self.cert_file is None:
            raise ConfigError(
                join(path, "client_ca_file"), f"needs {join(path, 'cert_file')} and key_file too"
            )

    def credentials(self, path: str = "server.tls") -> tuple[bytes, bytes, bytes | None]:
        """(certificate chain, private key, client CA or None), read now; a ConfigError names the
        key of a file that cannot be read."""
        contents: list[bytes | None] = []
        for name in ("cert_file", "key_file", "client_ca_file"):
            file = getattr(self, name)
            if file is None:
                contents.append(None)
                continue
            try:
                contents.append(Path(file).read_bytes())
            except OSError as err:
                raise ConfigError(join(path, name), f"cannot read {file}: {err.strerror}") from None
        cert, key, ca = contents
        assert cert is not None and key is not None
        return cert, key, ca


@dataclass(frozen=True)
class ServerConfig:
    """How clients reach the daemon: always a unix socket, optionally a TCP listener with a token."""

    unix_socket: str = setting("auto", non_empty=True)  # "auto": default_socket_path()
    socket_mode: Mode = 0o660
    tcp: str | None = None  # "host:port": "127.0.0.1:50051", "[::1]:50051", "0.0.0.0:50051"
    auth_token: str | None = setting(None, non_empty=True)
    auth_token_file: str | None = setting(None, non_empty=True)
    tls: TlsConfig = field(default_factory=TlsConfig)  # on the TCP listener; required off loopback
    # The largest unary request (65,536 keys, wire.MAX_REQUEST_BYTES) and no more by default: gRPC
    # refuses a larger message by its length, before it allocates anything for it.
    max_message_bytes: Size = setting(MiB + 64 * KiB, ge=64 * KiB, le=64 * MiB)
    grace_s: float = setting(5.0, ge=0)  # drain time on SIGTERM
    local_channel: bool = True  # same-host clients' unary calls on <socket>.local, without HTTP/2
    # Local-channel connections at most, in all and per uid: past them a new one is closed at once.
    max_local_connections: int = setting(1024, ge=1, le=65536)
    max_local_connections_per_uid: int = setting(256, ge=1, le=65536)
    # After a local-channel call, the event loop polls instead of sleeping for this long (0: never),
    # so that the next call finds the daemon on its core: one core busy while workers are active.
    local_poll_ms: float = setting(0.0, ge=0, le=1000)
    # Cyclic garbage collection off the calls' path (`kvstore.server.heap`): every gc_freeze_s the
    # objects that survived since are collected and frozen, so no collection scans the index again
    # (for a large index under churn: CPython's pauses reach ~190 ms at 1M pages); every gc_full_s
    # the whole heap is collected once (0: never). 0 (the default): CPython's own collections, until
    # the turns are measured again on the GPU hosts (bench/NOTES-control-plane.md).
    gc_freeze_s: float = setting(0.0, ge=0, le=3600)
    gc_full_s: float = setting(3600.0, ge=0, le=7 * 86400)
    # The event loop: uvloop (libuv) answers a local-channel call in a fraction of asyncio's time;
    # "auto" takes it where it is installed, else asyncio's own.
    event_loop: str = setting("auto", choices=("auto", "uvloop", "asyncio"))
    # KV events kept for consumers that reconnect (`kvctl events`); one that falls further behind
    # is told to resync. Bounds the events' memory (about 200 bytes each).
    events_buffer: int = setting(65536, ge=16, le=1 << 22)
    # Events streams followed at once, in all and per tenant (the admins count as one tenant):
    # past either, a new stream is refused (RESOURCE_EXHAUSTED), so idle streams cost bounded work.
    max_event_streams: int = setting(256, ge=1, le=65536)
    max_event_streams_per_tenant: int = setting(64, ge=1, le=65536)
    # Prometheus metrics (/metrics) and probes (/healthz, /readyz) over HTTP on "host:port"; null: off.
    metrics_address: str | None = None
    # Its HTTP server's bounds: connections open at once (past it the oldest still sending its
    # request is closed, so idle clients cannot keep a probe out); seconds a client has to send its
    # request and to take the reply; seconds a snapshot answers further scrapes.
    metrics_max_connections: int = setting(64, ge=4, le=4096)
    metrics_read_timeout_s: float = setting(5.0, gt=0, le=300)
    metrics_snapshot_reuse_s: float = setting(1.0, ge=0, le=60)

    @property
    def socket_path(self) -> Path:
        if self.unix_socket == "auto":
            return default_socket_path()
        return Path(self.unix_socket)

    @property
    def local_socket_path(self) -> Path:
        return self.socket_path.with_name(self.socket_path.name + LOCAL_SUFFIX)

    @property
    def token(self) -> str | None:
        """The bearer token TCP clients present: auth_token, or the stripped content of auth_token_file."""
        if self.auth_token_file is None:
            return self.auth_token
        key = "server.auth_token_file"
        try:
            token = Path(self.auth_token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(key, f"cannot read the token: {err}") from err
        if not token:
            raise ConfigError(key, f"{self.auth_token_file!r} is empty; write the token into it")
        check_token(token, key)
        return token

    def validate(self, path: str) -> None:
        token_key, file_key = join(path, "auth_token"), join(path, "auth_token_file")
        if self.unix_socket != "auto" and len(os.fsencode(self.unix_socket)) > _MAX_SOCKET_PATH:
            raise ConfigError(
                join(path, "unix_socket"), f"expected a path of at most {_MAX_SOCKET_PATH} bytes"
            )
        if self.auth_token is not None and self.auth_token_file is not None:
            raise ConfigError(token_key, f"set {token_key} or {file_key}, not both")
        if self.auth_token is not None:
            check_token(self.auth_token, token_key)
        if self.metrics_address is not None:
            match = _HOST_PORT_RE.fullmatch(self.metrics_address)
            if match is None or not 0 <= int(match["port"]) <= 65535:
                raise ConfigError(
                    join(path, "metrics_address"),
                    f"expected host:port, like 127.0.0.1:9464 or 0.0.0.0:9464, got {self.metrics_address!r}",
                )
        if self.tcp is None:
            if self.tls.enabled:
                raise ConfigError(join(path, "tls"), "TLS is for the TCP listener: set server.tcp too")
            return
        tcp_key = join(path, "tcp")
        match = _HOST_PORT_RE.fullmatch(self.tcp)
        if match is None or not 1 <= int(match["port"]) <= 65535:
            raise ConfigError(
                tcp_key,
                f"expected host:port with a port in 1..65535, like 127.0.0.1:50051 or [::1]:50051, "
                f"got {self.tcp!r}",
            )
        if self.auth_token is None and self.auth_token_file is None:
            raise ConfigError(
                tcp_key,
                f"a TCP listener needs {token_key} or {file_key} "
                "(clients send it as 'authorization: Bearer <token>' metadata)",
            )
        host = self.tcp.rsplit(":", 1)[0]
        if host not in _LOOPBACK_HOSTS and not self.tls.enabled:
            raise ConfigError(
                join(path, "tls"),
                f"a TCP listener on {host} needs server.tls.cert_file and key_file: without TLS the token "
                f"and the pages cross the network in clear (only a loopback address may go without)",
            )
