"""Who may use the daemon: `tenants[*]` (each one's members and shares) and `admins`.

- `TenantConfig`: a tenant's name, uids, gids and tokens file (`tokens()` reads it), its arena
  (`cpu_bytes`), its share of the disk tier and its most namespaces.
- `AdminsConfig`: the uids and gids (root always) whose calls span tenants.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from kvstore.config.server import check_token
from kvstore.config.settings import ConfigError, GiB, KiB, Size, join, setting

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
            check_token(token, key)
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
