"""Page transfer benchmark: gather/scatter GB/s against the PCIe link, and the model's slowdown.

Llama-3.1-8B geometry (32 layers, 8 KV heads, head_dim 128, bf16), block_size 16, pages of
256 tokens, 8k tokens (1 GiB) on a random block table, into and out of anonymous shared
memory pinned with cudaHostRegister (as the client pins the daemon's arena). Per layout and
direction, in one run:

- memcpy: one cudaMemcpyAsync of the same bytes (contiguous GPU tensor <-> the pinned
  buffer), the PCIe limit; "both ways" runs one each way on two streams. memcpy/pages: one
  cudaMemcpyAsync per 32 MiB page (x2: alternating between two streams), the staged path's
  copies without their packs.
- The per-block baselines (vLLM's swap_blocks: one cudaMemcpyAsync per block and layer):
  per_block_cuda issues them from the tightest Python loop (the copy list made beforehand,
  libcudart's cudaMemcpyAsync called through ctypes, 32768 calls of 32 KiB); per_block_batch
  hands the same list to one cudaMemcpyBatchAsync; per_block_python is the plain loop that
  indexes cache and buffer for every copy (per_block_torch, torch `copy_` on views made
  once, is in transfer_cases).
- kernel@N: the Triton kernel capped at N programs (N SMs at most); kernel: its default.
- copy_engine: the copy engines (2-D copy per block for cross_layer, else one batch).
- staged: the kernel packs each piece of a page into a device staging ring (device to
  device, 32 programs by default), one cudaMemcpyAsync per piece moves it over PCIe
  (scatter: the reverse); staged@N: N pack programs; staged/serial: packs and copies in one
  stream (no overlap); staged/<S>MiB: a ring of S MiB per direction (4 slots of S/4 MiB;
  the default is 128 MiB, 32 MiB slots: one 8B page per copy); staged/2streams: the copies
  alternate between two side streams.
- d2d@N: the staged path's pack alone (kernel, N programs, cache <-> a device buffer):
  the page bytes over this rate is how long a pack burst holds its N SMs.
- auto: one public call (`kvstore_kernels.gather`/`scatter`, default options), timed alone:
  the host's checks and issue included, on cache tensors seen before (what a serving engine
  does); auto/cold: the same as the first call on those tensors (full checks); auto@N:
  `max_programs=N`, at most N SMs. auto x4 / memcpy x4: four calls back to back (one
  synchronisation), so each call's host work overlaps the previous call's copies.
- both directions at once: a gather and a scatter on two streams (disjoint blocks).
- interference: a stream of bf16 8192³ products beside each variant (`interference`).
- GPU tier (`bench/gpu_tier.py`, after the layouts; `--no-gpu-tier` leaves it out): a daemon
  with both tiers, the same 8k tokens loaded by `client.load` from its GPU tier vs from its CPU
  tier vs a device-to-device copy of the same bytes, timed in turn in one run; its table and
  its acceptance checks are printed after the others and kept under "gpu_tier" in the JSON.

Model rows (`--models mla sliding`, instead of the table above), each through the public client
(`KVStoreClient.store` / `load` with the chunk keys, as an engine passes them) against a real
kvstored, each timed in turn with a pinned memcpy of the same bytes (`--model-tokens`, default
8k and 32k):

- mla: DeepSeek-V3's MLA cache (61 layers, one 576-wide latent per token, vLLM's MLA block
  size 64), bf16 and fp8 (float8_e4m3fn): a prompt's pages stored (the namespace cleared before
  each, untimed) and loaded; and the copy alone (`kvstore_kernels.gather` / `scatter` into the
  memcpy's pinned buffer, no daemon), which tells what the client's control calls add.
- llama: Llama-3.1-8B (flash_attn, bf16, blocks of 16; `--llama-tokens`, default 8k) the same way.
- Each mla and llama row also keeps the host timestamps of `reps` more stores and loads, each after
  its memcpy as in the timed rounds (`steps`, `step_rounds`; `StepClock`): the round trips, the
  host work before the copy, the wait, the closing call.
- sliding: gpt-oss-120b (36 layers alternating sliding window 128 and full attention, 8 KV
  heads, head dim 64, bf16), one namespace per KV-cache group as the vLLM connector keys them.
  A request resumed at the end of the prompt loads the full layers' every chunk and the
  sliding layers' last chunk(s) only (the w - 1 tokens its next token attends to), against
  every chunk of both groups: bytes and time of each.

`--dry-run` runs the model rows on CPU (small prompts, the torch reference path): that they
run and load the right bytes, not their speed.

`--sweep` instead measures kernel shapes (bytes per load, segments per step, warps,
programs, cache hints) and the copy-engine paths' issue cost, for choosing the defaults.

    python bench/transfer.py            # the table above; bench/results/transfer.json
    python bench/transfer.py --partial /tmp/t.json   # also dump the rows after each layout
    python bench/transfer.py --sweep    # bench/results/transfer-sweep.json
    python bench/transfer.py --profile  # the public call's host time, step by step
    python bench/transfer.py --variants memcpy auto --pairs memcpy auto+auto --name t  # a subset
    python bench/transfer.py --models mla sliding --name transfer-mla-sliding-h100
    python bench/transfer.py --dry-run  # the model rows on CPU, small prompts
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.*` when run as a script

from bench import gpu_tier  # noqa: E402
from bench.common import print_table, running_daemon, write_results  # noqa: E402
from bench.interference import MatmulStream  # noqa: E402
from bench.transfer_cases import (  # noqa: E402
    CAPS,
    CHUNK_TOKENS,
    GPT_OSS_WINDOW,
    Enqueue,
    HostCopy,
    ModelCache,
    Setup,
    StepClock,
    against,
    both_ways,
    copy_engines,
    daemon_config,
    deepseek_v3_spec,
    device_pack,
    gpt_oss_spec,
    kernel,
    make_spec,
    memcpy,
    memcpy_pages,
    per_block_cuda,
    per_block_python,
    staged_path,
    step_summary,
    synchronize,
    timed,
    timed_against,
    timed_pair,
    verify,
    wait_reserved,
    walls_in_turn,
    window_chunks,
)
from kvstore_client import KVStoreClient  # noqa: E402
from kvstore_kernels import (  # noqa: E402
    TransferOptions,
    copy_engine,
    cudart,
    gather,
    scatter,
    staged,
    triton_copy,
)

MiB = 1 << 20


def interference(matmul: MatmulStream, enqueues: list[Enqueue], row: dict[str, Any]) -> dict[str, Any]:
    """The products' slowdown beside `enqueues` (each on its own side stream), timed as in `row`."""
    return matmul.beside(enqueues, row["ms"], row["issue_ms"])._asdict()


def guarded(log: list[str], name: str, function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)`; a failure is logged and gives None, so the rest of the run goes on."""
    try:
        return function(*args)
    except Exception:
        log.append(f"{name}:\n{traceback.format_exc()}")
        print(f"FAILED {name}", file=sys.stderr, flush=True)
        return None


def with_interference(
    log: list[str],
    name: str,
    row: dict[str, Any],
    matmul: MatmulStream,
    enqueues: list[Enqueue],
    repeats: int,
) -> None:
    """Add `row["interference"]`: `repeats` measurements of the products beside `enqueues`."""
    runs = [guarded(log, f"interference {name}", interference, matmul, enqueues, row) for _ in range(repeats)]
    row["interference"] = [run for run in runs if run is not None]


# -- the full run ---------------------------------------------------------------------------------


def throughput_variants(setup: Setup, to_page: bool, num_sms: int) -> dict[str, Enqueue]:
    if setup.layout.startswith("vllm"):  # blocks are not packed runs: no per-block copy baselines
        return {
            "memcpy": memcpy(setup, to_page),
            "kernel": kernel(setup, to_page, None),
            "staged": staged_path(setup, to_page),
            "auto": setup.call(to_page, None),
            "auto/cold": setup.call(to_page, None, cold=True),
            "auto/per-layer": setup.per_layer(to_page),
            "memcpy x4": repeated(memcpy(setup, to_page), 4),
            "auto x4": repeated(setup.call(to_page, None), 4),
        }
    variants = {
        "memcpy": memcpy(setup, to_page),
        # The staged path's copies alone: one per 32 MiB page, on one side stream or two in turn.
        "memcpy/pages": memcpy_pages(setup, to_page),
        "memcpy/pages x2": memcpy_pages(setup, to_page, streams=2),
        "memcpy/pages+events": memcpy_pages(setup, to_page, handoff=True),
        "per_block_python": per_block_python(setup, to_page),
        "per_block_cuda": per_block_cuda(setup, to_page),
        "per_block_batch": copy_engines(setup, to_page, "1d"),
        "kernel@2": kernel(setup, to_page, 2),
        **{f"kernel@{cap or 'all'}": kernel(setup, to_page, cap or num_sms) for cap in CAPS},
        "kernel": kernel(setup, to_page, None),
        "copy_engine": copy_engines(setup, to_page),
        "staged": staged_path(setup, to_page),
        "staged/serial": staged_path(setup, to_page, overlap=False),
        "staged/64MiB": staged_path(setup, to_page, staging_bytes=64 * MiB),
        "staged/2streams": staged_path(setup, to_page, copy_streams=2),
        # Public calls, each timed alone (issue + run, synchronised): "auto" on cache tensors
        # seen before (a serving engine's case), "auto/cold" as the first call on them.
        "auto": setup.call(to_page, None),
        "auto/cold": setup.call(to_page, None, cold=True),
        **{f"auto@{n}": setup.call(to_page, TransferOptions(max_programs=n)) for n in AUTO_CAPS},
        # Four calls back to back, as a serving engine issues them: each call's host work
        # (validation, tables) overlaps the copies of the one before.
        "memcpy x4": repeated(memcpy(setup, to_page), 4),
        "auto x4": repeated(setup.call(to_page, None), 4),
    }
    if setup.layout == "flash_attn":  # the staged path's knobs: pack programs, slot size
        for programs in STAGED_PROGRAMS:
            variants[f"staged@{programs}"] = staged_path(setup, to_page, programs)
        for programs in (16, 32, 64):  # how long a pack burst holds its SMs: bytes / this rate
            variants[f"d2d@{programs}"] = device_pack(setup, to_page, programs)
    return variants


def picked(variants: dict[str, Any], names: list[str] | None) -> dict[str, Any]:
    """The variants named in `names` (None: all); the rest are never built into a row."""
    return variants if names is None else {name: v for name, v in variants.items() if name in names}


def repeated(enqueue: Enqueue, times: int) -> Enqueue:
    def enqueue_all() -> int:
        return sum(enqueue() for _ in range(times))

    return enqueue_all


STAGED_PROGRAMS = tuple(n for n in (8, 16, 32, 64) if n != staged.DEFAULT_PROGRAMS)
AUTO_CAPS = (4, 8, 16)  # public calls with max_programs: at most that many SMs
INTERLEAVED = ("auto", "auto@16", "auto/cold")  # also timed in turn with memcpy (`timed_against`)
INTERLEAVED_PAIRS = ("auto+auto", "auto/cold+auto/cold")


def pair_variants(setup: Setup) -> dict[str, tuple[Enqueue, Enqueue]]:
    """(gather, scatter) pairs for both directions at once; the scatter uses the second table."""
    g_kernel, s_kernel = kernel(setup, True, None), kernel(setup, False, None, second=True)
    pairs = {
        "memcpy": (memcpy(setup, True), memcpy(setup, False, second=True)),
        "kernel+kernel": (g_kernel, s_kernel),
        "kernel@16+kernel@16": (kernel(setup, True, 16), kernel(setup, False, 16, second=True)),
        "copy_engine+copy_engine": (copy_engines(setup, True), copy_engines(setup, False, second=True)),
        "staged+staged": (staged_path(setup, True), staged_path(setup, False, second=True)),
        "staged/serial+staged/serial": (
            staged_path(setup, True, overlap=False),
            staged_path(setup, False, overlap=False, second=True),
        ),
        "auto+auto": (setup.call(True, None), setup.call(False, None, second=True)),
        "auto/cold+auto/cold": (
            setup.call(True, None, cold=True),
            setup.call(False, None, second=True, cold=True),
        ),
        "auto@16+auto@16": (
            setup.call(True, TransferOptions(max_programs=16)),
            setup.call(False, TransferOptions(max_programs=16), second=True),
        ),
    }
    if setup.layout != "cross_layer":  # 1-D copy batches: 23-35 GB/s, measured before
        del pairs["copy_engine+copy_engine"]
    return pairs


INTERFERENCE_VARIANTS = (
    "memcpy",
    "kernel@2",
    "copy_engine",
    "staged",
    "staged/serial",
    "staged/64MiB",
    "staged/2streams",
    *(f"staged@{n}" for n in STAGED_PROGRAMS),
    "auto",
    "auto@16",
)
INTERFERENCE_PAIRS = (
    "memcpy",
    "kernel+kernel",
    "copy_engine+copy_engine",
    "staged/serial+staged/serial",
    "auto+auto",
)
VERIFIED = (
    "kernel",
    "kernel@all",
    "copy_engine",
    "per_block_batch",
    "staged",
    "staged/serial",
    "staged/64MiB",
    "staged/2streams",
    "auto",
    "auto/cold",
    *(f"auto@{n}" for n in AUTO_CAPS),
)


def full_layout(
    args: argparse.Namespace, log: list[str], setup: Setup, matmul: MatmulStream, num_sms: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """One layout's rows: each direction's variants, then both directions at once."""
    layout, rows, pairs, interleaved = setup.layout, [], [], []
    measure_interference = layout in args.interference_layouts
    for to_page in (True, False):
        direction = "gather" if to_page else "scatter"
        variants = picked(throughput_variants(setup, to_page, num_sms), args.variants)
        # The per-block variants hold tens of thousands of objects: keep them out of the cyclic
        # collector's scans, which otherwise land in the timed calls as millisecond pauses.
        gc.collect()
        gc.freeze()
        checks = {
            name: guarded(log, f"verify {layout} {direction} {name}", verify, setup, to_page, variants[name])
            for name in VERIFIED
            if name in variants
        }
        for name, enqueue in variants.items():
            reps = 1 if name.startswith("per_block") else args.reps
            row = guarded(log, f"{layout} {direction} {name}", timed, enqueue, reps)
            if row is None:
                continue
            row.update(layout=layout, direction=direction, variant=name, ok=checks.get(name))
            if measure_interference and name in INTERFERENCE_VARIANTS:
                with_interference(log, f"{layout} {direction} {name}", row, matmul, [enqueue], args.repeats)
            rows.append(row)
            print(
                f"{layout:12} {direction:8} {name:18} {row['gbps']:7.2f} GB/s "
                f"slowdown {median_slowdown(row)}",
                flush=True,
            )
        for name in INTERLEAVED:  # the acceptance ratios, each in turn with memcpy
            if name in variants and "memcpy" in variants:
                turns = guarded(
                    log, f"{layout} {direction} {name} vs memcpy", timed_against,
                    variants[name], variants["memcpy"], args.reps,
                )  # fmt: skip
                if turns is not None:
                    interleaved.append({"layout": layout, "direction": direction, "variant": name, **turns})
                    print(f"{layout:12} {direction:8} {name:18} in turn with memcpy: {turns['ratio']:.3f}")
    for name, (first, second) in picked(pair_variants(setup), args.pairs).items():
        row = guarded(log, f"{layout} both {name}", timed_pair, first, second, args.reps)
        if row is None:
            continue
        row.update(layout=layout, variant=name)
        if measure_interference and name in INTERFERENCE_PAIRS:
            with_interference(log, f"{layout} both {name}", row, matmul, [first, second], args.repeats)
        pairs.append(row)
        print(
            f"{layout:12} both     {name:24} {row['gbps']:7.2f} GB/s slowdown {median_slowdown(row)}",
            flush=True,
        )
    chosen = picked(pair_variants(setup), args.pairs)
    for name in INTERLEAVED_PAIRS:
        if name in chosen and "memcpy" in chosen:
            turns = guarded(
                log, f"{layout} both {name} vs memcpy", timed_against,
                both_ways(*chosen[name]), both_ways(*chosen["memcpy"]), args.reps,
            )  # fmt: skip
            if turns is not None:
                interleaved.append({"layout": layout, "direction": "both", "variant": name, **turns})
                print(f"{layout:12} both     {name:18} in turn with memcpy: {turns['ratio']:.3f}")
    return rows, pairs, interleaved


def run_full(args: argparse.Namespace, log: list[str]) -> dict[str, Any]:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    matmul = MatmulStream(8192)
    rows: list[dict[str, Any]] = []
    pairs: list[dict[str, Any]] = []
    interleaved: list[dict[str, Any]] = []
    for layout in args.layouts:
        setup = Setup(layout, args.tokens)
        layout_rows, layout_pairs, layout_turns = full_layout(args, log, setup, matmul, num_sms)
        setup.release()
        rows += layout_rows
        pairs += layout_pairs
        interleaved += layout_turns
        torch.cuda.empty_cache()
        if args.partial:
            Path(args.partial).write_text(json.dumps({"rows": rows, "both_ways": pairs, "errors": log}))
    return {"rows": rows, "both_ways": pairs, "interleaved": interleaved}


def median_slowdown(row: dict[str, Any] | None, key: str = "slowdown") -> float | None:
    runs = (row or {}).get("interference") or []
    values = [r[key] for r in runs if r["products"] >= 5 and key in r]
    return statistics.median(values) if values else None


def beside_gbps(row: dict[str, Any] | None) -> float | None:
    """The transfer's own rate while the products ran (median over the measurements)."""
    return median_slowdown(row, "transfer_gbps")


def summarize(result: dict[str, Any]) -> tuple[list[list[Any]], list[list[Any]], list[list[Any]]]:
    """(throughput table, both-ways table, acceptance table)."""
    rows = {(r["layout"], r["direction"], r["variant"]): r for r in result["rows"]}
    pairs = {(r["layout"], r["variant"]): r for r in result["both_ways"]}
    turns = {(r["layout"], r["direction"], r["variant"]): r["ratio"] for r in result.get("interleaved", [])}

    def ratio(row: dict[str, Any] | None, base: dict[str, Any] | None) -> float | None:
        return row["gbps"] / base["gbps"] if row and base else None

    def cell(value: float | None, digits: int = 3) -> Any:
        return "-" if value is None else round(value, digits)

    table = [
        [layout, direction, variant, round(row["gbps"], 2),
         cell(ratio(row, rows.get((layout, direction, "memcpy")))),
         cell(ratio(row, rows.get((layout, direction, "per_block_cuda"))), 1),
         cell(median_slowdown(row)), cell(median_slowdown(row, "mean_slowdown")), cell(beside_gbps(row), 1),
         "-" if row.get("ok") is None else row["ok"]]
        for (layout, direction, variant), row in rows.items()
    ]  # fmt: skip
    pair_table = [
        [layout, variant, round(row["gbps"], 2), cell(ratio(row, pairs.get((layout, "memcpy")))),
         cell(median_slowdown(row)), cell(median_slowdown(row, "mean_slowdown")), cell(beside_gbps(row), 1)]
        for (layout, variant), row in pairs.items()
    ]  # fmt: skip
    accept: list[list[Any]] = []

    def item(what: str, value: float | None, limit: float, above: bool = True) -> None:
        ok = value is not None and (value >= limit if above else value <= limit)
        shown = "-" if value is None else f"{value:.3f}"
        accept.append([what, shown, f"{'>=' if above else '<='} {limit}", ok])

    for layout in ("flash_attn", "flashinfer", "cross_layer"):
        for direction, no_cap, capped in (("gather", 0.93, 0.93), ("scatter", 0.90, 0.88)):

            def of(
                variant: str, base: str = "memcpy", key: tuple[str, str] = (layout, direction)
            ) -> float | None:
                return ratio(rows.get((*key, variant)), rows.get((*key, base)))

            for variant, what, limit in (
                ("auto", "one call (no cap)", no_cap),
                ("auto/cold", "first call on the tensors", no_cap),
                ("auto@16", "one call (<=16 SMs)", capped),
            ):
                item(f"{layout} {direction} {variant}, {what} / memcpy", of(variant), limit)
                turn = turns.get((layout, direction, variant))
                item(f"{layout} {direction} {variant}, {what} / memcpy, in turn", turn, limit)
            item(f"{layout} {direction} auto x4 back to back / memcpy x4", of("auto x4", "memcpy x4"), no_cap)
            item(f"{layout} {direction} auto / per_block_python", of("auto", "per_block_python"), 20)
            item(f"{layout} {direction} auto / per_block_cuda", of("auto", "per_block_cuda"), 20)
            item(f"{layout} {direction} auto / per_block_batch", of("auto", "per_block_batch"), 20)
            item(
                f"{layout} {direction} slowdown at default",
                median_slowdown(rows.get((layout, direction, "auto"))),
                1.10,
                above=False,
            )
        auto_pair = pairs.get((layout, "auto+auto"))
        item(f"{layout} both ways auto / memcpy", ratio(auto_pair, pairs.get((layout, "memcpy"))), 0.85)
        cold_pair = pairs.get((layout, "auto/cold+auto/cold"))
        item(f"{layout} both ways auto/cold / memcpy", ratio(cold_pair, pairs.get((layout, "memcpy"))), 0.85)
        item(f"{layout} both ways auto / memcpy, in turn", turns.get((layout, "both", "auto+auto")), 0.85)
        item(
            f"{layout} both ways auto/cold / memcpy, in turn",
            turns.get((layout, "both", "auto/cold+auto/cold")),
            0.85,
        )
        item(f"{layout} both ways slowdown at default", median_slowdown(auto_pair), 1.10, above=False)
    return table, pair_table, accept


# -- model geometries through the public client ---------------------------------------------------

MLA_DTYPES = ("bfloat16", "float8_e4m3fn")


def mla_rows(dtype: str, tokens: int, reps: int, way: ClientWay) -> list[dict[str, Any]]:
    """DeepSeek-V3's MLA pages of a `tokens` prompt through the public client (`client_rows`)."""
    return client_rows("deepseek-v3", deepseek_v3_spec(dtype), tokens, reps, way)


def llama_rows(tokens: int, reps: int, way: ClientWay) -> list[dict[str, Any]]:
    """Llama-3.1-8B's pages (flash_attn, bf16, blocks of 16) through the public client."""
    return client_rows("llama-3.1-8b", make_spec("flash_attn"), tokens, reps, way)


@dataclasses.dataclass(frozen=True)
class ClientWay:
    """How the client rows call the client and run the daemon. `registered`: the KV caches given
    as `client.register_kv_caches` returns them, as vLLM's and SGLang's adapters pass them (else
    the bare tensor lists, fingerprinted on every call). `poll_ms`: the daemon's
    `server.local_poll_ms`."""

    registered: bool = True
    poll_ms: float = 0.0


def client_rows(model: str, spec: Any, tokens: int, reps: int, way: ClientWay) -> list[dict[str, Any]]:
    """A prompt's pages stored, then loaded, by the public client, each in turn with a pinned
    memcpy of the same bytes (the namespace cleared before each store); and the copy alone,
    `kvstore_kernels.gather` / `scatter` into the memcpy's pinned buffer, no daemon: what the
    client's control calls add. Then `reps` more stores and loads, each after its memcpy as in
    the timed rounds, with their steps' host timestamps (`StepClock`)."""
    cache = ModelCache(spec, tokens, seed=1)
    moved = cache.num_chunks * spec.page.page_bytes
    copy = HostCopy(moved)
    try:
        config = daemon_config(spec.page.page_bytes, cache.num_chunks)
        config["server"] = {"local_poll_ms": way.poll_ms}
        with (
            running_daemon(config) as daemon,
            KVStoreClient.connect(daemon.address, spec) as client,
        ):
            wait_reserved(client)
            keys = client.keys(list(range(tokens)))
            source, target = cache.source, cache.target
            if way.registered:
                source, target = client.register_kv_caches(source), client.register_kv_caches(target)

            def store() -> None:
                if client.store(None, source, cache.table, keys=keys) != cache.num_chunks:
                    raise RuntimeError("store: the daemon took fewer pages than the prompt has")

            def load() -> None:
                if client.load(None, target, cache.table, keys=keys) != tokens:
                    raise RuntimeError("load: fewer tokens than were stored")

            offsets = [chunk * spec.page.page_bytes for chunk in range(cache.num_chunks)]
            chunks = range(cache.num_chunks)
            store()
            load()
            ok = cache.loaded_right(0)
            runs = {
                "memcpy store": copy.run(moved, True),
                "store": store,
                "gather alone": lambda: gather(spec, cache.source, cache.table, chunks, copy.host, offsets),
                "memcpy load": copy.run(moved, False),
                "load": load,
                "scatter alone": lambda: scatter(spec, cache.target, cache.table, chunks, copy.host, offsets),
            }
            walls = walls_in_turn(runs, reps, before={"store": client.clear})
            steps = client_steps(client, runs, reps)
            cache.poison()  # the loads of the steps' rounds, checked too
            load()
            synchronize()
            ok = ok and cache.loaded_right(0)
            cache.poison()  # the copy alone, checked: pages gathered, then scattered back
            runs["gather alone"]()
            runs["scatter alone"]()
            synchronize()
            ok_alone = cache.loaded_right(0)
            arena = client.stats()["client"]["arena"]
    finally:
        copy.release()
    common = {
        "model": model,
        "dtype": spec.dtype,
        "tokens": tokens,
        "page_bytes": spec.page.page_bytes,
        "registered": way.registered,
        "daemon_poll_ms": way.poll_ms,
    }
    return [
        {
            **common,
            "direction": way,
            **against(walls[way], walls[f"memcpy {baseline}"], moved),
            "ok": ok_alone if way.endswith("alone") else ok,
            "arena": arena,
            **({"steps": step_summary(steps[way]), "step_rounds": steps[way]} if way in steps else {}),
        }
        for way, baseline in (
            ("store", "store"),
            ("gather alone", "store"),
            ("load", "load"),
            ("scatter alone", "load"),
        )
    ]


def client_steps(client: Any, runs: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[Any]]:
    """`reps` stores and loads, each after its memcpy (and a store after a Clear), as in the timed
    rounds, with the host timestamps of their steps."""
    clock = StepClock()
    rounds: dict[str, list[Any]] = {"store": [], "load": []}
    with clock.installed():
        for _ in range(reps):
            for way in rounds:
                runs[f"memcpy {way}"]()
                if way == "store":
                    client.clear()
                synchronize()
                clock.take()
                clock.mark("call")
                runs[way]()
                synchronize()
                clock.mark("synchronised")
                rounds[way].append(clock.take())
    return rounds


def sliding_rows(tokens: int, reps: int) -> list[dict[str, Any]]:
    """gpt-oss-120b, a request resumed at `tokens`: the full-attention group's every chunk and the
    sliding group's window, against every chunk of both; each in turn with a pinned memcpy (to the
    device) of the same bytes."""
    full, sliding = (
        ModelCache(gpt_oss_spec(False), tokens, seed=2),
        ModelCache(gpt_oss_spec(True), tokens, seed=3),
    )
    page_bytes, chunks = full.spec.page.page_bytes, full.num_chunks
    first = {"window": chunks - window_chunks(GPT_OSS_WINDOW, CHUNK_TOKENS), "every token": 0}
    moved = {name: (2 * chunks - start) * page_bytes for name, start in first.items()}
    copy = HostCopy(moved["every token"])
    try:
        with (
            running_daemon(daemon_config(page_bytes, 2 * chunks)) as daemon,
            KVStoreClient.connect(daemon.address, full.spec) as full_client,
            KVStoreClient.connect(daemon.address, sliding.spec) as sliding_client,
        ):
            wait_reserved(full_client)
            groups = [(full_client, full), (sliding_client, sliding)]
            keys = [client.keys(list(range(tokens))) for client, _ in groups]
            for (client, cache), group_keys in zip(groups, keys, strict=True):
                if client.store(None, cache.source, cache.table, keys=group_keys) != chunks:
                    raise RuntimeError("store: the daemon took fewer pages than the prompt has")

            def request(start: int) -> Callable[[], None]:
                """Both groups' loads issued, then waited for, as the connector does per request."""

                def run() -> None:
                    handles = [
                        full_client.load_async(None, full.target, full.table, keys=keys[0]),
                        sliding_client.load_async(
                            None, sliding.target, sliding.blocks_of(start), keys=keys[1][start:]
                        ),
                    ]
                    if [handle.wait() for handle in handles] != [tokens, tokens - start * CHUNK_TOKENS]:
                        raise RuntimeError("load: fewer tokens than were stored")

                return run

            runs, ok = {}, {}
            for name, start in first.items():
                full.poison()
                sliding.poison()
                request(start)()
                ok[name] = full.loaded_right(0) and sliding.loaded_right(start)
                runs[f"memcpy {name}"], runs[name] = copy.run(moved[name], False), request(start)
            walls = walls_in_turn(runs, reps)
    finally:
        copy.release()
    return [
        {
            "model": "gpt-oss-120b",
            "tokens": tokens,
            "load": name,
            "chunks": {"full": chunks, "sliding": chunks - start},
            **against(walls[name], walls[f"memcpy {name}"], moved[name]),
            "ok": ok[name],
        }
        for name, start in first.items()
    ]


def run_models(args: argparse.Namespace, log: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = {"mla": [], "sliding": [], "llama": []}
    way = ClientWay(registered=args.register_caches, poll_ms=args.daemon_poll_ms)
    if "llama" in args.models:
        for tokens in args.llama_tokens:
            result["llama"] += guarded(log, f"llama {tokens}", llama_rows, tokens, args.reps, way) or []
            print_progress(result["llama"][-4:])
    for tokens in args.model_tokens:
        if "mla" in args.models:
            for dtype in MLA_DTYPES:
                result["mla"] += (
                    guarded(log, f"mla {dtype} {tokens}", mla_rows, dtype, tokens, args.reps, way) or []
                )
                print_progress(result["mla"][-4:])
        if "sliding" in args.models:
            result["sliding"] += guarded(log, f"sliding {tokens}", sliding_rows, tokens, args.reps) or []
            print_progress(result["sliding"][-2:])
    return result


def print_progress(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        what = row.get("direction") or row.get("load")
        speed = f"{row['gbps']:7.2f} GB/s {row['x_memcpy']:.3f}x memcpy"
        print(f"{row['model']:12} {row['tokens']:6} {what:11} {speed}", flush=True)


def print_models(result: dict[str, Any]) -> None:
    mib = 1 << 20
    client_rows = result.get("llama", []) + result["mla"]
    if client_rows:
        print_table(
            ["model", "dtype", "tokens", "way", "MiB", "ms", "GB/s", "memcpy ms", "x memcpy", "ok"],
            [
                [r["model"], r["dtype"], r["tokens"], r["direction"], round(r["bytes"] / mib, 1),
                 round(r["ms"], 2), round(r["gbps"], 2), round(r["memcpy_ms"], 2), round(r["x_memcpy"], 3),
                 r["ok"]]
                for r in client_rows
            ],
        )  # fmt: skip
        print()
        for r in client_rows:  # where the client's time beyond the copy goes (median ms per step)
            if r.get("steps"):
                steps = ", ".join(f"{step['to']} {step['ms']:.3f}" for step in r["steps"])
                print(f"{r['model']} {r['dtype']} {r['tokens']} {r['direction']}: {steps}")
        print()
    if result["sliding"]:
        print_table(
            ["model", "tokens", "resumed request loads", "chunks full/sliding", "MiB", "ms", "GB/s",
             "memcpy ms", "x memcpy", "ok"],
            [
                [r["model"], r["tokens"], r["load"], f"{r['chunks']['full']}/{r['chunks']['sliding']}",
                 round(r["bytes"] / mib, 1), round(r["ms"], 2), round(r["gbps"], 2), round(r["memcpy_ms"], 2),
                 round(r["x_memcpy"], 3), r["ok"]]
                for r in result["sliding"]
            ],
        )  # fmt: skip
        rows = {(r["tokens"], r["load"]): r for r in result["sliding"]}
        for tokens in sorted({r["tokens"] for r in result["sliding"]}):
            window, every = rows.get((tokens, "window")), rows.get((tokens, "every token"))
            if window and every:
                print(
                    f"{tokens} tokens: the window moves {window['bytes'] / every['bytes']:.3f}x the bytes "
                    f"in {window['ms'] / every['ms']:.3f}x the time of every token"
                )


# -- the sweep: kernel shapes and copy-engine paths ---------------------------------------------------

SWEEP_SHAPES = [  # (tile_bytes, segments_per_step, num_warps)
    (16384, 1, 8),
    (32768, 1, 8),
    (16384, 2, 8),
    (32768, 2, 8),
    (16384, 4, 8),
    (32768, 4, 8),
    (16384, 1, 4),
    (32768, 1, 4),
    (16384, 2, 4),
]
SWEEP_PROGRAMS = (2, 4, 8, 16)
SWEEP_HINTS = [
    {"load_cache": ".cg"},
    {"store_cache": ".cs"},
    {"eviction": "evict_first"},
    {"load_cache": ".cg", "store_cache": ".cs"},
]


def compile_report(compiled: Any) -> dict[str, Any]:
    """Registers, spills and how wide the global loads and stores are, from Triton's compiled kernel."""
    ptx = compiled.asm.get("ptx", "") if compiled is not None else ""
    loads = [line for line in ptx.splitlines() if "ld.global" in line]
    stores = [line for line in ptx.splitlines() if "st.global" in line]
    return {
        "n_regs": getattr(compiled, "n_regs", None),
        "n_spills": getattr(compiled, "n_spills", None),
        "ld_global_16B": sum(".v4.b32" in line or ".v2.b64" in line for line in loads),
        "ld_global": len(loads),
        "st_global_16B": sum(".v4.b32" in line or ".v2.b64" in line for line in stores),
        "st_global": len(stores),
    }


def sweep_shapes(layout: str) -> list[tuple[triton_copy.Tuning, str]]:
    shapes = [
        (triton_copy.Tuning(tile, segments, warps), f"tile={tile // 1024}K seg={segments} warps={warps}")
        for tile, segments, warps in SWEEP_SHAPES
    ]
    if layout != "flash_attn":  # the kernel's shape matters the same way on every layout
        return shapes[:2]
    return shapes + [
        (triton_copy.Tuning(**hints), ",".join(f"{k}={v}" for k, v in hints.items())) for hints in SWEEP_HINTS
    ]


def sweep_layout(
    args: argparse.Namespace, log: list[str], setup: Setup, matmul: MatmulStream
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Kernel shapes x program counts, and the copy-engine paths, of one layout."""
    layout, kernels, engines = setup.layout, [], []
    for to_page in (True, False):
        direction = "gather" if to_page else "scatter"
        plan = setup.plan(to_page=to_page)
        for tuning, label in sweep_shapes(layout):
            compiled = guarded(log, f"compile {label}", _launch_once, setup, plan, to_page, tuning)
            report = compile_report(compiled)
            for programs in SWEEP_PROGRAMS:
                row = guarded(
                    log,
                    f"{layout} {direction} {label} @{programs}",
                    timed,
                    kernel(setup, to_page, programs, tuning),
                    3,
                )
                if row is None:
                    continue
                row.update(
                    layout=layout,
                    direction=direction,
                    shape=label,
                    programs=programs,
                    tuning=tuning._asdict(),
                    **report,
                )
                kernels.append(row)
                print(
                    f"{layout:12} {direction:8} {label:44} @{programs:<3} {row['gbps']:7.2f} GB/s "
                    f"regs={report['n_regs']} 16B={report['ld_global_16B']}/{report['ld_global']}",
                    flush=True,
                )
        paths = [("memcpy", memcpy(setup, to_page)), ("copy_engine_1d", copy_engines(setup, to_page, "1d"))]
        if copy_engine.can_copy_2d(setup.spec, plan):
            paths.append(("copy_engine_2d", copy_engines(setup, to_page, "2d")))
        for name, enqueue in paths:
            row = guarded(log, f"{layout} {direction} {name}", timed, enqueue, args.reps)
            if row is None:
                continue
            row.update(layout=layout, direction=direction, variant=name)
            with_interference(log, f"{layout} {direction} {name}", row, matmul, [enqueue], args.repeats)
            engines.append(row)
            print(
                f"{layout:12} {direction:8} {name:20} {row['gbps']:7.2f} GB/s issue {row['issue_ms']:.2f} ms "
                f"slowdown {median_slowdown(row)}",
                flush=True,
            )
        for programs in (2, 4, 8):  # the kernel's interference: the fastest shape at each program count
            mine = [r for r in kernels if (r["direction"], r["programs"]) == (direction, programs)]
            if not mine:
                continue
            best = max(mine, key=lambda r: r["gbps"])
            enqueue = kernel(setup, to_page, programs, triton_copy.Tuning(**best["tuning"]))
            with_interference(
                log, f"kernel {best['shape']}@{programs}", best, matmul, [enqueue], args.repeats
            )
            print(
                f"{layout:12} {direction:8} best@{programs} {best['shape']:40} "
                f"slowdown {median_slowdown(best)}",
                flush=True,
            )
    return kernels, engines


def _launch_once(setup: Setup, plan: Any, to_page: bool, tuning: triton_copy.Tuning) -> Any:
    compiled = triton_copy.launch(setup.spec, plan, to_page=to_page, max_programs=2, tuning=tuning)
    torch.cuda.synchronize()
    return compiled


def run_sweep(args: argparse.Namespace, log: list[str]) -> dict[str, Any]:
    matmul = MatmulStream(8192)
    kernels: list[dict[str, Any]] = []
    engines: list[dict[str, Any]] = []
    for layout in args.layouts:
        setup = Setup(layout, args.tokens)
        layout_kernels, layout_engines = sweep_layout(args, log, setup, matmul)
        setup.release()
        kernels += layout_kernels
        engines += layout_engines
        torch.cuda.empty_cache()
    return {"kernels": kernels, "engines": engines}


def run_profile(args: argparse.Namespace) -> None:
    """Where the host's time goes before and while a public call issues its transfer."""
    setup = Setup(args.layouts[0], args.tokens)
    for to_page in (True, False):
        profile_direction(setup, to_page)
    setup.release()


def profile_direction(setup: Setup, to_page: bool) -> None:
    """Each step's median time alone, then cProfile over 5 public calls."""
    import cProfile
    import pstats

    from kvstore_kernels import cache_facts, routing
    from kvstore_kernels.geometry import Geometry
    from kvstore_kernels.validate import plan_transfer

    spec, direction = setup.spec, "gather" if to_page else "scatter"

    def median_us(function: Callable[[], Any], count: int = 200) -> float:
        samples = []
        for _ in range(count):
            start = time.perf_counter()
            function()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e6

    def plan() -> Any:
        return plan_transfer(
            spec, setup.caches, setup.table, setup.chunks, setup.buffer, setup.offsets, None, 0,
            writes_cache=not to_page,
        )  # fmt: skip

    def cold_plan() -> Any:
        cache_facts.forget()
        return plan()

    made = plan()
    steps = {
        "plan_transfer (tensors seen before)": plan,
        "plan_transfer (first call: full checks)": cold_plan,
        "buffer.is_pinned()": setup.buffer.is_pinned,
        "routing.choose": lambda: routing.choose(spec, made, TransferOptions(), to_page=to_page),
        "Geometry": lambda: Geometry(spec, made),
    }
    for name, function in steps.items():
        print(f"{direction:8} {name:44} {median_us(function):8.1f} us", flush=True)
    call = setup.call(to_page, None)
    issue_pieces = staged._issue_cuda
    reached: list[float] = []

    def marked(*args: Any, **kwargs: Any) -> None:
        reached.append(time.perf_counter())  # the host is about to queue the first piece
        issue_pieces(*args, **kwargs)

    staged._issue_cuda = marked
    try:
        for name, enqueue in (("public call", call), ("staged, plan prepared", staged_path(setup, to_page))):
            enqueue()
            torch.cuda.synchronize()
            issue, first = [], []
            for _ in range(20):
                start = time.perf_counter()
                enqueue()
                issue.append(time.perf_counter() - start)
                first.append(reached[-1] - start)
                torch.cuda.synchronize()
            for what, samples in (("issue", issue), ("until the first piece is queued", first)):
                label = f"{name}: {what}"
                print(f"{direction:8} {label:44} {statistics.median(samples) * 1e6:8.1f} us", flush=True)
    finally:
        staged._issue_cuda = issue_pieces
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        call()
        torch.cuda.synchronize()
    profiler.disable()
    print(f"-- {direction}: 5 public calls")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)


def environment() -> dict[str, Any]:
    import triton

    props = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "host_programs": dict(triton_copy.HOST_PROGRAMS),
        "staged": {
            "programs": staged.DEFAULT_PROGRAMS,
            "staging_bytes": staged.DEFAULT_STAGING_BYTES,
            "slots": staged.NUM_SLOTS,
            "overlap": staged.OVERLAP,
        },
        "tuning": triton_copy.DEFAULT_TUNING._asdict(),
    }
    try:
        runtime = cudart.runtime()
        info.update(cudart=runtime.path, cudart_version=runtime.version, can_batch=runtime.can_batch)
    except RuntimeError as exc:
        info["cudart"] = str(exc)
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", action="store_true", help="kernel shapes and copy-engine paths instead")
    parser.add_argument("--profile", action="store_true", help="profile the staged path's host time instead")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layouts", nargs="+", default=["flash_attn", "cross_layer", "flashinfer"])
    parser.add_argument("--interference-layouts", nargs="+", default=["flash_attn", "cross_layer"])
    parser.add_argument("--reps", type=int, default=7, help="timed transfers per figure (median)")
    parser.add_argument("--repeats", type=int, default=5, help="interference measurements per variant")
    parser.add_argument("--partial", default="", help="also write the rows so far here after each layout")
    parser.add_argument("--variants", nargs="+", help="only these one-way variants (default: all)")
    parser.add_argument("--pairs", nargs="+", help="only these both-ways variants (default: all)")
    parser.add_argument("--name", default="transfer", help="results file name (bench/results/NAME.json)")
    parser.add_argument(
        "--gpu-tier",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also load from a daemon's GPU tier vs its CPU tier vs a d2d copy (bench/gpu_tier.py)",
    )
    parser.add_argument("--gpu-tier-repeats", type=int, default=20, help="timed rounds of the GPU-tier rows")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=("mla", "sliding", "llama"),
        help="the model rows instead (DeepSeek-V3 MLA, gpt-oss, Llama-3.1-8B through the client)",
    )
    parser.add_argument(
        "--llama-tokens", nargs="+", type=int, default=[8192], help="prompts of the Llama-3.1-8B rows"
    )
    parser.add_argument(
        "--model-tokens", nargs="+", type=int, default=[8192, 32768], help="prompts of the model rows"
    )
    parser.add_argument(
        "--register-caches",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="model rows: pass the caches as client.register_kv_caches returns them, as the engine "
        "adapters do (default), or as bare tensor lists",
    )
    parser.add_argument(
        "--daemon-poll-ms", type=float, default=0.0, help="model rows: the daemon's server.local_poll_ms"
    )
    parser.add_argument("--dry-run", action="store_true", help="the model rows on CPU: 1024 tokens, 2 rounds")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.models, args.model_tokens, args.reps = args.models or ["mla", "sliding", "llama"], [1024], 2
        args.llama_tokens = [1024]
    if args.models and args.name == "transfer":
        args.name = "transfer-models-dry-run" if args.dry_run else "transfer-models"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    log: list[str] = []
    if args.models:
        run_and_print_models(args, log)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench/transfer.py needs a CUDA GPU (the page buffer is pinned host memory)")
    env = environment()
    if args.profile:
        run_profile(args)
        return
    if args.sweep:
        result = run_sweep(args, log)
        path = write_results(
            "transfer-sweep", {"config": vars(args), "environment": env, **result, "errors": log}
        )
        best: dict[tuple[str, str, int], dict[str, Any]] = {}
        for row in result["kernels"]:
            key = (row["layout"], row["direction"], row["programs"])
            if key not in best or row["gbps"] > best[key]["gbps"]:
                best[key] = row
        print_table(
            ["layout", "direction", "programs", "best shape", "GB/s", "slowdown"],
            [
                [*key, row["shape"], round(row["gbps"], 2), median_slowdown(row) or "-"]
                for key, row in best.items()
            ],
        )
    else:
        result = run_full(args, log)
        if args.gpu_tier:
            gc.collect()
            torch.cuda.empty_cache()  # the layouts' buffers: the daemon allocates its pool next
            try:
                result["gpu_tier"] = gpu_tier.measure(args.tokens, args.gpu_tier_repeats)
            except Exception:
                log.append(f"gpu_tier: {traceback.format_exc()}")
        path = write_results(args.name, {"config": vars(args), "environment": env, **result, "errors": log})
        table, pair_table, accept = summarize(result)
        print(
            f"\n{env['device']} ({env['sms']} SMs), {args.tokens} tokens, torch {env['torch']}, "
            f"triton {env['triton']}, cudart {env.get('cudart_version')}"
        )
        headers = ["layout", "dir", "variant", "GB/s", "x memcpy", "x per-block", "matmul x", "mean x"]
        print_table([*headers, "GB/s beside", "ok"], table)
        print()
        print_table(
            ["layout", "both ways", "GB/s", "x memcpy", "matmul x", "mean x", "GB/s beside"], pair_table
        )
        print()
        print_table(["acceptance", "value", "limit", "holds"], accept)
        if "gpu_tier" in result:
            print()
            gpu_tier.print_report(result["gpu_tier"])
    if log:
        print(f"\n{len(log)} measurements failed; tracebacks in {path}", file=sys.stderr)
    print(path)


def run_and_print_models(args: argparse.Namespace, log: list[str]) -> None:
    if not torch.cuda.is_available() and not args.dry_run:
        raise SystemExit("bench/transfer.py --models needs a CUDA GPU; --dry-run runs the rows on CPU")
    env = (
        environment()
        if torch.cuda.is_available()
        else {"device": "cpu (dry run)", "torch": torch.__version__}
    )
    result = run_models(args, log)
    path = write_results(args.name, {"config": vars(args), "environment": env, **result, "errors": log})
    print(f"\n{env['device']}, torch {env['torch']}")
    print_models(result)
    if log:
        print(f"\n{len(log)} measurements failed; tracebacks in {path}", file=sys.stderr)
        for entry in log:
            print(entry, file=sys.stderr)
    print(path)


if __name__ == "__main__":
    main()
