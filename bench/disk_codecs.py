"""Page codecs on real KV: ratio and single-core MB/s of none, lz4 and byte-shuffle + lz4.

KV comes from a random-weight transformers Llama (a config, no download: 2048 hidden,
8 layers, 32 heads, 8 KV heads, head dim 64) run over random token ids, in bf16 and fp16,
cut into pages in the page layout (`[layer][k|v][token][kv_head][head_dim]`, 256 tokens,
4 MiB each). Each codec compresses and decompresses every page; MB/s are of page bytes
(the best of `--repeats` passes), and each round trip is checked byte for byte.

- lz4: `kvstore.tiers.codec` as the disk tier runs it (lz4 frame, 4 MiB blocks), and lz4 frame
  with its default 64 KiB blocks.
- shuffle+lz4: the page's 16-bit values split into a low-byte plane and a high-byte plane
  (blosc's shuffle), then lz4 frame; undone after decompression.

    python bench/disk_codecs.py            # needs transformers (pip install transformers)
"""

from __future__ import annotations

import argparse
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lz4.frame
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.common` when run as a script

from bench.common import print_table, write_results  # noqa: E402
from kvstore.tiers.codec import Codec, compress, decompress  # noqa: E402

CHUNK_TOKENS = 256


def kv_pages(dtype_name: str, tokens: int = 2048, seed: int = 0) -> list[bytes]:
    """Pages of KV from a random-weight Llama, in the page layout."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=32000,
        max_position_embeddings=8192,
    )
    torch.manual_seed(seed)
    dtype = getattr(torch, dtype_name)
    model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, config.vocab_size, (1, tokens)), use_cache=True).past_key_values
    pages = []
    for start in range(0, tokens, CHUNK_TOKENS):
        # HF keeps [batch, kv_head, token, head_dim]; a page holds [token][kv_head][head_dim].
        parts = [
            kv[0, :, start : start + CHUNK_TOKENS, :].transpose(0, 1).contiguous().view(torch.uint8).flatten()
            for layer in cache.layers
            for kv in (layer.keys, layer.values)
        ]
        pages.append(torch.cat(parts).numpy().tobytes())
    return pages


def shuffle(page: bytes) -> bytes:
    return np.frombuffer(page, np.uint8).reshape(-1, 2).T.tobytes()


def unshuffle(planes: bytes) -> bytes:
    return np.frombuffer(planes, np.uint8).reshape(2, -1).T.tobytes()


def tier_encode(page: bytes) -> bytes:
    """What the disk tier stores: lz4 frame, or the page itself when lz4 does not shrink it."""
    codec, payload = compress(Codec.LZ4, page)
    return struct.pack("<BQ", codec, len(page)) + bytes(payload)


def tier_decode(blob: bytes) -> bytes:
    codec, raw_length = struct.unpack_from("<BQ", blob)
    return bytes(decompress(Codec(codec), memoryview(blob)[9:], raw_length))


Encoder = Callable[[bytes], bytes]
CODECS: dict[str, tuple[Encoder, Encoder]] = {
    "none (a copy)": (lambda page: bytes(bytearray(page)), lambda payload: bytes(bytearray(payload))),
    "lz4 (the tier's)": (tier_encode, tier_decode),
    "lz4, 64 KiB blocks": (lz4.frame.compress, lz4.frame.decompress),
    "shuffle+lz4": (
        lambda page: lz4.frame.compress(shuffle(page), block_size=lz4.frame.BLOCKSIZE_MAX4MB),
        lambda payload: unshuffle(lz4.frame.decompress(payload)),
    ),
}


def measure(pages: list[bytes], encode: Encoder, decode: Encoder, repeats: int) -> dict[str, float]:
    raw = sum(map(len, pages))
    best_c = best_d = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        payloads = [encode(page) for page in pages]
        best_c = min(best_c, time.perf_counter() - began)
        began = time.perf_counter()
        back = [decode(payload) for payload in payloads]
        best_d = min(best_d, time.perf_counter() - began)
        if back != pages:
            raise AssertionError("a codec did not round-trip the pages")
    stored = sum(map(len, payloads))
    return {"ratio": raw / stored, "compress_mb_s": raw / best_c / 1e6, "decompress_mb_s": raw / best_d / 1e6}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of KV per dtype (a multiple of 256)")
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows: list[list[Any]] = []
    results = []
    for dtype in ("bfloat16", "float16"):
        pages = kv_pages(dtype, args.tokens)
        for name, (encode, decode) in CODECS.items():
            figures = measure(pages, encode, decode, args.repeats)
            results.append({"dtype": dtype, "codec": name, **figures})
            rows.append(
                [
                    dtype,
                    name,
                    round(figures["ratio"], 3),
                    figures["compress_mb_s"],
                    figures["decompress_mb_s"],
                ]
            )
    print_table(["dtype", "codec", "ratio", "compress MB/s", "decompress MB/s"], rows)
    path = write_results(
        "disk-codecs",
        {
            "kv": {
                "model": "random-weight Llama, 2048 hidden, 8 layers, 8 KV heads, head dim 64",
                "tokens": args.tokens,
                "page_bytes": len(pages[0]),
                "pages_per_dtype": len(pages),
            },
            "results": results,
        },
    )
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
