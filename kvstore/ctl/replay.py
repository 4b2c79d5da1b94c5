"""Replay a trace through the real store and eviction policy, in-process: no daemon, no GPU.

For each request: look up the longest stored prefix and count its blocks as hits
(per tier), then store the whole request (reserve + commit; no bytes are
written). Each block id is one page, keyed by `block_key(id)`; the ids are
already chained, so no key needs its predecessor (an id a request repeats is
stored once). Pages are 4 KiB
(`REPLAY_SPEC`) in a sparse arena file in a temporary directory.

`replay(trace, cpu_pages, policy)` -> `ReplayResult`; `bounds(trace, cpu_pages)`
-> the infinite-capacity and Belady ratios for the same capacity (`belady.py`);
`report(...)` -> both as plain data (`kvctl replay --json`).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import xxhash

from kvstore.config.root import DiskTierConfig
from kvstore.ctl.belady import belady_hits, infinite_hits
from kvstore.ctl.trace import Trace
from kvstore.shared.domain import Tier
from kvstore.shared.errors import ResourceExhausted
from kvstore.shared.spec import PageSpec
from kvstore.store.policy import make_policy
from kvstore.store.store import Store
from kvstore.store.store_settings import StoreSettings
from kvstore.tiers.cpu import Arena, CpuTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.records import HEADER_BYTES

REPLAY_SPEC = PageSpec(
    model="replay", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16", chunk_tokens=64
)  # 4 KiB pages
TIER_NAMES = {tier.value: tier.name.lower() for tier in Tier}


class ReplayResult(NamedTuple):
    policy: str
    cpu_pages: int
    requests: int
    blocks: int
    hit_blocks: int
    tier_hit_blocks: dict[str, int]
    unstored_requests: int  # requests whose pages could not all be stored (ResourceExhausted)
    elapsed_s: float

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / (self.blocks or 1)

    def tier_ratios(self) -> dict[str, float]:
        blocks = self.blocks or 1
        return {tier: hits / blocks for tier, hits in self.tier_hit_blocks.items()}


class Bounds(NamedTuple):
    cpu_pages: int
    infinite: float
    belady: float
    elapsed_s: float


def block_key(block_id: int) -> bytes:
    return xxhash.xxh3_128_digest(block_id.to_bytes(8, "little"))


def request_keys(trace: Trace) -> list[list[bytes]]:
    keys = {block: block_key(block) for request in trace.requests for block in request}
    return [[keys[block] for block in request] for request in trace.requests]


def replay(
    trace: Trace,
    cpu_pages: int,
    policy: str,
    progress: Callable[[int], None] | None = None,
    disk_pages: int = 0,
) -> ReplayResult:
    """Replays `trace` with a CPU tier of `cpu_pages` pages; calls `progress(requests done)` now and then.

    With `disk_pages`, a real disk tier of that many pages (in the temporary directory) sits behind
    the CPU tier: see `_replay`.
    """
    if cpu_pages <= 0:
        raise ValueError(f"cpu_pages: expected a positive number of pages, got {cpu_pages}")
    return asyncio.run(_replay(trace, cpu_pages, policy, disk_pages, progress))


async def _replay(
    trace: Trace, cpu_pages: int, policy: str, disk_pages: int, progress: Callable[[int], None] | None
) -> ReplayResult:
    """For each request: look up its prefix, then store the whole request.

    With a disk tier, evicted CPU pages are written behind to it and each request loads like a
    worker: a leased lookup (its disk hits are promoted into the CPU tier), Acquire (waits for
    them), Release. Hits count per tier as the lookup reports them. The tier's writes end before
    the next request, on one thread, so a replay gives the same hits every time.
    """
    every = max(1, len(trace.requests) // 200)
    with tempfile.TemporaryDirectory(prefix="kvstore-replay-") as run_dir:
        disk = _disk(Path(run_dir), disk_pages) if disk_pages else None
        store = replay_store(Path(run_dir), cpu_pages, policy, disk)
        try:
            started = time.perf_counter()
            ns = store.connect(REPLAY_SPEC).id
            hit_blocks, tier_hits, unstored = 0, Counter[int](), 0
            for done, keys in enumerate(request_keys(trace), 1):
                found = store.lookup(ns, keys, lease=disk is not None)
                hit_blocks += found.hit_chunks
                tier_hits.update(found.tiers)
                if found.lease_id:
                    await store.acquire(ns, found.lease_id)
                    store.release(ns, found.lease_id)
                try:
                    reserved = store.reserve(ns, list(dict.fromkeys(keys)))  # an id repeated: stored once
                except ResourceExhausted:
                    unstored += 1
                else:
                    if reserved.lease_id:
                        store.commit(ns, reserved.lease_id)
                if disk is not None:  # what the disk holds does not depend on its thread's speed
                    await asyncio.to_thread(disk.wait_written)
                if progress is not None and done % every == 0:
                    progress(done)
            elapsed = time.perf_counter() - started
        finally:
            if disk is not None:
                await asyncio.to_thread(disk.close)
            store.cpu.close()
    shown = {Tier.CPU.value, *tier_hits} | ({Tier.DISK.value} if disk_pages else set())
    tiers = {TIER_NAMES[tier]: tier_hits[tier] for tier in sorted(shown)}
    return ReplayResult(
        policy, cpu_pages, len(trace.requests), trace.num_blocks, hit_blocks, tiers, unstored, elapsed
    )


def _disk(run_dir: Path, disk_pages: int) -> DiskTier:
    record_bytes = REPLAY_SPEC.page_bytes + HEADER_BYTES
    config = DiskTierConfig(
        enabled=True,
        path=str(run_dir / "disk"),
        bytes=disk_pages * record_bytes,
        fsync="never",
        codec="none",
        queue_bytes=1 << 30,
        threads=1,  # records indexed in the order they are written behind
    )
    disk = DiskTier(config)
    disk.recover()
    return disk


def replay_store(run_dir: Path, cpu_pages: int, policy: str, disk: DiskTier | None = None) -> Store:
    size = cpu_pages * REPLAY_SPEC.page_bytes
    arena = Arena(run_dir / "arena", size, prefault=False)
    # A clock that never moves: no lease of the replay expires.
    return Store(
        CpuTier(arena, size),
        make_policy(policy, serving=False),
        StoreSettings(lease_ttl_s=60.0, max_lease_ttl_s=60.0),
        clock=lambda: 0.0,
        disk=disk,
    )


def bounds(trace: Trace, cpu_pages: int) -> Bounds:
    started = time.perf_counter()
    blocks = trace.num_blocks or 1
    infinite = infinite_hits(trace.requests) / blocks
    belady = belady_hits(trace.requests, cpu_pages) / blocks
    return Bounds(cpu_pages, infinite, belady, time.perf_counter() - started)


def report(trace: Trace, result: ReplayResult, limits: Bounds) -> dict[str, Any]:
    """One replay as plain data: what `kvctl replay --json` prints."""
    return {
        "trace": trace.path,
        "requests": result.requests,
        "blocks": result.blocks,
        "distinct_blocks": trace.num_distinct_blocks,
        "policy": result.policy,
        "cpu_pages": result.cpu_pages,
        "hit_ratio": result.hit_ratio,
        "hit_blocks": result.hit_blocks,
        "tiers": result.tier_ratios(),
        "tier_hit_blocks": result.tier_hit_blocks,
        "belady": limits.belady,
        "infinite": limits.infinite,
        "unstored_requests": result.unstored_requests,
        "replay_s": round(result.elapsed_s, 3),
        "bounds_s": round(limits.elapsed_s, 3),
    }
