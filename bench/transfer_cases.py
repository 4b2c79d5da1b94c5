"""The transfer benchmark's 8B-geometry setup, and a daemon sized for a benchmark's pages.

- `make_spec(layout)`: Llama-3.1-8B's pages (32 layers, 8 KV heads, head dim 128, bf16, blocks
  of 16, pages of 256 tokens) in one of the kernels' layouts.
- `Setup(layout, tokens)`: a random KV cache, two disjoint random block tables, two pinned
  buffers (anonymous shared memory registered with CUDA, like the client's arena); `Setup.call`
  is the public API with options. The ways of moving its pages are in `transfer_variants`, their
  timing in `transfer_timing`.
- `daemon_config(page_bytes, pages)`, `wait_reserved(client)`: a daemon whose CPU tier holds
  the pages, and the wait until it has reserved all of it (also `bench/handover.py`'s).
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import kvstore_kernels
from kvstore.shared.spec import KVSpec
from kvstore_kernels import cache_facts
from kvstore_kernels.validate import plan_transfer

CHUNK_TOKENS = 256
CAPS = (4, 8, 16, None)  # None: one program per SM
Enqueue = Callable[[], int]  # queues one transfer on the current stream, returns its bytes
SLAB_BYTES = 256 << 20


def make_spec(layout: str) -> KVSpec:
    return KVSpec(
        model="llama-3.1-8b",
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        block_size=16,
        layout=layout,
        chunk_tokens=CHUNK_TOKENS,
    )


class PinnedBuffer:
    """Anonymous shared memory registered with CUDA, like the client's view of the arena."""

    def __init__(self, size: int) -> None:
        self._map = mmap.mmap(-1, size)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        status = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), size, 0)
        if int(getattr(status, "value", status)) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {status}")

    def unregister(self) -> None:
        torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())


class Setup:
    """One layout's cache, block tables, pinned buffers and baselines' tensors."""

    def __init__(self, layout: str, tokens: int, seed: int = 0) -> None:
        self.spec = spec = make_spec(layout.split("/")[0])
        self.layout = layout
        self.num_pages = tokens // CHUNK_TOKENS
        blocks_needed = self.num_pages * spec.blocks_per_chunk
        num_blocks = 2 * blocks_needed  # two disjoint tables: gather from one, scatter into the other
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.caches: Any = random_caches(layout, num_blocks, gen)
        order = np.random.default_rng(seed).permutation(num_blocks)
        self.table, self.table2 = order[:blocks_needed].tolist(), order[blocks_needed:].tolist()
        self.page_bytes = spec.page.page_bytes
        self.bytes = self.num_pages * self.page_bytes
        self.chunks = list(range(self.num_pages))
        self.offsets = (
            np.random.default_rng(seed + 1).permutation(self.num_pages) * self.page_bytes
        ).tolist()
        self.pinned = PinnedBuffer(self.bytes)
        self.pinned2 = PinnedBuffer(self.bytes)
        self.buffer, self.buffer2 = self.pinned.tensor, self.pinned2.tensor
        noise = torch.randint(0, 256, (self.bytes,), dtype=torch.uint8, device="cuda", generator=gen)
        self.buffer.copy_(noise)
        self.buffer2.copy_(noise)
        self.flat = noise  # the memcpy baseline's GPU side
        self.flat2 = torch.empty_like(noise)
        torch.cuda.synchronize()

    def release(self) -> None:
        """Unpin the buffers (the memory goes when the last view of it does)."""
        torch.cuda.synchronize()
        self.pinned.unregister()
        self.pinned2.unregister()

    def plan(self, *, to_page: bool, buffer: torch.Tensor | None = None, second: bool = False) -> Any:
        table = self.table2 if second else self.table
        buf = buffer if buffer is not None else (self.buffer2 if second else self.buffer)
        return plan_transfer(
            self.spec, self.caches, table, self.chunks, buf, self.offsets, None, 0, writes_cache=not to_page
        )

    def call(
        self,
        to_page: bool,
        options: kvstore_kernels.TransferOptions | None,
        second: bool = False,
        cold: bool = False,
    ) -> Enqueue:
        """The public call. `cold`: as the first call on these cache tensors (what the checks learnt
        about them is forgotten first, `cache_facts.forget`)."""
        table = self.table2 if second else self.table
        buffer = self.buffer2 if second else self.buffer
        function = kvstore_kernels.gather if to_page else kvstore_kernels.scatter

        def enqueue() -> int:
            if cold:
                cache_facts.forget()
            function(self.spec, self.caches, table, self.chunks, buffer, self.offsets, options=options)
            return self.bytes

        return enqueue

    def per_layer(self, to_page: bool) -> Enqueue:
        """One public call per layer, back to back: what a save (or load) issued layer by layer
        from inside the forward costs, against one call for every layer ("auto")."""
        function = kvstore_kernels.gather if to_page else kvstore_kernels.scatter
        layers = [range(layer, layer + 1) for layer in range(self.spec.num_layers)]

        def enqueue() -> int:
            for layer in layers:
                function(self.spec, self.caches, self.table, self.chunks, self.buffer, self.offsets, layer)
            return self.bytes

        return enqueue


def random_caches(layout: str, num_blocks: int, gen: torch.Generator) -> Any:
    """An 8B cache of `num_blocks` blocks in `layout`, random bf16 bit patterns: one tensor, or a
    list of one per layer (vLLM's layouts: views of the tensors it allocates)."""
    shape = {
        "flash_attn": [(2, num_blocks, 16, 8, 128)] * 32,
        "flashinfer": [(num_blocks, 2, 16, 8, 128)] * 32,
        "cross_layer": (num_blocks, 32, 2, 16, 8, 128),
        # vLLM 0.33's views [blocks, heads, tokens, K|V]: LBNHC (tokens before heads in memory)
        # and BLHNC (block-outermost: one block holds every layer, vLLM's cross-layer cache).
        "vllm": [(num_blocks, 16, 8, 256)] * 32,
        "vllm/cross": (num_blocks, 32, 8, 16, 256),
    }[layout]

    def rand(size: Any) -> torch.Tensor:
        return torch.randint(-32768, 32767, size, dtype=torch.int16, device="cuda", generator=gen).view(
            torch.bfloat16
        )

    caches: Any = rand(shape) if isinstance(shape, tuple) else [rand(s) for s in shape]
    if layout == "vllm":
        caches = [cache.transpose(1, 2) for cache in caches]
    elif layout == "vllm/cross":
        blocks_outermost: Any = caches
        caches = [blocks_outermost[:, layer] for layer in range(32)]
    return caches


def daemon_config(page_bytes: int, pages: int) -> dict[str, Any]:
    """A daemon whose CPU tier holds `pages` pages of `page_bytes`, and one slab to spare."""
    per_slab = SLAB_BYTES // (-(-page_bytes // 4096) * 4096)
    slabs = -(-pages // per_slab) + 1
    return {
        "chunk_tokens": CHUNK_TOKENS,
        "tiers": {"cpu": {"bytes": slabs * SLAB_BYTES, "slab_bytes": SLAB_BYTES}},
    }


def wait_reserved(client: Any, timeout_s: float = 120.0) -> None:
    """Until the daemon has reserved its whole arena. It serves once the first slab is reserved and
    reserves the rest behind; a Reserve that needs the rest before then is refused
    (RESOURCE_EXHAUSTED, seen on the H100 host with 3 slabs of 4 still pending)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if stats["counters"]["arena_reserved_bytes"] >= stats["tiers"]["cpu"]["bytes_capacity"]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the daemon's arena is still not reserved after {timeout_s} s")
        time.sleep(0.01)
