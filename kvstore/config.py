"""The daemon's configuration: YAML loaded into a tree of frozen dataclasses.

- `load_config(path)` / `parse_config(mapping)`: build a validated `Config`. Every problem is a
  `ConfigError` whose message names the dotted key and what was expected
  (`tiers.cpu.bytes: expected a size like 8GiB, got 'lots'`); `load_config` prefixes the file.
- `parse_size("8GiB")`: byte sizes, binary (KiB, MiB, GiB, TiB) or decimal (KB, MB, GB, TB) units.
- `unix_socket: auto` puts the socket at `kvstore.paths.default_socket_path()`.

The loader is generic (`kvstore.settings`): each dataclass here declares its keys with their
types and bounds, and a `validate(path)` for rules that span several fields.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstore.hugepages import hugetlbfs_page_bytes
from kvstore.paths import LOCAL_SUFFIX, default_socket_path
from kvstore.settings import (
    ConfigError,
    GiB,
    KiB,
    MiB,
    Mode,
    Size,
    TiB,
    build,
    format_size,
    join,
    parse_size,
    read_yaml,
    setting,
)

__all__ = [
    "ConfigError",
    "Config",
    "format_size",
    "load_config",
    "parse_config",
    "parse_size",
    "GiB",
    "KiB",
    "MiB",
    "TiB",
]

_HOST_PORT_RE = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(?P<port>\d{1,5})")
_MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path holds 108 bytes, the last one a NUL
LOG_LEVELS = ("debug", "info", "warning", "error")


def _check_token(token: str, key: str) -> None:
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
        _check_token(token, key)
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
            _check_token(self.auth_token, token_key)
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


@dataclass(frozen=True)
class LeaseConfig:
    """Leases pin pages for a worker; a lease not renewed within its TTL is reaped."""

    ttl_s: float = setting(30.0, gt=0)
    max_ttl_s: float = setting(600.0, gt=0)
    reap_interval_s: float = setting(0.25, gt=0)
    quarantine_s: float = setting(300.0, gt=0)  # the longest an expired store lease's slots stay fenced

    def validate(self, path: str) -> None:
        if self.max_ttl_s < self.ttl_s:
            ttl_key = join(path, "ttl_s")
            expected = f"expected a value >= {ttl_key} ({self.ttl_s})"
            raise ConfigError(join(path, "max_ttl_s"), f"{expected}, got {self.max_ttl_s}")


@dataclass(frozen=True)
class CpuTierConfig:
    """The shared-memory arena that workers map and pin."""

    bytes: Size = setting(1 * GiB, ge=4 * KiB)  # at least one 4 KiB slot
    slab_bytes: Size = setting(
        256 * MiB, ge=4 * KiB
    )  # pages of one size class are carved from slabs this big
    shm_dir: str = setting("/dev/shm", non_empty=True)
    file_mode: Mode = 0o600
    prefault: bool = True  # back the arena with memory: a slab before serving, the rest behind (`reserve`)

    def validate(self, path: str) -> None:
        if self.slab_bytes > self.bytes:
            bytes_key = join(path, "bytes")
            expected = f"expected at most {bytes_key} ({format_size(self.bytes)})"
            raise ConfigError(join(path, "slab_bytes"), f"{expected}, got {format_size(self.slab_bytes)}")
        if not os.path.isabs(self.shm_dir):
            raise ConfigError(join(path, "shm_dir"), f"expected an absolute path, got {self.shm_dir!r}")
        huge_page = hugetlbfs_page_bytes(self.shm_dir) if os.path.isdir(self.shm_dir) else None
        for key, value in (("bytes", self.bytes), ("slab_bytes", self.slab_bytes)):
            if huge_page and value % huge_page:  # a hugetlbfs file grows and maps in whole pages
                raise ConfigError(
                    join(path, key),
                    f"{join(path, 'shm_dir')} {self.shm_dir} is on hugetlbfs with {format_size(huge_page)} "
                    f"pages: expected a multiple of {format_size(huge_page)}, got {format_size(value)}",
                )


@dataclass(frozen=True)
class DiskTierConfig:
    """Checksummed page records under a directory: written behind, read back on a hit, recovered at start."""

    enabled: bool = False
    path: str = setting("/var/lib/kvstore/disk", non_empty=True)
    bytes: Size = setting(64 * GiB, gt=0)  # records kept at most; the least recently used go first
    write: str = setting("behind", choices=("behind", "through"))  # at CPU eviction, or every commit too
    fsync: str = setting("batch", choices=("never", "batch", "always"))
    fsync_interval_s: float = setting(1.0, gt=0)  # batch: a sync when the queue empties, at least this often
    codec: str = setting("lz4", choices=("lz4", "none"))
    threads: int = setting(4, gt=0, le=64)  # workers that compress, write and read records
    queue_bytes: Size = setting(256 * MiB, gt=0)  # pages waiting to be written; past it, new ones drop

    def validate(self, path: str) -> None:
        if not os.path.isabs(self.path):
            raise ConfigError(join(path, "path"), f"expected an absolute path, got {self.path!r}")


@dataclass(frozen=True)
class GpuTierConfig:
    """Device-memory pools in the daemon that same-host workers open through CUDA IPC."""

    enabled: bool = False  # off (one log line) where there is no CUDA device or runtime
    devices: tuple[int, ...] = (0,)  # CUDA device indices, as this process sees them (CUDA_VISIBLE_DEVICES)
    bytes: Size = setting(4 * GiB, ge=4 * KiB)  # one pool of this size per device, allocated at start
    slab_bytes: Size = setting(
        256 * MiB, ge=4 * KiB
    )  # pages of one size class are carved from slabs this big
    promote_after_hits: int = setting(2, ge=1)  # a page's leased hits before it moves up from the CPU tier

    def validate(self, path: str) -> None:
        devices_key = join(path, "devices")
        if not self.devices:
            raise ConfigError(devices_key, "expected at least one device index, like [0]")
        for i, device in enumerate(self.devices):
            if device < 0:
                raise ConfigError(f"{devices_key}[{i}]", f"expected a device index >= 0, got {device}")
        if len(set(self.devices)) != len(self.devices):
            raise ConfigError(devices_key, f"a device is listed twice in {list(self.devices)}")
        if self.slab_bytes > self.bytes:
            bytes_key = join(path, "bytes")
            expected = f"expected at most {bytes_key} ({format_size(self.bytes)})"
            raise ConfigError(join(path, "slab_bytes"), f"{expected}, got {format_size(self.slab_bytes)}")


def _without_password(url: str) -> str:
    """`url` with its password (in the user part or the query) shown as ***."""
    from urllib.parse import parse_qsl, urlencode, urlsplit

    parts = urlsplit(url)
    query = parse_qsl(parts.query)
    if parts.password is None and all(name != "password" for name, _ in query):
        return url
    netloc = parts.netloc
    if parts.password is not None:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.partition(':')[0]}:***@{host}"
    shown = urlencode([(name, "***" if name == "password" else value) for name, value in query], safe="*/")
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{shown}" if shown else "")


@dataclass(frozen=True)
class RemoteTierConfig:
    """Page records in Redis or Valkey, shared by the daemons of many hosts (`tiers/remote.py`)."""

    enabled: bool = False
    url: str = setting("redis://127.0.0.1:6379/0", non_empty=True)  # redis://, rediss:// or unix://
    # A Redis or Valkey Cluster: its slot map is discovered from the seed nodes in `urls` (or `url`).
    cluster: bool = False
    urls: tuple[str, ...] = ()  # a cluster's seed nodes, with the same credentials and TLS
    key_prefix: str = "kvstore:"  # records are <key_prefix><namespace hex>:<key hex>
    write: str = setting("through", choices=("through", "behind"))  # every commit, or at CPU eviction
    codec: str = setting("none", choices=("lz4", "none"))
    threads: int = setting(4, gt=0, le=64)  # workers that read records, and as many that write them
    # Pages waiting to be sent; past it, new ones drop. Write-through keeps them pinned in the CPU
    # tier until sent, so this also bounds the CPU tier's bytes waiting on the server.
    queue_bytes: Size = setting(256 * MiB, gt=0)
    timeout_s: float = setting(2.0, gt=0, le=60)  # a worker's read or write
    lookup_timeout_s: float = setting(0.05, gt=0, le=5)  # the existence check a Lookup makes
    retry_s: float = setting(5.0, gt=0)  # after a failure the tier is skipped (misses) this long
    ttl_s: float = setting(0.0, ge=0)  # records expire after this (0: never; the server's maxmemory evicts)
    # Secret bytes every daemon of the fleet shares (mode 0600): records carry a MAC under it, and a
    # record without a valid one is a miss. None: records are trusted as the server holds them.
    record_key_file: str | None = setting(None, non_empty=True)

    @property
    def seeds(self) -> tuple[str, ...]:
        return self.urls or (self.url,)

    @property
    def where(self) -> str:
        """The server, or the cluster's seeds, as a log line names them (passwords left out)."""
        seeds = [_without_password(url) for url in self.seeds]
        return f"cluster {', '.join(seeds)}" if self.cluster else seeds[0]

    def validate(self, path: str) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                join(path, "url"), f"expected a redis://, rediss:// or unix:// URL, got {self.url!r}"
            )
        if self.urls and not self.cluster:
            raise ConfigError(
                join(path, "urls"),
                f"lists a cluster's seed nodes: set {join(path, 'cluster')}: true, or name one server in "
                f"{join(path, 'url')}",
            )
        if self.cluster:
            self._validate_seeds(join(path, "urls") if self.urls else join(path, "url"))
        if self.ttl_s and self.ttl_s < 1:
            expected = "expected 0 (no expiry) or at least 1 s"
            raise ConfigError(join(path, "ttl_s"), f"{expected}, got {self.ttl_s}")
        if self.enabled:
            self.record_key(path)  # readable, private and long enough now, or an error naming the key

    def record_key(self, path: str = "tiers.remote") -> bytes | None:
        """The bytes of record_key_file (a trailing newline ignored), read now; None when unset.
        The file must not be readable by group or others, and must hold at least 16 bytes."""
        if self.record_key_file is None:
            return None
        from kvstore.tiers.records import MIN_RECORD_KEY_BYTES

        key = join(path, "record_key_file")
        try:
            with open(self.record_key_file, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                secret = f.read(1 << 16).rstrip(b"\r\n")
        except OSError as err:
            raise ConfigError(key, f"cannot read {self.record_key_file}: {err.strerror}") from None
        if mode & 0o077:
            raise ConfigError(
                key, f"{self.record_key_file} is readable by others (mode {mode & 0o777:o}): chmod 600 it"
            )
        if not secret:
            raise ConfigError(key, f"{self.record_key_file} is empty; write the fleet's secret into it")
        if len(secret) < MIN_RECORD_KEY_BYTES:
            raise ConfigError(
                key,
                f"{self.record_key_file} holds {len(secret)} bytes; expected at least {MIN_RECORD_KEY_BYTES} "
                "(head -c 32 /dev/urandom > FILE)",
            )
        return secret

    def _validate_seeds(self, key: str) -> None:
        from urllib.parse import urlsplit

        first = urlsplit(self.seeds[0])
        for i, url in enumerate(self.seeds):
            where = f"{key}[{i}]" if self.urls else key
            parts = urlsplit(url)
            if parts.scheme not in ("redis", "rediss"):
                raise ConfigError(
                    where, f"a cluster is reached over TCP: expected redis:// or rediss://, got {url!r}"
                )
            if parts.path.strip("/") not in ("", "0"):
                raise ConfigError(where, f"a cluster has database 0 only, got {url!r}")
            if (parts.scheme, parts.username, parts.password, parts.query) != (
                first.scheme,
                first.username,
                first.password,
                first.query,
            ):
                raise ConfigError(
                    where, "every seed node takes the same scheme, credentials and TLS settings as the first"
                )


@dataclass(frozen=True)
class TiersConfig:
    gpu: GpuTierConfig = field(default_factory=GpuTierConfig)
    cpu: CpuTierConfig = field(default_factory=CpuTierConfig)
    disk: DiskTierConfig = field(default_factory=DiskTierConfig)
    remote: RemoteTierConfig = field(default_factory=RemoteTierConfig)


@dataclass(frozen=True)
class EvictionConfig:
    """What leaves a full tier first, and what never does (pinned chains)."""

    policy: str = setting("lfuda", non_empty=True)  # a name in the policy registry
    pin_fraction: float = setting(0.1, gt=0, le=1)  # pinned pages may fill this share of a tier at most
    max_pin_ttl_s: float = setting(86400.0, gt=0)  # the longest a Pin may keep pages

    def validate(self, path: str) -> None:
        from kvstore.policy import make_policy  # the registry (and what it may serve) is the policies'

        try:
            make_policy(self.policy)
        except ValueError as err:  # its message starts with this key: keep the loader's form
            key = join(path, "policy")
            raise ConfigError(key, str(err).removeprefix(f"{key}: ")) from None


_TENANT_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
MAX_TENANT_NAMESPACES = 4096


@dataclass(frozen=True)
class TenantConfig:
    """One tenant: who its members are (local uids and gids, TCP tokens) and its shares.

    Its pages live in an arena of its own (`cpu_bytes`, a sealed memfd that the daemon hands to
    its members only), its namespaces are keyed by its name, and eviction within the arena keeps
    it at its quota: no tenant can read, write, evict or name another's pages.
    """

    name: str = ""  # lower-case letters, digits, '.', '_', '-'; keys its namespaces
    uids: tuple[int, ...] = ()
    gids: tuple[int, ...] = ()
    tokens_file: str | None = setting(None, non_empty=True)  # bearer tokens for TCP, one per line
    cpu_bytes: Size = setting(1 * GiB, ge=4 * KiB)  # its arena: a share of tiers.cpu.bytes
    disk_bytes: Size | None = setting(None, gt=0)  # its share of tiers.disk.bytes (None: an equal share)
    max_namespaces: int = setting(64, ge=1, le=MAX_TENANT_NAMESPACES)

    def validate(self, path: str) -> None:
        if not _TENANT_NAME_RE.fullmatch(self.name):
            raise ConfigError(
                join(path, "name"),
                f"expected 1-63 lower-case letters, digits, '.', '_' or '-' (starting with a letter or "
                f"digit), got {self.name!r}",
            )
        if not (self.uids or self.gids or self.tokens_file):
            raise ConfigError(path, "a tenant needs members: uids, gids or a tokens_file")
        for key in ("uids", "gids"):
            for i, value in enumerate(getattr(self, key)):
                if not 0 <= value < 2**32 - 1:
                    expected = f"expected an id in 0..4294967294, got {value}"
                    raise ConfigError(f"{join(path, key)}[{i}]", expected)

    def tokens(self, path: str) -> frozenset[str]:
        """The bearer tokens in tokens_file (one per line; blank lines and '#' comments skipped),
        read now. The file must not be readable by group or others."""
        if self.tokens_file is None:
            return frozenset()
        key = join(path, "tokens_file")
        try:
            with open(self.tokens_file, encoding="utf-8") as f:
                mode = os.fstat(f.fileno()).st_mode
                text = f.read()
        except (OSError, UnicodeDecodeError) as err:
            reason = err.strerror if isinstance(err, OSError) else str(err)
            raise ConfigError(key, f"cannot read {self.tokens_file}: {reason}") from None
        if mode & 0o077:
            raise ConfigError(
                key, f"{self.tokens_file} is readable by others (mode {mode & 0o777:o}): chmod 600 it"
            )
        tokens = [line.strip() for line in text.splitlines()]
        tokens = [t for t in tokens if t and not t.startswith("#")]
        for token in tokens:
            _check_token(token, key)
            if len(token) < 16:
                raise ConfigError(key, "expected tokens of at least 16 characters")
        if not tokens:
            raise ConfigError(key, f"{self.tokens_file} holds no token")
        return frozenset(tokens)


@dataclass(frozen=True)
class AdminsConfig:
    """Who may do what spans tenants (Clear of everything, Stats of every tenant, shortening a
    pin): root always, and these uids and gids."""

    uids: tuple[int, ...] = ()
    gids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Config:
    """Everything `kvstored` reads from its YAML file."""

    log_level: str = setting("info", choices=LOG_LEVELS)
    log_format: str = setting("text", choices=("text", "json"))  # json: one object per line (kvstore.logs)
    chunk_tokens: int = setting(256, gt=0, le=1 << 20)  # a page spec's own limit (kvstore.spec)
    server: ServerConfig = field(default_factory=ServerConfig)
    leases: LeaseConfig = field(default_factory=LeaseConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    tenants: tuple[TenantConfig, ...] = ()  # none: one tenant, today's behaviour
    admins: AdminsConfig = field(default_factory=AdminsConfig)

    def validate(self, path: str) -> None:
        if not self.tenants:
            return
        names: dict[str, int] = {}
        owners: dict[tuple[str, int], int] = {}
        for i, tenant in enumerate(self.tenants):
            key = f"tenants[{i}]"
            if tenant.name in names:
                problem = f"{tenant.name!r} is tenants[{names[tenant.name]}]'s name too"
                raise ConfigError(join(key, "name"), problem)
            names[tenant.name] = i
            for kind in ("uids", "gids"):
                for value in getattr(tenant, kind):
                    other = owners.setdefault((kind, value), i)
                    if other != i:
                        raise ConfigError(
                            join(key, kind), f"{kind[:-1]} {value} is a member of tenants[{other}] already"
                        )
            if tenant.cpu_bytes < self.tiers.cpu.slab_bytes:
                raise ConfigError(
                    join(key, "cpu_bytes"),
                    f"expected at least tiers.cpu.slab_bytes ({format_size(self.tiers.cpu.slab_bytes)}), "
                    f"got {format_size(tenant.cpu_bytes)}",
                )
        cpu = sum(t.cpu_bytes for t in self.tenants)
        if cpu > self.tiers.cpu.bytes:
            raise ConfigError(
                "tiers.cpu.bytes",
                f"the tenants' cpu_bytes add up to {format_size(cpu)}, more than this "
                f"({format_size(self.tiers.cpu.bytes)}): raise it or lower theirs",
            )
        disk = sum(t.disk_bytes or 0 for t in self.tenants)
        if self.tiers.disk.enabled and disk > self.tiers.disk.bytes:
            raise ConfigError(
                "tiers.disk.bytes",
                f"the tenants' disk_bytes add up to {format_size(disk)}, more than this "
                f"({format_size(self.tiers.disk.bytes)}): raise it or lower theirs",
            )
        if self.tiers.gpu.enabled:
            raise ConfigError(
                "tiers.gpu.enabled",
                "the GPU tier cannot be combined with tenants: its device memory is opened by every "
                "worker through CUDA IPC and cannot be confined to one tenant",
            )

    def tenant_disk_bytes(self, tenant: TenantConfig) -> int:
        """A tenant's share of the disk tier: its disk_bytes, or an equal share of what the
        tenants that name none leave."""
        if tenant.disk_bytes is not None:
            return tenant.disk_bytes
        named = sum(t.disk_bytes or 0 for t in self.tenants)
        unnamed = sum(1 for t in self.tenants if t.disk_bytes is None)
        return max(4 * KiB, (self.tiers.disk.bytes - named) // unnamed)

    def to_dict(self, *, redact: bool = True) -> dict[str, Any]:
        """The effective config as plain data (sizes and modes as ints); parse_config reads it back."""
        data = asdict(self)
        if redact and self.server.auth_token is not None:
            data["server"]["auth_token"] = "<redacted>"
        return data


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a YAML config file; every error names the file."""
    source = os.fspath(path)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else str(err)
        raise ConfigError("", f"cannot read the config file: {reason}", source) from err
    data = read_yaml(text, source)
    return parse_config(data, source)


def parse_config(data: Mapping[str, Any] | None, source: str | None = None) -> Config:
    """Validate already-parsed config data; None or {} gives all defaults.

    `source` (a file name) prefixes error messages; without it they start with the dotted key.
    """
    try:
        config: Config = build(Config, data, "")
    except ConfigError as err:
        if source is None:
            raise
        raise ConfigError(err.key, err.problem, source) from None
    return config
