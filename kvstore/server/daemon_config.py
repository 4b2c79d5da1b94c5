"""What `kvstored` makes of its config beyond the loader: checks on this host, who callers
are, the event loop, and the config as `--check-config` prints it.

- `checked(config)`: the config, once what the loader cannot see alone is checked (the policy
  name, the token and TLS files, the event loop, the arena's directory, the tenants' tokens,
  the local channel's caps); a `ConfigError` names the key otherwise.
- `tenancy(config)`: the tenants, the admins and every token, read now (`kvstore.server.tenants`).
- `event_loop_factory(choice)`: the event loop `server.event_loop` names (None: asyncio's).
- `effective_config(config)`: the config as plain data, modes in octal, `auto` resolved.
- `naming_the_file(path, exc)`: an error's message as kvstored prints it, naming the file.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

from kvstore.config.claim import check_shared_directory
from kvstore.config.root import Config, ConfigError
from kvstore.config.settings import Mode
from kvstore.server.tenants import Tenancy
from kvstore.store.policy import make_policy


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


def checked(config: Config) -> Config:
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


def naming_the_file(path: Path | None, exc: ValueError) -> str:
    """An error in the config file `path` as kvstored reports it: naming the file, as the loader's
    own errors do, also where a check after loading found it (`checked`)."""
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
