"""`kvctl`: administer a running kvstored.

    kvctl [--address ADDR] [--token TOKEN] stats [--json]
    kvctl health
    kvctl ls [--json]
    kvctl clear [--namespace NS]

Tables for people, `--json` for scripts. The default address is the default
config's unix socket.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.config import default_socket_path
from kvstore.errors import KVStoreError, from_rpc_error
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.stats import stats_to_dict


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class Admin:
    def __init__(self, address: str, token: str | None, timeout_s: float) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout_s = timeout_s

    def call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self.stub, method)(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, method) from None

    def stats(self) -> dict[str, Any]:
        return stats_to_dict(self.call("Stats", pb.StatsRequest()))


def cmd_stats(admin: Admin, args: argparse.Namespace) -> int:
    stats = admin.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(f"kvstored {stats['version']}, up {stats['uptime_s']:.0f} s\n")
    print(
        table(
            ("tier", "used", "capacity", "use", "pages"),
            [
                (
                    name,
                    human_bytes(t["bytes_used"]),
                    human_bytes(t["bytes_capacity"]),
                    f"{100 * t['bytes_used'] / max(t['bytes_capacity'], 1):.1f}%",
                    t["pages"],
                )
                for name, t in stats["tiers"].items()
            ],
        )
    )
    counters = stats["counters"]
    looked_up = counters.get("hit_chunks", 0) + counters.get("missed_chunks", 0)
    rows = [(name, value) for name, value in counters.items()]
    rows.append(("chunk_hit_ratio", f"{counters.get('hit_chunks', 0) / looked_up:.3f}" if looked_up else "-"))
    print()
    print(table(("counter", "value"), rows))
    if stats["namespaces"]:
        print()
        print(_namespace_table(stats["namespaces"]))
    return 0


def _namespace_table(namespaces: list[dict[str, Any]]) -> str:
    return table(
        ("namespace", "model", "pages", "bytes", "page size"),
        [
            (n["namespace"], n["model"], n["pages"], human_bytes(n["bytes"]), human_bytes(n["page_bytes"]))
            for n in namespaces
        ],
    )


def cmd_ls(admin: Admin, args: argparse.Namespace) -> int:
    namespaces = admin.stats()["namespaces"]
    if args.json:
        print(json.dumps(namespaces, indent=2))
    elif namespaces:
        print(_namespace_table(namespaces))
    else:
        print("no namespaces")
    return 0


def cmd_clear(admin: Admin, args: argparse.Namespace) -> int:
    namespace = b""
    if args.namespace:
        try:
            namespace = bytes.fromhex(args.namespace)
        except ValueError:
            raise KVStoreError(
                f"--namespace: expected 32 hex digits as `kvctl ls` shows, got {args.namespace!r}"
            ) from None
    pages = admin.call("Clear", pb.ClearRequest(namespace=namespace)).pages
    print(f"cleared {pages} pages" + (f" of namespace {args.namespace}" if args.namespace else ""))
    return 0


def cmd_health(admin: Admin, args: argparse.Namespace) -> int:
    stub = health_pb2_grpc.HealthStub(admin.channel)
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=admin.timeout_s)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, "Health.Check") from None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvctl", description="Administer a running kvstored.")
    parser.add_argument(
        "--address", default=None, help=f"daemon address (default: unix://{default_socket_path()})"
    )
    parser.add_argument("--token", default=None, help="auth token, for a daemon reached over TCP")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer")
    commands = parser.add_subparsers(dest="command", required=True)
    stats = commands.add_parser("stats", help="tiers, counters and namespaces")
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(run=cmd_stats)
    commands.add_parser("health", help="SERVING or NOT_SERVING (exit 0 or 1)").set_defaults(run=cmd_health)
    ls = commands.add_parser("ls", help="namespaces with page counts and bytes")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(run=cmd_ls)
    clear = commands.add_parser("clear", help="drop every stored page (or one namespace's)")
    clear.add_argument("--namespace", help="namespace id in hex, as `kvctl ls` shows")
    clear.set_defaults(run=cmd_clear)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    admin = Admin(args.address or f"unix://{default_socket_path()}", args.token, args.timeout)
    try:
        code: int = args.run(admin, args)
        return code
    except KVStoreError as exc:
        print(f"kvctl: {exc}", file=sys.stderr)
        return 1
    finally:
        admin.channel.close()


if __name__ == "__main__":
    sys.exit(main())
