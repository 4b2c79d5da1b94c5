"""Request traces in the Mooncake format, for replay.

One JSON object a line; its `hash_ids` list has one id per 512-token block of
the prompt, chained: an id stands for its whole prefix, so two requests that
share an id share every block before it. Other fields (timestamp, lengths) are
ignored. `load_trace(path)` reads and checks a file; every error names the line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple


class TraceError(ValueError):
    """The trace file is missing or malformed; the message names the file and line."""


class Trace(NamedTuple):
    path: str
    requests: list[list[int]]  # hash_ids of each request, in order

    @property
    def num_blocks(self) -> int:
        return sum(map(len, self.requests))

    @property
    def num_distinct_blocks(self) -> int:
        return len({block for request in self.requests for block in request})


def load_trace(path: str | os.PathLike[str]) -> Trace:
    source = os.fspath(path)
    try:
        lines = Path(source).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else str(err)
        raise TraceError(f"{source}: cannot read the trace: {reason}") from err
    requests = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            requests.append(_hash_ids(line, f"{source}:{number}"))
    if not requests:
        raise TraceError(f"{source}: no requests (expected one JSON object with `hash_ids` a line)")
    return Trace(source, requests)


def _hash_ids(line: str, where: str) -> list[int]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise TraceError(f"{where}: invalid JSON: {err.msg}") from None
    ids = record.get("hash_ids") if isinstance(record, dict) else None
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise TraceError(f"{where}: expected an object whose `hash_ids` is a list of non-negative integers")
    return ids
