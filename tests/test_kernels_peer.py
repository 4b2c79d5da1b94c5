"""Pages in a buffer on another GPU of the host (a GPU-tier pool of another device, reached over
NVLink or PCIe peer-to-peer): gather writes them there and scatter reads them from there, in
place, byte for byte what the torch reference moves; with peer access missing, the call is
refused with the reason. Needs two CUDA devices with peer access (the multi-GPU machines).
"""

from __future__ import annotations

import pytest
import torch

import kvstore_kernels
from kvstore_kernels.routing import choose
from kvstore_kernels.validate import plan_transfer
from tests.kernel_cases import (
    CUDA,
    POISONS,
    as_bytes,
    build,
    expected_buffer,
    gpu,
    model_call,
    write_expected,
)

PEERS = CUDA and torch.cuda.device_count() >= 2 and torch.cuda.can_device_access_peer(0, 1)
needs_peers = pytest.mark.skipif(not PEERS, reason="needs two CUDA devices with peer access")


CASES = [
    ("vllm_rows", "bfloat16"),
    ("flash_attn", "float8_e5m2"),
    ("mla", "bfloat16"),
    ("mla", "float8_e4m3fn"),
]


@gpu
@needs_peers
@pytest.mark.parametrize("engine", ["auto", "kernel"])
@pytest.mark.parametrize(("cache_on", "buffer_on"), [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")])
@pytest.mark.parametrize(("layout", "dtype"), CASES)
def test_pages_on_a_peer_gpu(layout: str, dtype: str, cache_on: str, buffer_on: str, engine: str) -> None:
    """Gathered into a peer GPU's buffer: every byte the reference writes, the poison elsewhere;
    scattered from it: the cache holds exactly what the reference writes."""
    spec, caches, table, chunks, offsets, size = model_call(layout, dtype, cache_on)
    options = kvstore_kernels.TransferOptions(engine=engine)
    expected = expected_buffer(spec, caches, table, chunks, offsets, size)
    for poison in POISONS:
        buffer = torch.full((size,), poison, dtype=torch.uint8, device=buffer_on)
        torch.cuda.synchronize(buffer_on)  # the poison is there before the other GPU's kernel writes
        kvstore_kernels.gather(spec, caches, table, chunks, buffer, offsets, options=options)
        torch.cuda.synchronize(cache_on)
        assert torch.equal(buffer.cpu(), torch.where(expected < 0, poison, expected).to(torch.uint8))
    pages = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    for poison in POISONS:
        bases, restored = build(spec, cache_on, num_blocks=40, fill=poison)
        want_bases, want = build(spec, "cpu", num_blocks=40, fill=poison)
        peer_pages = pages.to(buffer_on)
        torch.cuda.synchronize(buffer_on)
        kvstore_kernels.scatter(spec, restored, table, chunks, peer_pages, offsets, options=options)
        torch.cuda.synchronize(cache_on)
        write_expected(spec, want, table, chunks, pages, offsets)
        for got, wanted in zip(as_bytes(bases), as_bytes(want_bases), strict=True):
            assert torch.equal(got, wanted)


@gpu
@needs_peers
@pytest.mark.parametrize("to_page", [True, False])
def test_prepared_transfer_to_a_peer_gpu(to_page: bool) -> None:
    """`prepare` then `run` (the client's store and load), registered caches, the pages' offsets
    known only at `run`: the bytes the reference moves."""
    spec, caches, table, chunks, offsets, size = model_call("mla", "bfloat16", "cuda:0")
    registered = kvstore_kernels.register(spec, caches)
    pages = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    for poison in POISONS:
        if to_page:
            buffer = torch.full((size,), poison, dtype=torch.uint8, device="cuda:1")
            torch.cuda.synchronize("cuda:1")
            prepared = kvstore_kernels.prepare(spec, registered, table, chunks, buffer, to_page=True)
            prepared.run([2, 0, 3, 1], [offsets[2], offsets[0], offsets[3], offsets[1]])
            torch.cuda.synchronize("cuda:0")
            expected = expected_buffer(spec, caches, table, chunks, offsets, size)
            assert torch.equal(buffer.cpu(), torch.where(expected < 0, poison, expected).to(torch.uint8))
        else:
            bases, restored = build(spec, "cuda:0", num_blocks=40, fill=poison)
            want_bases, want = build(spec, "cpu", num_blocks=40, fill=poison)
            target = kvstore_kernels.register(spec, restored)
            peer_pages = pages.to("cuda:1")
            torch.cuda.synchronize("cuda:1")
            prepared = kvstore_kernels.prepare(spec, target, table, chunks, peer_pages, to_page=False)
            prepared.run([1, 3], [offsets[1], offsets[3]])
            torch.cuda.synchronize("cuda:0")
            write_expected(spec, want, table, [chunks[1], chunks[3]], pages, [offsets[1], offsets[3]])
            for got, wanted in zip(as_bytes(bases), as_bytes(want_bases), strict=True):
                assert torch.equal(got, wanted)


@gpu
@needs_peers
def test_the_auto_rule_names_the_peer_buffer() -> None:
    spec, caches, table, chunks, offsets, size = model_call("vllm_rows", "bfloat16", "cuda:0")
    buffer = torch.zeros(size, dtype=torch.uint8, device="cuda:1")
    plan = plan_transfer(spec, caches, table, chunks, buffer, offsets, None, 0, writes_cache=False)
    route = choose(spec, plan, kvstore_kernels.TransferOptions(), to_page=True)
    assert (route.engine, route.reason) == ("kernel", "a buffer on another GPU, over peer access")
