"""The config loader: YAML into frozen dataclasses, every problem a ConfigError naming its key.

- `build(cls, data, path)`: walks dataclass `cls`'s typed fields, converts each value by its
  type (`Size` and `Mode` mark byte sizes and octal file modes), checks the bounds kept in the
  field's metadata (`setting(default, gt=, ge=, le=, choices=, non_empty=)`), then calls the
  dataclass's `validate(path)` for rules that span several fields. A key given twice, an
  unknown key (with the closest valid one), a wrong type or a value out of bounds is a
  `ConfigError` whose message starts with the dotted key.
- `read_yaml(text, source)`: YAML text as plain data (a key given twice is an error).
- `parse_size("8GiB")` / `format_size(n)`: byte sizes, binary (KiB, MiB, GiB, TiB) or decimal
  (KB, MB, GB, TB) units.

`kvstore.config.root` declares the daemon's settings with these.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import operator
import re
from collections.abc import Mapping
from dataclasses import field, fields, is_dataclass
from fractions import Fraction
from types import NoneType, UnionType
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

try:
    import yaml
except ImportError as exc:  # a worker's install: the daemon's packages are the `daemon` extra
    raise ImportError(
        "PyYAML is missing: kvstored and kvctl need the daemon's packages (pip install 'kvstore[daemon]')"
    ) from exc

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)
_MODE_RE = re.compile(r"(?:0o)?[0-7]+", re.IGNORECASE)


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


def setting(default: Any, **checks: Any) -> Any:
    """A field with checks the loader applies to values read from a file: gt, ge, le, choices, non_empty."""
    return field(default=default, metadata=checks)


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def read_yaml(text: str, source: str) -> Any:
    """`text` parsed as YAML (plain data only); a ConfigError naming `source` where it is not."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain data only
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError("", f"{where}invalid YAML: {problem}", source) from err
    return data


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


def build(cls: Any, data: object, path: str) -> Any:
    """An instance of dataclass `cls` from a mapping; absent keys keep their defaults."""
    if data is None:  # a section whose keys are all commented out
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(path or "(top level)", f"expected a mapping, got {_describe(data)}")
    hints = get_type_hints(cls, include_extras=True)
    known = {f.name: f for f in fields(cls)}
    values: dict[str, Any] = {}
    for key, raw in data.items():
        key_path = join(path, str(key))
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
    if isinstance(hint, UnionType) or get_origin(hint) is Union:  # `X | None`; Optional[Annotated[...]]
        others = [arg for arg in get_args(hint) if arg is not NoneType]
        if len(others) != 1:
            raise TypeError(f"config fields support `X | None` unions only, not {hint}")
        return None if value is None else _convert(others[0], value, path)
    if is_dataclass(hint):
        return build(hint, value, path)
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
