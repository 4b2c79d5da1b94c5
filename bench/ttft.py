"""Time to first token with a prefix restored from kvstored vs full recompute, on a real transformers model.

A Llama of Llama-3.1-8B's geometry with random bf16 weights (sdpa attention) on the GPU;
for each prompt length, the whole prompt's KV is stored in the CPU tier of a kvstored
this benchmark starts, then the same prompt is answered four ways, each timed from the
request to the first token's logits (GPU synchronised), median of `--repeats` after a
warm-up:

- recompute: one forward over the whole prompt (`logits_to_keep=1`);
- reuse: `HFPrefixCache.restore` (lookup, lease, copy of every layer's KV from the arena)
  and a forward over the one token left;
- reuse + overlap: the same with `restore(overlap=True)`: one copy per layer, and decoder
  layer i waits on the GPU for layer i's KV only;
- pure transfer: `client.load` of the same pages into preallocated tensors: the bytes
  alone, with the same lookup and lease.
Also the parts of reuse: `restore` alone ("restore", synchronised) and the forward of the
last token with its KV already in place ("decode step"), so reuse can be compared with pure
transfer + one decode step; and how long `restore(overlap=True)` takes to return ("issue").

    python bench/ttft.py                       # 2k, 8k, 32k tokens, Llama-3.1-8B geometry
    python bench/ttft.py --preset tiny --lengths 512 2048 --device cpu   # a smoke run anywhere
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

from bench.common import print_table, running_daemon, write_results  # noqa: E402
from examples.hf_prefix_reuse import PRESETS, build_model, page_bytes_per_token  # noqa: E402
from kvstore_client import KVSpec, KVStoreClient  # noqa: E402
from kvstore_client.hf import HFPrefixCache  # noqa: E402
from kvstore_kernels import TransferOptions  # noqa: E402

SLAB_BYTES = 256 << 20


def timed(run: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, list[float]]:
    """Median seconds of `run` (GPU synchronised), after one untimed warm-up; and every sample."""
    samples = []
    for attempt in range(repeats + 1):
        sync(device)
        started = time.perf_counter()
        run()
        sync(device)
        if attempt:
            samples.append(time.perf_counter() - started)
    return statistics.median(samples), samples


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def forward(model: Any, input_ids: torch.Tensor, cache: Any = None) -> torch.Tensor:
    return model(input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits


def measure(
    model: Any, prefix: HFPrefixCache, client: KVStoreClient, length: int, repeats: int, device: torch.device
) -> dict[str, Any]:
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length)).to(device)
    with torch.no_grad():
        out = model(prompt, use_cache=True, logits_to_keep=1)
    stored = prefix.save(prompt, out.past_key_values)
    want = out.logits[0, -1].float()
    del out
    hit_seen: list[int] = []
    logits: list[torch.Tensor] = []

    def recompute() -> None:
        forward(model, prompt)

    issue_samples: list[float] = []

    def reuse(overlap: bool) -> Callable[[], None]:
        def run() -> None:
            started = time.perf_counter()
            hit, cache = prefix.restore(prompt, overlap=overlap)
            if overlap:
                issue_samples.append(time.perf_counter() - started)
            logits.append(forward(model, prompt[:, hit:], cache)[0, -1].float())
            hit_seen.append(hit)

        return run

    spec = client.spec
    tokens = prompt[0].tolist()
    shape = (2, 1, spec.num_kv_heads, length, spec.head_dim)
    dtype = getattr(torch, spec.dtype)
    buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
    targets = [(pair[0], pair[1]) for pair in buffers]

    def transfer() -> None:
        loaded = client.load(tokens, targets, None)
        assert loaded == stored * spec.page.chunk_tokens, (loaded, stored)

    decode_samples, restore_samples = [], []
    for attempt in range(repeats + 1):
        sync(device)
        started = time.perf_counter()
        hit, cache = prefix.restore(prompt)
        sync(device)
        restored = time.perf_counter()
        forward(model, prompt[:, hit:], cache)
        sync(device)
        if attempt:
            restore_samples.append(restored - started)
            decode_samples.append(time.perf_counter() - restored)
        del cache

    recompute_s, recompute_all = timed(recompute, device, repeats)
    reuse_s, reuse_all = timed(reuse(False), device, repeats)
    overlap_s, overlap_all = timed(reuse(True), device, repeats)
    transfer_s, transfer_all = timed(transfer, device, repeats)
    decode_s = statistics.median(decode_samples)
    difference = max((got - want).abs().max().item() for got in logits)
    page_bytes = stored * client.page_bytes
    return {
        "tokens": length,
        "hit_tokens": hit_seen[-1],
        "chunks": stored,
        "bytes": page_bytes,
        "recompute_ms": recompute_s * 1e3,
        "reuse_ms": reuse_s * 1e3,
        "reuse_overlap_ms": overlap_s * 1e3,
        "transfer_ms": transfer_s * 1e3,
        "transfer_gb_s": page_bytes / transfer_s / 1e9,
        "decode_step_ms": decode_s * 1e3,
        "restore_ms": statistics.median(restore_samples) * 1e3,
        "overlap_issue_ms": statistics.median(issue_samples[1:] or issue_samples) * 1e3,
        "reuse_vs_recompute": reuse_s / recompute_s,
        "reuse_overlap_vs_recompute": overlap_s / recompute_s,
        "reuse_over_transfer_plus_decode_ms": (min(reuse_s, overlap_s) - transfer_s - decode_s) * 1e3,
        "max_logit_difference": difference,
        "samples_ms": {
            "recompute": [s * 1e3 for s in recompute_all],
            "reuse": [s * 1e3 for s in reuse_all],
            "reuse_overlap": [s * 1e3 for s in overlap_all],
            "transfer": [s * 1e3 for s in transfer_all],
            "decode_step": [s * 1e3 for s in decode_samples],
            "restore": [s * 1e3 for s in restore_samples],
        },
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.1-8b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shm-dir", default="/dev/shm", help="where the daemon's arena lives")
    parser.add_argument(
        "--layerwise-engine",
        choices=["kernel", "staged", "auto"],
        help="how a layer-wise load moves each run of layers (default: the client's)",
    )
    parser.add_argument("--layerwise-runs", type=int, help="runs a layer-wise load cuts layers into")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    started = time.perf_counter()
    model = build_model(args.preset, device, dtype)
    print(f"built {args.preset} with random weights in {time.perf_counter() - started:.1f} s", flush=True)
    per_token = page_bytes_per_token(model, dtype)
    cpu_bytes = -(-(sum(args.lengths) + 1024) * per_token // SLAB_BYTES) * SLAB_BYTES
    config = {
        "log_level": "warning",
        "tiers": {"cpu": {"bytes": cpu_bytes, "slab_bytes": SLAB_BYTES, "shm_dir": args.shm_dir}},
    }
    spec = KVSpec.from_hf_config(model.config, dtype=dtype, model=f"random-{args.preset}")
    rows = []
    with running_daemon(config) as daemon, KVStoreClient.connect(daemon.address, spec) as client:
        if args.layerwise_engine:
            client.layerwise_options = TransferOptions(engine=args.layerwise_engine)
        if args.layerwise_runs:
            client.layerwise_runs = args.layerwise_runs
        prefix = HFPrefixCache(client, model)
        for length in args.lengths:
            row = measure(model, prefix, client, length, args.repeats, device)
            rows.append(row)
            print(f"{length} tokens: done", flush=True)
            torch.cuda.empty_cache() if device.type == "cuda" else None

    columns = {
        "tokens": "tokens",
        "recompute ms": "recompute_ms",
        "reuse ms": "reuse_ms",
        "+overlap ms": "reuse_overlap_ms",
        "transfer ms": "transfer_ms",
        "GB/s": "transfer_gb_s",
        "restore ms": "restore_ms",
        "decode ms": "decode_step_ms",
        "issue ms": "overlap_issue_ms",
        "reuse/recompute": "reuse_vs_recompute",
        "overlap/recompute": "reuse_overlap_vs_recompute",
        "max |dlogit|": "max_logit_difference",
    }
    print_table(list(columns), [[row[key] for key in columns.values()] for row in rows])
    write_results(
        "ttft",
        {
            "preset": args.preset,
            "model_config": PRESETS[args.preset],
            "dtype": str(dtype),
            "attention": "sdpa",
            "chunk_tokens": client.spec.page.chunk_tokens,
            "repeats": args.repeats,
            "layerwise_transfer": str(client.layerwise_options),
            "layerwise_runs": client.layerwise_runs,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
