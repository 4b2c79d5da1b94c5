"""Model geometries the transfer benchmark moves through the public client, and their timing.

- `deepseek_v3_spec(dtype)`: DeepSeek-V3's MLA cache; `gpt_oss_spec(sliding)`: one of
  gpt-oss-120b's two KV-cache groups; `window_chunks(window, chunk_tokens)`: the chunks a
  sliding layer attends to at a resume point.
- `ModelCache(spec, tokens, seed)`: a random KV cache on a random block table and a poisoned
  target to load into, checked with `loaded_right`.
- `HostCopy(size)`: the baseline, one copy between the device and pinned host memory.
- `against(walls, baseline, moved)`: a row's figures against the baseline timed in turn with it
  (`common_timing.walls_in_turn`).
- `device()`, `synchronize()`: CUDA where there is one, else the CPU (a dry run).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from bench.transfer_cases import CHUNK_TOKENS, PinnedBuffer
from kvstore.shared.spec import KVSpec

DEEPSEEK_V3_LAYERS, DEEPSEEK_V3_LATENT, MLA_BLOCK = 61, 576, 64  # 512 compressed KV + 64 rope
GPT_OSS_LAYERS, GPT_OSS_WINDOW = 36, 128  # gpt-oss-120b: layers 0, 2, ... slide, 1, 3, ... attend to all


def deepseek_v3_spec(dtype: str) -> KVSpec:
    """DeepSeek-V3's MLA cache as vLLM's MLA backends hold it: one 576-wide latent per token."""
    return KVSpec(
        model="deepseek-v3",
        num_layers=DEEPSEEK_V3_LAYERS,
        num_kv_heads=1,
        head_dim=DEEPSEEK_V3_LATENT,
        dtype=dtype,
        block_size=MLA_BLOCK,
        layout="mla",
        chunk_tokens=CHUNK_TOKENS,
    )


def gpt_oss_spec(sliding: bool) -> KVSpec:
    """One of gpt-oss-120b's two KV-cache groups (its own namespace, as the vLLM connector keys it):
    the 18 sliding-window layers or the 18 full-attention ones."""
    return KVSpec(
        model="gpt-oss-120b",
        num_layers=GPT_OSS_LAYERS // 2,
        num_kv_heads=8,
        head_dim=64,
        dtype="bfloat16",
        block_size=16,
        layout="flash_attn",
        chunk_tokens=CHUNK_TOKENS,
        layer_ids=tuple(range(0 if sliding else 1, GPT_OSS_LAYERS, 2)),
    )


def window_chunks(window: int, chunk_tokens: int) -> int:
    """Chunks before a resume point that a sliding layer's next token attends to (w - 1 tokens)."""
    return -(-(window - 1) // chunk_tokens)


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run through the reference path


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class ModelCache:
    """A KV cache of `tokens` in `spec`'s layout, random bytes, on a random block table; `target`,
    the same shape poisoned (0xA5), to load into."""

    def __init__(self, spec: KVSpec, tokens: int, seed: int) -> None:
        self.spec = spec
        self.num_chunks = tokens // spec.page.chunk_tokens
        self.num_blocks = tokens // spec.block_size
        shape = {
            "mla": (self.num_blocks, spec.block_size, spec.head_dim),
            "flash_attn": (2, self.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim),
        }[spec.layout]
        byte_shape = (*shape[:-1], shape[-1] * spec.page.itemsize)
        dtype = getattr(torch, spec.dtype)
        gen = torch.Generator(device=device()).manual_seed(seed)
        self.source = [
            torch.randint(0, 256, byte_shape, dtype=torch.uint8, device=device(), generator=gen).view(dtype)
            for _ in range(spec.num_layers)
        ]
        self.target = [torch.full(byte_shape, 0xA5, dtype=torch.uint8, device=device()).view(dtype)
                       for _ in range(spec.num_layers)]  # fmt: skip
        self.table = np.random.default_rng(seed).permutation(self.num_blocks).tolist()

    def blocks_of(self, first_chunk: int) -> list[int]:
        """The block table of chunks `first_chunk..` (a load of those chunks alone)."""
        return self.table[first_chunk * self.spec.blocks_per_chunk :]

    def poison(self) -> None:
        for layer in self.target:
            layer.view(torch.uint8).fill_(0xA5)

    def loaded_right(self, first_chunk: int) -> bool:
        """Whether `target` holds `source`'s bytes in the blocks of chunks `first_chunk..` and the
        poison everywhere else."""
        loaded = torch.tensor(self.blocks_of(first_chunk), device=device())
        axis = 1 if self.spec.layout == "flash_attn" else 0
        for got, want in zip(self.target, self.source, strict=True):
            expected = torch.full_like(want.view(torch.uint8), 0xA5)
            expected.index_copy_(axis, loaded, want.view(torch.uint8).index_select(axis, loaded))
            if not torch.equal(got.view(torch.uint8), expected):
                return False
        return True


class HostCopy:
    """The baseline: one copy of `size` bytes between a contiguous device tensor and pinned host
    memory (anonymous shared memory registered with CUDA, as the client's arena); on CPU, a
    memory copy."""

    def __init__(self, size: int) -> None:
        self.pinned = PinnedBuffer(size) if torch.cuda.is_available() else None
        self.host = self.pinned.tensor if self.pinned else torch.empty(size, dtype=torch.uint8)
        self.device = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device())

    def run(self, size: int, to_host: bool) -> Callable[[], None]:
        host, dev = self.host[:size], self.device[:size]

        def copy() -> None:
            (host.copy_(dev, non_blocking=True) if to_host else dev.copy_(host, non_blocking=True))

        return copy

    def release(self) -> None:
        if self.pinned is not None:
            synchronize()
            self.pinned.unregister()


def against(walls: list[float], baseline: list[float], moved: int) -> dict[str, Any]:
    """A row's figures: median ms and GB/s, and the median per-round ratio to the baseline's rate
    (baseline wall / wall; the two timed in turn)."""
    wall, base = statistics.median(walls), statistics.median(baseline)
    return {
        "bytes": moved,
        "ms": wall * 1e3,
        "gbps": moved / wall / 1e9,
        "memcpy_ms": base * 1e3,
        "memcpy_gbps": moved / base / 1e9,
        "x_memcpy": statistics.median(b / w for b, w in zip(baseline, walls, strict=True)),
        "walls_ms": [round(w * 1e3, 3) for w in walls],
        "memcpy_walls_ms": [round(w * 1e3, 3) for w in baseline],
    }
