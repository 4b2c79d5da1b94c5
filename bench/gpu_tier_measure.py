"""The GPU-tier benchmark's rows and acceptance: loads from the GPU tier vs the CPU tier vs a d2d copy.

- `measure(tokens, repeats, profile=, sweep=, daemon_poll_ms=)`: one daemon with both tiers
  (`gpu_tier_loads`), the rows timed in turn in each round and the acceptance's rows again back
  to back (`BACK_TO_BACK`), then `--sweep` (`gpu_tier_sweep`) and `--profile`
  (`gpu_tier_profile`); returns the rows, each with its ms, GB/s and share of the d2d copy's
  rate, and the acceptance checks (`acceptance`).
- `print_report(measured)`: its tables.
"""

from __future__ import annotations

from typing import Any

from bench.common import print_table, running_daemon
from bench.common_timing import medians_in_turn
from bench.gpu_tier_loads import IN_FLIGHT, Prompts, TierLoads
from bench.gpu_tier_profile import run_profile
from bench.gpu_tier_setup import BLOCK, CHUNK, HEAD_DIM, HEADS, LAYERS, SPEC, daemon_config, median_s
from bench.gpu_tier_sweep import run_sweep
from kvstore_client import KVStoreClient

# Rows also timed on their own, repeated back to back: the acceptance's rows (keys + registered
# cache: how an engine's connector calls a load) and the copy they are compared with.
BACK_TO_BACK = (
    "d2d copy",
    "load, CPU tier",
    "load, GPU tier",
    "load, CPU tier, keys + registered cache",
    "load, GPU tier, keys + registered cache",
)
PER_RUN = {  # loads per timed run, where more than one
    f"{IN_FLIGHT} loads in flight, CPU tier": IN_FLIGHT,
    f"{IN_FLIGHT} loads in flight, GPU tier": IN_FLIGHT,
}


def measure(
    tokens: int, repeats: int, *, profile: bool = False, sweep: bool = False, daemon_poll_ms: float = 0.0
) -> dict[str, Any]:
    """Runs the rows (and `--profile`, `--sweep`); returns them with the acceptance checks.

    `daemon_poll_ms`: the daemon's `server.local_poll_ms`."""
    prompts = Prompts.make(tokens)
    total = prompts.total
    results: dict[str, Any] = {}
    with (
        running_daemon(daemon_config(total, daemon_poll_ms)) as daemon,
        KVStoreClient.connect(daemon.address, SPEC) as client,
    ):
        loads = TierLoads(client, prompts)
        promote_s = loads.prepare()
        pool, offsets = loads.pool_of_b()
        runs = loads.runs(pool, offsets)
        timings = medians_in_turn(runs, repeats)
        # The method's timing (a warm-up call, then each call repeated, median): each row on its own,
        # so that no load follows a 21 ms one of the other tier (the acceptance rows).
        for name in BACK_TO_BACK:
            timings[f"{name}, back to back"] = median_s(runs[name], repeats)
        if sweep:
            results["sweep"], swept_timings = run_sweep(loads, pool, offsets, repeats)
            timings |= swept_timings
        if profile:
            results |= run_profile(loads, pool, offsets, repeats)
        stats = client.stats()
    d2d_in_turn = total / timings["d2d copy"] / 1e9
    d2d_back = total / timings["d2d copy, back to back"] / 1e9
    rows = add_rows(results, timings, total, d2d_in_turn, d2d_back)
    checks = acceptance(results, d2d_in_turn, d2d_back)
    return {
        "geometry": {
            "layers": LAYERS,
            "kv_heads": HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "bfloat16",
            "block": BLOCK,
            "chunk_tokens": CHUNK,
            "tokens": tokens,
            "bytes": total,
        },
        "repeats": repeats,
        "daemon_poll_ms": daemon_poll_ms,
        "promote_by_pin_ms": promote_s * 1e3,
        "rows": rows,
        "results": results,
        "gpu_vs_cpu_load": _rate(results, "load, GPU tier, keys + registered cache, back to back")
        / _rate(results, "load, CPU tier, keys + registered cache, back to back"),
        "acceptance": checks,
        "daemon_gpu_tier": stats["tiers"]["gpu"],
    }


def add_rows(
    results: dict[str, Any], timings: dict[str, float], total: int, d2d_in_turn: float, d2d_back: float
) -> list[list[Any]]:
    """Per timed row: ms and GB/s per load, and the share of the d2d copy's rate (the copy timed
    alike: in turn, or back to back), as table rows and into `results` by name."""
    rows: list[list[Any]] = []
    for name, seconds in timings.items():
        seconds /= PER_RUN.get(name, 1)  # per load
        gb_s = total / seconds / 1e9
        d2d = d2d_back if name.endswith(", back to back") else d2d_in_turn  # the copy timed alike
        rows.append([name, seconds * 1e3, gb_s, gb_s / d2d])
        results[name] = {"ms": seconds * 1e3, "gb_s": gb_s, "x_d2d": gb_s / d2d}
    return rows


def _rate(results: dict[str, Any], name: str) -> float:
    return float(results[name]["gb_s"])


def acceptance(results: dict[str, Any], d2d_in_turn: float, d2d_back: float) -> dict[str, bool]:
    """Issue 7's checks: a GPU-tier load >= 10x the CPU-tier load and >= 0.5x the d2d copy, with
    keys from the lookup and the cache registered, back to back; the other comparisons "also"."""

    def holds(gpu_row: str, cpu_row: str, d2d: float) -> tuple[bool, bool]:
        return _rate(results, gpu_row) >= 10 * _rate(results, cpu_row), _rate(results, gpu_row) >= 0.5 * d2d

    checks: dict[str, bool] = {}
    ten, half = holds(
        "load, GPU tier, keys + registered cache, back to back",
        "load, CPU tier, keys + registered cache, back to back",
        d2d_back,
    )
    checks["acceptance: GPU-tier load >= 10x CPU-tier load (keys + registered cache, back to back)"] = ten
    checks["acceptance: GPU-tier load >= 0.5x d2d copy (keys + registered cache, back to back)"] = half
    ten, half = holds("load, GPU tier, back to back", "load, CPU tier, back to back", d2d_back)
    checks["also: the same, keys hashed and cache checked per call: >= 10x"] = ten
    checks["also: the same, keys hashed and cache checked per call: >= 0.5x d2d"] = half
    for variant in ("", ", keys from the lookup", ", keys + registered cache"):
        ten, half = holds(f"load, GPU tier{variant}", f"load, CPU tier{variant}", d2d_in_turn)
        label = f"also: in turn{variant}"
        checks[f"{label}: >= 10x"] = ten
        checks[f"{label}: >= 0.5x d2d"] = half
    ten, half = holds(
        f"{IN_FLIGHT} loads in flight, GPU tier", f"{IN_FLIGHT} loads in flight, CPU tier", d2d_in_turn
    )
    checks[f"also: {IN_FLIGHT} loads in flight: >= 10x"] = ten
    checks[f"also: {IN_FLIGHT} loads in flight: >= 0.5x d2d"] = half
    return checks


def print_report(measured: dict[str, Any]) -> None:
    geometry = measured["geometry"]
    size = f"{geometry['bytes'] / 2**30:.2f} GiB in {geometry['tokens'] // CHUNK} pages"
    print(
        f"{geometry['tokens']} tokens, {size}; pin -> GPU tier in {measured['promote_by_pin_ms']:.1f} ms; "
        f"daemon polls {measured.get('daemon_poll_ms', 0):g} ms after a call"
    )
    print_table(("what (ms and GB/s per load)", "ms", "GB/s", "x d2d"), measured["rows"])
    print_table(("acceptance", "holds"), list(measured["acceptance"].items()))
    print(f"GPU-tier load / CPU-tier load (back to back): {measured['gpu_vs_cpu_load']:.1f}x")
