"""The daemon's own work per Lookup and its index size, one source tree at a time (issue #31, part 3).

    PYTHONPATH=<a tree's import names> python bench/control_plane_host.py CALLS INDEX_PAGES

Imports `kvstore` from whatever PYTHONPATH names (`lookup_storm.Tree` points it at one tree), so
`bench/control_plane.py --parts host --baseline TREE` times this tree and TREE alike, each in a
process of its own. TREE must be from the layer folders on (43aa469 or later): the probe imports
their module paths and builds the `Store` from `StoreSettings`. It builds a real `Store` (default
policy, `lfuda`), commits one chain of 512 keys, and prints one JSON line of p50s (µs) over CALLS
calls each:

- `policy_hit_512`: the policy's hit accounting for the 512 pages (`store.policy.hit`, what a
  leased Lookup counts as a use: `of_which_policy_hit` in `server_breakdown`);
- `leased_lookup_512`: `store.lookup(lease=True)` then `store.release`, the daemon's work for a
  load's Lookup; `plain_lookup_512`: a Lookup that is a query (no lease, not a use);
- `respond_lookup_64`: the local channel's whole answer to a 64-key Lookup frame
  (`LocalChannelServer.respond`: parse, handler, reply frame); `respond_query_64`: to the same
  question as a Query (`wire.QUERY`, no message), where the tree has it;
- `reserve_32`, `commit_8`, `leased_lookup_32`: a TP 4 rank's 8k-token prompt of Llama-3.1-8B's
  geometry (32 pages of 8 MiB) stored and loaded as the client does it: its Reserve (with the
  writer named), each of its four Commits of 8 pages, its leased Lookup + Release (a fresh
  prompt each time, in an arena with room for all of them: no eviction);

and, with INDEX_PAGES > 0, `index_bytes_per_page` at that many pages (`bench/policy.py`'s
`store_bytes_per_page`: a steady state of 64-page chains, as many evicted as held).
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def p50_us(call: Callable[[], object], calls: int) -> float:
    # The probe runs as a script: bench/, its folder, is the first entry of its path.
    from common_timing import median_us, time_calls

    time_calls(call, max(10, calls // 10))  # warm-up
    return float(median_us(call, calls))


def measure(calls: int) -> dict[str, float]:
    from kvstore.config.root import EvictionConfig
    from kvstore.ctl.replay import REPLAY_SPEC
    from kvstore.proto import kvstore_pb2 as pb
    from kvstore.server.handlers import Handlers
    from kvstore.server.local import LocalChannelServer
    from kvstore.shared import wire
    from kvstore.shared.keys import pack_keys
    from kvstore.shared.wire import METHOD_IDS
    from kvstore.store.policy import make_policy
    from kvstore.store.store import Store
    from kvstore.store.store_settings import StoreSettings
    from kvstore.tiers.cpu import Arena, CpuTier

    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmp:
        arena = Arena(Path(tmp) / "arena", 16 << 20, prefault=False)
        try:
            settings = StoreSettings(60.0, 600.0)
            store = Store(CpuTier(arena, 16 << 20), make_policy(EvictionConfig().policy), settings)
            ns = store.connect(REPLAY_SPEC).id
            keys = [index.to_bytes(16, "little") for index in range(512)]
            store.commit(ns, store.reserve(ns, keys).lease_id)
            hits = [store.namespaces[ns].entries[key] for key in keys]
            server = LocalChannelServer(
                Handlers({"": store}, REPLAY_SPEC.chunk_tokens, 4 << 20), Path(tmp) / "s"
            )
            frame_64 = pb.LookupRequest(namespace=ns, keys=pack_keys(keys[:64])).SerializeToString()
            lookup_id = METHOD_IDS["Lookup"]

            def leased() -> None:
                store.release(ns, store.lookup(ns, keys, lease=True).lease_id)

            figures = {
                "policy_hit_512": p50_us(lambda: store.policy.hit(hits), calls),
                "leased_lookup_512": p50_us(leased, calls),
                "plain_lookup_512": p50_us(lambda: store.lookup(ns, keys, touch=False), calls),
                "respond_lookup_64": p50_us(lambda: server.respond(lookup_id, frame_64, None), calls),
            }
            query = getattr(wire, "QUERY", None)  # a tree from before the Query has none
            if query is not None:
                query_64 = ns + pack_keys(keys[:64])
                figures["respond_query_64"] = p50_us(lambda: server.respond(query, query_64, None), calls)
            if store.lookup(ns, keys).hit_chunks != 512 or len(store.policy) != 512:
                raise RuntimeError("the 512 stored keys did not all stay stored and in the policy")
        finally:
            arena.close(unlink=True)
        figures |= prompt_calls(Path(tmp), calls)
    return figures


def prompt_calls(tmp: Path, calls: int) -> dict[str, float]:
    """p50 µs of a TP 4 rank's prompt's Reserve, Commit (of 8 pages) and leased Lookup + Release."""
    import os

    from kvstore.config.root import EvictionConfig
    from kvstore.shared.peers import Peer
    from kvstore.shared.spec_page import PageSpec
    from kvstore.store.policy import make_policy
    from kvstore.store.store import Store
    from kvstore.store.store_settings import StoreSettings
    from kvstore.tiers.cpu import Arena, CpuTier

    page = PageSpec(
        model="8b", num_layers=32, num_kv_heads=2, head_dim=128, dtype="bfloat16", chunk_tokens=256
    )
    prompts = min(calls, 400)
    size = (prompts * 32 * page.page_bytes // (256 << 20) + 1) * (256 << 20)  # sparse: never touched
    arena = Arena(tmp / "prompts", size, prefault=False)
    try:
        store = Store(CpuTier(arena, size), make_policy(EvictionConfig().policy), StoreSettings(60.0, 600.0))
        ns = store.connect(page).id
        writer = Peer(pid=os.getpid(), uid=os.getuid(), start_time=1, connected=True)
        times: dict[str, list[float]] = {"reserve_32": [], "commit_8": [], "leased_lookup_32": []}
        for prompt in range(prompts):
            keys = [(prompt * 32 + k).to_bytes(16, "little") for k in range(32)]
            begun = time.perf_counter()
            lease = store.reserve(ns, keys, None, writer).lease_id
            reserved = time.perf_counter()
            for _ in range(4):
                store.commit(ns, lease, 8)
            committed = time.perf_counter()
            store.release(ns, store.lookup(ns, keys, lease=True).lease_id)
            times["reserve_32"].append(reserved - begun)
            times["commit_8"].append((committed - reserved) / 4)
            times["leased_lookup_32"].append(time.perf_counter() - committed)
        if store.lookup(ns, keys).hit_chunks != 32:
            raise RuntimeError("the last prompt's 32 pages are not all stored")
    finally:
        arena.close(unlink=True)
    skip = prompts // 10  # warm-up
    return {name: statistics.median(ts[skip:]) * 1e6 for name, ts in times.items()}


def compare(this: Path, baseline: Path | None, rounds: int, calls: int, index_pages: int) -> dict[str, Any]:
    """Each tree's figures in `rounds` rounds of fresh processes, the trees taking turns; the
    index size once per tree (it does not scatter)."""
    from bench.lookup_storm import Tree

    trees = {"this": this} | ({"baseline": baseline} if baseline is not None else {})
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="kvstore-host-") as tmp:
        names = {name: Tree(tree, Path(tmp) / name) for name, tree in trees.items()}
        for round_ in range(rounds):
            order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
            for name in order:
                pages = index_pages if round_ == rounds - 1 else 0
                probe = names[name].run([str(calls), str(pages)], Path(tmp), Path(__file__).resolve())
                out, _ = probe.communicate(timeout=1800)
                if probe.returncode:
                    raise RuntimeError(f"the host probe of {trees[name]} failed")
                runs[name].append(json.loads(out))
                print(f"round {round_} {name}: {runs[name][-1]}", flush=True)
    medians = {
        name: {
            key: statistics.median(run[key] for run in tree_runs if key in run)
            for key in tree_runs[-1]
            if isinstance(tree_runs[-1][key], float)
        }
        for name, tree_runs in runs.items()
    }
    return {"trees": {name: str(path) for name, path in trees.items()}, "runs": runs, "medians": medians}


def main() -> None:
    calls, index_pages = int(sys.argv[1]), int(sys.argv[2])
    figures: dict[str, object] = {"python": platform.python_version(), **measure(calls)}
    if index_pages:
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, not the repository
        from policy import store_bytes_per_page

        started = time.perf_counter()
        figures["index_pages"] = index_pages
        figures["index_bytes_per_page"] = store_bytes_per_page("lfuda", index_pages)
        figures["index_s"] = time.perf_counter() - started
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
