"""The pushed hand-over (`KVStoreClient.expect` / `deliver`): one copy, device to device, written
by the producer's GPU into blocks the consumer set aside, for `bench/handover_lent.py`.

Before each round the consumer poisons its cache, sets the prompt's blocks aside (`expect`) and
sends the receipt to the producer over a pipe (as a router would, ahead of the prefill), then
waits on its inbox. Timed from the producer's `deliver` call to the moment the consumer's wait
returns (the last byte has landed: the producer's GPU writes the inbox after its copy), on
CLOCK_MONOTONIC, which both processes share. Phases: the producer's call ("deliver": the receipt
parsed, the slot claimed, the copy enqueued), then the copy until the consumer sees it land. Every
round's bytes are compared with the producer's. `$PUSH_PROFILE`: a file for the cProfile of the
producer's timed `deliver` calls.
"""

from __future__ import annotations

import cProfile
import os
import statistics
import time
import traceback
from typing import Any

import torch

from bench.handover_lent import run_pair, seeded_cache

PUSH_PHASES = ("deliver", "copy until landed")


def _producer(address: str, spec: Any, tokens: int, device: int, reps: int, pipe: Any, out: Any) -> None:
    from kvstore_client import KVStoreClient

    try:
        torch.cuda.set_device(device)
        source = seeded_cache(spec, tokens, torch.device("cuda", device), seed=7)
        table = list(range(tokens // spec.block_size))
        with KVStoreClient.connect(address, spec, name="push-producer") as client:
            cache = client.register_kv_caches(source)
            keys = client.keys(list(range(tokens)))
            profiler = cProfile.Profile() if os.environ.get("PUSH_PROFILE") else None
            for attempt in range(reps + 1):
                receipt = pipe.recv()
                if receipt is None:
                    raise RuntimeError("the consumer failed")
                torch.cuda.synchronize()
                started = time.monotonic()
                if profiler is not None and attempt:
                    profiler.enable()
                delivery = client.deliver(receipt, None, cache, table, keys=keys)
                if profiler is not None:
                    profiler.disable()
                returned = time.monotonic()
                pipe.send((started, returned, delivery.tokens))
                delivery.wait()
        if profiler is not None:
            profiler.dump_stats(os.environ["PUSH_PROFILE"])
        out.put(("producer", {}))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put(("producer", traceback.format_exc()))
        pipe.send(None)


def _consumer(address: str, spec: Any, tokens: int, device: int, reps: int, pipe: Any, out: Any) -> None:
    from kvstore_client import KVStoreClient

    try:
        torch.cuda.set_device(device)
        gpu = torch.device("cuda", device)
        expected = seeded_cache(spec, tokens, gpu, seed=7)
        target = seeded_cache(spec, tokens, gpu, seed=None)
        table = list(range(tokens // spec.block_size))
        walls, ok, phases = [], True, {name: [] for name in PUSH_PHASES}
        with KVStoreClient.connect(address, spec, name="push-consumer") as client:
            cache = client.register_kv_caches(target)
            keys = client.keys(list(range(tokens)))
            for attempt in range(reps + 1):
                for layer in target:
                    layer.view(torch.uint8).fill_(0xA5)
                torch.cuda.synchronize()
                receiving = client.expect(None, cache, table, keys=keys)
                pipe.send(receiving.receipt)
                loaded = receiving.wait(timeout_s=60)
                ended = time.monotonic()
                message = pipe.recv()
                if message is None:
                    raise RuntimeError("the producer failed")
                started, returned, sent = message
                torch.cuda.synchronize()
                same = all(
                    torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    for a, b in zip(target, expected, strict=True)
                )
                ok = ok and loaded == tokens == sent and same
                if attempt:
                    walls.append((ended - started) * 1e3)
                    phases["deliver"].append((returned - started) * 1e3)
                    phases["copy until landed"].append((ended - returned) * 1e3)
        medians = {name: statistics.median(values) for name, values in phases.items()}
        out.put(("consumer", (walls, ok, medians)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put(("consumer", traceback.format_exc()))
        pipe.send(None)


def push_handover(
    address: str, spec: Any, tokens: int, devices: tuple[torch.device, torch.device], reps: int
) -> tuple[list[float], bool, dict[str, float]]:
    """The wall ms of `reps` pushed hand-overs between two processes, whether every one landed
    the whole prompt byte for byte, and the median ms of each of `PUSH_PHASES`."""
    results = run_pair(
        (_producer, _consumer),
        devices,
        lambda device, end, out: (address, spec, tokens, device.index, reps, end, out),
    )
    walls, ok, phases = results["consumer"]
    return walls, ok, phases
