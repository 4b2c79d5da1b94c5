"""What eviction adds to a Reserve: a TP 4 rank's prompt (32 pages of 8 MiB, Llama-3.1-8B's
geometry) reserved in the daemon's own store (`Store`, default policy), then committed in four
parts of 8 as the client does, `--prompts` prompts in a row, four ways:

- `room`: an arena with room for every prompt (nothing evicted);
- `own`: an arena of 100 prompts, so each Reserve evicts as many of its own older pages;
- `other`: an arena full of another geometry's 32 MiB pages (a TP 1 worker's), each prompt
  committed at once, evicted to make room (one frees room for four);
- `other-parts`: the same, each of those prompts committed in parts as the client commits
  them (10, 10, 11 and 1 pages).

A way the tree cannot run (its Reserve refused) reports the error.

p50 and max µs of the Reserve over the second half of the prompts, `--rounds` times in turns.
`--profile`: a cProfile of the `own` way instead. The arenas are sparse (never touched).

    python bench/reserve_evicting.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
# a child of `--against` imports the product (and what imports it) from the tree it times
sys.path.insert(0, sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv else str(HERE))

from bench.common import print_table, write_results  # noqa: E402

SLAB = 256 << 20


def reserve_times(way: str, prompts: int) -> dict[str, Any]:
    from kvstore.config.root import EvictionConfig
    from kvstore.shared.peers import Peer
    from kvstore.shared.spec_page import PageSpec
    from kvstore.store.policy import make_policy
    from kvstore.store.store import Store
    from kvstore.store.store_settings import StoreSettings
    from kvstore.tiers.cpu import Arena, CpuTier

    def geometry(heads: int) -> PageSpec:
        return PageSpec(
            model="8b", num_layers=32, num_kv_heads=heads, head_dim=128, dtype="bfloat16", chunk_tokens=256
        )

    rank, whole = geometry(2), geometry(8)
    held = 100 if way == "own" else prompts + 10
    size = (held * 32 * rank.page_bytes // SLAB + 1) * SLAB
    arena = Arena(Path(tempfile.mkdtemp(prefix="kvstore-bench-")) / "arena", size, prefault=False)
    try:
        store = Store(CpuTier(arena, SLAB), make_policy(EvictionConfig().policy), StoreSettings(60.0, 600.0))
        writer = Peer(pid=os.getpid(), uid=os.getuid(), start_time=1, connected=True)
        if way.startswith("other"):
            other = store.connect(whole).id
            parts = [10, 10, 11, 1] if way == "other-parts" else [32]
            for prompt in range(size // (32 * whole.page_bytes)):
                keys = [(10**6 + prompt * 32 + k).to_bytes(16, "little") for k in range(32)]
                lease = store.reserve(other, keys, None, writer).lease_id
                for part in parts:
                    store.commit(other, lease, part)
        ns = store.connect(rank).id
        times = []
        for prompt in range(prompts):
            keys = [(prompt * 32 + k).to_bytes(16, "little") for k in range(32)]
            begun = time.perf_counter()
            try:
                lease = store.reserve(ns, keys, None, writer).lease_id
            except Exception as exc:  # noqa: BLE001 - the figure is the refusal
                return {"error": f"prompt {prompt}: {type(exc).__name__}: {exc}"[:160]}
            times.append(time.perf_counter() - begun)
            for _ in range(4):
                store.commit(ns, lease, 8)
        if store.lookup(ns, keys).hit_chunks != 32:
            raise RuntimeError("the last prompt's 32 pages are not all stored")
        evicted = store.state.counters["evicted_chunks"]
    finally:
        arena.close(unlink=True)
    steady = times[len(times) // 2 :]
    return {"p50_us": statistics.median(steady) * 1e6, "max_us": max(steady) * 1e6, "evicted": evicted}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="a cProfile of the evicting way instead")
    parser.add_argument("--name", default="reserve_evicting")
    parser.add_argument("--against", help="a tree to time in turns with this one (each in its own process)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: one way, its figures as JSON
    parser.add_argument("--tree", help=argparse.SUPPRESS)  # the child's product tree
    args = parser.parse_args()
    if args.one:
        import kvstore

        print(json.dumps(reserve_times(args.one, args.prompts) | {"product": kvstore.__file__}))
        return
    if args.profile:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        reserve_times("own", args.prompts)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(22)
        return
    trees = {"this": HERE} | ({"against": Path(args.against).resolve()} if args.against else {})
    rows, runs = [], []
    for round_ in range(args.rounds):
        for way in ("room", "own", "other", "other-parts"):
            for tree, root in trees.items():
                result = {"round": round_, "way": way, "tree": tree, **_child(root, way, args.prompts)}
                runs.append(result)
                if "error" in result:
                    rows.append([round_, way, tree, result["error"][:60], "", ""])
                    continue
                p50, most = f"{result['p50_us']:.0f}", f"{result['max_us']:.0f}"
                rows.append([round_, way, tree, p50, most, result["evicted"]])
    print_table(["round", "way", "tree", "Reserve p50 µs", "max µs", "pages evicted"], rows)
    trees_run = {name: str(root) for name, root in trees.items()}
    print(f"wrote {write_results(args.name, {'prompts': args.prompts, 'trees': trees_run, 'runs': runs})}")


def _child(root: Path, way: str, prompts: int) -> dict[str, Any]:
    """`reserve_times` in a fresh process that imports the product from `root`."""
    child = [sys.executable, __file__, "--one", way, "--prompts", str(prompts), "--tree", str(root)]
    out = subprocess.run(child, check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout.splitlines()[-1]))


if __name__ == "__main__":
    main()
