"""Recurrent-state pages through every copy path: a page holds, per stored layer, the raw state
bytes of one block (`PageSpec.state`), read from caches whose blocks sit a padded page apart as
vLLM keeps a Mamba layer's. Each gather is compared with an oracle that indexes the caches block
by block, under two poisons; each scatter writes exactly the oracle's bytes and nothing else.
Without CUDA the Triton kernel runs in Triton's interpreter (tests.kernel_cases sets it up)."""

from __future__ import annotations

import pytest
import torch

import kvstore_kernels
from kvstore.shared.spec import KVSpec
from tests.kernel_cases import CUDA, POISONS, triton_module

LAYERS, BLOCKS, PADDED = 3, 12, 1536


def state_spec(state_bytes: int) -> KVSpec:
    return KVSpec(
        model="hybrid",
        num_layers=LAYERS,
        num_kv_heads=1,
        head_dim=state_bytes,
        dtype="uint8",
        block_size=1,
        layout="mla",
        chunk_tokens=64,  # keys only: a page holds one state per layer whatever the chunk
        layer_ids=(1, 2, 5),
        state="test:float32[3,5,7];bfloat16[4,9]",
    )


def caches(state_bytes: int, device: str, fill: int | None = None, seed: int = 0) -> list[torch.Tensor]:
    """Per layer a `[blocks, 1, state_bytes]` view into blocks PADDED bytes apart."""
    views = []
    for layer in range(LAYERS):
        if fill is None:
            gen = torch.Generator().manual_seed(seed * 100 + layer)
            raw = torch.randint(0, 256, (BLOCKS * PADDED,), dtype=torch.uint8, generator=gen)
        else:
            raw = torch.full((BLOCKS * PADDED,), fill, dtype=torch.uint8)
        raw = raw.to(device)
        views.append(raw.as_strided((BLOCKS, 1, state_bytes), (PADDED, state_bytes, 1)))
    return views


def oracle(views: list[torch.Tensor], table: list[int], chunks: list[int], state_bytes: int) -> torch.Tensor:
    """The pages, one after another: per chunk, per layer, its block's state bytes."""
    parts = [views[layer][table[chunk], 0].cpu() for chunk in chunks for layer in range(LAYERS)]
    return torch.cat(parts)


CASES = [("torch", "cpu")] + (
    [("kernel", "cuda"), ("copy_engine", "cuda"), ("auto", "cuda")] if CUDA else [("kernel", "cpu")]
)


@pytest.mark.parametrize("state_bytes", [1000, 1024, 1533])
@pytest.mark.parametrize(("engine", "device"), CASES)
def test_state_pages_gather_and_scatter_exact_bytes(engine: str, device: str, state_bytes: int) -> None:
    if engine == "kernel" and not CUDA:
        triton_module()  # the kernel in Triton's interpreter, whatever imported it first
    spec = state_spec(state_bytes)
    page = spec.page
    assert page.page_bytes == LAYERS * state_bytes
    table, chunks = [7, 2, 11, 0, 5], [0, 2, 4]
    offsets = [i * page.page_bytes for i in range(len(chunks))]
    size = len(chunks) * page.page_bytes
    source = caches(state_bytes, device, seed=1)
    want = oracle(source, table, chunks, state_bytes)
    options = kvstore_kernels.TransferOptions(engine=engine)
    for poison in POISONS:
        buffer = torch.full((size,), poison, dtype=torch.uint8)
        buffer = buffer.pin_memory() if device == "cuda" else buffer
        kvstore_kernels.gather(spec, source, table, chunks, buffer, offsets, options=options)
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(buffer.cpu(), want)

    pages = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    pages = pages.pin_memory() if device == "cuda" else pages
    for poison in POISONS:
        target = caches(state_bytes, device, fill=poison)
        kvstore_kernels.scatter(spec, target, table, chunks, pages, offsets, options=options)
        if device == "cuda":
            torch.cuda.synchronize()
        expected = [torch.full((BLOCKS * PADDED,), poison, dtype=torch.uint8) for _ in range(LAYERS)]
        position = 0
        for chunk in chunks:
            for layer in range(LAYERS):
                start = table[chunk] * PADDED
                expected[layer][start : start + state_bytes] = pages[position : position + state_bytes].cpu()
                position += state_bytes
        for layer in range(LAYERS):
            raw = target[layer].as_strided((BLOCKS * PADDED,), (1,)).cpu()
            assert torch.equal(raw, expected[layer])  # the states written, padding and others untouched
