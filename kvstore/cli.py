"""`kvctl`: administer a running kvstored, and replay traces without one.

    kvctl [--address ADDR] [--token-file FILE] stats [--json]
    kvctl health
    kvctl ls [--json]
    kvctl clear [--namespace NS]
    kvctl pin NS (--tokens FILE | --keys HEX,...) --ttl SECONDS [--json]
    kvctl top [--interval S] [--once]                               (a live view)
    kvctl events [--json] [--namespace NS] [--since N --epoch E | --from-now] [--count N]
    kvctl replay TRACE --cpu-pages N [--policy NAME] [--json]     (in-process, no daemon)
    kvctl replay TRACE --cpu-pages N --hosts H --remote-pages R [--assign round-robin|random|affinity]
    kvctl --version

Tables for people, `--json` for scripts. The default address is the default
config's unix socket. Names come from clients: tables and event lines show their control
characters escaped (`printable`), and JSON is ASCII with `\\u` escapes.

Each command imports what it needs when it runs: a kvctl call is a fresh process, often a
script's or a probe's, so `kvctl --version` loads neither gRPC nor numpy nor the store, and
`kvctl stats` loads no store, replay or fleet (`bench/kvctl_startup.py` times them).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore import __version__
from kvstore.paths import default_socket_path, default_token, local_socket_of, read_token

if TYPE_CHECKING:
    import grpc

    from kvstore.channel import LocalChannel
    from kvstore.errors import KVStoreError
    from kvstore.trace import Trace


NO_LIMIT = "no limit"
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


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def printable(text: str) -> str:
    """`text` with every character a terminal would act on (C0 and C1 controls, DEL, bidi
    controls, line separators) written as its Python escape (`\\x1b`, `\\r`, `\\u202e`): names
    come from clients, and what kvctl prints reaches an admin's terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(map(str, headers))] + [[printable(str(c)) for c in row] for row in rows]
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
    """The daemon, as kvctl calls it: over its local channel where the address is a unix socket
    and no token is given (the daemon knows the caller by its uid there: root and `admins` may do
    what spans tenants), else gRPC with the token. The gRPC channel is opened on first use."""

    def __init__(
        self, address: str, token: str | None, timeout_s: float, tls: grpc.ChannelCredentials | None = None
    ) -> None:
        self.address, self.tls = address, tls
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self.local: LocalChannel | None = None
        path = local_socket_of(address)
        if path and not token:
            from kvstore.channel import LocalChannel

            try:
                self.local = LocalChannel(path, timeout_s)
            except OSError:
                self.local = None  # no local channel there: gRPC

    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            import grpc

            if self.tls is not None and not self.address.startswith("unix:"):
                self._channel = grpc.secure_channel(self.address, self.tls)
            else:
                self._channel = grpc.insecure_channel(self.address)
        return self._channel

    @property
    def stub(self) -> Any:
        if self._stub is None:
            from kvstore.proto import kvstore_pb2_grpc as pb_grpc

            self._stub = pb_grpc.KVStoreStub(self.channel)
        return self._stub

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
        if self._channel is not None:
            self._channel.close()

    def call(self, method: str, request: Any) -> Any:
        from kvstore.channel import Refused
        from kvstore.errors import KVStoreError, ResourceExhausted, from_rpc_error

        refusal: KVStoreError | None = None
        if self.local is not None:
            first_reply = not self.local.answered
            try:
                return self.local.call(method, request)
            except (Refused, ResourceExhausted) as exc:
                # Refused at the daemon's caps (closed at once, or told so): gRPC, where a daemon
                # without tenants serves anyone who can reach its socket.
                if not (isinstance(exc, Refused) or (first_reply and _told_channel_full(exc))):
                    raise
                self.local.close()
                self.local, refusal = None, exc
        import grpc  # gRPC only here: a call the local channel answers never loads it

        try:
            return getattr(self.stub, method)(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            error = from_rpc_error(exc, method)
            if refusal is not None:
                raise KVStoreError(
                    f"{refusal}; over gRPC instead: {error}. Try again once fewer clients are connected, "
                    f"or run kvctl as root or an admin (admins.uids), who get connections past the caps"
                ) from None
            raise error from None

    def stats(self) -> dict[str, Any]:
        from kvstore.proto import kvstore_pb2 as pb
        from kvstore.wire import stats_to_dict

        return stats_to_dict(self.call("Stats", pb.StatsRequest()))


def _told_channel_full(exc: Exception) -> bool:
    from kvstore.local import LOCAL_CHANNEL_FULL  # the daemon's server module: only on this rare path

    return LOCAL_CHANNEL_FULL in str(exc)


def arena_pages_line(counters: dict[str, Any]) -> str:
    """Which pages the CPU tier's arena got (`kvstore.hugepages.ArenaPages`)."""
    from kvstore.hugepages import KINDS, ArenaPages

    kind = KINDS[int(counters.get("arena_huge_pages", 0))]
    return f"arena pages: {ArenaPages(kind, int(counters['arena_page_bytes'])).describe()}"


def cmd_stats(admin: Admin, args: argparse.Namespace) -> int:
    stats = admin.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    head = f"kvstored {stats['version']}, up {stats['uptime_s']:.0f} s, events epoch {stats['event_epoch']}"
    print(printable(head) + "\n")
    print(
        table(
            ("tier", "used", "capacity", "use", "pages"),
            [
                (name, human_bytes(t["bytes_used"]), *capacity_and_use(t), t["pages"])
                for name, t in stats["tiers"].items()
            ],
        )
    )
    for name, tier in stats["tiers"].items():
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
    counters = stats["counters"]
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
    if stats["namespaces"]:
        print()
        print(_namespace_table(stats["namespaces"]))
    return 0


def capacity_and_use(tier: dict[str, Any]) -> tuple[str, str]:
    """A tier's capacity and the share of it in use, as cells. A capacity of 0 is a remote
    server without `maxmemory`: no limit, and no share of one."""
    capacity = tier["bytes_capacity"]
    if not capacity:
        return NO_LIMIT, "-"
    return human_bytes(capacity), f"{100 * tier['bytes_used'] / capacity:.1f}%"


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


def _namespace_table(namespaces: list[dict[str, Any]]) -> str:
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


def cmd_ls(admin: Admin, args: argparse.Namespace) -> int:
    namespaces = admin.stats()["namespaces"]
    if args.json:
        print(json.dumps(namespaces, indent=2))
    elif namespaces:
        print(_namespace_table(namespaces))
    else:
        print("no namespaces")
    return 0


def _hex_bytes(text: str, what: str) -> bytes:
    from kvstore.errors import KVStoreError
    from kvstore.keys import KEY_BYTES

    try:
        value = bytes.fromhex(text)
    except ValueError:
        value = b""
    if len(value) != KEY_BYTES:
        raise KVStoreError(f"{what}: expected {2 * KEY_BYTES} hex digits as `kvctl ls` shows, got {text!r}")
    return value


def cmd_clear(admin: Admin, args: argparse.Namespace) -> int:
    from kvstore.proto import kvstore_pb2 as pb

    namespace = _hex_bytes(args.namespace, "--namespace") if args.namespace else b""
    pages = admin.call("Clear", pb.ClearRequest(namespace=namespace)).pages
    print(f"cleared {pages} pages" + (f" of namespace {args.namespace}" if args.namespace else ""))
    return 0


def cmd_health(admin: Admin, args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore.errors import from_rpc_error

    stub = health_pb2_grpc.HealthStub(admin.channel)
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=admin.timeout_s)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, "Health.Check") from None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _tokens(path: str) -> list[int]:
    """Token ids from a file ("-": stdin): a JSON list, or integers separated by spaces or commas."""
    from kvstore.errors import KVStoreError

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise KVStoreError(f"--tokens: cannot read {path}: {err.strerror}") from None
    try:
        tokens = json.loads(text) if text.lstrip().startswith("[") else text.replace(",", " ").split()
        return [int(token) for token in tokens]
    except (ValueError, TypeError):
        raise KVStoreError(f"--tokens: expected token ids in {path}, as a JSON list or integers") from None


def cmd_pin(admin: Admin, args: argparse.Namespace) -> int:
    from kvstore.errors import KVStoreError
    from kvstore.keys import pack_keys
    from kvstore.proto import kvstore_pb2 as pb

    if (args.tokens is None) == (args.keys is None):
        raise KVStoreError("pin: give the chain as --tokens FILE or as --keys HEX,..., not both")
    request = pb.PinRequest(namespace=_hex_bytes(args.namespace, "namespace"), ttl_ms=round(args.ttl * 1000))
    if args.tokens is not None:
        request.tokens.extend(_tokens(args.tokens))
    else:
        request.keys = pack_keys([_hex_bytes(key, "--keys") for key in args.keys.split(",")])
    reply = admin.call("Pin", request)
    if not reply.pinned_chunks:  # nothing to keep: say so, and fail, so that a script notices
        print(
            f"kvctl: pin: no chunk of the chain is stored in namespace {args.namespace} (its first chunk "
            f"is not there: check the namespace with `kvctl ls`, and that the tokens or keys are the "
            f"prompt's, from its start)",
            file=sys.stderr,
        )
    if args.json:
        print(
            json.dumps(
                {
                    "pinned_chunks": reply.pinned_chunks,
                    "ttl_s": args.ttl,
                    "pinned_pages": reply.pinned_pages,
                    "pinned_bytes": reply.pinned_bytes,
                }
            )
        )
    else:
        print(
            f"pinned {reply.pinned_chunks} chunks for {args.ttl:g} s; the tier holds "
            f"{reply.pinned_pages} pinned pages ({human_bytes(reply.pinned_bytes)})"
        )
    return 0 if reply.pinned_chunks else 1


def cmd_events(admin: Admin, args: argparse.Namespace) -> int:
    """Follows the daemon's KV events (every page entering or leaving a tier), one line each."""
    import grpc

    from kvstore.errors import from_rpc_error
    from kvstore.proto import kvstore_pb2 as pb

    request = pb.EventsRequest(
        since=args.since,
        epoch=args.epoch,
        namespace=_hex_bytes(args.namespace, "namespace") if args.namespace else b"",
        from_now=args.from_now,
    )
    shown = 0
    try:
        for batch in admin.stub.Events(request, metadata=admin.metadata):
            for event in batch.events:
                print(_event_line(event, args.json), flush=True)
                shown += 1
                if args.count and shown >= args.count:
                    return 0
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, "Events") from None
    except KeyboardInterrupt:
        pass
    return 0


def _event_line(event: Any, as_json: bool) -> str:
    from kvstore.proto import kvstore_pb2 as pb

    fields = {
        "sequence": event.sequence,
        "kind": pb.KVEvent.Kind.Name(event.kind).lower(),
        "tier": pb.Tier.Name(event.tier).removeprefix("TIER_").lower(),
        "namespace": event.namespace.hex(),
        "tenant": event.tenant,
        "model": event.model,
        "key": event.key.hex(),
        "parent": event.parent.hex(),
        "reason": event.reason,
        "epoch": event.epoch,
    }
    if as_json:
        return json.dumps(fields)  # ASCII only: control characters come out as \\u escapes
    owner = f"{fields['tenant']}/{fields['model']}" if fields["tenant"] else fields["model"]
    return printable(
        f"{fields['sequence']:>10} {fields['kind']:<7} {fields['tier']:<6} {fields['namespace'][:12]} "
        f"{owner} {fields['key']} {fields['reason']}"
    )


def cmd_top(admin: Admin, args: argparse.Namespace) -> int:
    from kvstore import top  # rich, only for this command

    return top.run(admin.stats, args.interval, args.once)


class ProgressBar:
    """`label [#####.....] done/total` on stderr, redrawn in place; nothing unless stderr is a terminal."""

    def __init__(self, label: str, total: int, width: int = 40) -> None:
        self.label, self.total, self.width = label, total, width
        self.shown = sys.stderr.isatty()

    def __call__(self, done: int) -> None:
        if self.shown:
            filled = self.width * done // max(self.total, 1)
            bar = "#" * filled + "." * (self.width - filled)
            sys.stderr.write(f"\r{self.label} [{bar}] {done}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def cmd_replay(args: argparse.Namespace) -> int:
    from kvstore.config import EvictionConfig
    from kvstore.replay import bounds, replay, report
    from kvstore.trace import load_trace

    args.policy = args.policy or EvictionConfig().policy
    trace = load_trace(args.trace)
    if args.hosts is not None or args.remote_pages is not None:
        return _replay_fleet(trace, args)
    progress = ProgressBar(f"replay {args.policy}", len(trace.requests))
    try:
        result = replay(trace, args.cpu_pages, args.policy, progress, disk_pages=args.disk_pages or 0)
    finally:
        progress.close()
    data = report(trace, result, bounds(trace, args.cpu_pages))
    if args.json:
        print(json.dumps(data))
        return 0
    print(
        f"{trace.path}: {data['requests']} requests, {data['blocks']} blocks ({data['distinct_blocks']} "
        f"distinct); policy {args.policy}, CPU tier of {args.cpu_pages} pages"
        + (f", disk tier of {args.disk_pages} pages" if args.disk_pages else "")
        + "\n"
    )
    rows = [
        (tier, data["tier_hit_blocks"][tier], f"{100 * ratio:.2f}%") for tier, ratio in data["tiers"].items()
    ]
    rows.append(("total", data["hit_blocks"], f"{100 * data['hit_ratio']:.2f}%"))
    print(table(("tier", "hit blocks", "prefix hits"), rows))
    print()
    print(
        table(
            (f"bound at {args.cpu_pages} pages", "prefix hits"),
            [("belady", f"{100 * data['belady']:.2f}%"), ("infinite", f"{100 * data['infinite']:.2f}%")],
        )
    )
    unstored = (
        f", {data['unstored_requests']} requests not stored (no room)" if data["unstored_requests"] else ""
    )
    print(f"\nreplay {data['replay_s']:.1f} s, bounds {data['bounds_s']:.1f} s{unstored}")
    return 0


def _replay_fleet(trace: Trace, args: argparse.Namespace) -> int:
    """`kvctl replay --hosts N --remote-pages R`: the fleet simulation (`kvstore.fleet`)."""
    from kvstore.errors import KVStoreError
    from kvstore.fleet import fleet_replay

    if args.disk_pages:
        raise KVStoreError("--disk-pages: the fleet simulation has no disk tiers; leave it out with --hosts")
    hosts, remote = args.hosts or 1, args.remote_pages or 0
    progress = ProgressBar(f"fleet of {hosts}", len(trace.requests))
    try:
        result = fleet_replay(trace, hosts, args.cpu_pages, remote, args.assign, args.policy, progress)
    finally:
        progress.close()
    data = {"trace": trace.path, "requests": len(trace.requests), "policy": args.policy, **result.as_dict()}
    if args.json:
        print(json.dumps(data))
        return 0
    print(
        f"{trace.path}: {data['requests']} requests, {result.blocks} blocks over {hosts} hosts "
        f"({args.assign}), each a CPU tier of {args.cpu_pages} pages, sharing a remote tier of "
        f"{remote} pages; policy {args.policy}\n"
    )
    ratios = result.host_ratios()
    shown = range(hosts) if hosts <= 8 else (ratios.index(min(ratios)), ratios.index(max(ratios)))
    rows = [(f"host {h}", result.host_blocks[h], f"{100 * ratios[h]:.2f}%") for h in shown]
    rows.append(("fleet", result.blocks, f"{100 * result.hit_ratio:.2f}%"))
    print(table(("host", "blocks", "prefix hits"), rows))
    print(
        f"\nthe shared tier served {100 * result.remote_ratio:.2f}% of the blocks "
        f"({100 * result.remote_ratio / (result.hit_ratio or 1):.1f}% of the hits); "
        f"replay {result.elapsed_s:.1f} s"
    )
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or a positive number of pages, got {text}")
    return value


def _tls(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS credentials from --tls-ca/--tls-cert/--tls-key or $KVSTORE_TLS_CA_FILE, _CERT_FILE, _KEY_FILE."""
    files = [
        getattr(args, f"tls_{part}") or os.environ.get(f"KVSTORE_TLS_{part.upper()}_FILE") or None
        for part in ("ca", "cert", "key")
    ]
    if files[0] is None:
        return None
    import grpc

    if (files[1] is None) != (files[2] is None):
        raise ValueError("--tls-cert and --tls-key go together (mutual TLS)")
    ca, cert, key = (None if f is None else _read_file(f) for f in files)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _read_file(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror}") from None


class Choices:
    """An option's choices, read from their registry only when argparse checks a value or
    prints help: the registries live with the store, which other commands never import."""

    def __init__(self, names: Callable[[], Sequence[str]]) -> None:
        self._names = names

    def __contains__(self, value: object) -> bool:
        return value in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())


def _policy_names() -> list[str]:
    from kvstore.policy import policy_names

    return policy_names(serving=False)


def _assignments() -> Sequence[str]:
    from kvstore.fleet import ASSIGNMENTS

    return ASSIGNMENTS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvctl", description="Administer a running kvstored.")
    parser.add_argument(
        "--address", default=None, help=f"daemon address (default: unix://{default_socket_path()})"
    )
    parser.add_argument(
        "--token-file",
        default=None,
        metavar="FILE",
        help="the auth token for a daemon reached over TCP (default: $KVSTORE_TOKEN, or the file "
        "$KVSTORE_TOKEN_FILE names); never on the command line, where other users can read it",
    )
    parser.add_argument(
        "--tls-ca", metavar="FILE", help="over TCP with TLS: the CA of the daemon's certificate"
    )
    parser.add_argument("--tls-cert", metavar="FILE", help="mutual TLS: this client's certificate chain")
    parser.add_argument("--tls-key", metavar="FILE", help="mutual TLS: this client's private key")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer")
    parser.add_argument("--version", action="version", version=f"kvctl {__version__}")
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
    pin = commands.add_parser("pin", help="keep a chain (a system prompt) out of eviction for a while")
    pin.add_argument("namespace", help="namespace id in hex, as `kvctl ls` shows")
    pin.add_argument(
        "--tokens",
        metavar="FILE",
        help="the prompt's token ids ('-': stdin); the daemon cuts them into the namespace's chunks",
    )
    pin.add_argument("--keys", metavar="HEX,...", help="or the chain's chunk keys, in order")
    pin.add_argument("--ttl", type=float, required=True, metavar="SECONDS", help="how long the pin lasts")
    pin.add_argument("--json", action="store_true")
    pin.set_defaults(run=cmd_pin)
    events = commands.add_parser(
        "events", help="follow the KV events: pages stored into and removed from tiers"
    )
    events.add_argument("--json", action="store_true", help="one JSON object per event (keys in hex)")
    events.add_argument("--namespace", help="only this namespace's (hex, as `kvctl ls` shows)")
    events.add_argument("--since", type=int, default=0, metavar="N", help="the events after sequence N")
    events.add_argument(
        "--epoch",
        type=int,
        default=0,
        metavar="E",
        help="the epoch of event N (as --json prints it); a --since without it, or from an earlier "
        "daemon start, begins with a resync",
    )
    events.add_argument("--from-now", action="store_true", help="only events from now on")
    events.add_argument("--count", type=int, default=0, metavar="N", help="stop after N events")
    events.set_defaults(run=cmd_events)
    top = commands.add_parser("top", help="a live view: hit ratio, throughput, tier fill, leases")
    top.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period")
    top.add_argument("--once", action="store_true", help="print one frame (two samples apart) and exit")
    top.set_defaults(run=cmd_top)
    play = commands.add_parser("replay", help="replay a Mooncake-format trace through the store, in-process")
    play.add_argument("trace", help="JSONL file, one request a line with `hash_ids` (one id per block)")
    play.add_argument("--cpu-pages", type=_positive, required=True, help="CPU tier capacity, in pages")
    play.add_argument(
        "--disk-pages", type=_positive, help="a disk tier of this many pages behind the CPU tier"
    )
    play.add_argument(
        "--policy",
        choices=Choices(_policy_names),
        metavar="NAME",
        help="the eviction policy: %(choices)s (default: kvstored's, eviction.policy)",
    )
    play.add_argument("--hosts", type=_positive, help="a fleet of this many hosts, each its own CPU tier")
    play.add_argument(
        "--remote-pages",
        type=_non_negative,
        help="a remote tier of this many pages the hosts share (0: none)",
    )
    play.add_argument(
        "--assign",
        choices=Choices(_assignments),
        metavar="HOW",
        default="round-robin",
        help="how the fleet's requests go to hosts: %(choices)s (default: %(default)s)",
    )
    play.add_argument("--json", action="store_true")
    play.set_defaults(run=cmd_replay, local=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    # SIGPIPE stays ignored: a local channel the daemon closed at its caps is an error kvctl
    # reports, not a signal that kills it; `kvctl stats | head` still ends quietly (quiet_exit).
    try:
        return _main(argv)
    except BrokenPipeError:  # stdout's reader went away
        return quiet_exit()


def quiet_exit() -> int:
    """The exit of a command whose output nobody reads any more, as a shell reports SIGPIPE's,
    without a traceback (stdout is pointed at /dev/null, so its final flush cannot fail)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)  # exits here for --version and --help
    from kvstore.errors import KVStoreError
    from kvstore.trace import TraceError

    if getattr(args, "local", False):  # needs no daemon
        try:
            return int(args.run(args))
        except (KVStoreError, TraceError) as exc:
            print(f"kvctl: {exc}", file=sys.stderr)
            return 1
    try:
        token = read_token(args.token_file) if args.token_file else default_token()
        tls = _tls(args)
    except ValueError as exc:
        print(f"kvctl: {exc}", file=sys.stderr)
        return 1
    admin = Admin(args.address or f"unix://{default_socket_path()}", token, args.timeout, tls)
    try:
        return int(args.run(admin, args))
    except KVStoreError as exc:
        print(f"kvctl: {printable(str(exc))}", file=sys.stderr)
        return 1
    finally:
        admin.close()


if __name__ == "__main__":
    sys.exit(main())
