"""The daemon's configuration: YAML loaded into a tree of frozen dataclasses.

- `load_config(path)` / `parse_config(mapping)`: build a validated `Config`. Every problem is a
  `ConfigError` whose message names the dotted key and what was expected
  (`tiers.cpu.bytes: expected a size like 8GiB, got 'lots'`); `load_config` prefixes the file.
- `parse_size("8GiB")`: byte sizes, binary (KiB, MiB, GiB, TiB) or decimal (KB, MB, GB, TB) units.
- `unix_socket: auto` puts the socket at `kvstore.shared.paths.default_socket_path()`.
- `Config`: the whole tree; here too `LeaseConfig` and `EvictionConfig`. The other sections
  live with their subject and are importable from here as well: the listeners in
  `kvstore.config.server` (`ServerConfig`, `TlsConfig`), the tiers in `kvstore.config.tiers`
  (`TiersConfig`, `CpuTierConfig`, `DiskTierConfig`, `GpuTierConfig`, `RemoteTierConfig`),
  tenants and admins in `kvstore.config.tenants` (`TenantConfig`, `AdminsConfig`).

The loader is generic (`kvstore.config.settings`): each dataclass here declares its keys with their
types and bounds, and a `validate(path)` for rules that span several fields.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstore.config.server import ServerConfig, TlsConfig
from kvstore.config.settings import (
    ConfigError,
    GiB,
    KiB,
    MiB,
    TiB,
    build,
    format_size,
    join,
    parse_size,
    read_yaml,
    setting,
)
from kvstore.config.tenants import AdminsConfig, TenantConfig
from kvstore.config.tiers import (
    CpuTierConfig,
    DiskTierConfig,
    GpuTierConfig,
    RemoteTierConfig,
    TiersConfig,
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
    "AdminsConfig",
    "CpuTierConfig",
    "DiskTierConfig",
    "EvictionConfig",
    "GpuTierConfig",
    "LeaseConfig",
    "RemoteTierConfig",
    "ServerConfig",
    "TenantConfig",
    "TiersConfig",
    "TlsConfig",
]

LOG_LEVELS = ("debug", "info", "warning", "error")


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
class EvictionConfig:
    """What leaves a full tier first, and what never does (pinned chains)."""

    policy: str = setting("lfuda", non_empty=True)  # a name in the policy registry
    pin_fraction: float = setting(0.1, gt=0, le=1)  # pinned pages may fill this share of a tier at most
    max_pin_ttl_s: float = setting(86400.0, gt=0)  # the longest a Pin may keep pages

    def validate(self, path: str) -> None:
        from kvstore.store.policy import make_policy  # the registry (and what it may serve) is the policies'

        try:
            make_policy(self.policy)
        except ValueError as err:  # its message starts with this key: keep the loader's form
            key = join(path, "policy")
            raise ConfigError(key, str(err).removeprefix(f"{key}: ")) from None


@dataclass(frozen=True)
class Config:
    """Everything `kvstored` reads from its YAML file."""

    log_level: str = setting("info", choices=LOG_LEVELS)
    log_format: str = setting(
        "text", choices=("text", "json")
    )  # json: one object per line (kvstore.server.logs)
    chunk_tokens: int = setting(256, gt=0, le=1 << 20)  # a page spec's own limit (kvstore.shared.spec)
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
        if self.tiers.cpu.pinned:
            raise ConfigError(
                "tiers.cpu.pinned",
                "a pinned arena is not offered with tenants yet: each tenant's arena is a sealed "
                "memfd; set tiers.cpu.pinned: false",
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
