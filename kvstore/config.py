"""The daemon's configuration: YAML loaded into a tree of frozen dataclasses.

- `load_config(path)` / `parse_config(mapping)`: build a validated `Config`. Every problem is a
  `ConfigError` whose message names the dotted key and what was expected
  (`tiers.cpu.bytes: expected a size like 8GiB, got 'lots'`); `load_config` prefixes the file.
- `parse_size("8GiB")`: byte sizes, binary (KiB, MiB, GiB, TiB) or decimal (KB, MB, GB, TB) units.
- `unix_socket: auto` puts the socket at `kvstore.paths.default_socket_path()`.

The loader is generic: it walks each dataclass's typed fields, converts each value by its type
(`Size` and `Mode` mark byte sizes and octal file modes), checks the bounds kept in the field's
metadata, then calls the dataclass's `validate(path)` for rules that span several fields.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import operator
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from fractions import Fraction
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Any, get_args, get_origin, get_type_hints

import yaml

from kvstore.paths import default_socket_path

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)
_MODE_RE = re.compile(r"(?:0o)?[0-7]+", re.IGNORECASE)
_HOST_PORT_RE = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(?P<port>\d{1,5})")
_MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path holds 108 bytes, the last one a NUL
LOG_LEVELS = ("debug", "info", "warning", "error")


class _SizeMark:
    """Marks an int field written as a byte size: 4096, "512MiB", "2GB"."""


class _ModeMark:
    """Marks an int field holding file permission bits: 0o660, "0660"."""


Size = Annotated[int, _SizeMark]
Mode = Annotated[int, _ModeMark]


class ConfigError(ValueError):
    """A config value is missing, malformed or out of range; the message starts with its dotted key."""

    def __init__(self, key: str, problem: str, source: str | None = None) -> None:
        self.key, self.problem, self.source = key, problem, source
        message = f"{key}: {problem}" if key else problem
        super().__init__(f"{source}: {message}" if source else message)

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str, str | None]]:
        return ConfigError, (self.key, self.problem, self.source)


def parse_size(text: str | int) -> int:
    """Bytes in `text`: 4096, "4096", "64KiB", "1.5GiB", "2GB" (= 2 * 10**9)."""
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    match = _SIZE_RE.fullmatch(text) if isinstance(text, str) else None
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise ValueError(f"expected a size like 4096, 512MiB or 8GiB, got {text!r}")
    size = Fraction(match.group(1)) * unit
    if size.denominator != 1:
        raise ValueError(f"expected a whole number of bytes, got {text!r} = {float(size)} bytes")
    return int(size)


def format_size(num_bytes: int) -> str:
    """The shortest exact spelling of a size: 268435456 -> "256MiB"."""
    for name, unit in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if num_bytes and num_bytes % unit == 0:
            return f"{num_bytes // unit}{name}"
    return str(num_bytes)


def _setting(default: Any, **checks: Any) -> Any:
    """A field with checks the loader applies to values read from a file: gt, ge, le, choices, non_empty."""
    return field(default=default, metadata=checks)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _check_token(token: str, key: str) -> None:
    # The token travels as gRPC metadata, which allows printable ASCII only.
    if not (token.isascii() and token.isprintable()) or " " in token:
        raise ConfigError(key, "expected a token of printable ASCII characters without spaces")


@dataclass(frozen=True)
class ServerConfig:
    """How clients reach the daemon: always a unix socket, optionally a TCP listener with a token."""

    unix_socket: str = _setting("auto", non_empty=True)  # "auto": default_socket_path()
    socket_mode: Mode = 0o660
    tcp: str | None = None  # "host:port": "127.0.0.1:50051", "[::1]:50051", "0.0.0.0:50051"
    auth_token: str | None = _setting(None, non_empty=True)
    auth_token_file: str | None = _setting(None, non_empty=True)
    max_message_bytes: Size = _setting(4 * MiB, ge=64 * KiB, le=64 * MiB)
    grace_s: float = _setting(5.0, ge=0)  # drain time on SIGTERM
    local_channel: bool = True  # same-host clients' unary calls on <socket>.local, without HTTP/2
    # After a local-channel call, the event loop polls instead of sleeping for this long (0: never),
    # so that the next call finds the daemon on its core: one core busy while workers are active.
    local_poll_ms: float = _setting(0.0, ge=0, le=1000)
    # The event loop: uvloop (libuv) answers a local-channel call in a fraction of asyncio's time;
    # "auto" takes it where it is installed, else asyncio's own.
    event_loop: str = _setting("auto", choices=("auto", "uvloop", "asyncio"))

    @property
    def socket_path(self) -> Path:
        if self.unix_socket == "auto":
            return default_socket_path()
        return Path(self.unix_socket)

    @property
    def local_socket_path(self) -> Path:
        return self.socket_path.with_name(self.socket_path.name + ".local")

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
        token_key, file_key = _join(path, "auth_token"), _join(path, "auth_token_file")
        if self.unix_socket != "auto" and len(os.fsencode(self.unix_socket)) > _MAX_SOCKET_PATH:
            raise ConfigError(
                _join(path, "unix_socket"), f"expected a path of at most {_MAX_SOCKET_PATH} bytes"
            )
        if self.auth_token is not None and self.auth_token_file is not None:
            raise ConfigError(token_key, f"set {token_key} or {file_key}, not both")
        if self.auth_token is not None:
            _check_token(self.auth_token, token_key)
        if self.tcp is None:
            return
        tcp_key = _join(path, "tcp")
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


@dataclass(frozen=True)
class LeaseConfig:
    """Leases pin pages for a worker; a lease not renewed within its TTL is reaped."""

    ttl_s: float = _setting(30.0, gt=0)
    max_ttl_s: float = _setting(600.0, gt=0)
    reap_interval_s: float = _setting(0.25, gt=0)
    quarantine_s: float = _setting(300.0, gt=0)  # the longest an expired store lease's slots stay fenced

    def validate(self, path: str) -> None:
        if self.max_ttl_s < self.ttl_s:
            ttl_key = _join(path, "ttl_s")
            expected = f"expected a value >= {ttl_key} ({self.ttl_s})"
            raise ConfigError(_join(path, "max_ttl_s"), f"{expected}, got {self.max_ttl_s}")


@dataclass(frozen=True)
class CpuTierConfig:
    """The shared-memory arena that workers map and pin."""

    bytes: Size = _setting(1 * GiB, gt=0)
    slab_bytes: Size = _setting(256 * MiB, gt=0)  # pages of one size class are carved from slabs this big
    shm_dir: str = _setting("/dev/shm", non_empty=True)
    file_mode: Mode = 0o600
    prefault: bool = True  # reserve the memory at start, so a full /dev/shm fails at start, not later

    def validate(self, path: str) -> None:
        if self.slab_bytes > self.bytes:
            bytes_key = _join(path, "bytes")
            expected = f"expected at most {bytes_key} ({format_size(self.bytes)})"
            raise ConfigError(_join(path, "slab_bytes"), f"{expected}, got {format_size(self.slab_bytes)}")
        if not os.path.isabs(self.shm_dir):
            raise ConfigError(_join(path, "shm_dir"), f"expected an absolute path, got {self.shm_dir!r}")


@dataclass(frozen=True)
class DiskTierConfig:
    """Checksummed page records under a directory: written behind, read back on a hit, recovered at start."""

    enabled: bool = False
    path: str = _setting("/var/lib/kvstore/disk", non_empty=True)
    bytes: Size = _setting(64 * GiB, gt=0)  # records kept at most; the least recently used go first
    write: str = _setting("behind", choices=("behind", "through"))  # at CPU eviction, or every commit too
    fsync: str = _setting("batch", choices=("never", "batch", "always"))
    fsync_interval_s: float = _setting(1.0, gt=0)  # batch: a sync when the queue empties, at least this often
    codec: str = _setting("lz4", choices=("lz4", "none"))
    threads: int = _setting(4, gt=0, le=64)  # workers that compress, write and read records
    queue_bytes: Size = _setting(256 * MiB, gt=0)  # pages waiting to be written; past it, new ones drop

    def validate(self, path: str) -> None:
        if not os.path.isabs(self.path):
            raise ConfigError(_join(path, "path"), f"expected an absolute path, got {self.path!r}")


@dataclass(frozen=True)
class GpuTierConfig:
    """Device-memory pools in the daemon that same-host workers open through CUDA IPC."""

    enabled: bool = False  # off (one log line) where there is no CUDA device or runtime
    devices: tuple[int, ...] = (0,)  # CUDA device indices, as this process sees them (CUDA_VISIBLE_DEVICES)
    bytes: Size = _setting(4 * GiB, gt=0)  # one pool of this size per device, allocated at start
    slab_bytes: Size = _setting(256 * MiB, gt=0)  # pages of one size class are carved from slabs this big
    promote_after_hits: int = _setting(2, ge=1)  # a page's leased hits before it moves up from the CPU tier

    def validate(self, path: str) -> None:
        devices_key = _join(path, "devices")
        if not self.devices:
            raise ConfigError(devices_key, "expected at least one device index, like [0]")
        for i, device in enumerate(self.devices):
            if device < 0:
                raise ConfigError(f"{devices_key}[{i}]", f"expected a device index >= 0, got {device}")
        if len(set(self.devices)) != len(self.devices):
            raise ConfigError(devices_key, f"a device is listed twice in {list(self.devices)}")
        if self.slab_bytes > self.bytes:
            bytes_key = _join(path, "bytes")
            expected = f"expected at most {bytes_key} ({format_size(self.bytes)})"
            raise ConfigError(_join(path, "slab_bytes"), f"{expected}, got {format_size(self.slab_bytes)}")


@dataclass(frozen=True)
class RemoteTierConfig:
    """Page records in Redis or Valkey, shared by the daemons of many hosts (`tiers/remote.py`)."""

    enabled: bool = False
    url: str = _setting("redis://127.0.0.1:6379/0", non_empty=True)  # redis://, rediss:// or unix://
    key_prefix: str = "kvstore:"  # records are <key_prefix><namespace hex>:<key hex>
    write: str = _setting("through", choices=("through", "behind"))  # every commit, or at CPU eviction
    codec: str = _setting("none", choices=("lz4", "none"))
    threads: int = _setting(4, gt=0, le=64)  # workers that read records, and as many that write them
    # Pages waiting to be sent; past it, new ones drop. Write-through keeps them pinned in the CPU
    # tier until sent, so this also bounds the CPU tier's bytes waiting on the server.
    queue_bytes: Size = _setting(256 * MiB, gt=0)
    timeout_s: float = _setting(2.0, gt=0, le=60)  # a worker's read or write
    lookup_timeout_s: float = _setting(0.05, gt=0, le=5)  # the existence check a Lookup makes
    retry_s: float = _setting(5.0, gt=0)  # after a failure the tier is skipped (misses) this long
    ttl_s: float = _setting(0.0, ge=0)  # records expire after this (0: never; the server's maxmemory evicts)

    def validate(self, path: str) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                _join(path, "url"), f"expected a redis://, rediss:// or unix:// URL, got {self.url!r}"
            )
        if self.ttl_s and self.ttl_s < 1:
            expected = "expected 0 (no expiry) or at least 1 s"
            raise ConfigError(_join(path, "ttl_s"), f"{expected}, got {self.ttl_s}")


@dataclass(frozen=True)
class TiersConfig:
    gpu: GpuTierConfig = field(default_factory=GpuTierConfig)
    cpu: CpuTierConfig = field(default_factory=CpuTierConfig)
    disk: DiskTierConfig = field(default_factory=DiskTierConfig)
    remote: RemoteTierConfig = field(default_factory=RemoteTierConfig)


@dataclass(frozen=True)
class EvictionConfig:
    """What leaves a full tier first, and what never does (pinned chains)."""

    policy: str = _setting("lfuda", non_empty=True)  # a name in the policy registry
    pin_fraction: float = _setting(0.1, gt=0, le=1)  # pinned pages may fill this share of a tier at most
    max_pin_ttl_s: float = _setting(86400.0, gt=0)  # the longest a Pin may keep pages


@dataclass(frozen=True)
class Config:
    """Everything `kvstored` reads from its YAML file."""

    log_level: str = _setting("info", choices=LOG_LEVELS)
    chunk_tokens: int = _setting(256, gt=0)
    server: ServerConfig = field(default_factory=ServerConfig)
    leases: LeaseConfig = field(default_factory=LeaseConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)

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
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain data only
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError("", f"{where}invalid YAML: {problem}", source) from err
    return parse_config(data, source)


def parse_config(data: Mapping[str, Any] | None, source: str | None = None) -> Config:
    """Validate already-parsed config data; None or {} gives all defaults.

    `source` (a file name) prefixes error messages; without it they start with the dotted key.
    """
    try:
        config: Config = _build(Config, data, "")
    except ConfigError as err:
        if source is None:
            raise
        raise ConfigError(err.key, err.problem, source) from None
    return config


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses a key given twice in one mapping, instead of keeping the last."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:str":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
                    )
                seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


def _build(cls: Any, data: object, path: str) -> Any:
    """An instance of dataclass `cls` from a mapping; absent keys keep their defaults."""
    if data is None:  # a section whose keys are all commented out
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(path or "(top level)", f"expected a mapping, got {_describe(data)}")
    hints = get_type_hints(cls, include_extras=True)
    known = {f.name: f for f in fields(cls)}
    values: dict[str, Any] = {}
    for key, raw in data.items():
        key_path = _join(path, str(key))
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(known)}"
            raise ConfigError(key_path, f"unknown key ({hint})")
        value = _convert(hints[key], raw, key_path)
        values[key] = _check(known[key].metadata, value, key_path, hints[key])
    instance = cls(**values)
    if hasattr(instance, "validate"):
        instance.validate(path)
    return instance


_BOUNDS = (("gt", ">", operator.gt), ("ge", ">=", operator.ge), ("le", "<=", operator.le))
_EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _convert(hint: Any, value: object, path: str) -> Any:
    """`value` converted to the field type `hint`, or a ConfigError saying what was expected."""
    if get_origin(hint) is Annotated:
        base, *marks = get_args(hint)
        if _SizeMark in marks:
            return _to_size(value, path)
        if _ModeMark in marks:
            return _to_mode(value, path)
        return _convert(base, value, path)
    if isinstance(hint, UnionType):
        others = [arg for arg in get_args(hint) if arg is not NoneType]
        if len(others) != 1:
            raise TypeError(f"config fields support `X | None` unions only, not {hint}")
        return None if value is None else _convert(others[0], value, path)
    if is_dataclass(hint):
        return _build(hint, value, path)
    if get_origin(hint) is tuple:
        return _to_tuple(hint, value, path)
    if hint not in _EXPECTED:
        raise TypeError(f"config field type {hint!r} is not supported")
    if hint is float:
        return _to_float(value, path)
    if isinstance(value, hint) and (hint is bool or not isinstance(value, bool)):
        return value
    raise ConfigError(path, f"expected {_EXPECTED[hint]}, got {_describe(value)}")


def _to_tuple(hint: Any, value: object, path: str) -> tuple[Any, ...]:
    """A list of items of one type (`tuple[int, ...]`), each converted and named by its index."""
    item, *rest = get_args(hint)
    if rest != [Ellipsis]:
        raise TypeError(f"config fields support `tuple[X, ...]` only, not {hint}")
    if not isinstance(value, list | tuple):
        raise ConfigError(path, f"expected a list, like [0, 1], got {_describe(value)}")
    return tuple(_convert(item, element, f"{path}[{i}]") for i, element in enumerate(value))


def _to_float(value: object, path: str) -> float:
    number = value
    if isinstance(value, str):  # PyYAML reads 1e3 (no dot) as a string
        with contextlib.suppress(ValueError):
            number = float(value)
    if isinstance(number, int | float) and not isinstance(number, bool) and math.isfinite(number):
        return float(number)
    raise ConfigError(path, f"expected a number, got {_describe(value)}")


def _to_size(value: object, path: str) -> int:
    if isinstance(value, str | int):
        try:
            return parse_size(value)
        except ValueError:
            pass
    raise ConfigError(path, f"expected a size like 8GiB, got {_describe(value)}")


def _to_mode(value: object, path: str) -> int:
    mode = None
    if isinstance(value, int) and not isinstance(value, bool):
        mode = value
    elif isinstance(value, str) and _MODE_RE.fullmatch(value):
        mode = int(value, 8)
    if mode is not None and 0 <= mode <= 0o777:
        return mode
    # An unquoted 660 is decimal 660 = 0o1224 in YAML; the leading 0 is what makes it octal.
    hint = f" (= {mode:#o}; write the mode with a leading 0)" if mode is not None and mode > 0o777 else ""
    raise ConfigError(path, f"expected a file mode like 0660 or '0o660', got {_describe(value)}{hint}")


def _check(checks: Mapping[str, Any], value: Any, path: str, hint: Any) -> Any:
    """`value` after the bounds and choices in a field's metadata (choices come back lower-case)."""
    if value is None or not checks:
        return value
    choices = checks.get("choices")
    if choices:
        if value.lower() not in choices:
            raise ConfigError(path, f"expected one of {', '.join(choices)}, got {value!r}")
        return value.lower()
    if checks.get("non_empty") and not value.strip():
        raise ConfigError(path, "expected a non-empty string")
    show = format_size if _SizeMark in get_args(hint) else str
    for name, symbol, holds in _BOUNDS:
        bound = checks.get(name)
        if bound is not None and not holds(value, bound):
            raise ConfigError(path, f"expected a value {symbol} {show(bound)}, got {show(value)}")
    return value


def _describe(value: object) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple | set):
        return "a list"
    return repr(value)
