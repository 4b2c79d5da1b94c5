"""Loads from the GPU tier vs from the CPU tier vs a device-to-device copy of the same bytes.

Llama-3.1-8B geometry (32 layers, 8 KV heads, head dim 128, bf16, 16-token blocks, flash-attn
layout), 8k tokens = 1 GiB of KV in 32 pages of 256 tokens. One daemon with both tiers; prompt A
stays in the CPU tier (promote_after_hits is set out of reach), prompt B is moved into the GPU
tier with a Pin. Each figure is the median of `--repeats` timed calls, GPU synchronised, the
rows timed in turn in each round after an untimed round, GB/s of KV bytes landed in the cache:

- d2d copy: one `copy_` of a 1 GiB device tensor (the same bytes, contiguous): the ceiling;
- load, CPU tier: `client.load` of A (Lookup with lease, Acquire, scatter from the registered
  arena over PCIe, Release);
- load, GPU tier: `client.load` of B: the same calls, the scatter reading the daemon's pool
  opened over CUDA IPC; once with the kernels' default program count for a device buffer and
  once with one program per SM;
- scatter only: the kernel alone from the pool (no control calls), both program counts;
- both loads again with the chunk keys passed in (`keys=`), as an engine does that hashed
  the prompt once when it looked it up; and again with the keys and the KV cache registered
  once (`client.register_kv_caches`), as vLLM's connectors register it;
- 4 loads in flight: four `load_async` (keys, registered cache) issued before the first is
  waited for, as an engine issues the loads of a batch; ms per load, so each load's host
  work overlaps the copies of the loads before it;
- after the rows above, the d2d copy and the loads of each tier (plain, and keys + registered
  cache) again, each timed on its own: a warm-up call, then `--repeats` calls back to back,
  median (the method's way, and the acceptance's rows: timed in turn, a GPU-tier load always
  follows a 21 ms CPU-tier load, after which the GPU machine's host runs every step of the next
  load slower, see `--profile` and NOTES-gpu-tier.md). "x d2d" compares a row with the copy
  timed the same way.

`--daemon-poll-ms N` runs the daemon with `server.local_poll_ms: N`.

`measure()` is also run by `bench/transfer.py`, which prints these rows after its own.

Acceptance (issue 7): GPU-tier load >= 10x the CPU-tier load and >= 0.5x the d2d copy, with the
loads as an engine's connector makes them (keys from its lookup, cache registered once) and
timed back to back; the other comparisons are printed as "also".

`--profile` adds where one GPU-tier load spends its time: each step of `client.load` taken
one by one (keys, Lookup with lease, Acquire unless the Lookup answered it, cutting the reply
into pieces, the public scatter call's host time, the wait for the GPU, Release), the GPU
span of the scatter (events), the scatter call's own steps (checks, geometry, kernel
arguments and table upload, launch), and cProfile's top functions over a run of loads; and
a GPU-tier load's time after pauses of several kinds (a CPU-tier load, a sleep, GPU work),
with its steps back to back and after a sleep.
`--sweep` times the kernel's shapes and program counts reading the pool (GPU time of calls
back to back), and the copy engines moving the same segments in one batched call.

    python bench/gpu_tier.py            # writes bench/results/gpu_tier.json
    python bench/gpu_tier.py --profile --sweep
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

import kvstore_kernels  # noqa: E402
from bench.common import print_table, running_daemon, write_results  # noqa: E402
from kvstore.keys import pack_keys  # noqa: E402
from kvstore.proto import kvstore_pb2 as pb  # noqa: E402
from kvstore.tiers import Tier  # noqa: E402
from kvstore_client import KVSpec, KVStoreClient  # noqa: E402
from kvstore_kernels import TransferOptions, scatter, triton_copy  # noqa: E402
from kvstore_kernels.geometry import Geometry, geometry_of  # noqa: E402
from kvstore_kernels.routing import choose  # noqa: E402
from kvstore_kernels.validate import plan_transfer  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK, CHUNK = 32, 8, 128, 16, 256
SPEC = KVSpec(
    model="llama-3.1-8b-bench",
    num_layers=LAYERS,
    num_kv_heads=HEADS,
    head_dim=HEAD_DIM,
    dtype=torch.bfloat16,
    block_size=BLOCK,
    chunk_tokens=CHUNK,
)


def median_s(run: Callable[[], Any], repeats: int) -> float:
    samples = []
    for attempt in range(repeats + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        if attempt:
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def in_turn(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each run, GPU synchronised, the runs timed in turn in each of `repeats`
    rounds after one untimed round (so that no run's figure depends on its place in the order)."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for attempt in range(repeats + 1):
        for name, run in runs.items():
            torch.cuda.synchronize()
            started = time.perf_counter()
            run()
            torch.cuda.synchronize()
            if attempt:
                samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in samples.items()}


def cache(blocks: int, fill: float | None = None) -> list[torch.Tensor]:
    shape = (2, blocks, BLOCK, HEADS, HEAD_DIM)
    if fill is None:
        return [torch.randn(shape, device="cuda").bfloat16() for _ in range(LAYERS)]
    return [torch.full(shape, fill, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]


def tiers_of(client: KVStoreClient, tokens: list[int]) -> bytes:
    reply = client._rpc(
        "Lookup", pb.LookupRequest(namespace=client.namespace, keys=pack_keys(client.keys(tokens)))
    )
    return bytes(reply.tiers)


def gpu_ms(run: Callable[[], Any], repeats: int) -> float:
    """GPU time per call of `repeats` calls issued back to back, after one warm-up call."""
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / repeats


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
    device = target[0].device
    stream = client._streams.side(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    given = keys
    for attempt in range(repeats + 1):
        if pause is not None:
            pause()
        torch.cuda.synchronize()
        marks = [("start", time.perf_counter())]
        keys = given if given is not None else client.keys(prompt)
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
        start.record(stream)
        with torch.cuda.stream(stream):
            for buf, chunks, offsets in pieces:
                client._gpu_pools.scatter_for(buf, scatter)(
                    SPEC, target, block_ids, chunks, buf, offsets, range(LAYERS)
                )
        end.record(stream)
        marks.append(("scatter call (host)", time.perf_counter()))
        end.synchronize()
        marks.append(("wait for the GPU", time.perf_counter()))
        if client._local is not None:  # as `client.load` does once the copy ended within the lease
            client._local.send("Release", lease)
        else:
            client._rpc("Release", lease)
        marks.append(("Release (not waited for)", time.perf_counter()))
        if attempt:
            for (_, before), (name, after) in zip(marks, marks[1:], strict=False):
                steps.setdefault(name, []).append((after - before) * 1e3)
            steps.setdefault("total (host)", []).append((marks[-1][1] - marks[0][1]) * 1e3)
            steps.setdefault("GPU span of the scatter", []).append(float(start.elapsed_time(end)))
    return {name: statistics.median(values) for name, values in steps.items()}


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
        samples = []
        for attempt in range(repeats + 1):
            if before is not None:
                before()
            torch.cuda.synchronize()
            started = time.perf_counter()
            gpu_load()
            torch.cuda.synchronize()
            if attempt:
                samples.append((time.perf_counter() - started) * 1e3)
        timed[name] = statistics.median(samples)
    return timed


def host_steps(
    client: KVStoreClient,
    registered: Any,
    block_ids: list[int],
    chunks: int,
    pool: torch.Tensor,
    offsets: list[int],
    calls: int = 1000,
) -> dict[str, float]:
    """Median microseconds of each host step a GPU-tier load takes after the Lookup reply, each
    called `calls` times in a row (warm: the steps' floor, not what a load after a pause pays)."""
    from kvstore_kernels import check_blocks, staging
    from kvstore_kernels.geometry import geometry_of as kept_geometry

    stream = client._streams.side(pool.device)
    checked = check_blocks(SPEC, registered, block_ids, chunks, writes_cache=True)
    plan = plan_transfer(SPEC, registered, checked, range(chunks), pool, offsets, None, 0, writes_cache=True)
    geometry = kept_geometry(SPEC, plan)
    values, _ = geometry.table_values(plan.blocks)  # type: ignore[arg-type]
    launch = triton_copy.Launch(SPEC, plan, geometry, to_page=False, tuning=triton_copy.DEVICE_TUNING)
    reply = pb.AcquireResponse(
        ready_chunks=chunks, offsets=offsets, tiers=bytes([Tier.GPU]) * chunks, pools=[0] * chunks
    )
    wire = reply.SerializeToString()

    def in_stream() -> None:
        with torch.cuda.stream(stream):
            pass

    def event() -> None:
        torch.cuda.Event().record(stream)

    def in_device() -> None:
        with torch.cuda.device(pool.device):
            pass

    compiled = launch.run(0, geometry.num_segments, 1 << 20)  # no segment moves (0..0) when timed

    steps: dict[str, Callable[[], Any]] = {
        "AcquireResponse.FromString (32 chunks)": lambda: pb.AcquireResponse.FromString(wire),
        "pieces": lambda: client._gpu_pools.pieces(reply, client.arena),  # type: ignore[arg-type]
        "check_blocks (in the Lookup's shadow)": lambda: check_blocks(
            SPEC, registered, block_ids, chunks, writes_cache=True
        ),
        "plan_transfer (registered, checked blocks)": lambda: plan_transfer(
            SPEC, registered, checked, range(chunks), pool, offsets, None, 0, writes_cache=True
        ),
        "choose (route)": lambda: choose(SPEC, plan, TransferOptions(), to_page=False),
        "TransferOptions()": TransferOptions,
        "geometry_of (kept)": lambda: kept_geometry(SPEC, plan),
        "table_values": lambda: geometry.table_values(plan.blocks),  # type: ignore[arg-type]
        "staging.to_device (tables)": lambda: staging.to_device(values, pool.device),
        "torch.empty on the device": lambda: torch.empty(values.size, dtype=torch.int64, device=pool.device),
        "Launch(...) (tables included)": lambda: triton_copy.Launch(
            SPEC, plan, geometry, to_page=False, tuning=triton_copy.DEVICE_TUNING
        ),
        "Launch.run (kernel launch)": lambda: launch.run(0, geometry.num_segments, 1 << 20),
        "torch.cuda.stream(s) enter+exit": in_stream,
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "torch.cuda.Event() + record": event,
        "stream.wait_stream(current)": lambda: stream.wait_stream(torch.cuda.current_stream()),
        "scatter(...) public call, registered + checked (short path)": lambda: scatter(
            SPEC, registered, checked, range(chunks), pool, offsets
        ),
        "the same, the general path (options given)": lambda: scatter(
            SPEC, registered, checked, range(chunks), pool, offsets, options=TransferOptions()
        ),
        "kvstore_kernels._run(plan)": lambda: kvstore_kernels._run(SPEC, plan, TransferOptions(), False),
        "triton_copy.launch(plan)": lambda: triton_copy.launch(SPEC, plan, to_page=False),
        "torch.cuda.device(d) enter+exit": in_device,
        "shape_of": lambda: triton_copy.shape_of(
            SPEC, plan, geometry, False, triton_copy.DEVICE_TUNING, False
        ),
        "tensor slice": lambda: launch.tables[5:],
        "no_launch_hooks()": triton_copy.no_launch_hooks,
        "compiled.run alone": lambda: compiled.run(
            1,
            1,
            1,
            stream.cuda_stream,
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *launch._pointers,
            0,
            0,
            0,
            *launch._constants,
        ),  # fmt: skip
    }
    timed: dict[str, float] = {}
    for name, step in steps.items():
        samples = []
        for _ in range(calls):
            torch.cuda.synchronize()  # untimed: no call waits for the GPU (a full ring, a full queue)
            started = time.perf_counter()
            step()
            samples.append(time.perf_counter() - started)
        timed[name] = statistics.median(samples) * 1e6
    torch.cuda.synchronize()
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


SWEEP_SHAPES = [  # (tile_bytes, segments_per_step, num_warps, word_bytes)
    (16384, 4, 8, 8),  # DEFAULT_TUNING
    (4096, 1, 4, 8),
    (8192, 1, 4, 8),
    (8192, 1, 8, 8),
    (16384, 1, 8, 8),
    (32768, 1, 8, 8),
    (32768, 1, 16, 8),
    (8192, 2, 8, 8),
    (16384, 2, 8, 8),
    (4096, 4, 4, 8),
    (8192, 4, 8, 8),
    (8192, 1, 4, 4),
    (16384, 1, 8, 4),
    (16384, 4, 8, 4),
]
SWEEP_HINTS = [{"load_cache": ".cg", "store_cache": ".cs"}, {"eviction": "evict_first"}]
SWEEP_PROGRAMS_PER_SM = (1, 2, 4, 8, 16, 0)  # 0: one program per step (no persistent loop)


def sweep_tunings() -> list[triton_copy.Tuning]:
    shapes = [
        triton_copy.Tuning(tile, segments, warps, word_bytes=word)
        for tile, segments, warps, word in SWEEP_SHAPES
    ]
    return shapes + [triton_copy.Tuning(8192, 1, 4, **hints) for hints in SWEEP_HINTS]  # type: ignore[arg-type]


def sweep_label(tuning: triton_copy.Tuning) -> str:
    label = f"tile={tuning.tile_bytes // 1024}K seg={tuning.segments_per_step} warps={tuning.num_warps}"
    hints = ("load_cache", "store_cache", "eviction")
    return (
        label
        + f" word={tuning.word_bytes}"
        + "".join(f" {h}={getattr(tuning, h)}" for h in hints if getattr(tuning, h))
    )


def ptx_counts(compiled: Any) -> str:
    ptx = getattr(compiled, "asm", {}).get("ptx", "")
    kinds = ("ld.global.v4", "ld.global.v2", "ld.global.", "st.global.v4", "st.global.v2", "st.global.")
    counts = {kind: ptx.count(kind) for kind in kinds}
    regs = getattr(compiled, "n_regs", "?")
    return f"regs={regs} " + " ".join(f"{k.removesuffix('.')}={v}" for k, v in counts.items())


def sweep_kernel(
    target: list[torch.Tensor],
    source: list[torch.Tensor],
    block_ids: list[int],
    chunks: int,
    pool: torch.Tensor,
    offsets: list[int],
    total: int,
    repeats: int,
) -> list[dict[str, Any]]:
    """GPU time of the kernel's shapes and program counts reading the pool, and of the copy engines."""
    plan = plan_transfer(SPEC, target, block_ids, range(chunks), pool, offsets, None, 0, writes_cache=True)
    geometry = Geometry(SPEC, plan)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows: list[dict[str, Any]] = []
    for tuning in sweep_tunings():
        label = sweep_label(tuning)
        try:
            launch = triton_copy.Launch(SPEC, plan, geometry, to_page=False, tuning=tuning)
            steps = triton.cdiv(geometry.num_segments, launch.segments_per_step)
            for t in target:
                t.fill_(-1.0)
            compiled = launch.run(0, geometry.num_segments, steps)
            torch.cuda.synchronize()
            exact = all(torch.equal(a, b) for a, b in zip(target, source, strict=True))
            print(f"sweep {label}: {ptx_counts(compiled)} exact={exact}", flush=True)
            for per_sm in SWEEP_PROGRAMS_PER_SM:
                programs = per_sm * sms or steps
                ms = gpu_ms(functools.partial(launch.run, 0, geometry.num_segments, programs), repeats)
                rows.append(
                    {"shape": label, "programs": programs, "ms": ms, "gb_s": total / ms / 1e6, "exact": exact}
                )
        except Exception as exc:  # a shape that does not compile is reported, the sweep goes on
            print(f"sweep {label}: failed: {exc!r}"[:300], flush=True)
    try:
        from kvstore_kernels import cudart

        runtime = cudart.runtime()
        cache_addrs, page_addrs = geometry.segment_addresses(np.asarray(plan.blocks))
        sizes = np.full(cache_addrs.size, geometry.segment_bytes, dtype=np.uint64)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):

            def batch() -> None:
                runtime.memcpy_batch_async(cache_addrs.ravel(), page_addrs.ravel(), sizes, stream.cuda_stream)

            started = time.perf_counter()
            batch()
            host_ms = (time.perf_counter() - started) * 1e3
            ms = gpu_ms(batch, max(2, repeats // 4))
        rows.append(
            {
                "shape": f"copy engines, one batched call (host {host_ms:.2f} ms)",
                "programs": 0,
                "ms": ms,
                "gb_s": total / ms / 1e6,
                "exact": None,
            }
        )
    except Exception as exc:
        print(f"sweep copy engines: failed: {exc!r}"[:300], flush=True)
    return rows


IN_FLIGHT = 4  # loads issued before the first is waited for: an engine's batch of requests
# Rows also timed on their own, repeated back to back: the acceptance's rows (keys + registered
# cache: how an engine's connector calls a load) and the copy they are compared with.
BACK_TO_BACK = (
    "d2d copy",
    "load, CPU tier",
    "load, GPU tier",
    "load, CPU tier, keys + registered cache",
    "load, GPU tier, keys + registered cache",
)


def measure(
    tokens: int, repeats: int, *, profile: bool = False, sweep: bool = False, daemon_poll_ms: float = 0.0
) -> dict[str, Any]:
    """Runs the rows (and `--profile`, `--sweep`); returns them with the acceptance checks.

    `daemon_poll_ms`: the daemon's `server.local_poll_ms`."""
    chunks = tokens // CHUNK
    blocks = tokens // BLOCK
    page_bytes = SPEC.page.page_bytes
    total = chunks * page_bytes
    pool_bytes = (total // (256 << 20) + 1) * (256 << 20)
    config = {
        "chunk_tokens": CHUNK,
        "tiers": {
            "cpu": {"bytes": 2 * pool_bytes, "slab_bytes": 256 << 20},
            "gpu": {
                "enabled": True,
                "bytes": pool_bytes,
                "slab_bytes": 256 << 20,
                "promote_after_hits": 1 << 30,
            },
        },
        "eviction": {"pin_fraction": 1.0},
        "server": {"local_poll_ms": daemon_poll_ms},
    }
    prompt_a = list(range(tokens))
    prompt_b = list(range(1 << 20, (1 << 20) + tokens))
    source_a, source_b, target = cache(blocks), cache(blocks), cache(blocks, fill=0.0)
    block_ids = list(range(blocks))
    results: dict[str, Any] = {}
    per_run = {
        f"{IN_FLIGHT} loads in flight, CPU tier": IN_FLIGHT,
        f"{IN_FLIGHT} loads in flight, GPU tier": IN_FLIGHT,
    }
    with running_daemon(config) as daemon, KVStoreClient.connect(daemon.address, SPEC) as client:
        assert client.store(prompt_a, source_a, block_ids) == chunks
        assert client.store(prompt_b, source_b, block_ids) == chunks
        started = time.perf_counter()
        pin = pb.PinRequest(
            namespace=client.namespace, keys=pack_keys(client.keys(prompt_b)), ttl_ms=3_600_000
        )
        client._rpc("Pin", pin)
        while tiers_of(client, prompt_b) != bytes([Tier.GPU]) * chunks:
            time.sleep(0.001)
        promote_s = time.perf_counter() - started
        assert tiers_of(client, prompt_a) == bytes([Tier.CPU]) * chunks
        registered = client.register_kv_caches(target)

        def check(source: list[torch.Tensor]) -> None:
            for got, want in zip(target, source, strict=True):
                if not torch.equal(got, want):
                    raise AssertionError("loaded bytes differ from the stored ones")

        def load(
            prompt: list[int], source: list[torch.Tensor], keys: Any = None, kv: Any = target
        ) -> Callable[[], None]:
            def run() -> None:
                assert client.load(prompt, kv, block_ids, keys=keys) == tokens

            for layer in target:  # the check below then sees this load's bytes
                layer.zero_()
            run()
            check(source)
            return run

        def in_flight(prompt: list[int], source: list[torch.Tensor], keys: Any) -> Callable[[], None]:
            def run() -> None:
                handles = [
                    client.load_async(prompt, registered, block_ids, keys=keys) for _ in range(IN_FLIGHT)
                ]
                assert [handle.wait() for handle in handles] == [tokens] * IN_FLIGHT

            for layer in target:  # the check below then sees this load's bytes
                layer.zero_()
            run()
            check(source)
            return run

        src, dst = (
            torch.empty(total, dtype=torch.uint8, device="cuda"),
            torch.empty(total, dtype=torch.uint8, device="cuda"),
        )
        sms = torch.cuda.get_device_properties(0).multi_processor_count

        def with_programs(programs: int | None, run: Callable[[], None]) -> Callable[[], None]:
            def timed() -> None:
                client._gpu_pools.max_programs = programs
                try:
                    run()
                finally:
                    client._gpu_pools.max_programs = None

            return timed

        hit = client._rpc(
            "Lookup",
            pb.LookupRequest(
                namespace=client.namespace, keys=pack_keys(client.keys(prompt_b)), lease=True, gpu_pools=[0]
            ),
        )
        lease = pb.LeaseRequest(namespace=client.namespace, lease_id=hit.lease_id, epoch=client.epoch)
        acquired = client._rpc("Acquire", lease)
        assert bytes(acquired.tiers) == bytes([Tier.GPU]) * chunks
        pool = client._gpu_pools.tensors[acquired.pools[0]]
        offsets = list(acquired.offsets)
        client._rpc("Release", lease)  # the Pin keeps the pages in the pool for what follows
        keys_a, keys_b = client.keys(prompt_a), client.keys(prompt_b)
        runs: dict[str, Callable[[], Any]] = {
            "d2d copy": lambda: dst.copy_(src),
            "load, CPU tier": load(prompt_a, source_a),
            "load, GPU tier": load(prompt_b, source_b),
            # An engine hashes a prompt's chunks once, when it looks the prompt up, and hands the
            # keys to the load it schedules next.
            "load, CPU tier, keys from the lookup": load(prompt_a, source_a, keys_a),
            "load, GPU tier, keys from the lookup": load(prompt_b, source_b, keys_b),
            # ... and registers its KV cache once (`register_kv_caches`), as vLLM's connectors do.
            "load, CPU tier, keys + registered cache": load(prompt_a, source_a, keys_a, registered),
            "load, GPU tier, keys + registered cache": load(prompt_b, source_b, keys_b, registered),
            # A batch of requests: each load's host work overlaps the copies of the loads before it.
            f"{IN_FLIGHT} loads in flight, CPU tier": in_flight(prompt_a, source_a, keys_a),
            f"{IN_FLIGHT} loads in flight, GPU tier": in_flight(prompt_b, source_b, keys_b),
        }
        client._gpu_pools.max_programs = sms  # the first call, which checks the bytes, with them too
        runs[f"load, GPU tier, {sms} programs"] = with_programs(sms, load(prompt_b, source_b))
        client._gpu_pools.max_programs = None
        for programs in (None, sms):
            options = TransferOptions(max_programs=programs)
            label = f"scatter only, {programs or 'default'} programs"
            runs[label] = functools.partial(
                scatter, SPEC, target, block_ids, range(chunks), pool, offsets, options=options
            )
        timings = in_turn(runs, repeats)
        # The method's timing (a warm-up call, then each call repeated, median): each row on its own,
        # so that no load follows a 21 ms one of the other tier (the acceptance rows).
        for name in BACK_TO_BACK:
            timings[f"{name}, back to back"] = median_s(runs[name], repeats)
        if sweep:
            swept = sweep_kernel(target, source_b, block_ids, chunks, pool, offsets, total, repeats)
            best = min((row for row in swept if row["exact"]), key=lambda row: row["ms"])
            results["sweep"] = swept
            print_table(
                ("kernel shape (reading the pool)", "programs", "ms", "GB/s"),
                [
                    [r["shape"], r["programs"], r["ms"], r["gb_s"]]
                    for r in sorted(swept, key=lambda r: r["ms"])[:25]
                ],
            )
            print(f"best: {best}")
            shape = next(t for t in sweep_tunings() if sweep_label(t) == best["shape"])
            triton_copy.DEVICE_TUNING, triton_copy.DEVICE_MAX_PROGRAMS = shape, best["programs"]
            timings["load, GPU tier, swept best"] = median_s(load(prompt_b, source_b), repeats)
            timings["scatter only, swept best"] = median_s(
                lambda: scatter(SPEC, target, block_ids, range(chunks), pool, offsets), repeats
            )
        if profile:
            steps = profile_load(client, prompt_b, target, block_ids, repeats)
            print_table(("GPU-tier load, step by step", "ms (median)"), list(steps.items()))
            waits = idle_effect(
                load(prompt_b, source_b, keys_b, registered),
                load(prompt_a, source_a, keys_a, registered),
                repeats,
            )
            print_table(("GPU-tier load (keys + registered cache) ...", "ms (median)"), list(waits.items()))
            results["idle_effect_ms"] = waits
            for label, pause in (("back to back", None), ("after 20 ms asleep", lambda: time.sleep(0.02))):
                split = profile_load(
                    client, prompt_b, registered, block_ids, repeats, keys=keys_b, pause=pause
                )
                name = f"step by step (keys + registered cache), {label}"
                print_table((name, "ms (median)"), list(split.items()))
                results.setdefault("profile_idle", {})[name] = split
            warm = host_steps(client, registered, block_ids, chunks, pool, offsets)
            print_table(("host step after the reply, warm", "us (median)"), list(warm.items()))
            results["host_steps_us"] = warm
            plan = plan_transfer(
                SPEC, registered, block_ids, range(chunks), pool, offsets, None, 0, writes_cache=True
            )
            print(
                cprofile_loads(
                    lambda: kvstore_kernels._run(SPEC, plan, TransferOptions(), False), 300, top=30
                )
            )
            inner = profile_scatter(target, block_ids, chunks, pool, offsets, repeats)
            print_table(("public scatter call, host", "ms (median)"), list(inner.items()))
            print(cprofile_loads(load(prompt_b, source_b, keys_b, registered), repeats))
            results["profile"] = {"load_steps_ms": steps, "scatter_steps_ms": inner}
        stats = client.stats()
    d2d_in_turn = total / timings["d2d copy"] / 1e9
    d2d_back = total / timings["d2d copy, back to back"] / 1e9
    rows: list[list[Any]] = []
    for name, seconds in timings.items():
        seconds /= per_run.get(name, 1)  # per load
        gb_s = total / seconds / 1e9
        d2d = d2d_back if name.endswith(", back to back") else d2d_in_turn  # the copy timed alike
        rows.append([name, seconds * 1e3, gb_s, gb_s / d2d])
        results[name] = {"ms": seconds * 1e3, "gb_s": gb_s, "x_d2d": gb_s / d2d}

    def rate(name: str) -> float:
        return float(results[name]["gb_s"])

    def holds(gpu_row: str, cpu_row: str, d2d: float) -> tuple[bool, bool]:
        return rate(gpu_row) >= 10 * rate(cpu_row), rate(gpu_row) >= 0.5 * d2d

    checks: dict[str, bool] = {}
    ten, half = holds(
        "load, GPU tier, keys + registered cache, back to back",
        "load, CPU tier, keys + registered cache, back to back",
        d2d_back,
    )
    checks["acceptance: GPU-tier load >= 10x CPU-tier load (keys + registered cache, back to back)"] = ten
    checks["acceptance: GPU-tier load >= 0.5x d2d copy (keys + registered cache, back to back)"] = half
    ten, half = holds("load, GPU tier, back to back", "load, CPU tier, back to back", d2d_back)
    checks["also: the same, keys hashed and cache checked per call: >= 10x"] = ten
    checks["also: the same, keys hashed and cache checked per call: >= 0.5x d2d"] = half
    for variant in ("", ", keys from the lookup", ", keys + registered cache"):
        ten, half = holds(f"load, GPU tier{variant}", f"load, CPU tier{variant}", d2d_in_turn)
        label = f"also: in turn{variant}"
        checks[f"{label}: >= 10x"] = ten
        checks[f"{label}: >= 0.5x d2d"] = half
    ten, half = holds(
        f"{IN_FLIGHT} loads in flight, GPU tier", f"{IN_FLIGHT} loads in flight, CPU tier", d2d_in_turn
    )
    checks[f"also: {IN_FLIGHT} loads in flight: >= 10x"] = ten
    checks[f"also: {IN_FLIGHT} loads in flight: >= 0.5x d2d"] = half
    return {
        "geometry": {
            "layers": LAYERS,
            "kv_heads": HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "bfloat16",
            "block": BLOCK,
            "chunk_tokens": CHUNK,
            "tokens": tokens,
            "bytes": total,
        },
        "repeats": repeats,
        "daemon_poll_ms": daemon_poll_ms,
        "promote_by_pin_ms": promote_s * 1e3,
        "rows": rows,
        "results": results,
        "gpu_vs_cpu_load": rate("load, GPU tier, keys + registered cache, back to back")
        / rate("load, CPU tier, keys + registered cache, back to back"),
        "acceptance": checks,
        "daemon_gpu_tier": stats["tiers"]["gpu"],
    }


def print_report(measured: dict[str, Any]) -> None:
    geometry = measured["geometry"]
    size = f"{geometry['bytes'] / 2**30:.2f} GiB in {geometry['tokens'] // CHUNK} pages"
    print(
        f"{geometry['tokens']} tokens, {size}; pin -> GPU tier in {measured['promote_by_pin_ms']:.1f} ms; "
        f"daemon polls {measured.get('daemon_poll_ms', 0):g} ms after a call"
    )
    print_table(("what (ms and GB/s per load)", "ms", "GB/s", "x d2d"), measured["rows"])
    print_table(("acceptance", "holds"), list(measured["acceptance"].items()))
    print(f"GPU-tier load / CPU-tier load (back to back): {measured['gpu_vs_cpu_load']:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="time each step of a GPU-tier load")
    parser.add_argument("--sweep", action="store_true", help="time the kernel's shapes reading the pool")
    parser.add_argument(
        "--daemon-poll-ms", type=float, default=0.0, help="the daemon's server.local_poll_ms (default 0)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_tier.py needs a CUDA device")
    measured = measure(
        args.tokens, args.repeats, profile=args.profile, sweep=args.sweep, daemon_poll_ms=args.daemon_poll_ms
    )
    print_report(measured)
    path = write_results("gpu_tier", {key: value for key, value in measured.items() if key != "rows"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
