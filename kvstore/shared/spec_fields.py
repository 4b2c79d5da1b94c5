"""The checks of a spec's fields, one at a time, shared by `PageSpec` and `KVSpec` (`spec`).

- `DTYPE_ITEMSIZE`, `dtype_name(dtype)`: the dtypes a page may hold, and the canonical name
  ('bfloat16') of a torch dtype or a string, without importing torch.
- `SPEC_LIMITS`, `MAX_NAME_BYTES`, `MAX_SCALES_BYTES`: how large a field may be.
- `check_name(name, text)`: a name without control characters (it reaches admins' terminals).
- `check_weights(weights)`, `check_layer_ids(layer_ids, num_layers)`, `check_positive(name,
  value)`: a field as the spec keeps it, or a ValueError naming the field.
"""

from __future__ import annotations

import re
from typing import Any

DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,  # raw bytes: a recurrent state's (PageSpec.state) and nothing else
}

MAX_SCALES_BYTES = 1024  # the text of a cache's quantization scales (`PageSpec.scales`)


def dtype_name(dtype: Any) -> str:
    """Canonical dtype name ('bfloat16') from a torch dtype or a string, without importing torch."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        supported = ", ".join(DTYPE_ITEMSIZE)
        raise ValueError(f"dtype: unsupported {dtype!r}; expected one of {supported}")
    return name


def check_weights(weights: Any) -> tuple[tuple[int, str], ...]:
    """`weights` as ((stop, id), ...): ranges from layer 0, stops increasing, ids named."""
    checked: list[tuple[int, str]] = []
    for entry in weights:
        try:
            stop, ident = entry
        except (TypeError, ValueError):
            raise ValueError(f"weights: expected (stop layer, weights id) pairs, got {entry!r}") from None
        if not isinstance(stop, int) or isinstance(stop, bool) or not isinstance(ident, str):
            raise ValueError(f"weights: expected (stop layer, weights id) pairs, got {entry!r}")
        low = checked[-1][0] if checked else 0
        if not low < stop <= SPEC_LIMITS["num_layers"]:
            raise ValueError(f"weights: range ({low}, {stop}) is empty or out of order; stops must increase")
        if not ident or len(ident.encode()) > MAX_NAME_BYTES:
            raise ValueError(
                f"weights: the id of the range ending at {stop} must be 1-{MAX_NAME_BYTES} bytes"
            )
        check_name(f"weights: the id of the range ending at {stop}", ident)
        checked.append((stop, ident))
    return tuple(checked)


def check_layer_ids(layer_ids: Any, num_layers: int) -> tuple[int, ...]:
    """`layer_ids` as a tuple of distinct increasing engine layer indices, one per layer (or empty)."""
    ids = tuple(layer_ids)
    if not ids:
        return ()
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
        raise ValueError(f"layer_ids: expected engine layer indices, got {ids!r:.120}")
    if len(ids) != num_layers or list(ids) != sorted(set(ids)):
        raise ValueError(
            f"layer_ids: expected {num_layers} distinct increasing layer indices (one per layer), "
            f"got {len(ids)}"
        )
    if ids[-1] >= SPEC_LIMITS["num_layers"]:
        raise ValueError(f"layer_ids: {ids[-1]} is over {SPEC_LIMITS['num_layers']}")
    return ids


def check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")


MAX_NAME_BYTES = 256  # a model id or salt (UTF-8): it is listed in every Stats reply
# What moves a terminal's cursor or reorders what it shows: C0 and C1 controls, DEL, line and
# paragraph separators, and the bidi marks, embeddings, overrides and isolates.
_CONTROL_CHARACTERS = re.compile(
    "[\x00-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)


def check_name(name: str, text: str) -> None:
    """Refuses a name (model, salt, weights id) with a control character: names reach admins'
    terminals (`kvctl ls`, `kvctl events`), where an escape sequence would be another user's
    input on root's screen."""
    found = _CONTROL_CHARACTERS.search(text)
    if found is not None:
        raise ValueError(
            f"{name}: control character U+{ord(found.group()):04X} at index {found.start()}; names "
            f"must be printable text (no C0 or C1 controls, DEL, line separators or bidi controls)"
        )


SPEC_LIMITS = {  # far above any model, low enough that no request makes the daemon build a huge table
    "num_layers": 4096,
    "num_kv_heads": 4096,
    "head_dim": 1 << 16,
    "chunk_tokens": 1 << 20,
    "tp_size": 4096,
}
