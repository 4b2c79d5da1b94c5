"""Eviction-policy benchmark: prefix-hit ratios on a trace, policy operations per second, bytes per page.

1. Hit ratios: every registered policy replayed through the real store (`kvstore.ctl.replay`) on a
   Mooncake-format trace at 1000..20000 CPU pages, beside Belady's optimum and the infinite bound,
   with the replay's time (lookup + reserve + commit of every request).
2. Operations per second on the policy object holding `--pages` pages, one page per call, in a
   mix of 50% lookups (`hit`), 25% touches (`stored` of a held page) and 25% evictions (take the
   first candidate, `evicted`, then `stored` of a new page in its place); the harness's own loop
   is included.
3. Index bytes per page at `--pages` pages, in a steady state (as many pages evicted as held):
   the policy's own structures (ghost keys included), and the whole store index (entries, keys,
   namespace table, slot allocator, policy) of a real `Store`.

    python bench/policy.py            # the conversation trace, 1M pages
    python bench/policy.py --quick    # CI-sized: the trace's first 2000 requests, 100k pages
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

from bench.common import print_table, write_results  # noqa: E402
from kvstore.ctl.replay import REPLAY_SPEC, bounds, replay  # noqa: E402
from kvstore.ctl.trace import Trace, load_trace  # noqa: E402
from kvstore.store.policy import POLICIES, EvictionPolicy, make_policy  # noqa: E402
from kvstore.store.store import Store  # noqa: E402
from kvstore.store.store_settings import StoreSettings  # noqa: E402
from kvstore.tiers.cpu import Arena, CpuTier  # noqa: E402

TRACE = "/work/shared/traces/conversation_trace.jsonl"
CAPACITIES = (1000, 2000, 5000, 10000, 20000)
REFERENCE_LRU = {1000: 4.45, 2000: 5.37, 5000: 11.04, 10000: 21.12, 20000: 28.75}
OPS_TARGET = 200_000
BYTES_TARGET = 256


class FakePage:
    """A held page as the store hands it to a policy: an identity and a 16-byte key."""

    __slots__ = ("key", "index", "place")  # place: where an LFUDA policy keeps it in its order

    def __init__(self, number: int, index: int) -> None:
        self.key = number.to_bytes(16, "little")
        self.index = index  # its place in the harness's list
        self.place = None  # an LFUDA policy's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 2000-request trace prefix, 100k pages")
    parser.add_argument("--trace", default=TRACE, help="Mooncake-format trace (JSONL with hash_ids)")
    parser.add_argument("--pages", type=int, help="pages for the ops and memory parts (full: 1M)")
    parser.add_argument("--ops", type=int, help="timed policy operations per policy (full: 2M)")
    parser.add_argument("--policies", nargs="+", choices=sorted(POLICIES), default=sorted(POLICIES))
    parser.add_argument("--name", help="results name (default: policy, or policy-quick)")
    args = parser.parse_args(argv)
    args.pages = args.pages or (100_000 if args.quick else 1_000_000)
    args.ops = args.ops or (200_000 if args.quick else 2_000_000)
    args.name = args.name or ("policy-quick" if args.quick else "policy")
    return args


# -- 1. hit ratios --------------------------------------------------------------------------------


def bench_hit_ratios(trace: Trace, policies: list[str]) -> dict[str, Any]:
    table: dict[str, dict[int, float]] = {}
    replay_s: dict[str, dict[int, float]] = {}
    for policy in policies:
        results = [replay(trace, pages, policy) for pages in CAPACITIES]
        table[policy] = {r.cpu_pages: 100 * r.hit_ratio for r in results}
        replay_s[policy] = {r.cpu_pages: r.elapsed_s for r in results}
    limits = [bounds(trace, pages) for pages in CAPACITIES]
    table["belady"] = {b.cpu_pages: 100 * b.belady for b in limits}
    table["infinite"] = {b.cpu_pages: 100 * b.infinite for b in limits}
    rows = [[name] + [round(ratios[pages], 2) for pages in CAPACITIES] for name, ratios in table.items()]
    rows.insert(0, ["reference lru"] + [REFERENCE_LRU[pages] for pages in CAPACITIES])
    print(f"\nprefix-hit % on {trace.path} ({len(trace.requests)} requests, {trace.num_blocks} blocks)")
    print_table(["policy"] + [f"{pages} pages" for pages in CAPACITIES], rows)
    slowest = max(s for per_policy in replay_s.values() for s in per_policy.values())
    print(
        f"slowest replay: {slowest:.2f} s; bounds {sum(b.elapsed_s for b in limits):.2f} s for all capacities"
    )
    return {
        "trace": trace.path,
        "requests": len(trace.requests),
        "blocks": trace.num_blocks,
        "capacities": list(CAPACITIES),
        "hit_pct": table,
        "reference_lru_pct": REFERENCE_LRU,
        "replay_s": replay_s,
        "blocks_per_s": {p: trace.num_blocks / max(s.values()) for p, s in replay_s.items()},
    }


# -- 2. operations per second ---------------------------------------------------------------------


def filled_policy(name: str, pages: int) -> tuple[EvictionPolicy, list[FakePage]]:
    policy = make_policy(name, serving=False)
    held = [FakePage(i, i) for i in range(pages)]
    for page in held:
        policy.stored((page,))
    for page in held[::2]:  # half of them read again
        policy.hit((page,))
    return policy, held


def run_mix(policy: EvictionPolicy, held: list[FakePage], ops: int, seed: int) -> float:
    """Runs the 50/25/25 mix of hits, touches and evictions; returns the seconds it took."""
    rng = random.Random(seed)
    plan = [(rng.random(), rng.randrange(len(held))) for _ in range(ops)]
    number = len(held) + seed * ops  # new pages get fresh keys
    started = time.perf_counter()
    for draw, index in plan:
        if draw < 0.5:
            policy.hit((held[index],))
        elif draw < 0.75:
            policy.stored((held[index],))
        else:
            victim: Any = next(policy.candidates())
            policy.evicted(victim)
            page = held[victim.index] = FakePage(number, victim.index)
            policy.stored((page,))
            number += 1
    return time.perf_counter() - started


def ops_per_second(name: str, pages: int, ops: int) -> float:
    policy, held = filled_policy(name, pages)
    return ops / run_mix(policy, held, ops, seed=1)


# -- 3. index bytes per page ----------------------------------------------------------------------


def traced_bytes(build: Callable[[], object]) -> int:
    """Bytes still allocated by `build` while its result is alive."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        kept = build()
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
        del kept
    finally:
        tracemalloc.stop()
    return used


def policy_bytes_per_page(name: str, pages: int) -> float:
    def pages_alone() -> object:
        return [FakePage(i, i) for i in range(pages)]

    def pages_in_policy() -> object:
        policy, held = filled_policy(name, pages)
        run_mix(policy, held, 2 * pages, seed=2)  # half the pages evicted and replaced
        return policy, held

    return (traced_bytes(pages_in_policy) - traced_bytes(pages_alone)) / pages


def store_bytes_per_page(name: str, pages: int) -> float:
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as run_dir:
        size = pages * REPLAY_SPEC.page_bytes
        arena = Arena(Path(run_dir) / "arena", size, prefault=False)  # sparse: never written
        try:

            def filled_store() -> object:
                policy, settings = make_policy(name, serving=False), StoreSettings(60.0, 60.0)
                store = Store(CpuTier(arena, size), policy, settings, clock=lambda: 0.0)
                ns = store.connect(REPLAY_SPEC).id
                rng = random.Random(3)
                chains = 2 * pages // 64  # 64-page chains, each followed by a lookup of an earlier one
                for chain in range(chains):
                    keys = [(64 * chain + i).to_bytes(16, "little") for i in range(64)]
                    store.commit(ns, store.reserve(ns, keys).lease_id)
                    old = max(0, chain - rng.randrange(1, max(2, pages // 64)))
                    store.lookup(ns, [(64 * old + i).to_bytes(16, "little") for i in range(64)])
                return store

            return traced_bytes(filled_store) / pages
        finally:
            arena.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trace = load_trace(args.trace)
    if args.quick:
        trace = Trace(trace.path + " (first 2000 requests)", trace.requests[:2000])
    ratios = bench_hit_ratios(trace, args.policies)

    rows, perf = [], {}
    for name in args.policies:
        rate = ops_per_second(name, args.pages, args.ops)
        own = policy_bytes_per_page(name, args.pages)
        whole = store_bytes_per_page(name, args.pages)
        perf[name] = {"ops_per_s": rate, "policy_bytes_per_page": own, "store_index_bytes_per_page": whole}
        rows.append([name, round(rate), rate >= OPS_TARGET, round(own), own <= BYTES_TARGET, round(whole)])
    print(f"\npolicy operations and index size at {args.pages} pages (one page per call)")
    print_table(
        [
            "policy",
            "ops/s",
            f">= {OPS_TARGET // 1000}k",
            "policy B/page",
            f"<= {BYTES_TARGET}",
            "store index B/page",
        ],
        rows,
    )
    path = write_results(
        args.name, {"pages": args.pages, "ops": args.ops, "hit_ratios": ratios, "policies": perf}
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
