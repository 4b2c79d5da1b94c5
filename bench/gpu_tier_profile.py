"""The GPU-tier benchmark's profile (`--profile`): where a GPU-tier load spends its time.

- `profile_load`: each step of `client.load` taken one by one as it takes them (keys, Lookup
  with lease, Acquire unless the Lookup answered it, the reply cut into pieces, the scatter
  call's host time, the wait for the GPU, Release) and the scatter's GPU span;
- `profile_scatter`: the public scatter call's own steps on the host;
- `idle_effect`: a load's time after pauses of several kinds (a CPU-tier load, a sleep, GPU work);
- `cprofile_loads`: cProfile's top functions over a run of calls;
- `run_profile(loads, pool, offsets, repeats)`: all of them, and `gpu_tier_host_steps`, printed.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import kvstore_kernels
from bench.common import print_table
from bench.common_timing import walls_in_turn
from bench.gpu_tier_host_steps import HostSteps, host_steps
from bench.gpu_tier_loads import TierLoads
from bench.gpu_tier_setup import LAYERS, SPEC
from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.keys import pack_keys
from kvstore_client import KVStoreClient
from kvstore_kernels import TransferOptions, scatter, triton_copy
from kvstore_kernels.geometry import geometry_of
from kvstore_kernels.routing import choose
from kvstore_kernels.validate import plan_transfer


def run_profile(loads: TierLoads, pool: torch.Tensor, offsets: list[int], repeats: int) -> dict[str, Any]:
    """Every profile of a GPU-tier load, printed as it ends; returns the figures kept in the
    results (`idle_effect_ms`, `profile_idle`, `host_steps_us`, `profile`)."""
    client, p, registered = loads.client, loads.prompts, loads.registered
    a, b = (p.prompt_a, p.source_a, loads.keys_a), (p.prompt_b, p.source_b, loads.keys_b)
    results: dict[str, Any] = {}
    steps = profile_load(client, p.prompt_b, p.target, p.block_ids, repeats)
    print_table(("GPU-tier load, step by step", "ms (median)"), list(steps.items()))
    waits = idle_effect(loads.load(*b, registered), loads.load(*a, registered), repeats)
    print_table(("GPU-tier load (keys + registered cache) ...", "ms (median)"), list(waits.items()))
    results["idle_effect_ms"] = waits
    for label, pause in (("back to back", None), ("after 20 ms asleep", lambda: time.sleep(0.02))):
        split = profile_load(
            client, p.prompt_b, registered, p.block_ids, repeats, keys=loads.keys_b, pause=pause
        )
        name = f"step by step (keys + registered cache), {label}"
        print_table((name, "ms (median)"), list(split.items()))
        results.setdefault("profile_idle", {})[name] = split
    warm = host_steps(HostSteps(client, registered, p.block_ids, p.chunks, pool, offsets))
    print_table(("host step after the reply, warm", "us (median)"), list(warm.items()))
    results["host_steps_us"] = warm
    plan = plan_transfer(
        SPEC, registered, p.block_ids, range(p.chunks), pool, offsets, None, 0, writes_cache=True
    )
    print(cprofile_loads(lambda: kvstore_kernels._run(SPEC, plan, TransferOptions(), False), 300, top=30))
    inner = profile_scatter(p.target, p.block_ids, p.chunks, pool, offsets, repeats)
    print_table(("public scatter call, host", "ms (median)"), list(inner.items()))
    print(cprofile_loads(loads.load(*b, registered), repeats))
    results["profile"] = {"load_steps_ms": steps, "scatter_steps_ms": inner}
    return results


def profile_load(
    client: KVStoreClient,
    prompt: list[int],
    target: Any,
    block_ids: list[int],
    repeats: int,
    *,
    keys: list[bytes] | None = None,
    pause: Callable[[], Any] | None = None,
) -> dict[str, float]:
    """Median milliseconds of each step of a GPU-tier `client.load`, taken one by one as it takes them
    (`keys`: given, as an engine that hashed the prompt gives them; `pause`: run, untimed, before
    each load)."""
    steps: dict[str, list[float]] = {}
    stream = client._streams.side(target[0].device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for attempt in range(repeats + 1):
        if pause is not None:
            pause()
        torch.cuda.synchronize()
        marks = _load_marked(client, prompt, target, block_ids, keys, stream, (start, end))
        if attempt:
            for (_, before), (name, after) in zip(marks, marks[1:], strict=False):
                steps.setdefault(name, []).append((after - before) * 1e3)
            steps.setdefault("total (host)", []).append((marks[-1][1] - marks[0][1]) * 1e3)
            steps.setdefault("GPU span of the scatter", []).append(float(start.elapsed_time(end)))
    return {name: statistics.median(values) for name, values in steps.items()}


def _load_marked(
    client: KVStoreClient,
    prompt: list[int],
    target: Any,
    block_ids: list[int],
    keys: list[bytes] | None,
    stream: torch.cuda.Stream,
    events: tuple[torch.cuda.Event, torch.cuda.Event],
) -> list[tuple[str, float]]:
    """One GPU-tier load, step by step as `client.load` takes them: the host time after each step,
    the scatter's span recorded between `events` on `stream`."""
    device = target[0].device
    marks = [("start", time.perf_counter())]
    keys = keys if keys is not None else client.keys(prompt)
    marks.append(("keys", time.perf_counter()))
    reply = client._rpc(
        "Lookup",
        pb.LookupRequest(
            namespace=client.namespace,
            keys=pack_keys(keys),
            lease=True,
            gpu_pools=[0],
            acquire=True,
            epoch=client.epoch,
        ),
    )
    marks.append(("Lookup(lease)", time.perf_counter()))
    lease = pb.LeaseRequest(namespace=client.namespace, lease_id=reply.lease_id, epoch=client.epoch)
    acquired = reply.acquired if reply.HasField("acquired") else client._rpc("Acquire", lease)
    marks.append(("Acquire (if asked)", time.perf_counter()))
    pieces = client._gpu_pools.pieces(acquired, client.arena)
    marks.append(("pieces", time.perf_counter()))
    stream.wait_stream(torch.cuda.current_stream(device))
    events[0].record(stream)
    with torch.cuda.stream(stream):
        for buf, chunks, offsets in pieces:
            client._gpu_pools.scatter_for(buf, scatter)(
                SPEC, target, block_ids, chunks, buf, offsets, range(LAYERS)
            )
    events[1].record(stream)
    marks.append(("scatter call (host)", time.perf_counter()))
    events[1].synchronize()
    marks.append(("wait for the GPU", time.perf_counter()))
    if client._local is not None:  # as `client.load` does once the copy ended within the lease
        client._local.send("Release", lease)
    else:
        client._rpc("Release", lease)
    marks.append(("Release (not waited for)", time.perf_counter()))
    return marks


def profile_scatter(
    target: list[torch.Tensor],
    block_ids: list[int],
    chunks: int,
    pool: torch.Tensor,
    offsets: list[int],
    repeats: int,
) -> dict[str, float]:
    """Median milliseconds of the public scatter call's own steps, on the host."""
    steps: dict[str, list[float]] = {}
    for attempt in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plan = plan_transfer(
            SPEC, target, block_ids, range(chunks), pool, offsets, None, 0, writes_cache=True
        )
        t1 = time.perf_counter()
        route = choose(SPEC, plan, TransferOptions(), to_page=False)
        geometry = route.geometry or geometry_of(SPEC, plan)
        t2 = time.perf_counter()
        launch = triton_copy.Launch(
            SPEC, plan, geometry, to_page=False, tuning=triton_copy.default_tuning(plan)
        )
        t3 = time.perf_counter()
        launch.run(0, geometry.num_segments, triton_copy.default_programs(plan, to_page=False))
        t4 = time.perf_counter()
        if attempt:
            for name, value in (
                ("plan_transfer (checks)", t1 - t0),
                ("route + geometry_of", t2 - t1),
                ("Launch (arguments, table upload)", t3 - t2),
                ("run (launch)", t4 - t3),
            ):
                steps.setdefault(name, []).append(value * 1e3)
    torch.cuda.synchronize()
    return {name: statistics.median(values) for name, values in steps.items()}


def _busy(seconds: float) -> None:
    """Keeps this thread on its core for `seconds` (a loop that reads the clock)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _polled(run: Callable[[], None]) -> None:
    """`run`, with every CUDA wait in it done by polling (the thread never leaves its core)."""
    original = torch.cuda.Event.synchronize

    def polling(event: torch.cuda.Event) -> None:
        while not event.query():
            pass

    torch.cuda.Event.synchronize = polling  # type: ignore[method-assign,assignment]
    try:
        run()
    finally:
        torch.cuda.Event.synchronize = original  # type: ignore[method-assign]


def idle_effect(gpu_load: Callable[[], None], cpu_load: Callable[[], None], repeats: int) -> dict[str, float]:
    """Median ms of `gpu_load` after each kind of pause (untimed): does a load pay for what ran, or
    did not run, before it? (After a pause the host's steps run slower: see NOTES-gpu-tier.md.)"""
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.02)  # ~20 ms at the base clock
    befores: dict[str, Callable[[], Any] | None] = {
        "back to back": None,
        "after a CPU-tier load": cpu_load,
        "after 20 ms asleep": lambda: time.sleep(0.02),
        "after 2 ms asleep": lambda: time.sleep(0.002),
        "after ~20 ms of GPU work": lambda: torch.cuda._sleep(cycles),
        "after 20 ms of host work": lambda: _busy(0.02),
        "after a CPU-tier load, waited by polling": lambda: _polled(cpu_load),
    }
    timed: dict[str, float] = {}
    for name, before in befores.items():
        walls = walls_in_turn({name: gpu_load}, repeats, {name: before} if before is not None else None)
        timed[name] = statistics.median(walls[name]) * 1e3
    return timed


def cprofile_loads(run: Callable[[], Any], repeats: int, top: int = 40) -> str:
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(repeats):
        run()
    profiler.disable()
    parts = []
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(top)
        lines = [line for line in out.getvalue().splitlines() if line.strip()]
        parts.append("\n".join(lines[: top + 8]))
    return "\n".join(parts)
