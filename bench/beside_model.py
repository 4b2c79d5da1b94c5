"""Transfers beside a model on one GPU: what each costs the other.

An engine loads a hit's pages and stores a prefill's while its model computes other requests. One
worker on one GPU, Llama-3.1-8B's geometry (`--tp 4`: a rank's share of the KV heads, 8 MiB pages;
`--tp 1`: 32 MiB), four 8k-token prompts a round, every store and load as an engine drives them
(the caches registered, every `store_async` / `load_async` of the round started, then all waited
for), the daemon's arena pinned by the daemon, as on a GPU host:

- alone: `memcpy store` and `memcpy load` (one pinned `cudaMemcpyAsync` a prompt, device to
  host and host to device: the limit), the client's store of the round's prompts (the namespace
  cleared first, so every store moves its bytes), then their load;
- beside a model: the same while a stream of bf16 n^3 products (`--sizes`: 8192, a prefill's
  large GEMMs, and 4096) runs on the GPU (a thread keeps a few queued; each timed with events),
  measured alone for `--model-s` before and after. The model runs in one window for the memcpys
  and one for the client's stores and loads, so what each costs the model is its own.

The staged path's ring is one per device and direction in a process, its slots sized by the
largest page moved so far: run one `--tp` a process where the ring's slots matter (a TP 4 rank's
8 MiB pages take 16 slots alone, 4 after TP 1's 32 MiB pages).

Reported: each way's median round, over its direction's memcpy alone, and beside each model over
alone; the model's slowdown in each window (its median product there over alone, before and after
pooled). The last prompt is loaded into a poisoned cache and compared byte for byte.

    python bench/beside_model.py [--tp 4] [--rounds 5] [--sizes 8192 4096] [--name beside-model]
    python bench/beside_model.py --dry-run   # the CPU, no model: it runs and its bytes are right

Prints a table and writes bench/results/<name>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, running_daemon, write_results  # noqa: E402
from bench.host_gpus import CHUNK_TOKENS, SLAB_BYTES, Products, llama_spec  # noqa: E402

PROMPTS = 4


class Way:
    """One client (one TP share) and its prompts' tensors."""

    def __init__(self, address: str, tp: int, tokens: int, on: str) -> None:
        import numpy as np
        import torch

        from kvstore_client import KVStoreClient

        spec = llama_spec()
        self.spec = dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // tp, tp_rank=0, tp_size=tp)
        self.tp, self.tokens = tp, tokens
        blocks = tokens // self.spec.block_size
        gen = torch.Generator(device=on).manual_seed(tp)
        shape = (2, blocks, self.spec.block_size, self.spec.num_kv_heads, self.spec.head_dim * 2)
        self.source = [
            torch.randint(0, 256, shape, dtype=torch.uint8, device=on, generator=gen).view(torch.bfloat16)
            for _ in range(self.spec.num_layers)
        ]
        self.target = [torch.full(shape, 0xA5, dtype=torch.uint8, device=on).view(torch.bfloat16)
                       for _ in self.source]  # fmt: skip
        self.table = np.random.default_rng(tp).permutation(blocks).tolist()
        self.client = KVStoreClient.connect(address, self.spec, name=f"beside-{tp}")
        while self.client.stats()["client"]["arena"].get("slabs_pending", 0):
            time.sleep(0.01)
        self.sources = self.client.register_kv_caches(self.source)
        self.targets = self.client.register_kv_caches(self.target)
        self.keys = [self.client.keys([p * tokens + t for t in range(tokens)]) for p in range(PROMPTS)]
        chunk_bytes = (tokens // CHUNK_TOKENS) * self.spec.page.page_bytes
        self.flat = torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8, device=on, generator=gen)
        self.host = torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=on == "cuda")

    def store(self) -> None:
        for handle in [self.client.store_async(None, self.sources, self.table, keys=k) for k in self.keys]:
            handle.wait()

    def load(self) -> None:
        for handle in [self.client.load_async(None, self.targets, self.table, keys=k) for k in self.keys]:
            if handle.wait() != self.tokens:
                raise RuntimeError(f"TP {self.tp}: a prompt was not all found")

    def memcpy_store(self) -> None:
        for _ in self.keys:
            self.host.copy_(self.flat, non_blocking=True)

    def memcpy_load(self) -> None:
        for _ in self.keys:
            self.flat.copy_(self.host, non_blocking=True)

    def bytes_exact(self, synchronize: Any) -> bool:
        import torch

        for layer in self.target:
            layer.view(torch.uint8).fill_(0xA5)
        got = self.client.load(None, self.target, self.table, keys=self.keys[-1])
        synchronize()
        return got == self.tokens and all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in zip(self.source, self.target, strict=True)
        )


WAYS = ("memcpy store", "store", "memcpy load", "load")  # each transfer after the memcpy of its direction


def measure(tps: list[int], rounds: int, model_s: float, tokens: int, sizes: list[int]) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    on = "cuda" if cuda else "cpu"

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(run: Any) -> float:
        synchronize()
        begun = time.perf_counter()
        run()
        synchronize()
        return (time.perf_counter() - begun) * 1e3

    # Room for every way's prompts (each way clears its namespace before it stores); pinned by the
    # daemon where there is a GPU, as on a GPU host (no client registers it).
    prompt_bytes = [PROMPTS * (tokens // CHUNK_TOKENS) * (llama_spec().page.page_bytes // tp) for tp in tps]
    slabs = sum(-(-size // SLAB_BYTES) for size in prompt_bytes) + 2
    cpu = {"bytes": slabs * SLAB_BYTES, "slab_bytes": SLAB_BYTES, **({"pinned": True} if cuda else {})}
    config = {"chunk_tokens": CHUNK_TOKENS, "tiers": {"cpu": cpu}}
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0) if cuda else "CPU (dry run)", "model": {}}
    times: dict[tuple[int, str, str], list[float]] = {}
    with running_daemon(config) as daemon:
        ways = [Way(daemon.address, tp, tokens, on) for tp in tps]

        def run_round(group: list[Way], names: tuple[str, ...], when: str) -> None:
            for way in group:
                for name in names:
                    if name == "store":
                        way.client.clear()  # every round's stores move their bytes
                    key = (way.tp, name, when)
                    times.setdefault(key, []).append(timed(getattr(way, name.replace(" ", "_"))))

        run_round(ways, WAYS, "untimed")  # Triton's compile, first touches
        for _ in range(rounds):  # alone, every way in turns
            run_round(ways, WAYS, "alone")
        for size in sizes if cuda else [0]:  # beside each model: a window of it for the memcpys and
            products = Products(on, size) if cuda else None  # one for the client's transfers
            model: dict[str, list[float]] = {"alone": alone(products, model_s)}
            for _ in range(rounds):
                for window, names in (
                    ("memcpy", ("memcpy store", "memcpy load")),
                    ("client", ("store", "load")),
                ):
                    if products is not None:
                        products.start()
                    run_round(ways, names, f"beside {size}")
                    if products is not None:
                        model.setdefault(window, []).extend(products.stop()[3:-3])
            if products is not None:
                model["alone"] += alone(products, model_s)
                base = statistics.median(model["alone"])
                result["model"][size] = {
                    "alone_ms": base,
                    "products": {window: len(ms) for window, ms in model.items()},
                    "slowdown": {w: statistics.median(ms) / base for w, ms in model.items() if w != "alone"},
                }
        result["exact"] = {f"TP {w.tp}": w.bytes_exact(synchronize) for w in ways}
        for way in ways:
            way.client.close()
    result["median_ms"] = {" / ".join(map(str, key)): statistics.median(ms) for key, ms in times.items()}
    result["rows"] = [row_of(times, tp, name) for tp in tps for name in WAYS]
    return result


def row_of(times: dict[tuple[int, str, str], list[float]], tp: int, name: str) -> dict[str, Any]:
    """One way's medians: alone, over its direction's memcpy alone, and beside each model over alone."""
    ms = {when: statistics.median(v) for (t, n, when), v in times.items() if (t, n) == (tp, name)}
    memcpy = (
        ms["alone"]
        if name.startswith("memcpy")
        else statistics.median(times[(tp, f"memcpy {name}", "alone")])
    )
    return {
        "tp": tp,
        "way": name,
        "ms": ms,
        "x_memcpy_alone": memcpy / ms["alone"],
        "beside_x_alone": {when: ms["alone"] / m for when, m in ms.items() if when.startswith("beside")},
    }


def alone(products: Any, seconds: float) -> list[float]:
    if products is None:
        return []
    products.start()
    time.sleep(seconds)
    return products.stop()[3:]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tp", type=int, nargs="+", default=[1, 4], help="each a rank's share: 1/tp of the heads"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[8192, 4096], help="the model: bf16 n^3 products, for each n"
    )
    parser.add_argument("--model-s", type=float, default=1.0, help="the model alone, before and after")
    parser.add_argument("--name", default="beside-model")
    parser.add_argument(
        "--dry-run", action="store_true", help="the CPU, 1k tokens, no model: it runs, bytes right"
    )
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        import torch

        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (or --dry-run)")
    tokens = 1024 if args.dry_run else 8192
    result = measure(args.tp, 1 if args.dry_run else args.rounds, args.model_s, tokens, args.sizes)
    besides = sorted({when for row in result["rows"] for when in row["beside_x_alone"]})
    rows = [
        [f"TP {row['tp']}", row["way"], f"{row['ms']['alone']:.1f}",
         f"{row['x_memcpy_alone']:.3f}", *(f"{row['beside_x_alone'][when]:.3f}" for when in besides)]
        for row in result["rows"]
    ]  # fmt: skip
    print(f"{result['gpu']}: {PROMPTS} prompts a round, median round; beside a model: x the same way alone")
    print_table(["share", "way", "alone ms", "x memcpy", *besides], rows)
    for size, m in result["model"].items():
        slowdowns = ", ".join(f"{window} {x:.3f}" for window, x in m["slowdown"].items())
        print(f"model {size}^3: {m['alone_ms']:.3f} ms a product alone; slowdown beside: {slowdowns}")
    print(f"bytes {result['exact']}")
    print(f"wrote {write_results(args.name, result)}")
    if not all(result["exact"].values()):
        sys.exit("a loaded prompt differs from what was stored")


if __name__ == "__main__":
    main()
