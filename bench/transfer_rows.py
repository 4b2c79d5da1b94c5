"""A transfer measurement's row, and what it costs the model: the helpers every part of
`bench/transfer.py` times its rows with.

- `guarded(log, name, function, *args)`: a measurement whose failure is logged, not raised, so
  that the run goes on.
- `timed_row(...)`: one variant (or two at once) timed, the row's fields added, and the matrix
  products' slowdown beside it (`with_interference`) where asked.
- `median_slowdown(row)`, `beside_gbps(row)`: a row's interference figures, medians over its
  measurements.
"""

from __future__ import annotations

import statistics
import sys
import traceback
from collections.abc import Callable
from typing import Any

from bench.interference import MatmulStream
from bench.transfer_cases import Enqueue
from bench.transfer_timing import timed, timed_pair


def interference(matmul: MatmulStream, enqueues: list[Enqueue], row: dict[str, Any]) -> dict[str, Any]:
    """The products' slowdown beside `enqueues` (each on its own side stream), timed as in `row`."""
    return matmul.beside(enqueues, row["ms"], row["issue_ms"])._asdict()


def guarded(log: list[str], name: str, function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)`; a failure is logged and gives None, so the rest of the run goes on."""
    try:
        return function(*args)
    except Exception:
        log.append(f"{name}:\n{traceback.format_exc()}")
        print(f"FAILED {name}", file=sys.stderr, flush=True)
        return None


def with_interference(
    log: list[str],
    name: str,
    row: dict[str, Any],
    matmul: MatmulStream,
    enqueues: list[Enqueue],
    repeats: int,
) -> None:
    """Add `row["interference"]`: `repeats` measurements of the products beside `enqueues`."""
    runs = [guarded(log, f"interference {name}", interference, matmul, enqueues, row) for _ in range(repeats)]
    row["interference"] = [run for run in runs if run is not None]


def timed_row(
    log: list[str],
    label: str,
    enqueues: list[Enqueue],
    reps: int,
    fields: dict[str, Any],
    matmul: MatmulStream | None = None,
    repeats: int = 0,
) -> dict[str, Any] | None:
    """`timed` (`timed_pair` for two enqueues, both ways at once) under `label`, `fields` added;
    with `matmul`, `repeats` measurements of the products beside it. None if the timing failed."""
    function = timed if len(enqueues) == 1 else timed_pair
    row: dict[str, Any] | None = guarded(log, label, function, *enqueues, reps)
    if row is None:
        return None
    row.update(fields)
    if matmul is not None:
        with_interference(log, label, row, matmul, enqueues, repeats)
    return row


def median_slowdown(row: dict[str, Any] | None, key: str = "slowdown") -> float | None:
    runs = (row or {}).get("interference") or []
    values = [r[key] for r in runs if r["products"] >= 5 and key in r]
    return statistics.median(values) if values else None


def beside_gbps(row: dict[str, Any] | None) -> float | None:
    """The transfer's own rate while the products ran (median over the measurements)."""
    return median_slowdown(row, "transfer_gbps")
