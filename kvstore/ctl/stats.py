"""`kvctl stats`, `ls` and `health`: how the daemon stands, as tables, JSON or a status.

- `show_stats(admin, args)`: `kvctl stats`, the tiers (and a remote tier's nodes), the counters
  (levels now apart from counts since start) and the namespaces.
- `show_namespaces(admin, args)`: `kvctl ls`.
- `check_health(admin, args)`: `kvctl health`, SERVING or NOT_SERVING (exit 0 or 1).
- `namespace_table(namespaces)`: one row per namespace.
- `LEVELS`: the counters that say how things stand now.

Loaded when one of these commands runs; it loads no store, replay or fleet.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from kvstore.ctl.cli import NO_LIMIT, arena_pages_line, capacity_and_use, human_bytes, printable, table

if TYPE_CHECKING:
    from kvstore.ctl.admin import Admin

# The Stats counters that say how things stand now, and go down as well as up. Every other one
# counts since the daemon started: `pinned_chunks` counts the chunks pinned, `pinned_pages` the
# pages pinned now (a Clear or an expiry unpins them).
LEVELS = frozenset(
    {
        "active_leases",
        "active_load_leases",
        "active_puts",
        "active_store_leases",
        "arena_huge_pages",
        "arena_page_bytes",
        "arena_reserved_bytes",
        "event_names",
        "event_streams",
        "namespaces",
        "pinned_bytes",
        "pinned_pages",
        "quarantined_bytes",
        "quarantined_pages",
        "remote_sending_bytes",
    }
)


def show_stats(admin: Admin, args: argparse.Namespace) -> int:
    stats = admin.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    head = f"kvstored {stats['version']}, up {stats['uptime_s']:.0f} s, events epoch {stats['event_epoch']}"
    print(printable(head) + "\n")
    _print_tiers(stats["tiers"])
    _print_counters(stats["counters"])
    if stats["namespaces"]:
        print()
        print(namespace_table(stats["namespaces"]))
    return 0


def _print_tiers(tiers: dict[str, dict[str, Any]]) -> None:
    """The tiers' fill, then each tier's own figures and a remote tier's nodes."""
    print(
        table(
            ("tier", "used", "capacity", "use", "pages"),
            [
                (name, human_bytes(t["bytes_used"]), *capacity_and_use(t), t["pages"])
                for name, t in tiers.items()
            ],
        )
    )
    for name, tier in tiers.items():
        detail = [
            (key, _figure(key, value))
            for key, value in tier.items()
            if key not in ("bytes_used", "bytes_capacity", "pages", "nodes")
        ]
        if detail:
            print()
            print(table((f"{name} tier", "value"), detail))
        if tier.get("nodes"):
            print()
            print(_nodes_table(name, tier["nodes"]))


def _print_counters(counters: dict[str, Any]) -> None:
    """The arena's pages, then the counters: levels now, and counts since start with the hit ratio."""
    if "arena_page_bytes" in counters:
        print("\n" + arena_pages_line(counters))
    looked_up = counters.get("hit_chunks", 0) + counters.get("missed_chunks", 0)
    since_start = [(name, value) for name, value in counters.items() if name not in LEVELS]
    since_start.append(
        ("chunk_hit_ratio", f"{counters.get('hit_chunks', 0) / looked_up:.3f}" if looked_up else "-")
    )
    print()
    print(table(("now", "value"), [(name, value) for name, value in counters.items() if name in LEVELS]))
    print()
    print(table(("since start", "count"), since_start))


def _nodes_table(tier: str, nodes: list[dict[str, Any]]) -> str:
    """The remote tier's servers: a cluster's nodes, with what each holds and this daemon's errors."""
    return table(
        (f"{tier} node", "role", "state", "used", "maxmemory", "keys", "errors"),
        [
            (
                node["address"],
                node["role"],
                "up" if node["up"] else "down",
                human_bytes(node["bytes_used"]),
                human_bytes(node["bytes_capacity"]) if node["bytes_capacity"] else NO_LIMIT,
                node["keys"],
                node["errors"],
            )
            for node in nodes
        ],
    )


def _figure(key: str, value: float) -> str:
    if key.endswith("bytes") or key.endswith("_bytes_used"):
        return human_bytes(value)
    return f"{value:.2f}" if isinstance(value, float) and not value.is_integer() else str(int(value))


def namespace_table(namespaces: list[dict[str, Any]]) -> str:
    """One row per namespace; a tenant column where the daemon has tenants, a contents column
    where a namespace holds a layer range or hidden states."""
    tenants = any("tenant" in n for n in namespaces)
    contents = any("contents" in n for n in namespaces)
    headers = (
        "namespace",
        *(("tenant",) if tenants else ()),
        "model",
        *(("holds",) if contents else ()),
        "pages",
        "bytes",
        "page size",
    )
    return table(
        headers,
        [
            (
                n["namespace"],
                *((n.get("tenant", ""),) if tenants else ()),
                n["model"],
                *((n.get("contents", "KV"),) if contents else ()),
                n["pages"],
                human_bytes(n["bytes"]),
                human_bytes(n["page_bytes"]),
            )
            for n in namespaces
        ],
    )


def show_namespaces(admin: Admin, args: argparse.Namespace) -> int:
    namespaces = admin.stats()["namespaces"]
    if args.json:
        print(json.dumps(namespaces, indent=2))
    elif namespaces:
        print(namespace_table(namespaces))
    else:
        print("no namespaces")
    return 0


def check_health(admin: Admin, args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.shared.errors import from_rpc_error

    stub = health_pb2_grpc.HealthStub(admin.channel)
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=admin.timeout_s)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, "Health.Check") from None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
