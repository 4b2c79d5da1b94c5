"""The hand-over with lent blocks (`KVStoreClient.lend`): one copy, device to device, for
`bench/handover.py`.

A producer process with the prompt's KV cache on GPU `producer` lends its blocks; a consumer
process with its cache on GPU `consumer` loads the prompt, which copies the producer's blocks
straight into its own over peer access. Timed from the producer's call to the consumer's last
byte on CLOCK_MONOTONIC, which both processes share: the producer's `lend` (it waits for its
stream, then one call to the daemon), the signal to the consumer (a pipe: what a router's message
would cost, tens of microseconds), the consumer's `load` (Lookup, the copy, Returned). Two
processes, as in a deployment: a process cannot open its own CUDA IPC export.

Each round the consumer's cache is poisoned first and compared with the producer's bytes after
(both made from the same seeded CPU generator), and the producer waits until `lends_done` names
the lend before the next round.
"""

from __future__ import annotations

import cProfile
import multiprocessing as mp
import statistics
import time
import traceback
from typing import Any

import torch

from bench.handover_profile import instrument

LENT_ROW = "hand-over, lent blocks (one copy over the link)"
# Where a round's time goes, median ms: the producer's lend (its stream waited for, the Lend call),
# the signal to the consumer, its load up to the copy's enqueue (the leased Lookup), the copy and
# its Returned.
PHASES = ("lend", "signal", "lookup and enqueue", "copy and returned")
PROFILES = "/tmp/handover-{role}-{tokens}.prof"  # cProfile of the timed rounds' calls, where profiled


def seeded_cache(spec: Any, tokens: int, device: torch.device, seed: int | None) -> list[torch.Tensor]:
    """A flash_attn cache: bytes from a seeded CPU generator (the same in every process), or poison."""
    shape = (2, tokens // spec.block_size, spec.block_size, spec.num_kv_heads, spec.head_dim * 2)  # bytes
    if seed is None:
        return [torch.full(shape, 0xA5, dtype=torch.uint8, device=device).view(torch.bfloat16)
                for _ in range(spec.num_layers)]  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device).view(torch.bfloat16)
        for _ in range(spec.num_layers)
    ]


def _producer(
    address: str, spec: Any, tokens: int, device: int, reps: int, pipe: Any, out: Any, profiled: bool
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
                lend_id, lent = client.lend(None, cache, table, keys=keys)
                if profiler is not None:
                    profiler.disable()
                pipe.send((started, lend_id, lent, time.monotonic()))
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


def _consumer(
    address: str, spec: Any, tokens: int, device: int, reps: int, pipe: Any, out: Any, profiled: bool
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
                started, _, lent, lent_at = message
                if profiler is not None and attempt:
                    profiler.enable()
                handle = client.load_async(None, cache, table, keys=keys)
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
                ok = ok and lent == tokens and loaded == tokens and same
                if attempt:
                    walls.append((ended - started) * 1e3)
                    marks = (started, lent_at, received, enqueued, ended)
                    for name, a, b in zip(PHASES, marks, marks[1:], strict=False):
                        phases.setdefault(name, []).append((b - a) * 1e3)
            lent_reads = client.stats()["counters"].get("lent_reads_returned", 0)
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
) -> tuple[list[float], bool, dict[str, float], dict[str, float]]:
    """The wall ms of `reps` lent hand-overs between two processes, whether every round lent and
    loaded the whole prompt, the producer's bytes, as a lent read, the median ms of each of
    `PHASES`, and (`profiled`) of each host step `bench.handover_profile.instrument` times."""
    context = mp.get_context("spawn")
    ends, out = context.Pipe(), context.Queue()
    processes = [
        context.Process(target=role, args=(address, spec, tokens, device.index, reps, end, out, profiled))
        for role, device, end in zip((_producer, _consumer), devices, ends, strict=True)
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
    walls, ok, phases, steps = results["consumer"]
    return walls, ok, phases, {**results["producer"], **steps}
