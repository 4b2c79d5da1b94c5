"""The daemon's pauses for cyclic garbage collection with a large index, CPython's own collections
against the tended heap (`kvstore.server.heap`), each in a process of its own.

    python bench/gc_pauses.py --pages 1000000 --seconds 60
    python bench/gc_pauses.py --pages 20000 --seconds 5 --name gc-pauses-dry   # a quick run

Each way builds a real `Store` (lfuda) and commits `--pages` pages in 64-page chains into an arena
of that many pages (sparse: never written), as the daemon's index at that size; then, for
`--seconds`, it stores new chains back to back (each evicting the oldest pages, as a full arena
does) with a 64-key Lookup between two, at up to `--pages-per-s` pages a second. Every collection
is timed (`gc.callbacks`), and the tended way runs `Heap.turn()` every `--turn-s` as the daemon's
task does (its pause counted as one). The table: pauses in all, over 10 ms, the longest, their
total, and the pages stored; JSON in bench/results/.

    python bench/gc_pauses.py --way cpython|tended --pages N --seconds S ...   # one way (internal)
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_results  # noqa: E402

WAYS = ("cpython", "tended")


def one_way(way: str, pages: int, seconds: float, turn_s: float, rate: float) -> dict[str, Any]:
    from kvstore.ctl.replay import REPLAY_SPEC
    from kvstore.server.heap import Heap
    from kvstore.store.policy import make_policy
    from kvstore.store.store import Store
    from kvstore.store.store_settings import StoreSettings
    from kvstore.tiers.cpu import Arena, CpuTier

    pauses: list[float] = []
    by_generation: list[tuple[int, float, int]] = []  # (generation, ms, objects collected)
    started: list[float] = []

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append(time.perf_counter() - started.pop())
            by_generation.append((info["generation"], round(pauses[-1] * 1e3, 2), info["collected"]))

    with tempfile.TemporaryDirectory(prefix="kvstore-gc-") as tmp:
        size = pages * REPLAY_SPEC.page_bytes
        arena = Arena(Path(tmp) / "arena", size, prefault=False)
        try:
            store = Store(
                CpuTier(arena, size), make_policy("lfuda"), StoreSettings(60.0, 60.0), clock=lambda: 0.0
            )
            ns = store.connect(REPLAY_SPEC).id
            heap = Heap(turn_s if way == "tended" else 0.0, 0.0)
            heap.start()  # the daemon's start: what exists is frozen (both ways), the tended way's thresholds
            chain = 0

            def store_chain() -> None:
                nonlocal chain
                keys = [(64 * chain + i).to_bytes(16, "little") for i in range(64)]
                store.commit(ns, store.reserve(ns, keys).lease_id)
                chain += 1

            for _ in range(pages // 64):  # the index at its size, before the timing
                store_chain()
            built = chain
            if way == "tended":
                heap.turn()  # as the daemon's turns would have, while its index grew
            else:
                gc.collect()  # as CPython's own collections would have
            gc.callbacks.append(timed)
            turns: list[float] = []
            begin = time.perf_counter()
            next_turn = begin + turn_s
            while (now := time.perf_counter()) < begin + seconds:
                store_chain()
                old = max(0, chain - 1 - (chain * 7919) % max(1, pages // 64))
                store.lookup(ns, [(64 * old + i).to_bytes(16, "little") for i in range(64)])
                if way == "tended" and now >= next_turn:
                    turn_started = time.perf_counter()
                    heap.turn()
                    turns.append(time.perf_counter() - turn_started)
                    next_turn = now + turn_s
                if rate:
                    due = begin + (chain - built) * 64 / rate
                    while (left := due - time.perf_counter()) > 0:
                        time.sleep(min(0.001, left))
            gc.callbacks.remove(timed)
            heap.stop()
        finally:
            arena.close()
    # The tended way's own turns are collections too (their callbacks timed them): count each once.
    all_pauses = sorted(pauses)
    return {
        "way": way,
        "pages": pages,
        "seconds": seconds,
        "pages_stored": (chain - built) * 64,
        "pauses": len(all_pauses),
        "over_10ms": sum(p > 0.010 for p in all_pauses),
        "max_ms": all_pauses[-1] * 1e3 if all_pauses else 0.0,
        "total_ms": sum(all_pauses) * 1e3,
        "turns": len(turns) if way == "tended" else 0,
        "max_turn_ms": max(turns) * 1e3 if way == "tended" and turns else 0.0,
        "python": sys.version.split()[0],
        "slowest": sorted(by_generation, key=lambda g: -g[1])[:10],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument(
        "--turn-s", type=float, default=1.0, help="the tended way's turn (server.gc_freeze_s)"
    )
    parser.add_argument(
        "--pages-per-s", type=float, default=0.0, help="store at most this fast (0: flat out)"
    )
    parser.add_argument("--way", choices=WAYS, help="run one way in this process and print its JSON")
    parser.add_argument("--name", default="gc-pauses")
    args = parser.parse_args()
    if args.way:
        print(json.dumps(one_way(args.way, args.pages, args.seconds, args.turn_s, args.pages_per_s)))
        return
    runs = []
    for way in WAYS:
        command = [sys.executable, __file__, "--way", way, "--pages", str(args.pages)]
        command += ["--seconds", str(args.seconds), "--turn-s", str(args.turn_s)]
        command += ["--pages-per-s", str(args.pages_per_s)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(f"{way}: {runs[-1]}", flush=True)
    print(f"\nGC pauses at {args.pages:,} pages, {args.seconds:.0f} s of stores (Python {runs[0]['python']})")
    print_table(
        ["way", "pages stored", "pauses", "over 10 ms", "longest ms", "total ms"],
        [
            [
                r["way"],
                r["pages_stored"],
                r["pauses"],
                r["over_10ms"],
                round(r["max_ms"], 1),
                round(r["total_ms"], 1),
            ]
            for r in runs
        ],
    )
    write_results(
        args.name, {"pages": args.pages, "seconds": args.seconds, "turn_s": args.turn_s, "runs": runs}
    )


if __name__ == "__main__":
    main()
