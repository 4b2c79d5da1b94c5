"""What the kernel tests share: caches in every layout, the poisons, and the oracle.

Each scenario builds a small random KV cache, poisons the destination twice (0xA5, then
0x5A), runs one implementation and checks every destination byte against an oracle that
indexes the cache token by token: a byte the oracle writes must hold the same value under
both poisons, and every other byte must still hold the poison. Without CUDA the Triton
kernels run in Triton's interpreter on CPU tensors and the copy lists run with memmove (the
staged path too: same pieces and ring slots, CPU memory); with CUDA they run on the GPU,
the staged path into pinned host buffers. Import this module before `kvstore_kernels`'
Triton module is first imported: it sets TRITON_INTERPRET where there is no CUDA.
"""

from __future__ import annotations

import os

import torch

# With CUDA the Triton cases run on the GPU; without it (or with TRITON_INTERPRET=1 set by the
# caller) in the interpreter on CPU tensors. The variable must be set before
# kvstore_kernels.triton_copy is imported: @triton.jit reads it.
CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
from collections.abc import Callable  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

import kvstore_kernels  # noqa: E402
from kvstore.shared.spec import KVSpec  # noqa: E402

LAYOUTS = ["flash_attn", "flashinfer", "cross_layer", "mla", "hf", "vllm", "vllm_rows"]
DTYPES = ["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"]
IMPLS = ["torch", "triton", "copy_engine", "staged"]
POISONS = (0xA5, 0x5A)
BATCH = 2
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def triton_module() -> ModuleType:
    """`kvstore_kernels.triton_copy`, its kernel in the interpreter where there is no CUDA."""
    from kvstore_kernels import triton_copy, triton_kernel

    if not CUDA and not triton_kernel.is_interpreted():
        importlib.reload(triton_kernel)  # imported before TRITON_INTERPRET was set
    return triton_copy


def launch_kernel(
    spec: KVSpec, caches: Any, table: Any, chunks: Any, buffer: torch.Tensor, offsets: Any, **launch: Any
) -> None:
    """The Triton path on a checked plan, with what only `triton_copy.launch` takes (`tuning`)."""
    from kvstore_kernels.validate import plan_transfer

    to_page = launch.pop("to_page")
    plan = plan_transfer(spec, caches, table, chunks, buffer, offsets, None, 0, writes_cache=not to_page)
    triton_module().launch(spec, plan, to_page=to_page, **launch)


def staged_options(spec: KVSpec, layers_per_slot: int = 2) -> kvstore_kernels.TransferOptions:
    """The staged path with slots of `layers_per_slot` stored layers: pages split into pieces,
    more pieces than ring slots."""
    from kvstore_kernels import staged

    size = staged.NUM_SLOTS * layers_per_slot * spec.page.layer_bytes
    return kvstore_kernels.TransferOptions(engine="staged", staging_bytes=size)


def run(
    impl: str,
    direction: str,
    *args: Any,
    options: kvstore_kernels.TransferOptions | None = None,
    **kwargs: Any,
) -> None:
    """`kvstore_kernels.gather` or `scatter` ("direction") through one path ("impl")."""
    if impl == "triton":
        triton_module()
    if options is None:
        engine = "kernel" if impl == "triton" else impl
        TransferOptions = kvstore_kernels.TransferOptions
        options = staged_options(args[0]) if impl == "staged" else TransferOptions(engine=engine)
    getattr(kvstore_kernels, direction)(*args, options=options, **kwargs)
    if CUDA and impl != "torch":
        torch.cuda.synchronize()


def device_of(impl: str) -> str:
    return "cuda" if impl != "torch" and CUDA else "cpu"


def buffer_of(impl: str, buffer: torch.Tensor) -> torch.Tensor:
    """`buffer` (CPU) where `impl` reads and writes pages: pinned host memory for the staged path
    on CUDA, else `device_of(impl)`."""
    if impl == "staged" and CUDA:
        return buffer.pin_memory()
    return buffer.to(device_of(impl))


def copy_engine_refuses(impl: str, spec: KVSpec, strided: bool = False) -> bool:
    """The copy engines move blocks that are contiguous runs only (not hf's, heads apart)."""
    if impl != "copy_engine":
        return False
    from kvstore_kernels.geometry import is_packed
    from kvstore_kernels.layouts import kv_views

    caches = build(spec, "cpu", num_blocks=2, strided=strided)[1]
    return not all(is_packed(view) for view in kv_views(spec, caches, 0))


REFUSAL = "engine='copy_engine': the KV cache's blocks are not contiguous runs"


def make_spec(
    layout: str,
    dtype: str = "bfloat16",
    *,
    num_layers: int = 3,
    block_size: int = 2,
    chunk_tokens: int | None = None,
    sharing: dict[int, int] | None = None,
    head_dim: int = 4,
) -> KVSpec:
    return KVSpec(
        model="m",
        num_layers=num_layers,
        num_kv_heads=1 if layout == "mla" else 2,
        head_dim=head_dim,
        dtype=dtype,
        block_size=block_size,
        layout=layout,
        chunk_tokens=chunk_tokens or 2 * block_size,
        kv_sharing=sharing or {},
    )


# -- caches: base tensors (whose every byte is checked) and the views handed to the kernels --


def _base_and_view(spec: KVSpec, num_blocks: int, strided: bool) -> tuple[tuple[int, ...], Callable]:
    bs, h, d, layers = spec.block_size, spec.num_kv_heads, spec.head_dim, spec.num_layers
    seq = num_blocks * bs + 1
    plain: dict[str, tuple[int, ...]] = {
        "flash_attn": (2, num_blocks, bs, h, d),
        "flashinfer": (num_blocks, 2, bs, h, d),
        "cross_layer": (num_blocks, layers, 2, bs, h, d),
        "mla": (num_blocks, bs, d),
        "hf": (BATCH, h, seq, d),
        "vllm": (num_blocks, h, bs, 2 * d),  # vLLM's LBHNC
        "vllm_rows": (num_blocks, h, bs, 2 * d),  # the same tensor, read as K rows then V rows
    }
    if not strided:
        return plain[spec.layout], lambda t: t
    return {  # views that are not packed, or whose blocks are not adjacent
        "flash_attn": ((2, num_blocks, bs, d, h), lambda t: t.transpose(-1, -2)),
        "flashinfer": ((2 * num_blocks, 2, bs, h, d), lambda t: t[::2]),
        "cross_layer": ((num_blocks, layers, 2, bs, h + 1, d), lambda t: t[..., :h, :]),
        "mla": ((num_blocks, bs, d + 3), lambda t: t[..., :d]),
        "hf": ((BATCH, seq, h, d), lambda t: t.transpose(1, 2)),
        "vllm": ((num_blocks, bs, h, 2 * d), lambda t: t.transpose(1, 2)),  # vLLM's LBNHC
        "vllm_rows": ((num_blocks, h + 1, bs, 2 * d), lambda t: t[:, :h]),  # heads apart, rows dense
    }[spec.layout]


def build(
    spec: KVSpec,
    device: str,
    *,
    num_blocks: int = 12,
    seed: int = 0,
    fill: int | None = None,
    strided: bool = False,
    alias_shared: bool = False,
) -> tuple[list[torch.Tensor], Any]:
    """(base tensors, kv_caches). Shared layers get their own tensor unless `alias_shared`."""
    shape, view = _base_and_view(spec, num_blocks, strided)
    dtype = getattr(torch, spec.dtype)
    gen = torch.Generator().manual_seed(seed)
    per_layer = 2 if spec.layout == "hf" else 1
    count = 1 if spec.layout == "cross_layer" else spec.num_layers * per_layer
    byte_shape = (*shape[:-1], shape[-1] * spec.page.itemsize)
    bases = [
        (
            torch.full(byte_shape, fill, dtype=torch.uint8)
            if fill is not None
            else torch.randint(0, 256, byte_shape, dtype=torch.uint8, generator=gen)
        )
        .view(dtype)
        .to(device)
        for _ in range(count)
    ]
    views = [view(base) for base in bases]
    if spec.layout == "cross_layer":
        return bases, views[0]
    entries: list[Any] = (
        [tuple(views[2 * i : 2 * i + 2]) for i in range(spec.num_layers)] if per_layer == 2 else views
    )
    if alias_shared:
        for layer, source in spec.kv_sharing.items():
            entries[layer] = entries[source]
    return bases, entries


def as_bytes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().cpu().contiguous().view(torch.uint8) for t in tensors]


def block_table(num_blocks: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:length]


# -- the oracle: token-by-token indexing of each layout, written from DESIGN.md's page format --


def _selector(spec: KVSpec, caches: Any, layer: int, kv: int, batch_index: int) -> torch.Tensor:
    """A view of one layer's K or V indexed by [block, offset] (by [position] for hf)."""
    if spec.layout == "flash_attn":
        return caches[layer][kv]
    if spec.layout == "flashinfer":
        return caches[layer].select(1, kv)
    if spec.layout == "cross_layer":
        return caches.select(2, kv).select(1, layer)
    if spec.layout == "mla":
        return caches[layer]
    if spec.layout == "vllm":  # [block, head, offset, k|v content]
        dim = spec.head_dim
        return caches[layer][..., kv * dim : (kv + 1) * dim].transpose(1, 2)
    if spec.layout == "vllm_rows":  # [block, head, K rows then V rows, head_dim]
        bs, dim = spec.block_size, spec.head_dim
        rows = caches[layer].view(caches[layer].shape[0], spec.num_kv_heads, 2 * bs, dim)
        return rows[:, :, kv * bs : (kv + 1) * bs].transpose(1, 2)
    return caches[layer][kv][batch_index].transpose(0, 1)


def _token_index(spec: KVSpec, table: Any, chunk: int) -> tuple[torch.Tensor, ...]:
    tokens = torch.arange(chunk * spec.page.chunk_tokens, (chunk + 1) * spec.page.chunk_tokens)
    if spec.layout == "hf":
        return (tokens,)
    return torch.as_tensor(table)[tokens // spec.block_size], tokens % spec.block_size


def _spans(spec: KVSpec, layers: range | None):
    """(engine layer, kv, byte offset in a page) of every K/V span that moves."""
    page = spec.page
    for position, layer in enumerate(page.stored_layers):
        if layers is None or layer in layers:
            for kv in range(page.kv_factor):
                yield layer, kv, position * page.layer_bytes + kv * page.chunk_tokens * page.token_bytes


def expected_buffer(
    spec: KVSpec,
    caches: Any,
    table: Any,
    chunks: list[int],
    offsets: list[int],
    size: int,
    layers: range | None = None,
    batch_index: int = 0,
) -> torch.Tensor:
    """int16 buffer: the byte each position must hold, or -1 where gather must not write."""
    out = torch.full((size,), -1, dtype=torch.int16)
    span_bytes = spec.page.chunk_tokens * spec.page.token_bytes
    for chunk, offset in zip(chunks, offsets, strict=True):
        index = _token_index(spec, table, chunk)
        for layer, kv, start in _spans(spec, layers):
            tokens = _selector(spec, caches, layer, kv, batch_index)[index].cpu().contiguous()
            out[offset + start : offset + start + span_bytes] = (
                tokens.view(torch.uint8).flatten().to(torch.int16)
            )
    return out


def write_expected(
    spec: KVSpec,
    caches: Any,
    table: Any,
    chunks: list[int],
    buffer: torch.Tensor,
    offsets: list[int],
    layers: range | None = None,
    batch_index: int = 0,
) -> None:
    """What scatter must do, token by token, into `caches` (CPU tensors)."""
    span_bytes = spec.page.chunk_tokens * spec.page.token_bytes
    dtype = getattr(torch, spec.dtype)
    for chunk, offset in zip(chunks, offsets, strict=True):
        index = _token_index(spec, table, chunk)
        for layer, kv, start in _spans(spec, layers):
            target = _selector(spec, caches, layer, kv, batch_index)
            span = buffer[offset + start : offset + start + span_bytes].cpu().clone().view(dtype)
            target[index] = span.view(target[index].shape)


def check_gather(
    impl: str,
    spec: KVSpec,
    caches: Any,
    table: Any,
    chunks: list[int],
    offsets: list[int],
    size: int,
    layers: range | None = None,
    batch_index: int = 0,
    options: kvstore_kernels.TransferOptions | None = None,
    given: Any = None,
) -> None:
    """`given`: what the gather gets in place of `table` (the same blocks, checked ahead)."""
    expected = expected_buffer(spec, caches, table, chunks, offsets, size, layers, batch_index)
    for poison in POISONS:
        buffer = buffer_of(impl, torch.full((size,), poison, dtype=torch.uint8))
        run(
            impl,
            "gather",
            spec,
            caches,
            table if given is None else given,
            chunks,
            buffer,
            offsets,
            layers,
            batch_index=batch_index,
            options=options,
        )
        want = torch.where(expected < 0, poison, expected).to(torch.uint8)
        assert torch.equal(buffer.cpu(), want), (
            f"poison {poison:#x}: {int((buffer.cpu() != want).sum())} bytes differ"
        )


def check_scatter(
    impl: str,
    spec: KVSpec,
    table: Any,
    chunks: list[int],
    offsets: list[int],
    size: int,
    layers: range | None = None,
    batch_index: int = 0,
    options: kvstore_kernels.TransferOptions | None = None,
    **build_args: Any,
) -> None:
    buffer = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    for poison in POISONS:
        bases, caches = build(spec, device_of(impl), fill=poison, **build_args)
        expected_bases, expected = build(spec, "cpu", fill=poison, **build_args)
        run(
            impl,
            "scatter",
            spec,
            caches,
            table,
            chunks,
            buffer_of(impl, buffer),
            offsets,
            layers,
            batch_index=batch_index,
            options=options,
        )
        write_expected(spec, expected, table, chunks, buffer, offsets, layers, batch_index)
        for index, (got, want) in enumerate(zip(as_bytes(bases), as_bytes(expected_bases), strict=True)):
            assert torch.equal(got, want), (
                f"poison {poison:#x}, tensor {index}: {int((got != want).sum())} bytes differ"
            )


def scenario(spec: KVSpec) -> tuple[Any, list[int], list[int], int]:
    """Permuted block table, chunks out of order, pages apart and out of order in one buffer."""
    page_bytes = spec.page.page_bytes
    chunks = [3, 0, 2]
    table = None if spec.layout == "hf" else block_table(12, 4 * spec.blocks_per_chunk)
    return table, chunks, [3 * page_bytes + 8, 16, 5 * page_bytes + 24], 7 * page_bytes + 32


def small_call() -> tuple[KVSpec, Any, torch.Tensor, torch.Tensor]:
    spec = make_spec("flash_attn")
    _, caches = build(spec, "cpu")
    return spec, caches, block_table(12, 2), torch.zeros(spec.page.page_bytes, dtype=torch.uint8)


def expected_with_skipped(
    spec: KVSpec, caches: Any, table: Any, chunks: list[int], offsets: list[int], size: int, skipped: list
) -> torch.Tensor:
    """`expected_buffer`, with -2 at the segments of the (page index, block of its chunk) in `skipped`."""
    expected = expected_buffer(spec, caches, table, chunks, offsets, size)
    segment = spec.block_size * spec.page.token_bytes
    span = spec.page.chunk_tokens * spec.page.token_bytes
    for page, block in skipped:  # every (layer, k|v) segment of that block: -2
        for start in range(0, spec.page.page_bytes, span):
            at = offsets[page] + start + block * segment
            expected[at : at + segment] = -2
    return expected


def model_call(
    layout: str, dtype: str, device: str = "cuda"
) -> tuple[KVSpec, Any, torch.Tensor, list[int], list[int], int]:
    """vLLM-sized caches of the newer page kinds on `device`: vllm_rows or flash_attn (8 KV heads,
    head dim 128, blocks of 16) and DeepSeek's MLA latent (576 wide, blocks of 64); layer 3 shares
    layer 1's KV. (spec, caches, block table, chunks, offsets, buffer size)."""
    mla = layout == "mla"
    spec = KVSpec(
        model="m",
        num_layers=4,
        num_kv_heads=1 if mla else 8,
        head_dim=576 if mla else 128,
        dtype=dtype,
        block_size=64 if mla else 16,
        layout=layout,
        chunk_tokens=256 if mla else 64,
        kv_sharing={3: 1},
    )
    _, caches = build(spec, device, num_blocks=40)
    page_bytes = spec.page.page_bytes
    chunks, offsets = [5, 1, 7, 0], [0, 3 * page_bytes + 16, page_bytes, 6 * page_bytes + 8]
    return spec, caches, block_table(40, 32), chunks, offsets, 7 * page_bytes + 32
