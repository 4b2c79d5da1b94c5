"""The tiers' settings: `tiers.gpu`, `tiers.cpu`, `tiers.disk` and `tiers.remote`.

- `CpuTierConfig`: the shared-memory arena (its size, slabs, directory, mode, prefault).
- `DiskTierConfig`: the record files' directory, size, write mode, fsync, codec, threads.
- `GpuTierConfig`: the device-memory pools (devices, size, slabs, promotion).
- `RemoteTierConfig`: Redis or Valkey (one server or a cluster's seeds), its timeouts and the
  fleet's record key (`record_key()` reads it); `where` names the server without passwords.
- `TiersConfig`: the four together, as `Config.tiers`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvstore.config.settings import ConfigError, GiB, KiB, MiB, Mode, Size, format_size, join, setting
from kvstore.shared.hugepages import hugetlbfs_page_bytes


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
    # Pin the arena in the daemon through CUDA, one allocation per slab (`kvstore.tiers.pinned`):
    # workers map the slabs' descriptors with nothing to register (shm_dir and prefault then
    # unused; file_mode says who may map them, as for the file). Needs a GPU and its driver.
    pinned: bool = False
    pinned_numa_node: int = setting(0, ge=0)  # the host NUMA node the pinned arena lives on

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
