"""Stats: the store's figures as a Stats message (`kvstore.wire.stats_to_dict` reads it back)."""

from __future__ import annotations

from kvstore.index import StoreStats
from kvstore.proto import kvstore_pb2 as pb


def stats_message(stats: StoreStats, version: str, uptime_s: float) -> pb.StatsResponse:
    return pb.StatsResponse(
        tiers=[
            pb.TierStats(
                name=t.name,
                bytes_used=t.bytes_used,
                bytes_capacity=t.bytes_capacity,
                pages=t.pages,
                extra=t.extra or {},
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
            )
            for n in stats.namespaces
        ],
        counters=stats.counters,
        version=version,
        uptime_s=uptime_s,
    )
