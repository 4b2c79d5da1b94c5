"""All GPUs of a host at once: one worker process per GPU, one daemon and one arena.

For each count of GPUs (`--gpus 1 2 4`), every worker takes a Llama-3.1-8B-geometry KV cache
(32 layers, 8 KV heads, head dim 128, bf16, flash_attn layout, blocks of 16, pages of 256
tokens) of `--tokens` tokens (8k: 1 GiB) on a random block table, and all of them run each
phase at the same moment (a barrier before each), `--prompts` prompts per worker:

- `memcpy`: one pinned `cudaMemcpyAsync` of the prompt's bytes per prompt, device to host
  (`store`) and host to device (`load`), between the worker's GPU and its own anonymous shared
  memory registered with CUDA: what the host moves for every GPU at once, the limit.
- `kernel`, `copy_engine`, `staged`: `kvstore_kernels.gather` / `scatter` of the prompt's pages
  between the cache and that pinned buffer with that engine, no daemon: the copy path alone, per
  engine (`staged` is what the client's transfers take by default).
- `client`: `KVStoreClient.store` of each prompt (distinct keys per worker, prompt and round),
  then `load` of each, through the daemon's arena, one call after the other.
- `client async`: the same with `store_async` / `load_async` of every prompt of the round started
  before any is waited for, as an engine's connector does.
- `client registered`: the same again with the caches registered once
  (`KVStoreClient.register_kv_caches`), as the vLLM connector and the SGLang backend do: what an
  engine gets. After these a prompt of each way is loaded into a poisoned cache and compared byte
  for byte with the cache it was stored from.
- `client registered + model` (GPUs): the namespace cleared (every store moves its bytes), the
  registered stores, then loads, `--rounds` rounds each, while a stream of bf16 8192^3 products
  runs on each GPU; "model slowdown" is the products' median time beside the stores (the loads)
  over alone (a second before and after), the larger of the two.

Each phase runs once untimed (warm-up: Triton's compile, first touches), then `--rounds` times,
timed; the median round is reported. A probe process makes 64-key Lookups back to back
throughout: their latency while idle and during the client phases. `--tp 4` also runs 4 workers
as the TP ranks of one model (each its 2 of the 8 KV heads, the same prompts).

A phase's aggregate GB/s is every worker's bytes over the time from the first worker's start
to the last worker's end; "x memcpy" divides it by the same direction's `memcpy` aggregate
of the same count in the same run. Each worker also reports its GPU's NUMA node, the CPUs it
ran on and how long the arena's registration took from its connect (7-22 s a count on the
shared-memory arena, 4x H200). `--pinned` has the daemon pin the arena (`tiers.cpu.pinned`, as
on a GPU host): it pins it once, and each count's workers map its slabs instead of registering
it.

    python bench/host_gpus.py --gpus 1 2 4 --tp 4 --name host_gpus-h100x4
    python bench/host_gpus.py --gpus 1 --tokens 1024 --prompts 2 --dry-run   # CPU: it runs, bytes right
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, running_daemon, write_results  # noqa: E402

CHUNK_TOKENS = 256  # make_spec's (bench.transfer_cases)
SLAB_BYTES = 256 << 20
DIRECTIONS = ("store", "load")
PHASES = ("memcpy", "kernel", "copy_engine", "staged", "client", "client async", "client registered")


def llama_spec() -> Any:
    from bench.transfer_cases import make_spec  # the 8B geometry every transfer bench uses

    return make_spec("flash_attn")


def numa_node(device: int) -> int:
    """The NUMA node of GPU `device`'s PCI function (-1 where the kernel does not say)."""
    import torch

    if not torch.cuda.is_available():
        return -1
    props = torch.cuda.get_device_properties(device)
    bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    try:
        return int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text())
    except (OSError, ValueError):
        return -1


class Timeline:
    """Each phase's (start, end) on CLOCK_MONOTONIC, which every process on the host shares."""

    def __init__(self, barrier: Any) -> None:
        self.barrier = barrier
        self.spans: dict[str, list[tuple[float, float]]] = {}

    def phase(self, name: str, run: Any, synchronize: Any) -> None:
        synchronize()
        self.barrier.wait()
        start = time.monotonic()
        run()
        synchronize()
        self.spans.setdefault(name, []).append((start, time.monotonic()))


class Products:
    """bf16 n^3 products (8192: a prefill's large GEMMs) on a stream of their own, queued by a
    thread while `running`, each timed with events (the GPU's time, whatever the host does): the
    model beside the transfers."""

    def __init__(self, device: str, n: int = 8192) -> None:
        import threading

        import torch

        gen = torch.Generator(device=device).manual_seed(0)
        self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
        self.b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
        self.out = torch.empty_like(self.a)
        self.stream = torch.cuda.Stream(device)
        self.events: list[tuple[Any, Any]] = []
        self.running = threading.Event()
        self.thread: Any = None

    def start(self) -> None:
        import threading

        self.events = []
        self.running.set()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            while self.running.is_set():
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                torch.matmul(self.a, self.b, out=self.out)
                end.record()
                self.events.append((begin, end))
                if len(self.events) > 8:  # keep a few queued, never an unbounded backlog
                    self.events[-8][1].synchronize()

    def stop(self) -> list[float]:
        """Each product's ms, in order."""
        self.running.clear()
        self.thread.join()
        self.stream.synchronize()
        return [begin.elapsed_time(end) for begin, end in self.events]

    def gaps(self) -> list[float]:
        """The ms the stream sat idle before each product after the first (after `stop`): the
        thread that queues them fell behind, and that product's time may hold the wait for its
        launch."""
        pairs = zip(self.events, self.events[1:], strict=False)
        return [end.elapsed_time(begin) for (_, end), (begin, _) in pairs]


def model_beside(
    client: Any, device: str, runs: dict[str, Any], rounds: int, timeline: Timeline, synchronize: Any
) -> dict[str, Any]:
    """The engine's way (caches registered, every prompt's transfer started, then all waited for)
    beside a model on every GPU: `rounds` rounds of stores, then of loads, each in a window of the
    model's products of its own; the products alone for a second before and after."""
    import statistics

    products = Products(device)

    windows: list[tuple[str, float, float]] = []  # (window, start, stop) on CLOCK_MONOTONIC

    # Per window: products that waited for their launch (the stream idle over 50 us before them)
    # and the stream's idle ms between products in all: 0 where the thread kept the queue full.
    waits: dict[str, int] = {}
    idle_ms: dict[str, float] = {}

    def record(window: str, ms: list[float]) -> None:
        gaps = products.gaps()
        waits[window] = waits.get(window, 0) + sum(g > 0.05 for g in gaps)
        idle_ms[window] = idle_ms.get(window, 0.0) + sum(gaps)

    def alone() -> list[float]:
        begun = time.monotonic()
        products.start()
        time.sleep(1.0)
        ms = products.stop()
        record("alone", ms)
        windows.append(("alone", begun, time.monotonic()))
        return ms[3:]

    # The namespace is every worker's: cleared once all have checked their bytes (a worker still
    # loading its prompts would find them gone), so that every store beside the model moves its bytes.
    timeline.barrier.wait()
    client.clear()
    timeline.barrier.wait()
    products_ms: dict[str, list[float]] = {"alone": alone()}
    for direction in ("store", "load"):
        begun = time.monotonic()
        products.start()
        for batch in range(1, rounds + 1):
            run = runs[f"client registered {direction}"]
            timeline.phase(
                f"client {direction} + model", lambda run=run, batch=batch: run(batch), synchronize
            )
        ms = products.stop()
        record(direction, ms)
        products_ms[direction] = ms[3:-3]
        windows.append((direction, begun, time.monotonic()))
    products_ms["alone"] += alone()
    base = statistics.median(products_ms["alone"])
    beside = {f"{d}_slowdown": statistics.median(products_ms[d]) / base for d in ("store", "load")}
    return {
        "alone_ms": base,
        **beside,
        "slowdown": max(beside.values()),
        "products": {window: len(ms) for window, ms in products_ms.items()},
        "windows": windows,
        "launch_waits": waits,
        "idle_ms": idle_ms,
    }


def worker(rank: int, count: int, args: dict[str, Any], address: str, barrier: Any, out: Any) -> None:
    try:
        out.put((rank, run_worker(rank, count, args, address, barrier)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        barrier.abort()
        out.put((rank, {"error": traceback.format_exc()}))


def run_worker(rank: int, count: int, args: dict[str, Any], address: str, barrier: Any) -> dict[str, Any]:
    import dataclasses

    import numpy as np
    import torch

    import kvstore_kernels
    from kvstore_client import KVStoreClient

    cuda = torch.cuda.is_available()
    gpu = (rank + args["rotate"]) % torch.cuda.device_count() if cuda else 0
    device = f"cuda:{gpu}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(gpu)

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    spec = llama_spec()
    tp = args["tp"]
    if tp:  # the ranks of one model: each its share of the heads, the same prompts
        spec = dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // count, tp_rank=rank, tp_size=count)
    tokens, prompts, rounds = args["tokens"], args["prompts"], args["rounds"]
    chunks = tokens // CHUNK_TOKENS
    blocks = tokens // spec.block_size
    page = spec.page.page_bytes
    moved = chunks * page
    gen = torch.Generator(device=device).manual_seed(rank + 1)
    shape = (2, blocks, spec.block_size, spec.num_kv_heads, spec.head_dim * 2)
    source = [
        torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen).view(torch.bfloat16)
        for _ in range(spec.num_layers)
    ]
    target = [
        torch.full(shape, 0xA5, dtype=torch.uint8, device=device).view(torch.bfloat16)
        for _ in range(spec.num_layers)
    ]
    table = np.random.default_rng(rank).permutation(blocks).tolist()
    flat = torch.randint(0, 256, (moved,), dtype=torch.uint8, device=device, generator=gen)
    host = (
        torch.empty(moved, dtype=torch.uint8).pin_memory() if cuda else torch.empty(moved, dtype=torch.uint8)
    )
    offsets = [i * page for i in range(chunks)]
    chunk_ids = list(range(chunks))
    timeline = Timeline(barrier)
    connected = time.monotonic()
    client = KVStoreClient.connect(address, spec, name=f"host-gpus-{rank}")
    registered_s = None
    try:
        while True:  # the arena's registration is warm-up, not transfer: waited for apart
            arena = client.stats()["client"]["arena"]
            if not arena.get("slabs_pending", 0):
                registered_s = time.monotonic() - connected
                break
            time.sleep(0.01)
        owner = 999 if tp else rank  # TP ranks store one prompt's shares; workers their own prompts

        def prompt_keys(batch: int) -> list[list[bytes]]:
            base = (owner * 32 + batch) * prompts * tokens  # < 2**31: 999 owners, 32 batches, 4 prompts
            return [client.keys([base + p * tokens + t for t in range(tokens)]) for p in range(prompts)]

        # the first batch warms up: every store stores anew
        batches = [prompt_keys(batch) for batch in range(rounds + 1)]
        loaded: list[list[bytes]] = batches[0]
        runs: dict[str, Any] = {
            "memcpy store": lambda _: [host.copy_(flat, non_blocking=True) for _ in range(prompts)],
            "memcpy load": lambda _: [flat.copy_(host, non_blocking=True) for _ in range(prompts)],
        }
        for engine in ("kernel", "copy_engine", "staged"):
            options = kvstore_kernels.TransferOptions(engine=engine if cuda else "torch")
            runs[f"{engine} store"] = lambda _, o=options: [
                kvstore_kernels.gather(spec, source, table, chunk_ids, host, offsets, options=o)
                for _ in range(prompts)
            ]
            runs[f"{engine} load"] = lambda _, o=options: [
                kvstore_kernels.scatter(spec, target, table, chunk_ids, host, offsets, options=o)
                for _ in range(prompts)
            ]
        runs["client store"] = lambda batch: [
            client.store(None, source, table, keys=k) for k in batches[batch]
        ]
        runs["client load"] = lambda batch: [client.load(None, target, table, keys=k) for k in batches[batch]]
        # An engine's way: every prompt's store (load) started, then all waited for.
        later = [prompt_keys(rounds + 2 + batch) for batch in range(rounds + 1)]
        runs["client async store"] = lambda batch: [
            handle.wait()
            for handle in [client.store_async(None, source, table, keys=k) for k in later[batch]]
        ]
        runs["client async load"] = lambda batch: [
            handle.wait() for handle in [client.load_async(None, target, table, keys=k) for k in later[batch]]
        ]
        # As the vLLM connector and the SGLang backend drive it: the caches registered once.
        sources, targets = client.register_kv_caches(source), client.register_kv_caches(target)
        again = [prompt_keys(2 * rounds + 3 + batch) for batch in range(rounds + 1)]
        runs["client registered store"] = lambda batch: [
            handle.wait()
            for handle in [client.store_async(None, sources, table, keys=k) for k in again[batch]]
        ]
        runs["client registered load"] = lambda batch: [
            handle.wait()
            for handle in [client.load_async(None, targets, table, keys=k) for k in again[batch]]
        ]
        caches = (source, sources)
        ways, checked = part_phases(client, spec, caches, table, host, prompt_keys, 3 * rounds + 4, args)
        runs.update(ways)
        for batch in range(rounds + 1):  # round 0 warms every path up (Triton's compile too), untimed
            for name, run in runs.items():
                if batch == 0:
                    run(0)
                    synchronize()
                else:
                    timeline.phase(name, lambda run=run, batch=batch: run(batch), synchronize)
        # The last prompt of the first round, stored each of the three ways, into a poisoned cache.
        loaded_tokens, prefix_ok = tokens, True
        for keys in (loaded[-1], later[0][-1], again[0][-1], *checked):
            for layer in target:
                layer.view(torch.uint8).fill_(0xA5)
            got = client.load(None, target, table, keys=keys)
            synchronize()
            hit = table[: got // spec.block_size]  # a miss loads a prefix: its blocks must match
            loaded_tokens = min(loaded_tokens, got)
            prefix_ok = prefix_ok and all(  # as bytes: random bf16 bits hold NaNs
                torch.equal(a[:, hit].view(torch.uint8), b[:, hit].view(torch.uint8))
                for a, b in zip(source, target, strict=True)
            )
        model = (
            model_beside(client, device, runs, rounds, timeline, synchronize)
            if cuda and args["products"]
            else {}
        )
        ok = loaded_tokens == tokens and prefix_ok
        # Each count leaves the arena empty once every worker has checked its bytes, so the next
        # count stores into room as the first did: what eviction costs is reserve_evicting's.
        timeline.barrier.wait()
        client.clear()
        cpus = sorted(os.sched_getaffinity(0))
        return {
            "rank": rank,
            "gpu": gpu,
            "numa_node": numa_node(gpu),
            "cpus": f"{cpus[0]}-{cpus[-1]} ({len(cpus)})" if cpus else "",
            "registered_s": registered_s,
            "spans": timeline.spans,
            "bytes_per_phase": moved * prompts,
            "model": model,
            "ok": bool(ok),
            "loaded_tokens": loaded_tokens,
            "prefix_ok": bool(prefix_ok),
            "arena": client.stats()["client"]["arena"],
        }
    finally:
        client.close()


def part_phases(
    client: Any, spec: Any, caches: Any, table: list[int], host: Any, prompt_keys: Any, first: int, args: Any
) -> tuple[dict[str, Any], list[list[bytes]]]:
    """`--part-mib`: for each size, the staged engine's gather into the worker's own pinned buffer
    in calls of that many MiB (`staged parts<N> store`), and the registered client's stores
    committed in parts of that size (`client parts<N> store`; 0: one Commit at the end); and the
    keys of a prompt of each size to load back and compare."""
    import kvstore_kernels
    from kvstore_client import stores

    runs: dict[str, Any] = {}
    checked: list[list[bytes]] = []
    (source, sources), page, chunks = caches, spec.page.page_bytes, args["tokens"] // CHUNK_TOKENS
    options = kvstore_kernels.TransferOptions(engine="staged" if host.is_pinned() else "torch")
    for index, mib in enumerate(args["part_mib"]):
        per_call = max(1, (mib << 20) // page) if mib else chunks
        cuts = [list(range(start, min(chunks, start + per_call))) for start in range(0, chunks, per_call)]
        runs[f"staged parts{mib} store"] = lambda _, cuts=cuts: [
            kvstore_kernels.gather(spec, source, table, cut, host, [i * page for i in cut], options=options)
            for _ in range(args["prompts"])
            for cut in cuts
        ]
        batches = [prompt_keys(first + index * (args["rounds"] + 1) + b) for b in range(args["rounds"] + 1)]

        def stored(batch: int, batches: list[Any] = batches, part: int = (mib << 20) or (1 << 50)) -> None:
            kept = stores.EARLY_COMMIT_PART_BYTES, getattr(stores, "EARLY_COMMIT_MAX_PARTS", 1 << 20)
            # this phase's alone (the bench's experiment): parts of that size, however many
            stores.EARLY_COMMIT_PART_BYTES, stores.EARLY_COMMIT_MAX_PARTS = part, 1 << 20
            try:
                handles = [client.store_async(None, sources, table, keys=k) for k in batches[batch]]
            finally:
                stores.EARLY_COMMIT_PART_BYTES, stores.EARLY_COMMIT_MAX_PARTS = kept
            for handle in handles:
                handle.wait()

        runs[f"client parts{mib} store"] = stored
        checked.append(batches[0][-1])
    return runs, checked


def lookup_probe(address: str, stop: Any, out: Any) -> None:
    """64-key Lookups back to back until `stop`: (start, seconds) of each."""
    from kvstore_client import KVStoreClient

    spec = llama_spec()
    samples = []
    # It moves no bytes (as an engine's scheduler): no arena mapped, no CUDA context of its own.
    with KVStoreClient.connect(address, spec, name="host-gpus-probe", pin_arena=False) as client:
        keys = client.keys(list(range(64 * CHUNK_TOKENS)))
        while not stop.is_set():
            begin = time.monotonic()
            client.lookup_chunks(keys)
            samples.append((begin, time.monotonic() - begin))
    out.put(samples)


def run_count(count: int, args: dict[str, Any], address: str) -> dict[str, Any]:
    context = mp.get_context("spawn")
    barrier, out = context.Barrier(count), context.Queue()
    stop, probed = context.Event(), context.Queue()
    probe = context.Process(target=lookup_probe, args=(address, stop, probed))
    probe.start()
    processes = [
        context.Process(target=worker, args=(r, count, args, address, barrier, out)) for r in range(count)
    ]
    for process in processes:
        process.start()
    results = dict(out.get(timeout=args["timeout_s"]) for _ in processes)
    stop.set()
    samples = probed.get(timeout=60)
    for process in [*processes, probe]:
        process.join(timeout=60)
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        raise RuntimeError(f"{count} GPU(s): a worker failed:\n{errors[0]}")
    workers = [results[r] for r in range(count)]
    total = sum(w["bytes_per_phase"] for w in workers)
    phases = {}
    for name in workers[0]["spans"]:
        rates, windows = [], []
        for index in range(len(workers[0]["spans"][name])):
            start = min(w["spans"][name][index][0] for w in workers)
            end = max(w["spans"][name][index][1] for w in workers)
            rates.append(total / (end - start) / 1e9)
            windows.append((start, end))
        phases[name] = {"gbps": sorted(rates)[len(rates) // 2], "gbps_rounds": rates, "windows": windows}
    for name, row in phases.items():
        direction = name.replace(" + model", "").split()[-1]
        row["x_memcpy"] = row["gbps"] / phases[f"memcpy {direction}"]["gbps"]
    first = min(w for row in phases.values() for w, _ in row["windows"])
    idle = [s for begin, s in samples if begin < first - 0.5]  # before the workers' first phase
    busy = [s for begin, s in samples for name in ("client store", "client load")
            for a, b in phases[name]["windows"] if a <= begin and begin + s <= b]  # fmt: skip
    lookups = {"idle": _latency(idle), "during_client_phases": _latency(busy)}
    if idle and busy:  # the calls during that took over twice the idle p99: when, and how long
        slow = 2 * lookups["idle"]["p99_us"] / 1e6
        lookups["slow_during"] = [
            (round(begin, 6), round(s * 1e6, 1))
            for begin, s in samples
            if s > slow
            and any(a <= begin and begin + s <= b for name in ("client store", "client load")
                    for a, b in phases[name]["windows"])
        ]  # fmt: skip
    return {"gpus": count, "tp": args["tp"], "phases": phases, "lookups": lookups, "workers": workers}


def _latency(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"calls": 0}
    ordered = sorted(samples)
    return {
        "calls": len(ordered),
        "p50_us": ordered[len(ordered) // 2] * 1e6,
        "p99_us": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, nargs="+", default=[1])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=4, help="per worker and round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, after one untimed")
    parser.add_argument(
        "--tp", type=int, nargs="*", default=[], help="also these counts as TP ranks of one model"
    )
    parser.add_argument("--no-products", dest="products", action="store_false", help="no model beside")
    parser.add_argument(
        "--pinned",
        action="store_true",
        help="the daemon pins the arena (tiers.cpu.pinned): no worker registers it, each maps it",
    )
    parser.add_argument("--arena-gib", type=float, default=0, help="0: room for every worker's prompts")
    parser.add_argument("--rotate", type=int, default=0, help="worker r runs on GPU (r + ROTATE) mod GPUs")
    parser.add_argument(
        "--daemon-gpu",
        type=int,
        default=None,
        help="the GPU the daemon's CUDA context (a pinned arena's) is made on (its device 0): "
        "CUDA_VISIBLE_DEVICES reordered for the daemon alone",
    )
    parser.add_argument(
        "--part-mib",
        type=int,
        nargs="*",
        default=[],
        help="also store in parts of these MiB: the staged engine alone, and the client's commits (0: one)",
    )
    parser.add_argument(
        "--gc-freeze-s", type=float, help="the daemon's server.gc_freeze_s (default: its own; 0: CPython's)"
    )
    parser.add_argument("--name", default="host_gpus")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument(
        "--dry-run", action="store_true", help="on CPU: one worker, it runs and bytes are right"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= 4 or (3 + len(args.part_mib)) * (args.rounds + 1) > 32 or args.prompts > 4:
        parser.error("--rounds 1 to 4, --prompts at most 4: each round's prompts get keys of their own")
    import torch

    if not torch.cuda.is_available() and not args.dry_run:
        parser.error("needs CUDA GPUs (or --dry-run)")
    available = torch.cuda.device_count() if torch.cuda.is_available() else 1
    counts = [c for c in args.gpus if c <= available]
    prompt_bytes = llama_spec().page.page_bytes * (args.tokens // CHUNK_TOKENS)
    # Room for the largest run's prompts (a TP group stores one worker's bytes); each run clears
    # its namespaces when it ends.
    groups = max(counts + [1 for c in args.tp if c <= available])
    batches = (3 + len(args.part_mib)) * (args.rounds + 1)
    arena = int(args.arena_gib * (1 << 30)) or groups * batches * args.prompts * prompt_bytes
    arena = -(-arena // SLAB_BYTES) * SLAB_BYTES + 2 * SLAB_BYTES
    cpu = {"bytes": arena, "slab_bytes": SLAB_BYTES, **({"pinned": True} if args.pinned else {})}
    config: dict[str, Any] = {"chunk_tokens": CHUNK_TOKENS, "tiers": {"cpu": cpu}}
    if args.gc_freeze_s is not None:
        config["server"] = {"gc_freeze_s": args.gc_freeze_s}
    settings = {
        "tokens": args.tokens,
        "prompts": args.prompts,
        "rounds": args.rounds,
        "products": args.products,
        "timeout_s": args.timeout_s,
        "pinned": args.pinned,
        "rotate": args.rotate,
        "daemon_gpu": args.daemon_gpu,
        "part_mib": args.part_mib,
        "gc_freeze_s": args.gc_freeze_s,
    }
    runs = []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if args.daemon_gpu is not None:
        gpus = visible.split(",") if visible else [str(d) for d in range(available)]
        first = gpus[args.daemon_gpu]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join([first, *(g for g in gpus if g != first)])
    with running_daemon(config) as daemon:
        if visible is None:  # the daemon has started: the workers see every GPU in order
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        from bench.connect_processes import ReserveWatch

        reserved_s = ReserveWatch(daemon, time.perf_counter()).wait(args.timeout_s)  # warm-up is part 1's
        print(f"the daemon's arena of {arena / (1 << 30):.0f} GiB reserved in {reserved_s} s", flush=True)
        for count, tp in [(c, False) for c in counts] + [(c, True) for c in args.tp if c <= available]:
            runs.append(run_count(count, {**settings, "tp": tp}, daemon.address))
            print(f"{count} GPU(s){' as TP ranks' if tp else ''} done", flush=True)
            # each count as it ends: a run cut short (a device call's time limit) keeps what it measured
            write_results(args.name, {"arena_bytes": arena, **settings, "runs": runs, "partial": True})
    rows = []
    for run in runs:
        names = [*PHASES, "client registered + model"] if "client store + model" in run["phases"] else PHASES
        for name in names:
            key = "client" if name.endswith(" + model") else name
            suffix = " + model" if name.endswith(" + model") else ""
            store, load = run["phases"][f"{key} store{suffix}"], run["phases"][f"{key} load{suffix}"]
            label = f"{run['gpus']}{' TP' if run['tp'] else ''}"
            rows.append([label, name, f"{store['gbps']:.1f}", f"{store['x_memcpy']:.2f}",
                         f"{load['gbps']:.1f}", f"{load['x_memcpy']:.2f}"])  # fmt: skip
    print_table(["GPUs", "path", "store GB/s", "x memcpy", "load GB/s", "x memcpy"], rows)
    part_rows = [
        [f"{run['gpus']}{' TP' if run['tp'] else ''}",
         f"{way} in parts of {mib} MiB" if mib else f"{way}, one part",
         f"{run['phases'][f'{way} parts{mib} store']['gbps']:.1f}",
         f"{run['phases'][f'{way} parts{mib} store']['x_memcpy']:.2f}"]
        for run in runs for mib in args.part_mib for way in ("staged", "client")
    ]  # fmt: skip
    if part_rows:
        print_table(["GPUs", "store", "GB/s", "x memcpy"], part_rows)
    probe_rows = [
        [f"{run['gpus']}{' TP' if run['tp'] else ''}", when, row.get("calls", 0),
         f"{row.get('p50_us', 0):.0f}", f"{row.get('p99_us', 0):.0f}"]
        for run in runs
        for when, row in run["lookups"].items()
        if isinstance(row, dict)
    ]  # fmt: skip
    print_table(["GPUs", "64-key Lookups", "calls", "p50 us", "p99 us"], probe_rows)
    worker_rows = [
        [
            f"{run['gpus']}{' TP' if run['tp'] else ''}",
            f"{w['rank']} (GPU {w['gpu']})",
            w["numa_node"],
            w["cpus"],
            f"{w['registered_s']:.2f}",
            " / ".join(f"{w['model'].get(f'{d}_slowdown', float('nan')):.3f}" for d in ("store", "load")),
            " / ".join(str(w["model"].get("launch_waits", {}).get(d, "-")) for d in ("alone", *DIRECTIONS)),
            "PASS"
            if w["ok"]
            else f"FAIL ({w['loaded_tokens']} tokens, prefix {'equal' if w['prefix_ok'] else 'DIFFERS'})",
        ]
        for run in runs
        for w in run["workers"]
    ]
    headers = [
        "GPUs",
        "worker",
        "GPU NUMA node",
        "CPUs",
        "registration s",
        "model slowdown (store / load)",
        "products after an idle stream (alone / store / load)",
        "bytes",
    ]
    print_table(headers, worker_rows)
    path = write_results(args.name, {"arena_bytes": arena, **settings, "runs": runs})
    print(f"wrote {path}")
    workers = [w for run in runs for w in run["workers"]]
    if not all(w["prefix_ok"] for w in workers):
        sys.exit("a worker loaded bytes that differ from what it stored")
    if not all(w["ok"] for w in workers):
        sys.exit("a worker's prompt was not all found: the arena evicted it (--arena-gib too small?)")


if __name__ == "__main__":
    main()
