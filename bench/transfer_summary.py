"""The transfer benchmark's full run in tables: throughput, both ways at once, acceptance.

- `summarize(result)`: (throughput table, both-ways table, acceptance table) of `run_full`'s
  rows: each variant's GB/s and its ratio to memcpy and to the per-block copies, the model's
  slowdown beside it; the acceptance items (the public call against memcpy, alone and in turn,
  against the per-block baselines, and its slowdown of the model) with their limits.
- `print_full(result, env, args)`: the three tables, under a line saying where they were taken.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.common import print_table
from bench.transfer_rows import beside_gbps, median_slowdown

Row = dict[str, Any]
ACCEPTED_LAYOUTS = ("flash_attn", "flashinfer", "cross_layer")
# Per direction: the public call's least share of memcpy's rate with no cap and with <= 16 SMs.
DIRECTION_LIMITS = (("gather", 0.93, 0.93), ("scatter", 0.90, 0.88))
BOTH_WAYS_LIMIT = 0.85
SLOWDOWN_LIMIT = 1.10
PER_BLOCK_LIMIT = 20


def summarize(result: dict[str, Any]) -> tuple[list[list[Any]], list[list[Any]], list[list[Any]]]:
    """(throughput table, both-ways table, acceptance table)."""
    rows = {(r["layout"], r["direction"], r["variant"]): r for r in result["rows"]}
    pairs = {(r["layout"], r["variant"]): r for r in result["both_ways"]}
    turns = {(r["layout"], r["direction"], r["variant"]): r["ratio"] for r in result.get("interleaved", [])}
    table = [
        [layout, direction, variant, round(row["gbps"], 2),
         _cell(_ratio(row, rows.get((layout, direction, "memcpy")))),
         _cell(_ratio(row, rows.get((layout, direction, "per_block_cuda"))), 1),
         *_interference_cells(row), "-" if row.get("ok") is None else row["ok"]]
        for (layout, direction, variant), row in rows.items()
    ]  # fmt: skip
    pair_table = [
        [layout, variant, round(row["gbps"], 2), _cell(_ratio(row, pairs.get((layout, "memcpy")))),
         *_interference_cells(row)]
        for (layout, variant), row in pairs.items()
    ]  # fmt: skip
    accept: list[list[Any]] = []
    for layout in ACCEPTED_LAYOUTS:
        for direction, no_cap, capped in DIRECTION_LIMITS:
            accept += _direction_items(rows, turns, layout, direction, no_cap, capped)
        accept += _both_ways_items(pairs, turns, layout)
    return table, pair_table, accept


def _ratio(row: Row | None, base: Row | None) -> float | None:
    return row["gbps"] / base["gbps"] if row and base else None


def _cell(value: float | None, digits: int = 3) -> Any:
    return "-" if value is None else round(value, digits)


def _interference_cells(row: Row) -> list[Any]:
    """The model's slowdown beside the row (median, mean) and the transfer's rate meanwhile."""
    return [
        _cell(median_slowdown(row)),
        _cell(median_slowdown(row, "mean_slowdown")),
        _cell(beside_gbps(row), 1),
    ]


def _item(what: str, value: float | None, limit: float, above: bool = True) -> list[Any]:
    """An acceptance row: what, the value, the limit, whether the value keeps to it."""
    ok = value is not None and (value >= limit if above else value <= limit)
    shown = "-" if value is None else f"{value:.3f}"
    return [what, shown, f"{'>=' if above else '<='} {limit}", ok]


def _direction_items(
    rows: dict[tuple[str, str, str], Row],
    turns: dict[tuple[str, str, str], float],
    layout: str,
    direction: str,
    no_cap: float,
    capped: float,
) -> list[list[Any]]:
    def of(variant: str, base: str = "memcpy") -> float | None:
        return _ratio(rows.get((layout, direction, variant)), rows.get((layout, direction, base)))

    items = []
    for variant, what, limit in (
        ("auto", "one call (no cap)", no_cap),
        ("auto/cold", "first call on the tensors", no_cap),
        ("auto@16", "one call (<=16 SMs)", capped),
    ):
        items.append(_item(f"{layout} {direction} {variant}, {what} / memcpy", of(variant), limit))
        turn = turns.get((layout, direction, variant))
        items.append(_item(f"{layout} {direction} {variant}, {what} / memcpy, in turn", turn, limit))
    items.append(
        _item(f"{layout} {direction} auto x4 back to back / memcpy x4", of("auto x4", "memcpy x4"), no_cap)
    )
    for baseline in ("per_block_python", "per_block_cuda", "per_block_batch"):
        items.append(_item(f"{layout} {direction} auto / {baseline}", of("auto", baseline), PER_BLOCK_LIMIT))
    slowdown = median_slowdown(rows.get((layout, direction, "auto")))
    items.append(_item(f"{layout} {direction} slowdown at default", slowdown, SLOWDOWN_LIMIT, above=False))
    return items


def _both_ways_items(
    pairs: dict[tuple[str, str], Row], turns: dict[tuple[str, str, str], float], layout: str
) -> list[list[Any]]:
    memcpy = pairs.get((layout, "memcpy"))
    auto_pair, cold_pair = pairs.get((layout, "auto+auto")), pairs.get((layout, "auto/cold+auto/cold"))
    return [
        _item(f"{layout} both ways auto / memcpy", _ratio(auto_pair, memcpy), BOTH_WAYS_LIMIT),
        _item(f"{layout} both ways auto/cold / memcpy", _ratio(cold_pair, memcpy), BOTH_WAYS_LIMIT),
        _item(
            f"{layout} both ways auto / memcpy, in turn",
            turns.get((layout, "both", "auto+auto")),
            BOTH_WAYS_LIMIT,
        ),
        _item(
            f"{layout} both ways auto/cold / memcpy, in turn",
            turns.get((layout, "both", "auto/cold+auto/cold")),
            BOTH_WAYS_LIMIT,
        ),
        _item(
            f"{layout} both ways slowdown at default", median_slowdown(auto_pair), SLOWDOWN_LIMIT, above=False
        ),
    ]


def print_full(result: dict[str, Any], env: dict[str, Any], args: argparse.Namespace) -> None:
    table, pair_table, accept = summarize(result)
    print(
        f"\n{env['device']} ({env['sms']} SMs), {args.tokens} tokens, torch {env['torch']}, "
        f"triton {env['triton']}, cudart {env.get('cudart_version')}"
    )
    headers = ["layout", "dir", "variant", "GB/s", "x memcpy", "x per-block", "matmul x", "mean x"]
    print_table([*headers, "GB/s beside", "ok"], table)
    print()
    print_table(["layout", "both ways", "GB/s", "x memcpy", "matmul x", "mean x", "GB/s beside"], pair_table)
    print()
    print_table(["acceptance", "value", "limit", "holds"], accept)
