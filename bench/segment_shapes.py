"""The kernel's shape for small segments: what a TP rank's pages need from host memory.

A TP rank of Llama-3.1-8B holds 8 / TP of its KV heads, so one segment of its pages (one block of
one layer's K or V: 16 tokens x heads x 128 x bf16) is 32 KiB at TP 1, 8 KiB at TP 4 and 4 KiB at
TP 8. The kernel keeps `segments_per_step` segments in flight per program, so the bytes in flight
per program shrink with the segment, and loads from host memory (latency-bound over PCIe) slow.

For each head count (`--heads 8 2 1`), one worker process per GPU (`--gpus N`) takes a flash_attn
cache of `--tokens` tokens on a random block table and a pinned buffer of its pages; all workers
run each phase at the same moment (a barrier before each):

- `memcpy`: one pinned `cudaMemcpyAsync` of the same bytes each way: the limit;
- `default`: `kvstore_kernels.gather` / `scatter` with the engine `kernel` (the shipped rule:
  `triton_copy.SMALL_SEGMENTS` for segments under 16 KiB);
- `tile=T seg=S p=P`: the kernel with that tile, segments per step and program count.

Every kernel row's bytes are checked once: the gather against the torch reference's pages, the
scatter into a poisoned cache against the source blocks. A phase's GB/s is every worker's bytes
over the time from the first worker's start to the last worker's end (median of `--reps`),
"x memcpy" the same direction's memcpy of the same head count in the same run.

    python bench/segment_shapes.py --gpus 1 --heads 8 2 1 --name segment-shapes-h200
    python bench/segment_shapes.py --gpus 4 --heads 8 2 --name segment-shapes-h200x4
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_meta, print_table, write_results  # noqa: E402

# (tile_bytes, segments_per_step, programs): the shipped shape's neighbours, more bytes in flight
SHAPES = [
    (16384, 4, 2),
    (16384, 8, 2),
    (16384, 16, 2),
    (16384, 4, 4),
    (16384, 8, 4),
    (16384, 16, 4),
    (16384, 4, 8),
    (16384, 8, 8),
]


def worker(rank: int, args: dict[str, Any], barrier: Any, out: Any) -> None:
    try:
        out.put((rank, run_worker(rank, args, barrier)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        barrier.abort()
        out.put((rank, {"error": traceback.format_exc()}))


class Case:
    """One head count's cache, pinned buffer and the torch reference's pages, on the current GPU."""

    def __init__(self, rank: int, heads: int, tokens: int) -> None:
        import torch

        from bench.transfer_cases import CHUNK_TOKENS, PinnedBuffer, make_spec
        from kvstore_kernels import reference
        from kvstore_kernels.validate import plan_transfer

        self.spec = spec = dataclasses.replace(make_spec("flash_attn"), num_kv_heads=heads)
        pages = tokens // CHUNK_TOKENS
        blocks = pages * spec.blocks_per_chunk
        gen = torch.Generator(device="cuda").manual_seed(rank * 100 + heads)
        shape = (2, blocks, spec.block_size, heads, spec.head_dim)
        self.source = [
            torch.randint(-32768, 32767, shape, dtype=torch.int16, device="cuda", generator=gen).view(
                torch.bfloat16
            )
            for _ in range(spec.num_layers)
        ]
        self.target = [torch.empty_like(layer) for layer in self.source]
        self.table = torch.randperm(blocks, generator=torch.Generator().manual_seed(rank)).tolist()
        self.size = pages * spec.page.page_bytes
        self.pinned = PinnedBuffer(self.size)
        self.host = self.pinned.tensor
        self.flat = torch.randint(0, 256, (self.size,), dtype=torch.uint8, device="cuda", generator=gen)
        self.offsets = [i * spec.page.page_bytes for i in range(pages)]
        self.chunks = list(range(pages))
        self.expected = torch.empty(self.size, dtype=torch.uint8)
        on_cpu = [layer.cpu() for layer in self.source]
        reference.gather_plan(
            plan_transfer(
                spec,
                on_cpu,
                self.table,
                self.chunks,
                self.expected,
                self.offsets,
                None,
                0,
                writes_cache=False,
            )
        )
        self.plans = {to_page: self._plan(to_page) for to_page in (True, False)}

    def _plan(self, to_page: bool) -> Any:
        from kvstore_kernels.validate import plan_transfer

        caches = self.source if to_page else self.target
        return plan_transfer(
            self.spec,
            caches,
            self.table,
            self.chunks,
            self.host,
            self.offsets,
            None,
            0,
            writes_cache=not to_page,
        )

    def runs(self, shapes: list[tuple[int, int, int]]) -> dict[str, tuple[Any, Any]]:
        """Each row's (store, load), each queueing one transfer of the prompt's bytes."""
        import kvstore_kernels
        from kvstore_kernels import triton_copy

        spec, host, flat = self.spec, self.host, self.flat
        args = (self.table, self.chunks, host, self.offsets)
        options = kvstore_kernels.TransferOptions(engine="kernel")
        runs: dict[str, tuple[Any, Any]] = {
            "memcpy": (
                lambda: host.copy_(flat, non_blocking=True),
                lambda: flat.copy_(host, non_blocking=True),
            ),
            "default": (
                lambda: kvstore_kernels.gather(spec, self.source, *args, options=options),
                lambda: kvstore_kernels.scatter(spec, self.target, *args, options=options),
            ),
        }
        for tile, segments, programs in shapes:
            tuning = triton_copy.Tuning(tile_bytes=tile, segments_per_step=segments)
            runs[f"tile={tile // 1024}K seg={segments} p={programs}"] = (
                lambda t=tuning, p=programs: triton_copy.launch(
                    spec, self.plans[True], to_page=True, max_programs=p, tuning=t
                ),
                lambda t=tuning, p=programs: triton_copy.launch(
                    spec, self.plans[False], to_page=False, max_programs=p, tuning=t
                ),
            )
        return runs

    def check(self, store: Any, load: Any) -> bool:
        """Gather into a poisoned buffer against the reference, scatter into a poisoned cache."""
        import torch

        self.host.fill_(0xA5)
        store()
        torch.cuda.synchronize()
        gathered = torch.equal(self.host, self.expected)
        for layer in self.target:
            layer.view(torch.uint8).fill_(0x5A)
        load()
        torch.cuda.synchronize()
        return gathered and all(
            torch.equal(t[:, self.table].view(torch.uint8), s[:, self.table].view(torch.uint8))
            for t, s in zip(self.target, self.source, strict=True)
        )

    def release(self) -> None:
        import torch

        torch.cuda.synchronize()
        self.pinned.unregister()


def run_worker(rank: int, args: dict[str, Any], barrier: Any) -> dict[str, Any]:
    import torch

    from bench.host_gpus import Timeline

    torch.cuda.set_device(rank)
    timeline = Timeline(barrier)
    checks: dict[str, bool] = {}
    sizes: dict[int, int] = {}
    for heads in args["heads"]:
        case = Case(rank, heads, args["tokens"])
        sizes[heads] = case.size
        for name, (store, load) in case.runs(args["shapes"]).items():
            store(), load()  # warm-up: Triton's compile, first touches
            torch.cuda.synchronize()
            if name != "memcpy":
                checks[f"{heads} {name}"] = case.check(store, load)
            for direction, run in (("store", store), ("load", load)):
                for _ in range(args["reps"]):
                    timeline.phase(f"{heads} {name} {direction}", run, torch.cuda.synchronize)
        case.release()
        del case
        torch.cuda.empty_cache()
    return {"rank": rank, "spans": timeline.spans, "checks": checks, "sizes": sizes}


def run(args: argparse.Namespace) -> dict[str, Any]:
    context = mp.get_context("spawn")
    barrier, out = context.Barrier(args.gpus), context.Queue()
    settings = {"heads": args.heads, "tokens": args.tokens, "reps": args.reps, "shapes": SHAPES}
    processes = [context.Process(target=worker, args=(r, settings, barrier, out)) for r in range(args.gpus)]
    for process in processes:
        process.start()
    results = dict(out.get(timeout=args.timeout_s) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        raise RuntimeError(f"a worker failed:\n{errors[0]}")
    workers = [results[r] for r in range(args.gpus)]
    rows = []
    for name in workers[0]["spans"]:
        heads, label, direction = int(name.split()[0]), " ".join(name.split()[1:-1]), name.split()[-1]
        total = sum(w["sizes"][heads] for w in workers)
        rates = []
        for index in range(len(workers[0]["spans"][name])):
            start = min(w["spans"][name][index][0] for w in workers)
            end = max(w["spans"][name][index][1] for w in workers)
            rates.append(total / (end - start) / 1e9)
        rows.append(
            {"heads": heads, "shape": label, "direction": direction, "gbps": sorted(rates)[len(rates) // 2]}
        )
    memcpy = {(r["heads"], r["direction"]): r["gbps"] for r in rows if r["shape"] == "memcpy"}
    for row in rows:
        row["x_memcpy"] = row["gbps"] / memcpy[(row["heads"], row["direction"])]
        checks = [w["checks"].get(f"{row['heads']} {row['shape']}", True) for w in workers]
        row["bytes_ok"] = all(checks)
    return {"rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--heads", type=int, nargs="+", default=[8, 2, 1], help="KV heads per rank")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--name", default="segment_shapes")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    args = parser.parse_args(argv)
    started = time.monotonic()
    result = run(args)
    print_table(
        ["heads", "segment", "shape", "store GB/s", "x memcpy", "load GB/s", "x memcpy", "bytes"],
        [
            [r["heads"], f"{r['heads'] * 4} KiB", r["shape"], f"{r['gbps']:.1f}", f"{r['x_memcpy']:.2f}",
             f"{load['gbps']:.1f}", f"{load['x_memcpy']:.2f}",
             "PASS" if r["bytes_ok"] and load["bytes_ok"] else "FAIL"]
            for r in result["rows"] if r["direction"] == "store"
            for load in result["rows"]
            if load["direction"] == "load" and load["heads"] == r["heads"] and load["shape"] == r["shape"]
        ],
    )  # fmt: skip
    payload = {"args": vars(args), "machine": machine_meta(), "seconds": time.monotonic() - started, **result}
    print(f"wrote {write_results(args.name, payload)}")


if __name__ == "__main__":
    main()
