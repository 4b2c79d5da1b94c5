"""A store committed in parts, as the copy engines see it: one transfer marked at each part's end
(what the client does) against one transfer per part (what it did) and one unmarked transfer,
with a pinned memcpy of the same bytes in turn; no daemon.

Each way gathers a prompt's pages, prepared as a store prepares them (`kvstore_kernels.prepare`,
the caches registered), into a pinned buffer at the client's parts (`stores.StorePath`'s rule):
- `marked`: `Prepared.run(pages, offsets, marks)`, then every mark and the end synchronized;
- `parts`: one `Prepared.run` per part, an event after each, all synchronized;
- `whole`: one `Prepared.run`, no mark.

    python bench/store_parts.py [--rounds 15] [--name store-parts]

Prints each row's median ms and its ratio to the memcpy; writes bench/results/<name>.json.
Needs a GPU. The bytes of the last round of each way are compared with the whole transfer's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvstore_kernels  # noqa: E402
from bench.common import print_table, write_results  # noqa: E402
from bench.transfer_cases import PinnedBuffer, make_spec  # noqa: E402
from bench.transfer_model_cases import ModelCache, deepseek_v3_spec  # noqa: E402

PART_BYTES, TAIL_BYTES, MOST = 64 << 20, 24 << 20, 3  # the client's (`kvstore_client.stores`)


def cuts(pages: int, page_bytes: int) -> list[int]:
    """Where the client cuts a store of `pages` into parts (`StorePath._early_parts`)."""
    tail, part = max(1, -(-TAIL_BYTES // page_bytes)), max(1, PART_BYTES // page_bytes)
    if pages <= tail:
        return []
    head = pages - tail
    ends = list(range(part, head + 1, part))
    return ends if len(ends) <= MOST else [head * i // MOST for i in range(1, MOST + 1)]


def ways(prepared: Any, pages: int, offsets: list[int], marks: list[int]) -> dict[str, Callable[[], None]]:
    every = list(range(pages))

    def marked() -> None:
        for done in prepared.run(every, offsets, marks):
            done.synchronize()
        torch.cuda.synchronize()

    def parts() -> None:
        events = []
        for start, stop in zip([0, *marks], [*marks, pages], strict=True):
            prepared.run(every[start:stop], offsets[start:stop])
            event = torch.cuda.Event()
            event.record(prepared.stream or torch.cuda.current_stream())
            events.append(event)
        for event in events:
            event.synchronize()
        torch.cuda.synchronize()

    def whole() -> None:
        prepared.run(every, offsets)
        torch.cuda.synchronize()

    return {"marked": marked, "parts": parts, "whole": whole}


def row(name: str, spec: Any, tokens: int, rounds: int) -> list[dict[str, Any]]:
    cache = ModelCache(spec, tokens, seed=3)
    pages, page_bytes = cache.num_chunks, spec.page.page_bytes
    size = pages * page_bytes
    buffer, device = PinnedBuffer(size), torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    try:
        registered = kvstore_kernels.register(spec, cache.source)
        offsets = [i * page_bytes for i in range(pages)]
        prepared = kvstore_kernels.prepare(
            spec, registered, cache.table, range(pages), buffer.tensor, None, to_page=True,
            stream=torch.cuda.Stream(),
        )  # fmt: skip
        marks = cuts(pages, page_bytes)
        runs = ways(prepared, pages, offsets, marks)

        def memcpy() -> None:
            buffer.tensor.copy_(device, non_blocking=True)
            torch.cuda.synchronize()

        runs["memcpy"] = memcpy
        walls: dict[str, list[float]] = {way: [] for way in runs}
        for _ in range(rounds + 2):  # the first two are warm-up
            for way, call in runs.items():
                start = time.perf_counter()
                call()
                walls[way].append(time.perf_counter() - start)
        expected = None
        same = {}
        for way in ("whole", "marked", "parts"):
            buffer.tensor.fill_(0xA5)
            runs[way]()
            got = buffer.tensor.clone()
            expected = got if expected is None else expected
            same[way] = bool(torch.equal(got, expected))
    finally:
        buffer.unregister()
    memcpy_ms = statistics.median(walls["memcpy"][2:]) * 1e3
    return [
        {
            "model": name,
            "tokens": tokens,
            "MiB": size >> 20,
            "parts": len(marks) + 1,
            "way": way,
            "ms": round(statistics.median(walls[way][2:]) * 1e3, 3),
            "x_memcpy": round(memcpy_ms / (statistics.median(walls[way][2:]) * 1e3), 3),
            "bytes": "same" if same.get(way, True) else "DIFFER",
        }
        for way in ("whole", "marked", "parts", "memcpy")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--name", default="store-parts")
    args = parser.parse_args()
    cases = [
        ("llama-3.1-8b", make_spec("flash_attn"), 2048),
        ("llama-3.1-8b", make_spec("flash_attn"), 8192),
        ("deepseek-v3 bf16", deepseek_v3_spec("bfloat16"), 8192),
        ("deepseek-v3 fp8", deepseek_v3_spec("float8_e4m3fn"), 8192),
    ]
    rows = [r for name, spec, tokens in cases for r in row(name, spec, tokens, args.rounds)]
    columns = ["model", "tokens", "MiB", "parts", "way", "ms", "x_memcpy", "bytes"]
    print_table(columns, [[r[c] for c in columns] for r in rows])
    write_results(args.name, {"rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
