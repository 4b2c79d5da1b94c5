"""The control-plane benchmark's targets for parts 1 and 2, checked and printed.

- `targets(lookup, moved)`: a 512-key Lookup's p50 and p99 over the local channel, and how many
  times faster the shared-memory arena stores and loads than inline bytes; a part not run is
  neither passed nor failed.
- `report_targets(goals)`: the table.
"""

from __future__ import annotations

from typing import Any

from bench.common import print_table

TARGET_LOOKUP_P50_US = 200.0
TARGET_LOOKUP_P99_US = 1000.0
TARGET_SHM_SPEEDUP = 5.0


def targets(lookup: dict[str, Any] | None, moved: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    def check(value: float | None, target: float, at_most: bool) -> dict[str, Any]:
        passed = None if value is None else (value <= target if at_most else value >= target)
        return {"value": value, "target": target, "at_most": at_most, "pass": passed}

    rpc = lookup["rpc_512"] if lookup else None
    ratio = moved["shm_over_bytes"] if moved else None
    return {
        "lookup_512_p50_us": check(rpc["p50_us"] if rpc else None, TARGET_LOOKUP_P50_US, True),
        "lookup_512_p99_us": check(rpc["p99_us"] if rpc else None, TARGET_LOOKUP_P99_US, True),
        "store_shm_over_bytes": check(ratio["store"] if ratio else None, TARGET_SHM_SPEEDUP, False),
        "load_shm_over_bytes": check(ratio["load"] if ratio else None, TARGET_SHM_SPEEDUP, False),
    }


def report_targets(goals: dict[str, Any]) -> None:
    print("\nTargets")
    print_table(
        ["target", "value", "goal", "result"],
        [
            [
                name,
                "-" if g["value"] is None else g["value"],
                f"{'<=' if g['at_most'] else '>='} {g['target']}",
                "skipped" if g["pass"] is None else g["pass"],
            ]
            for name, g in goals.items()
        ],
    )
