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

This module is the entry point (`main`, `quiet_exit`), the parser, and what the commands share:
`human_bytes`, `printable`, `table`, `capacity_and_use`, `arena_pages_line`, `hex_bytes`. Each
`cmd_*` imports its command's module as it runs: `kvstore.ctl.stats` (stats, ls, health),
`kvstore.ctl.pages` (clear, pin), `kvstore.ctl.events`, `kvstore.ctl.top`, `kvstore.ctl.replay_command`;
`kvstore.ctl.admin` is the daemon as they call it. None of them is loaded with this module.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvstore import __version__
from kvstore.shared.paths import default_socket_path, default_token, read_token

if TYPE_CHECKING:
    from kvstore.ctl.admin import Admin

    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]  # what add_subparsers returns

NO_LIMIT = "no limit"


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


def arena_pages_line(counters: dict[str, Any]) -> str:
    """Which pages the CPU tier's arena got (`kvstore.shared.hugepages.ArenaPages`)."""
    from kvstore.shared.hugepages import KINDS, ArenaPages

    kind = KINDS[int(counters.get("arena_huge_pages", 0))]
    return f"arena pages: {ArenaPages(kind, int(counters['arena_page_bytes'])).describe()}"


def capacity_and_use(tier: dict[str, Any]) -> tuple[str, str]:
    """A tier's capacity and the share of it in use, as cells. A capacity of 0 is a remote
    server without `maxmemory`: no limit, and no share of one."""
    capacity = tier["bytes_capacity"]
    if not capacity:
        return NO_LIMIT, "-"
    return human_bytes(capacity), f"{100 * tier['bytes_used'] / capacity:.1f}%"


def hex_bytes(text: str, what: str) -> bytes:
    """A namespace id or chunk key given in hex, as `kvctl ls` shows it."""
    from kvstore.shared.errors import KVStoreError
    from kvstore.shared.keys import KEY_BYTES

    try:
        value = bytes.fromhex(text)
    except ValueError:
        value = b""
    if len(value) != KEY_BYTES:
        raise KVStoreError(f"{what}: expected {2 * KEY_BYTES} hex digits as `kvctl ls` shows, got {text!r}")
    return value


# -- the commands: each imports its module when it runs ----------------------------------


def cmd_stats(admin: Admin, args: argparse.Namespace) -> int:
    from kvstore.ctl.stats import show_stats

    return show_stats(admin, args)


def cmd_health(admin: Admin, args: argparse.Namespace) -> int:
    from kvstore.ctl.stats import check_health

    return check_health(admin, args)


def cmd_ls(admin: Admin, args: argparse.Namespace) -> int:
    from kvstore.ctl.stats import show_namespaces

    return show_namespaces(admin, args)


def cmd_clear(admin: Admin, args: argparse.Namespace) -> int:
    from kvstore.ctl.pages import clear_pages

    return clear_pages(admin, args)


def cmd_pin(admin: Admin, args: argparse.Namespace) -> int:
    from kvstore.ctl.pages import pin_chain

    return pin_chain(admin, args)


def cmd_events(admin: Admin, args: argparse.Namespace) -> int:
    from kvstore.ctl.events import follow_events

    return follow_events(admin, args)


def cmd_top(admin: Admin, args: argparse.Namespace) -> int:
    from kvstore.ctl import top  # rich, only for this command

    return top.run(admin.stats, args.interval, args.once)


def cmd_replay(args: argparse.Namespace) -> int:
    from kvstore.ctl.replay_command import replay_trace

    return replay_trace(args)


# -- the command line ----------------------------------------------------------------------


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
    from kvstore.store.policy import policy_names

    return policy_names(serving=False)


def _assignments() -> Sequence[str]:
    from kvstore.ctl.fleet import ASSIGNMENTS

    return ASSIGNMENTS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvctl", description="Administer a running kvstored.")
    _add_connection_options(parser)
    parser.add_argument("--version", action="version", version=f"kvctl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_daemon_commands(commands)
    _add_pin_command(commands)
    _add_events_command(commands)
    _add_top_command(commands)
    _add_replay_command(commands)
    return parser


def _add_connection_options(parser: argparse.ArgumentParser) -> None:
    """Where the daemon is, how kvctl proves who it is there, and how long it waits."""
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


def _add_daemon_commands(commands: Subcommands) -> None:
    """`stats`, `health`, `ls` and `clear`."""
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


def _add_pin_command(commands: Subcommands) -> None:
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


def _add_events_command(commands: Subcommands) -> None:
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


def _add_top_command(commands: Subcommands) -> None:
    top = commands.add_parser("top", help="a live view: hit ratio, throughput, tier fill, leases")
    top.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period")
    top.add_argument("--once", action="store_true", help="print one frame (two samples apart) and exit")
    top.set_defaults(run=cmd_top)


def _add_replay_command(commands: Subcommands) -> None:
    """`replay`, which needs no daemon (`local`): one host's tiers, or a fleet's with --hosts."""
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
    from kvstore.ctl.trace import TraceError
    from kvstore.shared.errors import KVStoreError

    if getattr(args, "local", False):  # needs no daemon
        try:
            return int(args.run(args))
        except (KVStoreError, TraceError) as exc:
            print(f"kvctl: {exc}", file=sys.stderr)
            return 1
    from kvstore.ctl.admin import Admin, tls_credentials

    try:
        token = read_token(args.token_file) if args.token_file else default_token()
        tls = tls_credentials(args)
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
