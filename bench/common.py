"""Helpers every benchmark shares.

- `running_daemon(config)`, `Daemon`: a real `kvstored` process in its own temporary
  directory, started from a config dict and ready (health SERVING): the harness the tests use
  too (`tests.harness`).
- `Latency.of(samples_s)`: p50 / p99 / mean of timed calls, in microseconds.
- `bootstrap_ratio_interval(on, off, q)`: a 90% interval of a percentile's ratio between two
  sides timed in paired windows; `overlapping(starts, durations, spans)`: the calls that ran
  while something else did.
- `print_table(headers, rows)`: a plain-text table on stdout.
- `write_results(name, payload)`: `bench/results/<name>.json` (the latest, kept in git) and a
  copy of every run in `bench/results/runs/<name>-<UTC timestamp>.json` (ignored by git: a run
  that a note cites is copied beside `<name>.json` by hand), each with a `meta` block
  describing the machine.
"""

from __future__ import annotations

import bisect
import contextlib
import datetime as dt
import json
import os
import platform
import socket
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tests.harness import REPO_ROOT, Daemon, running_daemon

__all__ = [
    "Daemon",
    "Latency",
    "bootstrap_ratio_interval",
    "machine_meta",
    "overlapping",
    "print_table",
    "running_daemon",
    "write_results",
]

RESULTS_DIR = REPO_ROOT / "bench" / "results"
RUNS_DIR = RESULTS_DIR / "runs"  # every run, timestamped; ignored by git


class Latency(NamedTuple):
    """Summary of timed calls, in microseconds."""

    calls: int
    p50_us: float
    p99_us: float
    mean_us: float
    min_us: float
    max_us: float

    @classmethod
    def of(cls, samples_s: Sequence[float]) -> Latency:
        if not samples_s:
            raise ValueError("samples_s: expected at least one timed call")
        us = sorted(s * 1e6 for s in samples_s)
        return cls(len(us), _percentile(us, 50), _percentile(us, 99), statistics.fmean(us), us[0], us[-1])


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Columns sized to their widest cell; numbers right-aligned, text left-aligned."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max([len(header)] + [len(row[i]) for row in cells]) for i, header in enumerate(headers)]
    numeric = [
        bool(rows) and all(isinstance(row[i], int | float) for row in rows) for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    print(line(list(headers)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print(line(row))


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "PASS" if value else "FAIL"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.2f}"
    return str(value)


def machine_meta() -> dict[str, Any]:
    """Where and when the figures were taken."""
    meta: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": None,
        "gpu": None,
    }
    try:
        import torch
    except ImportError:
        return meta
    meta["torch"] = torch.__version__
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name(0)
    return meta


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def write_results(name: str, payload: dict[str, Any]) -> Path:
    """Write `payload` plus a `meta` block to `runs/<name>-<timestamp>.json` and to `<name>.json`;
    returns the latter."""
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    document = {"meta": machine_meta(), **payload}
    text = json.dumps(document, indent=2, default=str) + "\n"
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    (RUNS_DIR / f"{name}-{stamp}.json").write_text(text)
    latest = RESULTS_DIR / f"{name}.json"
    latest.write_text(text)
    return latest


def bootstrap_ratio_interval(
    on: Sequence[Sequence[float]], off: Sequence[Sequence[float]], q: float, resamples: int = 400
) -> tuple[float, float]:
    """A 90% bootstrap interval of percentile `q` of the pooled `on` windows over that of the
    pooled `off` windows: windows are paired (`on[i]` beside `off[i]`) and the pairs resampled
    with replacement, so that slow stretches of the host count as the unit they are."""
    import torch  # only the benchmarks that resample need it

    pairs = len(on)
    if pairs != len(off) or not pairs:
        raise ValueError("on, off: expected the same number of windows, at least one")
    on_t = [torch.tensor(window, dtype=torch.float64) for window in on]
    off_t = [torch.tensor(window, dtype=torch.float64) for window in off]
    generator = torch.Generator().manual_seed(0)
    ratios = []
    for _ in range(resamples):
        picks = torch.randint(0, pairs, (pairs,), generator=generator).tolist()
        top = torch.quantile(torch.cat([on_t[i] for i in picks]), q / 100)
        bottom = torch.quantile(torch.cat([off_t[i] for i in picks]), q / 100)
        ratios.append(float(top / bottom))
    ratios.sort()
    return ratios[int(0.05 * (resamples - 1))], ratios[int(0.95 * (resamples - 1))]


def overlapping(
    starts: Sequence[float], durations: Sequence[float], spans: Sequence[tuple[float, float]]
) -> dict[str, float]:
    """The calls (started at `starts`, taking `durations`, seconds on one clock) that overlapped
    one of `spans` (start, end): how many, their share of all calls, and their p50 / max (µs)."""
    ordered = sorted(spans)
    ends = [end for _, end in ordered]
    hit = []
    for start, took in zip(starts, durations, strict=True):
        first = bisect.bisect_left(ends, start)  # the first span that ends after the call starts
        if first < len(ordered) and ordered[first][0] <= start + took:
            hit.append(took)
    latency = Latency.of(hit) if hit else None
    return {
        "calls": len(hit),
        "share": len(hit) / max(len(starts), 1),
        "p50_us": latency.p50_us if latency else 0.0,
        "max_us": latency.max_us if latency else 0.0,
    }
