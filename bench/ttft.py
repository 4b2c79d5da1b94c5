"""Time to first token with a prefix restored from kvstored vs full recompute, on a real transformers model.

A Llama of Llama-3.1-8B's geometry with random bf16 weights (sdpa attention) on the GPU;
for each prompt length, the whole prompt's KV is stored in the CPU tier of a kvstored
this benchmark starts, then the same prompt is answered several ways, each timed from the
request to the first token's logits (GPU synchronised). Every variant runs once per round,
in turn, so a drift of the host's speed hits them all; one warm-up round, then `--repeats`
timed rounds; medians, and ratios to recompute as the median of the per-round ratios.

- recompute: one forward over the whole prompt (`logits_to_keep=1`);
- reuse: `HFPrefixCache.restore` (lookup, lease, copy of every layer's KV from the arena)
  and a forward over the one token left;
- overlap/R: the same with `restore(overlap=True)` and the client's `layerwise_runs = R`:
  the layers are copied in R runs (1, 1, 2, 4, ... layers) without the host waiting, and
  decoder layer i waits on the GPU for its run only;
- transfer: `client.load` of the same pages into preallocated tensors: the bytes alone,
  with the same lookup and lease.
Also the parts of reuse: `restore` alone ("restore", synchronised) and the forward of the
last token with its KV already in place ("decode step"), so reuse can be compared with pure
transfer + one decode step; and how long `restore(overlap=True)` takes to return ("issue").

With `--boundary B`, a progressive model's case too (`kvstore_client.hf_stages`): stage 1
stores the prompt's KV per layer range and the hidden states entering layer B; stage 2 (layers
[0, B) named by the same weights id, the rest by its own) answers the prompt with
`StagedPrefixCache.prefill`: the hidden states and layers [0, B)'s KV from the store, only
layers [B, L) computed. Timed against stage 2's full recompute, beside the ideal (L - B) / L.

    python bench/ttft.py                       # 2k, 8k, 32k tokens, Llama-3.1-8B geometry
    python bench/ttft.py --preset tiny --lengths 512 2048 --device cpu   # a smoke run anywhere
    python bench/ttft.py --lengths 8192 32768 --boundary 16 --parts partial   # the staged case only
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

from bench.common import print_table, running_daemon, write_results  # noqa: E402
from examples.hf_prefix_reuse import PRESETS, build_model, page_bytes_per_token  # noqa: E402
from kvstore_client import KVSpec, KVStoreClient  # noqa: E402
from kvstore_client.hf import HFPrefixCache  # noqa: E402
from kvstore_client.hf_stages import StagedPrefixCache  # noqa: E402
from kvstore_kernels import TransferOptions  # noqa: E402

SLAB_BYTES = 256 << 20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def in_rounds(
    variants: Mapping[str, Callable[[], object]],
    repeats: int,
    device: torch.device,
    parts: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Seconds of each variant, once per round in turn (GPU synchronised around each): a
    warm-up round, whose samples (and the `parts` the variants record) are dropped, then
    `repeats` rounds."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(repeats + 1):
        for name, run in variants.items():
            sync(device)
            started = time.perf_counter()
            run()
            sync(device)
            samples[name].append(time.perf_counter() - started)
        if round_index == 0:
            for values in (*samples.values(), *(parts or {}).values()):
                values.clear()
    return samples


@torch.inference_mode()
def forward(model: Any, input_ids: torch.Tensor, cache: Any = None) -> torch.Tensor:
    return model(input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits


def measure(
    model: Any,
    prefix: HFPrefixCache,
    client: KVStoreClient,
    length: int,
    repeats: int,
    runs_list: list[int],
    device: torch.device,
) -> dict[str, Any]:
    """Every variant once per round, in turn, for a warm-up round and `repeats` timed rounds."""
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length)).to(device)
    with torch.inference_mode():
        out = model(prompt, use_cache=True, logits_to_keep=1)
    stored = prefix.save(prompt, out.past_key_values)
    want = out.logits[0, -1].float()
    del out
    hits: list[int] = []
    logits: list[torch.Tensor] = []
    parts: dict[str, list[float]] = {"restore": [], "decode_step": []}
    parts.update({f"issue_runs{runs}": [] for runs in runs_list})

    def recompute() -> None:
        forward(model, prompt)

    def reuse(runs: int | None) -> Callable[[], None]:
        def run() -> None:
            started = time.perf_counter()
            if runs is None:
                hit, cache = prefix.restore(prompt)
            else:
                client.layerwise_runs = runs
                hit, cache = prefix.restore(prompt, overlap=True)
                parts[f"issue_runs{runs}"].append(time.perf_counter() - started)
            logits.append(forward(model, prompt[:, hit:], cache)[0, -1].float())
            hits.append(hit)

        return run

    def reuse_parts() -> None:
        started = time.perf_counter()
        hit, cache = prefix.restore(prompt)
        sync(device)
        restored = time.perf_counter()
        forward(model, prompt[:, hit:], cache)
        sync(device)
        parts["restore"].append(restored - started)
        parts["decode_step"].append(time.perf_counter() - restored)

    spec = client.spec
    tokens = prompt[0].tolist()
    shape = (2, 1, spec.num_kv_heads, length, spec.head_dim)
    buffers = [
        torch.empty(shape, dtype=getattr(torch, spec.dtype), device=device) for _ in range(spec.num_layers)
    ]
    targets = [(pair[0], pair[1]) for pair in buffers]

    def transfer() -> None:
        loaded = client.load(tokens, targets, None)
        assert loaded == stored * spec.page.chunk_tokens, (loaded, stored)

    variants: dict[str, Callable[[], None]] = {"recompute": recompute, "reuse": reuse(None)}
    variants.update({f"overlap_runs{runs}": reuse(runs) for runs in runs_list})
    variants.update({"transfer": transfer, "parts": reuse_parts})
    samples = in_rounds(variants, repeats, device, parts)
    del samples["parts"]

    def median_ms(values: list[float]) -> float:
        return statistics.median(values) * 1e3

    def ratio(name: str) -> float:
        """Median over rounds of `name` / recompute in the same round."""
        return statistics.median(a / b for a, b in zip(samples[name], samples["recompute"], strict=True))

    page_bytes = stored * client.page_bytes
    overlap = {runs: median_ms(samples[f"overlap_runs{runs}"]) for runs in runs_list}
    best_runs = min(overlap, key=lambda runs: overlap[runs])
    transfer_ms, decode_ms = median_ms(samples["transfer"]), median_ms(parts["decode_step"])
    return {
        "tokens": length,
        "hit_tokens": hits[-1],
        "chunks": stored,
        "bytes": page_bytes,
        "recompute_ms": median_ms(samples["recompute"]),
        "reuse_ms": median_ms(samples["reuse"]),
        "reuse_overlap_ms": overlap,
        "transfer_ms": transfer_ms,
        "transfer_gb_s": page_bytes / transfer_ms / 1e6,
        "restore_ms": median_ms(parts["restore"]),
        "decode_step_ms": decode_ms,
        "overlap_issue_ms": {runs: median_ms(parts[f"issue_runs{runs}"]) for runs in runs_list},
        "reuse_vs_recompute": ratio("reuse"),
        "reuse_overlap_vs_recompute": {runs: ratio(f"overlap_runs{runs}") for runs in runs_list},
        "best_overlap_runs": best_runs,
        "best_reuse_over_transfer_plus_decode_ms": min(median_ms(samples["reuse"]), overlap[best_runs])
        - transfer_ms
        - decode_ms,
        "max_logit_difference": max((got - want).abs().max().item() for got in logits),
        "samples_ms": {name: [v * 1e3 for v in values] for name, values in {**samples, **parts}.items()},
    }


def measure_partial(
    model: Any, address: str, spec: KVSpec, boundary: int, length: int, repeats: int, device: torch.device
) -> dict[str, Any]:
    """Stage 2's `prefill` of a prompt stage 1 stored (KV per range, hidden states at
    `boundary`) against stage 2's full recompute, in turns, a warm-up round then `repeats`."""
    layers = spec.num_layers
    weights = {
        stage: [(boundary, "random-base"), (layers, f"random-{stage}")] for stage in ("stage1", "stage2")
    }
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length + 1)).to(
        device
    )
    captured: list[torch.Tensor] = []
    hook = model.model.layers[boundary].register_forward_pre_hook(
        lambda module, args: captured.append(args[0])
    )
    try:
        with torch.inference_mode():
            out = model(prompt, use_cache=True, logits_to_keep=1)
    finally:
        hook.remove()
    want = out.logits[0, -1].float()
    stage = {name: replace(spec, weights=tuple(w)) for name, w in weights.items()}
    with (
        StagedPrefixCache.connect(address, stage["stage1"], model, boundary) as first,
        StagedPrefixCache.connect(address, stage["stage2"], model, boundary) as second,
    ):
        stored = first.save(prompt, out.past_key_values, captured[0])
        del out
        captured.clear()
        paths: list[str] = []
        logits: list[torch.Tensor] = []

        def partial() -> None:
            result = second.prefill(prompt)
            paths.append(result.path)
            logits.append(result.logits[0, -1].float())

        variants = {"recompute": lambda: forward(model, prompt), "partial": partial}
        samples = in_rounds(variants, repeats, device)
    if set(paths) != {"partial"}:
        raise RuntimeError(f"stage 2 took the paths {sorted(set(paths))}, not only 'partial'")
    ratio = statistics.median(a / b for a, b in zip(samples["partial"], samples["recompute"], strict=True))
    ideal = (layers - boundary) / layers
    return {
        "tokens": length,
        "boundary": boundary,
        "layers": layers,
        "chunks_stored": stored,
        "recompute_ms": statistics.median(samples["recompute"]) * 1e3,
        "partial_ms": statistics.median(samples["partial"]) * 1e3,
        "partial_vs_recompute": ratio,
        "ideal": ideal,
        "over_ideal": ratio / ideal,
        "target_over_ideal": 1.15,
        "max_logit_difference": max((got - want).abs().max().item() for got in logits),
        "samples_ms": {name: [v * 1e3 for v in values] for name, values in samples.items()},
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.1-8b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds, each variant once per round")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shm-dir", default="/dev/shm", help="where the daemon's arena lives")
    parser.add_argument(
        "--layerwise-engine",
        choices=["kernel", "staged", "auto"],
        help="how a layer-wise load moves each run of layers (default: the client's)",
    )
    parser.add_argument(
        "--layerwise-runs", type=int, nargs="+", default=[1, 6], help="runs of layers a layer-wise load uses"
    )
    parser.add_argument("--boundary", type=int, help="the staged case: layers before this are shared")
    parser.add_argument(
        "--parts", nargs="+", choices=["reuse", "partial"], default=["reuse", "partial"], help="what to time"
    )
    parser.add_argument("--name", default="ttft", help="results name")
    args = parser.parse_args()
    if "partial" in args.parts and args.boundary is None and args.parts == ["partial"]:
        parser.error("--parts partial needs --boundary B")

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    started = time.perf_counter()
    model = build_model(args.preset, device, dtype)
    print(f"built {args.preset} with random weights in {time.perf_counter() - started:.1f} s", flush=True)
    per_token = page_bytes_per_token(model, dtype)
    hidden_bytes = model.config.hidden_size * dtype.itemsize  # the staged case's hidden-state pages
    per_prompt_token = per_token * ("reuse" in args.parts) + (per_token + hidden_bytes) * (
        args.boundary is not None
    )
    cpu_bytes = -(-(sum(args.lengths) + 1024) * per_prompt_token // SLAB_BYTES) * SLAB_BYTES
    config = {
        "log_level": "warning",
        "tiers": {"cpu": {"bytes": cpu_bytes, "slab_bytes": SLAB_BYTES, "shm_dir": args.shm_dir}},
    }
    spec = KVSpec.from_hf_config(model.config, dtype=dtype, model=f"random-{args.preset}")
    # As a serving engine does after start-up: the long-lived objects (the model's modules and
    # parameters) leave the collector's generations, so a collection does not walk them in the
    # middle of a timed request.
    gc.collect()
    gc.freeze()
    rows: list[dict[str, Any]] = []
    staged: list[dict[str, Any]] = []
    with running_daemon(config) as daemon, KVStoreClient.connect(daemon.address, spec) as client:
        if args.layerwise_engine:
            client.layerwise_options = TransferOptions(engine=args.layerwise_engine)
        prefix = HFPrefixCache(client, model)
        for length in args.lengths:
            if "reuse" in args.parts:
                rows.append(measure(model, prefix, client, length, args.repeats, args.layerwise_runs, device))
            if "partial" in args.parts and args.boundary is not None:
                staged.append(
                    measure_partial(model, daemon.address, spec, args.boundary, length, args.repeats, device)
                )
            print(f"{length} tokens: done", flush=True)
            torch.cuda.empty_cache() if device.type == "cuda" else None
        chunk_tokens = client.spec.page.chunk_tokens

    runs_list = args.layerwise_runs
    headers = ["tokens", "recompute ms", "reuse ms", *[f"overlap/{r} ms" for r in runs_list], "transfer ms"]
    headers += [
        "GB/s",
        "restore ms",
        "decode ms",
        "reuse/recomp",
        *[f"overlap/{r}/recomp" for r in runs_list],
    ]
    table = [
        [row["tokens"], row["recompute_ms"], row["reuse_ms"], *row["reuse_overlap_ms"].values()]
        + [row["transfer_ms"], row["transfer_gb_s"], row["restore_ms"], row["decode_step_ms"]]
        + [row["reuse_vs_recompute"], *row["reuse_overlap_vs_recompute"].values()]
        for row in rows
    ]
    if rows:
        print_table(headers, table)
    if staged:
        print(
            f"\nStage 2 restores layers [0, {args.boundary}) and the hidden states entering layer "
            f"{args.boundary}, and computes the rest"
        )
        print_table(
            [
                "tokens",
                "recompute ms",
                "partial ms",
                "partial/recomp",
                "ideal",
                "over ideal",
                "max logit diff",
            ],
            [
                [r["tokens"], r["recompute_ms"], r["partial_ms"], r["partial_vs_recompute"], r["ideal"]]
                + [r["over_ideal"], r["max_logit_difference"]]
                for r in staged
            ],
        )
    write_results(
        args.name,
        {
            "preset": args.preset,
            "model_config": PRESETS[args.preset],
            "dtype": str(dtype),
            "attention": "sdpa",
            "chunk_tokens": chunk_tokens,
            "repeats": args.repeats,
            "layerwise_transfer": str(client.layerwise_options),
            "layerwise_runs": runs_list,
            "rows": rows,
            "partial": staged,
        },
    )


if __name__ == "__main__":
    main()
