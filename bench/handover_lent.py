"""The hand-over with lent blocks (`KVStoreClient.lend`): one copy, device to device, for
`bench/handover.py`.

A producer process with the prompt's KV cache on GPU `producer` lends its blocks; a consumer
process with its cache on GPU `consumer` loads the prompt, which copies the producer's blocks
straight into its own over peer access. Timed from the producer's call to the consumer's last
byte on CLOCK_MONOTONIC, which both processes share: the producer's `lend` (it waits for its
stream, then one call to the daemon), the signal to the consumer (a pipe: what a router's message
would cost, tens of microseconds), the consumer's `load` (Lookup, the copy, Returned). Two
processes, as in a deployment: a process cannot open its own CUDA IPC export.

Two ways (`ticket`): keyed, the consumer's leased Lookup finds the lend by the prompt's keys and
its answer names the blocks (the signal leaves once the Lend is answered); with a ticket, the
producer signals the ticket `lend(meanwhile=...)` hands it while the daemon records the lend, and
the consumer copies from it at once, its Lookup answered during the copy
(`kvstore_client.lent_tickets`). A round's first (untimed) load is keyed either way: it brings the
consumer's read slots.

A third way, pushed (`bench/handover_push.py`): the consumer hands the producer a receipt for
blocks it set aside, and the producer's GPU writes the prompt into them (`expect` / `deliver`).

Run alone (`python bench/handover_lent.py --tokens 8192 32768 --rounds 2 --spin-us 0 200
--block-copy auto kernel`), it times the peer copy of the same bytes, then both ways, in each of
`--rounds` rounds, one daemon for all, the keyed way once per `--spin-us` (`$KVSTORE_LOCAL_SPIN_US`:
how long a call spins for its reply before sleeping), all of it once per `--block-copy`
(`$KVSTORE_BLOCK_COPY`: the reader's copy by the copy engines where the blocks allow, or always
by the kernel); writes bench/results/handover-lent.json (`--name`).

Each round the consumer's cache is poisoned first and compared with the producer's bytes after
(both made from the same seeded CPU generator), and the producer waits until `lends_done` names
the lend before the next round.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, running_daemon, write_results  # noqa: E402
from bench.handover_profile import instrument  # noqa: E402
from bench.transfer_cases import daemon_config, make_spec  # noqa: E402

LENT_ROW = "hand-over, lent blocks (one copy over the link)"
TICKET_ROW = "hand-over, lent blocks from a ticket (one copy over the link)"
PUSH_ROW = "hand-over, pushed into the consumer's blocks (one copy over the link)"
LENT_ROWS = {LENT_ROW: False, TICKET_ROW: True, PUSH_ROW: None}  # row -> ticket (None: pushed)
# Where a round's time goes, median ms: the producer's lend (its stream waited for, the Lend call),
# the signal to the consumer, its load up to the copy's enqueue (the leased Lookup), the copy and
# its Returned.
PHASES = ("lend", "signal", "lookup and enqueue", "copy and returned")
PROFILES = "/tmp/handover-{role}-{tokens}.prof"  # cProfile of the timed rounds' calls, where profiled


def seeded_cache(spec: Any, tokens: int, device: torch.device, seed: int | None) -> list[torch.Tensor]:
    """A flash_attn cache: bytes from a seeded CPU generator for one layer, each layer that plus its
    index (mod 256) on `device` (the same bytes in every process; random bytes for every layer on
    the CPU took tens of seconds at 32k tokens), or poison."""
    shape = (2, tokens // spec.block_size, spec.block_size, spec.num_kv_heads, spec.head_dim * 2)  # bytes
    if seed is None:
        return [torch.full(shape, 0xA5, dtype=torch.uint8, device=device).view(torch.bfloat16)
                for _ in range(spec.num_layers)]  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)
    return [(base + layer).view(torch.bfloat16) for layer in range(spec.num_layers)]  # uint8 wraps


def _producer(
    address: str,
    spec: Any,
    tokens: int,
    device: int,
    reps: int,
    pipe: Any,
    out: Any,
    profiled: bool,
    ticket: bool,
) -> None:
    from kvstore_client import KVStoreClient

    try:
        torch.cuda.set_device(device)
        source = seeded_cache(spec, tokens, torch.device("cuda", device), seed=7)
        table = list(range(tokens // spec.block_size))
        with KVStoreClient.connect(address, spec, name="lent-producer") as client:
            cache = client.register_kv_caches(source)
            keys = client.keys(list(range(tokens)))
            timers = instrument(client, "producer") if profiled else None
            profiler = cProfile.Profile() if profiled else None
            for attempt in range(reps + 1):
                if pipe.recv() is None:  # the consumer's cache is poisoned and it waits
                    raise RuntimeError("the consumer failed")
                torch.cuda.synchronize()
                started = time.monotonic()
                if profiler is not None and attempt:
                    profiler.enable()
                tell = functools.partial(_tell, pipe, started) if ticket else None
                lend_id, lent = client.lend(None, cache, table, keys=keys, meanwhile=tell)
                if profiler is not None:
                    profiler.disable()
                if not ticket:
                    pipe.send((started, None, time.monotonic()))
                if lent != tokens:
                    raise RuntimeError(f"lent {lent} tokens of {tokens}")
                if timers is not None:
                    timers.next_round(keep=attempt > 0)
                if pipe.recv() is None:  # the consumer has loaded
                    raise RuntimeError("the consumer failed")
                deadline = time.monotonic() + 30
                while client.lends_done([lend_id]) != [lend_id]:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"lend {lend_id} not done 30 s after the consumer's load")
                    time.sleep(0.001)
        if profiler is not None:
            profiler.dump_stats(PROFILES.format(role="producer", tokens=tokens))
        out.put(("producer", timers.medians() if timers is not None else {}))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put(("producer", traceback.format_exc()))
        pipe.send(None)  # the consumer stops waiting


def _tell(pipe: Any, started: float, ticket: bytes) -> None:
    pipe.send((started, ticket, time.monotonic()))


def _consumer(
    address: str,
    spec: Any,
    tokens: int,
    device: int,
    reps: int,
    pipe: Any,
    out: Any,
    profiled: bool,
    ticket: bool,
) -> None:
    from kvstore_client import KVStoreClient

    try:
        torch.cuda.set_device(device)
        gpu = torch.device("cuda", device)
        expected = seeded_cache(spec, tokens, gpu, seed=7)
        target = seeded_cache(spec, tokens, gpu, seed=None)
        table = list(range(tokens // spec.block_size))
        walls, ok = [], True
        phases: dict[str, list[float]] = {}
        with KVStoreClient.connect(address, spec, name="lent-consumer") as client:
            returned_before = client.stats()["counters"].get("lent_reads_returned", 0)  # an earlier run's
            cache = client.register_kv_caches(target)
            keys = client.keys(list(range(tokens)))
            timers = instrument(client, "consumer") if profiled else None
            profiler = cProfile.Profile() if profiled else None
            for attempt in range(reps + 1):
                for layer in target:
                    layer.view(torch.uint8).fill_(0xA5)
                torch.cuda.synchronize()
                pipe.send("ready")
                message = pipe.recv()
                if message is None:
                    raise RuntimeError("the producer failed")
                received = time.monotonic()
                started, lent_ticket, lent_at = message
                if profiler is not None and attempt:
                    profiler.enable()
                handle = client.load_async(None, cache, table, keys=keys, lent=lent_ticket)
                enqueued = time.monotonic()
                loaded = handle.wait()
                if profiler is not None:
                    profiler.disable()
                torch.cuda.synchronize()
                ended = time.monotonic()
                pipe.send("loaded")
                if timers is not None:
                    timers.next_round(keep=attempt > 0)
                same = all(
                    torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    for a, b in zip(target, expected, strict=True)
                )
                ok = ok and loaded == tokens and same
                if attempt:
                    walls.append((ended - started) * 1e3)
                    marks = (started, lent_at, received, enqueued, ended)
                    for name, a, b in zip(PHASES, marks, marks[1:], strict=False):
                        phases.setdefault(name, []).append((b - a) * 1e3)
            lent_reads = client.stats()["counters"].get("lent_reads_returned", 0) - returned_before
        medians = {name: statistics.median(values) for name, values in phases.items()}
        steps = timers.medians() if timers is not None else {}
        if profiler is not None:
            profiler.dump_stats(PROFILES.format(role="consumer", tokens=tokens))
        out.put(("consumer", (walls, ok and lent_reads == reps + 1, medians, steps)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put(("consumer", traceback.format_exc()))
        pipe.send(None)  # the producer stops waiting


def lent_handover(
    address: str,
    spec: Any,
    tokens: int,
    devices: tuple[torch.device, torch.device],
    reps: int,
    profiled: bool = False,
    ticket: bool = False,
) -> tuple[list[float], bool, dict[str, float], dict[str, float]]:
    """The wall ms of `reps` lent hand-overs between two processes (`ticket`: from the producer's
    ticket), whether every round lent and loaded the whole prompt, the producer's bytes, as a lent
    read, the median ms of each of `PHASES`, and (`profiled`) of each host step
    `bench.handover_profile.instrument` times."""
    roles = (_producer, _consumer)
    results = run_pair(roles, devices, lambda device, end, out: (address, spec, tokens, device.index, reps,
                       end, out, profiled, ticket))  # fmt: skip
    walls, ok, phases, steps = results["consumer"]
    return walls, ok, phases, {**results["producer"], **steps}


def run_pair(roles: Any, devices: Any, args: Any) -> dict[str, Any]:
    """Runs the producer and the consumer (`roles`, each on its device, `args(device, pipe end,
    queue)` its arguments) in processes of their own, joined by a pipe; what each put on the
    queue, by role ("producer", "consumer"). RuntimeError with the traceback of a role that failed."""
    context = mp.get_context("spawn")
    ends, out = context.Pipe(), context.Queue()
    processes = [
        context.Process(target=role, args=args(device, end, out))
        for role, device, end in zip(roles, devices, ends, strict=True)
    ]
    for process in processes:
        process.start()
    try:
        results = dict(out.get(timeout=600) for _ in processes)
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    for role, result in results.items():
        if isinstance(result, str):
            raise RuntimeError(f"the {role} failed:\n{result}")
    return results


def lent_rows(
    address: str, spec: Any, tokens: int, devices: Any, reps: int, walls: dict[str, list[float]]
) -> tuple[bool, dict[str, dict[str, float]]]:
    """The ways of `LENT_ROWS` into `walls`: (whether every round of each was right, each way's
    phases)."""
    from bench.handover_push import push_handover

    ok, phases = True, {}
    for row, ticket in LENT_ROWS.items():
        if ticket is None:
            walls[row], good, phases[row] = push_handover(address, spec, tokens, devices, reps)
        else:
            walls[row], good, phases[row], _ = lent_handover(
                address, spec, tokens, devices, reps, ticket=ticket
            )
        ok = ok and good
    return ok, phases


def rounds(
    tokens: int, rounds: int, reps: int, spins: list[float], copies: list[str]
) -> list[dict[str, Any]]:
    """Each round: the peer copy, then for each of `copies` (`KVSTORE_BLOCK_COPY`) the keyed way
    at each spin, the ticket way (no spin), and the pushed way (`bench.handover_push`)."""
    spec = make_spec("flash_attn")
    devices = (torch.device("cuda", 0), torch.device("cuda", 1))
    moved = tokens // spec.chunk_tokens * spec.page.page_bytes
    flat_p = torch.randint(0, 256, (moved,), dtype=torch.uint8, device=devices[0])
    flat_c = torch.empty(moved, dtype=torch.uint8, device=devices[1])
    from bench.handover_push import push_handover

    ways = [
        (row, ticket, spin, copy)
        for copy in copies
        for row, ticket, spin in [
            *((LENT_ROW, False, spin) for spin in spins),
            (TICKET_ROW, True, 0.0),
            (PUSH_ROW, False, 0.0),
        ]
    ]
    rows = []
    with running_daemon(daemon_config(spec.page.page_bytes, 4)) as daemon:
        for number in range(rounds):
            peers = []
            for attempt in range(reps + 1):
                torch.cuda.synchronize(devices[0])
                started = time.perf_counter()
                flat_c.copy_(flat_p, non_blocking=True)
                torch.cuda.synchronize(devices[1])
                if attempt:
                    peers.append((time.perf_counter() - started) * 1e3)
            peer = statistics.median(peers)
            for row, ticket, spin, copy in ways:
                os.environ["KVSTORE_LOCAL_SPIN_US"] = str(spin)  # the two processes read it at connect
                os.environ["KVSTORE_BLOCK_COPY"] = copy
                if row == PUSH_ROW:
                    walls, ok, phases = push_handover(daemon.address, spec, tokens, devices, reps)
                else:
                    walls, ok, phases, _ = lent_handover(
                        daemon.address, spec, tokens, devices, reps, ticket=ticket
                    )
                ms = statistics.median(walls)
                rows.append(
                    {"round": number, "tokens": tokens, "path": row, "spin_us": spin, "block_copy": copy,
                     "ms": ms, "peer_ms": peer, "x_peer_copy": peer / ms, "ok": ok, "phases_ms": phases,
                     "walls_ms": walls}
                )  # fmt: skip
                verdict = "PASS" if ok else "FAIL"
                print(f"round {number}, {tokens} tokens, {row}, {copy}, spin {spin} us: {ms:.3f} ms, "
                      f"peer copy {peer:.3f} ms ({peer / ms:.3f}), {verdict}", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", nargs="+", type=int, default=[8192, 32768])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--spin-us", nargs="+", type=float, default=[0.0], help="the keyed way's spins")
    parser.add_argument(
        "--block-copy",
        nargs="+",
        default=["auto"],
        choices=["auto", "kernel"],
        help="KVSTORE_BLOCK_COPY, each",
    )
    parser.add_argument("--name", default="handover-lent")
    args = parser.parse_args(argv)
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench/handover_lent.py needs two CUDA GPUs")
    rows = [
        row
        for tokens in args.tokens
        for row in rounds(tokens, args.rounds, args.reps, args.spin_us, args.block_copy)
    ]
    table = [
        [r["round"], r["tokens"], r["path"], r["block_copy"], r["spin_us"], round(r["peer_ms"], 3),
         round(r["ms"], 3), round(r["x_peer_copy"], 3), "PASS" if r["ok"] else "FAIL"]
        for r in rows
    ]  # fmt: skip
    print_table(
        ["round", "tokens", "path", "block copy", "spin us", "peer copy ms", "ms", "x peer copy", "ok"], table
    )
    print(
        write_results(args.name, {"config": vars(args), "gpus": torch.cuda.get_device_name(0), "rows": rows})
    )


if __name__ == "__main__":
    main()
