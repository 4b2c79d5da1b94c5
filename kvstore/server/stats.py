"""Stats: the store's figures as a Stats message (`kvstore.shared.wire.stats_to_dict` reads it back),
several tenants' figures as one (`combined`), and the calls' latency (`RpcTimings`: bucket
counts per channel and method, which both transports feed and `kvstore.server.metrics` exports)."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.wire import METHOD_NAMES
from kvstore.store.index import StoreStats, TierUsage

RPC_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 0.01, 0.05, 0.25, 1.0, 10.0)
CHANNELS = ("local", "grpc")
STREAMING = ("Put", "Get")  # gRPC only
ARENA_PAGE_KEYS = ("arena_huge_pages", "arena_page_bytes")  # kvstore.shared.hugepages.ArenaPages.figures


def combined(parts: Sequence[StoreStats]) -> StoreStats:
    """Several tenants' stores as one: each tier's figures summed over them (a tier's capacity
    is then the sum of the tenants' shares), every namespace with its tenant, counters summed."""
    if len(parts) == 1:
        return parts[0]
    tiers: dict[str, TierUsage] = {}
    for part in parts:
        for tier in part.tiers:
            seen = tiers.get(tier.name)
            if seen is None:
                tiers[tier.name] = tier._replace(extra=dict(tier.extra or {}))
                continue
            if tier.name == "remote":  # one server, shared: its memory and keys are counted once
                tier = tier._replace(bytes_used=0, bytes_capacity=0, pages=0)
            extra = Counter(seen.extra or {})
            extra.update(tier.extra or {})
            tiers[tier.name] = TierUsage(
                tier.name,
                seen.bytes_used + tier.bytes_used,
                seen.bytes_capacity + tier.bytes_capacity,
                seen.pages + tier.pages,
                dict(extra),
                seen.nodes or tier.nodes,  # the remote servers, as the tenant that asked them saw them
            )
    counters: Counter[str] = Counter()
    for part in parts:
        counters.update(part.counters)
    for key in ARENA_PAGE_KEYS:  # one host's pages: every tenant's arena gets the same kind
        if key in counters:
            counters[key] = int(max(part.counters.get(key, 0) for part in parts))
    return StoreStats(list(tiers.values()), [n for part in parts for n in part.namespaces], dict(counters))


def stats_message(stats: StoreStats, version: str, uptime_s: float, event_epoch: int = 0) -> pb.StatsResponse:
    return pb.StatsResponse(
        tiers=[
            pb.TierStats(
                name=t.name,
                bytes_used=t.bytes_used,
                bytes_capacity=t.bytes_capacity,
                pages=t.pages,
                extra=t.extra or {},
                nodes=[pb.RemoteNode(**node._asdict()) for node in t.nodes],
            )
            for t in stats.tiers
        ],
        namespaces=[
            pb.NamespaceStats(
                namespace=n.namespace,
                model=n.model,
                pages=n.pages,
                stored_bytes=n.pages * n.page_bytes,
                page_bytes=n.page_bytes,
                tenant=n.tenant,
                contents=n.contents,
            )
            for n in stats.namespaces
        ],
        counters=stats.counters,
        version=version,
        uptime_s=uptime_s,
        event_epoch=event_epoch,
    )


class RpcTimings:
    """Latency histograms per (channel, method), as bucket counts kept on the event loop."""

    def __init__(self) -> None:
        self._series: dict[tuple[str, str], list[Any]] = {
            (channel, method): [[0] * (len(RPC_BUCKETS) + 1), 0.0]
            for channel in CHANNELS
            for method in (*METHOD_NAMES, *STREAMING)
            if channel == "grpc" or method not in STREAMING
        }

    def observe(self, channel: str, method: str, seconds: float) -> None:
        series = self._series.get((channel, method))
        if series is None:
            return
        series[0][bisect.bisect_left(RPC_BUCKETS, seconds)] += 1
        series[1] += seconds

    def copy(self) -> dict[tuple[str, str], tuple[list[int], float]]:
        return {key: (list(counts), total) for key, (counts, total) in self._series.items()}
