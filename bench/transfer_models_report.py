"""The transfer benchmark's model rows as they come and as tables.

- `print_progress(rows)`: a line a row, as each model's rows end.
- `print_models(result)`: the client rows (Llama-3.1-8B, DeepSeek-V3 MLA) with their steps, and
  the gpt-oss sliding-window rows with the window's share of bytes and time.
"""

from __future__ import annotations

from typing import Any

from bench.common import print_table


def print_progress(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        what = row.get("direction") or row.get("load")
        speed = f"{row['gbps']:7.2f} GB/s {row['x_memcpy']:.3f}x memcpy"
        print(f"{row['model']:12} {row['tokens']:6} {what:11} {speed}", flush=True)


def print_models(result: dict[str, Any]) -> None:
    mib = 1 << 20
    client_rows = result.get("llama", []) + result["mla"]
    if client_rows:
        print_table(
            ["model", "dtype", "tokens", "way", "MiB", "ms", "GB/s", "memcpy ms", "x memcpy", "ok"],
            [
                [r["model"], r["dtype"], r["tokens"], r["direction"], round(r["bytes"] / mib, 1),
                 round(r["ms"], 2), round(r["gbps"], 2), round(r["memcpy_ms"], 2), round(r["x_memcpy"], 3),
                 r["ok"]]
                for r in client_rows
            ],
        )  # fmt: skip
        print()
        for r in client_rows:  # where the client's time beyond the copy goes (median ms per step)
            if r.get("steps"):
                steps = ", ".join(f"{step['to']} {step['ms']:.3f}" for step in r["steps"])
                print(f"{r['model']} {r['dtype']} {r['tokens']} {r['direction']}: {steps}")
        print()
    if result["sliding"]:
        print_table(
            ["model", "tokens", "resumed request loads", "chunks full/sliding", "MiB", "ms", "GB/s",
             "memcpy ms", "x memcpy", "ok"],
            [
                [r["model"], r["tokens"], r["load"], f"{r['chunks']['full']}/{r['chunks']['sliding']}",
                 round(r["bytes"] / mib, 1), round(r["ms"], 2), round(r["gbps"], 2), round(r["memcpy_ms"], 2),
                 round(r["x_memcpy"], 3), r["ok"]]
                for r in result["sliding"]
            ],
        )  # fmt: skip
        rows = {(r["tokens"], r["load"]): r for r in result["sliding"]}
        for tokens in sorted({r["tokens"] for r in result["sliding"]}):
            window, every = rows.get((tokens, "window")), rows.get((tokens, "every token"))
            if window and every:
                print(
                    f"{tokens} tokens: the window moves {window['bytes'] / every['bytes']:.3f}x the bytes "
                    f"in {window['ms'] / every['ms']:.3f}x the time of every token"
                )
