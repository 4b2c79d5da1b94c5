"""Stats: the store's figures as a Stats message (`kvstore.wire.stats_to_dict` reads it back)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvstore.index import StoreStats, TierUsage
from kvstore.proto import kvstore_pb2 as pb


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
            extra = Counter(seen.extra or {})
            extra.update(tier.extra or {})
            tiers[tier.name] = TierUsage(
                tier.name,
                seen.bytes_used + tier.bytes_used,
                seen.bytes_capacity + tier.bytes_capacity,
                seen.pages + tier.pages,
                dict(extra),
            )
    counters: Counter[str] = Counter()
    for part in parts:
        counters.update(part.counters)
    return StoreStats(list(tiers.values()), [n for part in parts for n in part.namespaces], dict(counters))


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
                tenant=n.tenant,
            )
            for n in stats.namespaces
        ],
        counters=stats.counters,
        version=version,
        uptime_s=uptime_s,
    )
