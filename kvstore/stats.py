"""Stats: the store's figures as a Stats message, and that message as a plain dict.

The dict is what `KVStoreClient.stats()` returns and what `kvctl stats --json` prints:
`{"version", "uptime_s", "tiers": {name: {...}}, "namespaces": [{...}], "counters": {...}}`.
"""

from __future__ import annotations

from typing import Any

from kvstore.proto import kvstore_pb2 as pb
from kvstore.store import StoreStats


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


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def stats_to_dict(msg: pb.StatsResponse) -> dict[str, Any]:
    return {
        "version": msg.version,
        "uptime_s": round(msg.uptime_s, 3),
        "tiers": {
            t.name: {
                "bytes_used": t.bytes_used,
                "bytes_capacity": t.bytes_capacity,
                "pages": t.pages,
                **{k: _number(v) for k, v in sorted(t.extra.items())},
            }
            for t in msg.tiers
        },
        "namespaces": [
            {
                "namespace": n.namespace.hex(),
                "model": n.model,
                "pages": n.pages,
                "bytes": n.stored_bytes,
                "page_bytes": n.page_bytes,
            }
            for n in msg.namespaces
        ],
        "counters": {k: _number(v) for k, v in sorted(msg.counters.items())},
    }
