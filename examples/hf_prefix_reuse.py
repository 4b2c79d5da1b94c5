"""Prefix reuse with a transformers model: time to first token with and without kvstored.

Builds a Llama-architecture model from a config with random weights (nothing is
downloaded), runs a long prompt A and saves its KV in kvstored, then answers A + a
question twice: restoring A's KV from kvstored and computing only the question, and
recomputing everything. Prints both times to first token and the largest logit difference.

    python examples/hf_prefix_reuse.py                                # tiny model, CPU
    python examples/hf_prefix_reuse.py --preset llama-3.1-8b --prompt-tokens 8192   # a GPU

Without `--address` it starts its own kvstored (CPU tier sized for the prompt) and stops it
at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=32_000,
        max_position_embeddings=8192,
    ),
    "llama-3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128_256,
        max_position_embeddings=131_072,
        rope_theta=500_000.0,
    ),
}


def build_model(preset: str, device: torch.device, dtype: torch.dtype) -> Any:
    """A Llama of `preset`'s geometry with random weights, sdpa attention, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**PRESETS[preset])
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def page_bytes_per_token(model: Any, dtype: torch.dtype) -> int:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize


@contextlib.contextmanager
def kvstored(address: str | None, cpu_bytes: int) -> Iterator[str]:
    """`address`, or a private kvstored with a CPU tier of `cpu_bytes`, stopped on exit."""
    if address:
        yield address
        return
    from bench.common import running_daemon

    slab = 256 << 20
    config = {"tiers": {"cpu": {"bytes": -(-cpu_bytes // slab) * slab}}, "log_level": "warning"}
    with running_daemon(config) as daemon:
        yield daemon.address


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def first_token_logits(model: Any, input_ids: torch.Tensor, cache: Any = None) -> torch.Tensor:
    out = model(input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float()


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="tokens of the long prompt A")
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--address", help="a running kvstored (default: start one)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    from kvstore_client import KVSpec, KVStoreClient
    from kvstore_client.hf import HFPrefixCache

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.preset, device, dtype)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (1, args.prompt_tokens), generator=generator).to(device)
    question = torch.randint(0, vocab, (1, args.question_tokens), generator=generator).to(device)
    request = torch.cat([prompt, question], dim=1)
    cpu_bytes = 2 * (args.prompt_tokens + 512) * page_bytes_per_token(model, dtype)

    spec = KVSpec.from_hf_config(model.config, dtype=dtype, model=f"random-{args.preset}")
    with kvstored(args.address, cpu_bytes) as address, KVStoreClient.connect(address, spec) as client:
        prefix = HFPrefixCache(client, model)
        with torch.inference_mode():
            out = model(prompt, use_cache=True, logits_to_keep=1)
        stored = prefix.save(prompt, out.past_key_values)
        del out
        chunk = client.spec.page.chunk_tokens
        print(f"prompt A: {args.prompt_tokens} tokens, {stored} chunks of {chunk} stored")

        first_token_logits(model, request)  # warm-up: kernels, allocator
        synchronize(device)
        started = time.perf_counter()
        recomputed = first_token_logits(model, request)
        synchronize(device)
        recompute_s = time.perf_counter() - started

        hit, cache = prefix.restore(request)  # warm-up
        first_token_logits(model, request[:, hit:], cache)
        del cache
        synchronize(device)
        started = time.perf_counter()
        hit, cache = prefix.restore(request)
        reused = first_token_logits(model, request[:, hit:], cache)
        synchronize(device)
        reuse_s = time.perf_counter() - started

    difference = (reused - recomputed).abs().max().item()
    print(f"A + question: {request.shape[1]} tokens, {hit} restored from kvstored")
    print(f"time to first token, full recompute: {recompute_s * 1e3:9.1f} ms")
    speedup = recompute_s / reuse_s
    print(f"time to first token, with reuse:     {reuse_s * 1e3:9.1f} ms  ({speedup:.1f}x sooner)")
    print(f"largest logit difference: {difference:.3g} ({dtype})")


if __name__ == "__main__":
    main()
