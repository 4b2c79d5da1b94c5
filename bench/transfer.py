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
  once, is in transfer_variants).
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
import gc
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.*` when run as a script

# The parts, a module each: `transfer_full` (the table above) and `transfer_summary` (its tables),
# `transfer_models` (the model rows) and `transfer_models_report`, `transfer_sweep`,
# `transfer_profile`; the cases they time are in `transfer_cases` (the 8B setup),
# `transfer_variants`, `transfer_timing`, `transfer_model_cases` and `transfer_steps`.
from bench import gpu_tier  # noqa: E402
from bench.common import write_results  # noqa: E402
from bench.transfer_full import run_full  # noqa: E402
from bench.transfer_models import run_models  # noqa: E402
from bench.transfer_models_report import print_models  # noqa: E402
from bench.transfer_profile import run_profile  # noqa: E402
from bench.transfer_summary import print_full  # noqa: E402
from bench.transfer_sweep import print_sweep, run_sweep  # noqa: E402
from kvstore_kernels import cudart, staged, triton_copy  # noqa: E402


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


def _parser() -> argparse.ArgumentParser:
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
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
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
        print_sweep(result)
    else:
        path = run_and_print_full(args, log, env)
    if log:
        print(f"\n{len(log)} measurements failed; tracebacks in {path}", file=sys.stderr)
    print(path)


def run_and_print_full(args: argparse.Namespace, log: list[str], env: dict[str, Any]) -> Path:
    """The table above, then (unless --no-gpu-tier) the GPU-tier rows; returns the results' path."""
    result = run_full(args, log)
    if args.gpu_tier:
        gc.collect()
        torch.cuda.empty_cache()  # the layouts' buffers: the daemon allocates its pool next
        try:
            result["gpu_tier"] = gpu_tier.measure(args.tokens, args.gpu_tier_repeats)
        except Exception:
            log.append(f"gpu_tier: {traceback.format_exc()}")
    path = write_results(args.name, {"config": vars(args), "environment": env, **result, "errors": log})
    print_full(result, env, args)
    if "gpu_tier" in result:
        print()
        gpu_tier.print_report(result["gpu_tier"])
    return path


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
