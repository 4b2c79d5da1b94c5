"""Where the host time of a lent hand-over goes (`bench/handover_lent.py`), call by call.

Runs the lent hand-over between two GPUs with every host step of interest timed in place (the
client's calls wrapped with a perf_counter timer: the lender's `lend`, its descriptor, its Lend
call; the reader's leased Lookup, the local channel's round trip, the opened cache, the stream
ordering, `copy_blocks` and its launch, the wait, the Returned), and the daemon's own time per
call from its `kvstore_rpc_duration_seconds` histogram (metrics over HTTP), so the round trip
splits into the daemon's work and the rest. Each step's median ms over the rounds.

    python bench/handover_profile.py --tokens 8192 32768 --reps 50

Writes bench/results/handover_profile.json (`--name`).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, running_daemon, write_results  # noqa: E402
from bench.transfer_cases import daemon_config, make_spec  # noqa: E402


class Timers:
    """Wall ms per step, summed within a round; each step's median over the rounds."""

    def __init__(self) -> None:
        self._round: dict[str, float] = defaultdict(float)
        self._rounds: list[dict[str, float]] = []

    def wrap(self, owner: Any, attr: str, name: str | Callable[..., str]) -> None:
        """Times every call of `owner.attr` (a class's method, a module's or an object's function)."""
        original = getattr(owner, attr)
        timers = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                label = name if isinstance(name, str) else name(*args, **kwargs)
                timers._round[label] += (time.perf_counter() - started) * 1e3

        setattr(owner, attr, timed)

    def next_round(self, keep: bool) -> None:
        if keep:
            self._rounds.append(dict(self._round))
        self._round.clear()

    def medians(self) -> dict[str, float]:
        names = {name for one in self._rounds for name in one}
        return {name: statistics.median(one.get(name, 0.0) for one in self._rounds) for name in sorted(names)}


def _method(*args: Any, **_: Any) -> str:
    return str(args[1] if not isinstance(args[0], str) else args[0])


def instrument(client: Any, role: str) -> Timers:
    """The timers of `role`'s host steps ("producer" or "consumer"), installed on `client`."""
    import kvstore_kernels
    from kvstore.shared.channel import LocalChannel
    from kvstore_client import lent_tickets
    from kvstore_client.handles import LoadHandle
    from kvstore_client.lends import LendPath
    from kvstore_client.lent import LentCaches
    from kvstore_client.loads import LoadPath
    from kvstore_client.session import Session
    from kvstore_client.transfers import Streams
    from kvstore_kernels import block_engines

    blocks = __import__("kvstore_kernels.blocks", fromlist=["_launch"])
    timers = Timers()
    timers.wrap(client._conn, "call", lambda method, *_, **__: f"call {method} (request made, sent, read)")
    timers.wrap(LocalChannel, "call", lambda *a, **_: f"local channel {_method(*a)} (round trip)")
    if role == "producer":
        import torch

        from kvstore_client import lends

        timers.wrap(LendPath, "lend", "lend (all)")
        timers.wrap(LendPath, "_descriptor", "lend: descriptor")
        timers.wrap(torch.cuda.Stream, "synchronize", "lend: stream waited for")
        timers.wrap(lends, "pack_keys", "lend: keys packed")
        timers.wrap(type(client), "_keys_of", "lend: keys checked")
        return timers
    timers.wrap(LoadPath, "load_async", "load_async (all)")
    timers.wrap(LoadPath, "_lookup_leased", "load_async: leased Lookup")
    timers.wrap(LendPath, "read", "read (open, order, copy enqueued)")
    timers.wrap(LendPath, "devices", "read: lent_devices")
    timers.wrap(LentCaches, "open", "read: lender's cache opened")
    timers.wrap(Streams, "ordered_side", "read: side stream ordered")
    timers.wrap(kvstore_kernels, "copy_blocks", "copy_blocks (checks, launch)")
    timers.wrap(blocks, "_launch", "copy_blocks: launch")
    timers.wrap(blocks.staging, "to_device", "copy_blocks: block ids to the GPU")
    timers.wrap(LoadHandle, "wait", "wait (copy, Returned)")
    timers.wrap(LendPath, "_finish", "wait: Returned")
    timers.wrap(LendPath, "_finish_in_place", "wait: read slot checked, Returned sent")
    timers.wrap(lent_tickets, "read_ticket", "ticket: Lookup sent, copy enqueued")
    timers.wrap(lent_tickets, "_answered", "ticket: Lookup's answer, slot checked, Returned sent")
    timers.wrap(LocalChannel, "begin", "ticket: Lookup sent")
    timers.wrap(LendPath, "copy", "read: copy (ids, cache opened, copy_blocks, event)")
    timers.wrap(blocks, "copy_by_engines", "copy_blocks: by the engines")
    timers.wrap(blocks, "_plan", "copy_blocks: plan")
    timers.wrap(block_engines, "_batch", "copy_blocks: the batch call")
    timers.wrap(LoadHandle, "__init__", "load handle made")
    timers.wrap(Session, "_covered", "tokens covered")
    return timers


def daemon_rpc_ms(metrics: str) -> dict[str, tuple[float, int]]:
    """(seconds summed, calls) per local-channel method from the daemon's /metrics."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith("kvstore_rpc_duration_seconds_") or 'channel="local"' not in line:
            continue
        method = line.split('method="', 1)[1].split('"', 1)[0]
        value = float(line.rsplit(" ", 1)[1])
        if line.startswith("kvstore_rpc_duration_seconds_sum"):
            sums[method] = value
        elif line.startswith("kvstore_rpc_duration_seconds_count"):
            counts[method] = int(value)
    return {method: (sums[method], counts.get(method, 0)) for method in sums}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def profile(
    tokens: int, producer: int, consumer: int, reps: int, poll_ms: float, ticket: bool
) -> dict[str, Any]:
    import torch

    from bench.handover_lent import lent_handover

    spec = make_spec("flash_attn")
    config = daemon_config(spec.page.page_bytes, 4)
    metrics = f"127.0.0.1:{free_port()}"
    config["server"] = {"metrics_address": metrics, "local_poll_ms": poll_ms}
    devices = (torch.device("cuda", producer), torch.device("cuda", consumer))
    with running_daemon(config) as daemon:
        before = daemon_rpc_ms(metrics)
        walls, ok, phases, steps = lent_handover(
            daemon.address, spec, tokens, devices, reps, profiled=True, ticket=ticket
        )
        after = daemon_rpc_ms(metrics)
    daemon_ms = {
        f"daemon: {method}": (after[method][0] - before.get(method, (0.0, 0))[0])
        * 1e3
        / (after[method][1] - before.get(method, (0.0, 0))[1])
        for method in after
        if after[method][1] > before.get(method, (0.0, 0))[1]
    }
    return {
        "tokens": tokens,
        "local_poll_ms": poll_ms,
        "ticket": ticket,
        "ok": ok,
        "wall_ms": statistics.median(walls),
        "phases_ms": phases,
        "steps_ms": steps,
        "daemon_mean_ms": daemon_ms,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", nargs="+", type=int, default=[8192, 32768])
    parser.add_argument("--producer", type=int, default=0)
    parser.add_argument("--consumer", type=int, default=1)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--poll-ms", nargs="+", type=float, default=[0.0], help="server.local_poll_ms")
    parser.add_argument(
        "--ticket", action="store_true", help="the consumer copies from the producer's ticket"
    )
    parser.add_argument("--name", default="handover_profile")
    args = parser.parse_args(argv)
    rows = [
        profile(tokens, args.producer, args.consumer, args.reps, poll, args.ticket)
        for poll in args.poll_ms
        for tokens in args.tokens
    ]
    table = []
    for row in rows:
        named = {**row["phases_ms"], **row["steps_ms"], **row["daemon_mean_ms"]}
        where = (row["tokens"], row["local_poll_ms"])
        table += [[*where, name, f"{ms:.3f}"] for name, ms in named.items()]
        table.append([*where, "wall (median)", f"{row['wall_ms']:.3f}  ok={row['ok']}"])
    print_table(["tokens", "poll ms", "step", "ms (median; daemon: mean)"], table)
    write_results(args.name, {"rows": rows})


if __name__ == "__main__":
    main()
