"""One TP rank's loads on one GPU, and where their time goes (issue 31, part 2).

A TP rank of Llama-3.1-8B's geometry holds its share of the KV heads (`--tp 4`: 2 of 8), so an
8k-token prompt is 256 MiB a rank, in pages of 8 MiB: the same fixed costs a call (the Lookup, the
setup, the first copy) against a quarter of the bytes. On one GPU, four prompts a round:

- `memcpy`: one pinned `cudaMemcpyAsync` of a prompt's bytes per prompt, host to device: the limit;
- `staged alone`, `staged alone, registered`: `kvstore_kernels.scatter` from a pinned buffer, no
  daemon (the caches as a list of tensors, and registered with `kvstore_kernels.register`);
- `client`: `KVStoreClient.load` of each prompt, one after the other;
- `client async`, `client async, registered`: every prompt's `load_async` started, then all
  waited for, with the caches as tensors and registered (`register_kv_caches`, as the vLLM
  connector and the SGLang backend do).

Twelve rounds of each, in turns, the first two untimed (`--dry-run`: three); the median round
over memcpy's. Then one round of each async way with the host's steps timed (`load_async`, the
Lookup, the setup done while the Lookup is in flight, the scatter's enqueue; µs from the round's
start), and, with `--trace`, one round of some ways under torch's profiler: the GPU's busy time,
span and idle gaps. The last prompt is loaded into a poisoned cache and compared byte for byte.

    python bench/tp_rank_loads.py [--tp 4] [--trace] [--name tp-rank-loads] [--dry-run]

Prints a table and writes bench/results/<name>.json. Needs a GPU (`--dry-run`: the CPU, 1k
tokens, one timed round: it runs and its bytes are right, nothing more).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, running_daemon, write_results  # noqa: E402
from bench.host_gpus import CHUNK_TOKENS, SLAB_BYTES, llama_spec  # noqa: E402

PROMPTS, UNTIMED = 4, 2
STEPS: list[tuple[str, float]] = []


def time_steps() -> None:
    """Each step of a load records its start and end in `STEPS`."""
    import kvstore_client.loads as loads

    for owner, name in ((loads.LoadPath, "load_async"), (loads.LoadPath, "_lookup_leased"),
                        (loads._LoadTargets, "ready"), (loads.LoadPath, "_scatter")):  # fmt: skip
        real = getattr(owner, name)

        def timed(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            STEPS.append((f"{_name} in", time.perf_counter()))
            try:
                return _real(*args, **kwargs)
            finally:
                STEPS.append((f"{_name} out", time.perf_counter()))

        setattr(owner, name, timed)


def gpu_timeline(run: Any) -> dict[str, Any]:
    """One round of `run` under torch's profiler: the GPU's span, busy time and gaps over 20 µs."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"][:40]) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))  # fmt: skip
    first, busy, end, gaps = spans[0][0], 0.0, spans[0][0], []
    for begin, stop, name in spans:
        if begin > end:
            gaps.append((round(end - first), round(begin - end), name))
        busy += max(0.0, stop - max(begin, end))
        end = max(end, stop)
    return {"span_us": end - first, "busy_us": busy, "gaps_over_20us": [g for g in gaps if g[1] > 20]}


def measure(tp: int, trace: bool, tokens: int, rounds: int) -> dict[str, Any]:
    import numpy as np
    import torch

    import kvstore_kernels
    from kvstore_client import KVStoreClient

    on = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: --dry-run, the bench runs

    def synchronize() -> None:
        if on == "cuda":
            torch.cuda.synchronize()

    spec = llama_spec()
    spec = dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // tp, tp_rank=0, tp_size=tp)
    chunks, blocks, page = tokens // CHUNK_TOKENS, tokens // spec.block_size, spec.page.page_bytes
    gen = torch.Generator(device=on).manual_seed(1)
    shape = (2, blocks, spec.block_size, spec.num_kv_heads, spec.head_dim * 2)  # bytes, seen as bf16
    source = [
        torch.randint(0, 256, shape, dtype=torch.uint8, device=on, generator=gen).view(torch.bfloat16)
        for _ in range(spec.num_layers)
    ]
    target = [torch.full(shape, 0xA5, dtype=torch.uint8, device=on).view(torch.bfloat16) for _ in source]
    table = np.random.default_rng(0).permutation(blocks).tolist()
    flat = torch.randint(0, 256, (chunks * page,), dtype=torch.uint8, device=on, generator=gen)
    host = torch.empty(chunks * page, dtype=torch.uint8, pin_memory=on == "cuda")
    offsets, ids = [i * page for i in range(chunks)], list(range(chunks))
    slabs = max(4, -(-2 * PROMPTS * chunks * page // SLAB_BYTES))  # room for every prompt, twice
    config = {
        "chunk_tokens": CHUNK_TOKENS,
        "tiers": {"cpu": {"bytes": slabs * SLAB_BYTES, "slab_bytes": SLAB_BYTES}},
    }
    name = torch.cuda.get_device_name(0) if on == "cuda" else "CPU (dry run)"
    result: dict[str, Any] = {"gpu": name, "tp": tp, "prompt_bytes": chunks * page}
    with running_daemon(config) as daemon:
        client = KVStoreClient.connect(daemon.address, spec, name="tp-rank-loads")
        while client.stats()["client"]["arena"].get("slabs_pending", 0):
            time.sleep(0.01)
        keys = [client.keys([p * tokens + t for t in range(tokens)]) for p in range(PROMPTS)]
        for k in keys:
            client.store(None, source, table, keys=k)
        staged = kvstore_kernels.TransferOptions(engine="staged")
        registered, caches = client.register_kv_caches(target), kvstore_kernels.register(spec, target)

        def scatter_all(kv_caches: Any) -> list[Any]:
            return [
                kvstore_kernels.scatter(spec, kv_caches, table, ids, host, offsets, options=staged)
                for _ in keys
            ]

        def load_all(kv_caches: Any) -> list[int]:
            return [h.wait() for h in [client.load_async(None, kv_caches, table, keys=k) for k in keys]]

        runs = {
            "memcpy": lambda: [flat.copy_(host, non_blocking=True) for _ in keys],
            "staged alone": lambda: scatter_all(target),
            "staged alone, registered": lambda: scatter_all(caches),
            "client": lambda: [client.load(None, target, table, keys=k) for k in keys],
            "client async": lambda: load_all(target),
            "client async, registered": lambda: load_all(registered),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for index in range(UNTIMED + rounds):
            for name, run in runs.items():
                synchronize()
                begun = time.perf_counter()
                run()
                synchronize()
                if index >= UNTIMED:
                    times[name].append((time.perf_counter() - begun) * 1e3)
        result["median_ms"] = {name: statistics.median(ms) for name, ms in times.items()}
        result["steps_us"] = {
            name: host_steps(runs[name], synchronize) for name in ("client async", "client async, registered")
        }
        if trace:
            result["gpu_timeline"] = {
                name: gpu_timeline(runs[name]) for name in ("memcpy", "staged alone", "client async")
            }
        for layer in target:
            layer.view(torch.uint8).fill_(0xA5)
        got = client.load(None, target, table, keys=keys[-1])
        synchronize()
        result["bytes_exact"] = got == tokens and all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(source, target, strict=True)
        )
        client.close()
    return result


def host_steps(run: Any, synchronize: Any) -> list[tuple[str, int]]:
    """One round of `run` with its steps timed: (step, µs from the round's start)."""
    synchronize()
    STEPS.clear()
    begun = time.perf_counter()
    run()
    synchronize()
    STEPS.append(("round done", time.perf_counter()))
    return [(name, round((at - begun) * 1e6)) for name, at in STEPS]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp", type=int, default=4, help="the rank's share: 1/tp of the KV heads")
    parser.add_argument("--trace", action="store_true", help="one round of some ways under torch's profiler")
    parser.add_argument("--name", default="tp-rank-loads")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, 1k tokens: it runs, bytes right")
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # the staged path's kernel on the CPU, before Triton's import
    time_steps()
    result = measure(args.tp, args.trace, 1024 if args.dry_run else 8192, 1 if args.dry_run else 10)
    limit = result["median_ms"]["memcpy"]
    rows = [[name, f"{ms:.2f}", f"{limit / ms:.3f}"] for name, ms in result["median_ms"].items()]
    print(
        f"TP {args.tp} rank, {result['prompt_bytes'] >> 20} MiB a prompt, {PROMPTS} a round ({result['gpu']})"
    )
    print_table(["way", "round ms", "x memcpy"], rows)
    print(f"bytes {'exact' if result['bytes_exact'] else 'DIFFER'}; wrote {write_results(args.name, result)}")
    if not result["bytes_exact"]:
        sys.exit("the loaded prompt differs from what was stored")


if __name__ == "__main__":
    main()
