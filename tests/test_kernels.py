"""Page gather/scatter: every layout, dtype and direction, for the torch reference, Triton,
the copy engines and the staged path (Triton packing into a ring, copy engines moving it).

Each scenario builds a small random KV cache, poisons the destination twice (0xA5, then
0x5A), runs one implementation and checks every destination byte against an oracle that
indexes the cache token by token: a byte the oracle writes must hold the same value under
both poisons, and every other byte must still hold the poison. Without CUDA the Triton
kernels run in Triton's interpreter on CPU tensors and the copy lists run with memmove (the
staged path too: same pieces and ring slots, CPU memory); with CUDA they run on the GPU,
the staged path into pinned host buffers.
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
from kvstore.spec import KVSpec  # noqa: E402
from kvstore_kernels import reference  # noqa: E402

LAYOUTS = ["flash_attn", "flashinfer", "cross_layer", "mla", "hf", "vllm"]
DTYPES = ["float16", "bfloat16", "float32", "float8_e4m3fn"]
IMPLS = ["torch", "triton", "copy_engine", "staged"]
POISONS = (0xA5, 0x5A)
BATCH = 2
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def triton_module() -> ModuleType:
    from kvstore_kernels import triton_copy

    if not CUDA and not triton_copy.is_interpreted():
        importlib.reload(triton_copy)  # imported before TRITON_INTERPRET was set
    return triton_copy


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
    if impl in ("copy_engine", "staged"):
        if options is None:
            spec = args[0]
            options = (
                staged_options(spec) if impl == "staged" else kvstore_kernels.TransferOptions(engine=impl)
            )
        getattr(kvstore_kernels, direction)(*args, options=options, **kwargs)
        if CUDA:
            torch.cuda.synchronize()
        return
    module = reference if impl == "torch" else triton_module()
    getattr(module, direction)(*args, **kwargs)


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
) -> KVSpec:
    return KVSpec(
        model="m",
        num_layers=num_layers,
        num_kv_heads=1 if layout == "mla" else 2,
        head_dim=4,
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


# -- scenarios -----------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_every_layout_and_dtype(direction: str, layout: str, dtype: str, impl: str) -> None:
    spec = make_spec(layout, dtype, sharing={1: 0})  # layer 1 is shared: never stored, never written
    table, chunks, offsets, size = scenario(spec)
    if copy_engine_refuses(impl, spec):
        with pytest.raises(ValueError, match=REFUSAL):
            check_gather(impl, spec, build(spec, device_of(impl))[1], table, chunks, offsets, size)
        return
    if direction == "gather":
        _, caches = build(spec, device_of(impl))
        check_gather(impl, spec, caches, table, chunks, offsets, size, batch_index=1)
    else:
        check_scatter(impl, spec, table, chunks, offsets, size, batch_index=1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layers", [range(1, 4), range(2, 3), range(0, 2), range(3, 3)])
def test_layer_subsets_skip_shared_layers(layers: range, impl: str) -> None:
    spec = make_spec("flashinfer", num_layers=4, sharing={2: 0})
    table, chunks, offsets, size = scenario(spec)
    _, caches = build(spec, device_of(impl))
    check_gather(impl, spec, caches, table, chunks, offsets, size, layers)
    check_scatter(impl, spec, table, chunks, offsets, size, layers)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["flash_attn", "hf"])
def test_shared_layers_that_alias_their_source(layout: str, impl: str) -> None:
    spec = make_spec(layout, num_layers=4, sharing={1: 0, 3: 2})
    if copy_engine_refuses(impl, spec):
        return  # refusal: test_every_layout_and_dtype
    table, chunks, offsets, size = scenario(spec)
    _, caches = build(spec, device_of(impl), alias_shared=True)
    check_gather(impl, spec, caches, table, chunks, offsets, size)
    check_scatter(impl, spec, table, chunks, offsets, size, alias_shared=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
def test_block_sizes(block_size: int, impl: str) -> None:
    spec = make_spec("flash_attn", "float16", num_layers=2, block_size=block_size)
    table, chunks, offsets, size = scenario(spec)
    _, caches = build(spec, device_of(impl))
    check_gather(impl, spec, caches, table, chunks, offsets, size)
    check_scatter(impl, spec, table, chunks, offsets, size)


@pytest.mark.parametrize("impl", IMPLS)
def test_page_offsets_on_odd_bytes(impl: str) -> None:
    spec = make_spec("cross_layer", "float32")
    table, chunks, _, size = scenario(spec)
    offsets = [1, 2 * spec.page.page_bytes + 3, spec.page.page_bytes + 2]
    _, caches = build(spec, device_of(impl))
    check_gather(impl, spec, caches, table, chunks, offsets, size)
    check_scatter(impl, spec, table, chunks, offsets, size)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_strided_views_are_honoured(direction: str, layout: str, impl: str) -> None:
    spec = make_spec(layout, "bfloat16")
    table, chunks, offsets, size = scenario(spec)
    if copy_engine_refuses(impl, spec, strided=True):
        with pytest.raises(ValueError, match=REFUSAL):
            check_scatter(impl, spec, table, chunks, offsets, size, strided=True)
        return
    if direction == "gather":
        _, caches = build(spec, device_of(impl), strided=True)
        check_gather(impl, spec, caches, table, chunks, offsets, size)
    else:  # bytes of the base outside the view must keep their poison too
        check_scatter(impl, spec, table, chunks, offsets, size, strided=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_restores_the_blocks(layout: str, impl: str) -> None:
    spec = make_spec(layout, "float8_e4m3fn", sharing={2: 1})
    if copy_engine_refuses(impl, spec):
        return  # refusal: test_every_layout_and_dtype
    table, chunks, offsets, size = scenario(spec)
    _, original = build(spec, device_of(impl), seed=3)
    buffer = buffer_of(impl, torch.zeros(size, dtype=torch.uint8))
    run(impl, "gather", spec, original, table, chunks, buffer, offsets)
    bases, restored = build(spec, device_of(impl), fill=0xA5)
    run(impl, "scatter", spec, restored, table, chunks, buffer, offsets)
    expected_bases, expected = build(spec, "cpu", fill=0xA5)
    cpu_original = build(spec, "cpu", seed=3)[1]
    for chunk in chunks:  # the original blocks, copied token by token; all else stays poisoned
        index = _token_index(spec, table, chunk)
        for layer, kv, _ in _spans(spec, None):
            _selector(spec, expected, layer, kv, 0)[index] = _selector(spec, cpu_original, layer, kv, 0)[
                index
            ]
    for got, want in zip(as_bytes(bases), as_bytes(expected_bases), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_remembered_cache_facts_follow_the_tensors(impl: str) -> None:
    """A call on tensors seen before reuses what the checks learnt about them; the same memory
    seen through other strides is checked afresh and moved by its own strides, and one seen
    as another dtype is refused, after a call that passed."""
    spec = make_spec("flash_attn", "bfloat16")
    table, chunks, offsets, size = scenario(spec)
    _, caches = build(spec, device_of(impl))
    for _ in range(2):  # the second call finds the tensors' facts remembered
        check_gather(impl, spec, caches, table, chunks, offsets, size)
    layer = caches[1]
    permuted = list(caches)  # same address and shape: heads and dims swap strides within a block
    permuted[1] = layer.as_strided(layer.shape, (*layer.stride()[:3], 1, spec.num_kv_heads))
    assert permuted[1].data_ptr() == layer.data_ptr()
    if impl == "copy_engine":  # a block is no longer one run: refused, as a fresh check says
        with pytest.raises(ValueError, match=REFUSAL):
            check_gather(impl, spec, permuted, table, chunks, offsets, size)
    else:
        check_gather(impl, spec, permuted, table, chunks, offsets, size)
    check_gather(impl, spec, caches, table, chunks, offsets, size)
    retyped = list(caches)
    retyped[1] = layer.view(torch.float16)
    with pytest.raises(ValueError, match=r"kv_caches\[1\]: dtype float16 does not match"):
        run(
            impl,
            "gather",
            spec,
            retyped,
            table,
            chunks,
            buffer_of(impl, torch.zeros(size, dtype=torch.uint8)),
            offsets,
        )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "mla", "hf"])
def test_registered_caches_move_the_same_bytes(impl: str, layout: str) -> None:
    """Caches checked once (`register`) move exactly what the plain tensors move, for every
    layer subset and both directions; a strided view keeps its own strides."""
    spec = make_spec(layout, "bfloat16", sharing={2: 1})
    if copy_engine_refuses(impl, spec):
        return
    table, chunks, offsets, size = scenario(spec)
    _, caches = build(spec, device_of(impl), strided=layout == "hf")
    registered = kvstore_kernels.register(spec, caches)
    assert isinstance(registered, kvstore_kernels.RegisteredCaches) and list(registered) == list(caches)
    for layers in (None, range(1, 3), range(0, 1)):
        check_gather(impl, spec, registered, table, chunks, offsets, size, layers)
    buffer = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    for layers in (None, range(1, 2)):
        plain_bases, plain = build(spec, device_of(impl), fill=0xA5, strided=layout == "hf")
        reg_bases, reg = build(spec, device_of(impl), fill=0xA5, strided=layout == "hf")
        run(impl, "scatter", spec, plain, table, chunks, buffer_of(impl, buffer), offsets, layers)
        run(
            impl,
            "scatter",
            spec,
            kvstore_kernels.register(spec, reg),
            table,
            chunks,
            buffer_of(impl, buffer),
            offsets,
            layers,
        )
        for got, want in zip(as_bytes(reg_bases), as_bytes(plain_bases), strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_checked_blocks_move_the_same_bytes(impl: str) -> None:
    """A table checked ahead (`check_blocks`, as a load does while its Lookup is in flight) moves
    exactly what the table itself moves, for chunks among the checked ones in increasing order
    and, through the full check, for any others."""
    spec = make_spec("flash_attn", "bfloat16")
    table, _, _, _ = scenario(spec)  # 4 chunks' blocks
    page_bytes = spec.page.page_bytes
    _, caches = build(spec, device_of(impl))
    checked = kvstore_kernels.check_blocks(spec, caches, table, 3, writes_cache=True)
    assert isinstance(checked, kvstore_kernels.CheckedBlocks) and checked.chunks == 3 and checked.unique
    assert checked.table is table
    assert kvstore_kernels.check_blocks(spec, caches, table, 9, writes_cache=True).chunks == 4  # all it has
    for chunks in ([0, 1, 2], [1, 2], [2], [], [2, 0], [3], [0, 3]):  # the last three: checked in full
        offsets = [(2 * j + 1) * page_bytes for j in range(len(chunks))]
        size = (2 * len(chunks) + 1) * page_bytes
        check_gather(impl, spec, caches, table, chunks, offsets, size, given=checked)
        source = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
        plain_bases, plain = build(spec, device_of(impl), fill=0xA5)
        ahead_bases, ahead = build(spec, device_of(impl), fill=0xA5)
        run(impl, "scatter", spec, plain, table, chunks, buffer_of(impl, source), offsets)
        run(impl, "scatter", spec, ahead, checked, chunks, buffer_of(impl, source), offsets)
        for got, want in zip(as_bytes(ahead_bases), as_bytes(plain_bases), strict=True):
            assert torch.equal(got, want)


@pytest.mark.skipif(not CUDA, reason="needs CUDA: the device-buffer scatter's short path runs on a GPU only")
@pytest.mark.parametrize(
    ("layout", "strided"),
    [("flash_attn", False), ("flash_attn", True), ("flashinfer", False), ("mla", False)],
)
def test_device_scatter_moves_what_the_general_path_moves(layout: str, strided: bool) -> None:
    """A scatter from a device buffer into registered caches with checked blocks (the GPU tier's
    loads) takes the short path once the kernel is compiled, and writes exactly what the general
    path writes, for pages aligned every way, chunk subsets and layer ranges; what it does not
    take (chunks out of order, a page past the buffer, options) goes the general way."""
    from kvstore_kernels import device_scatter

    spec = make_spec(layout, "bfloat16", sharing={2: 1})
    table = block_table(12, 4 * spec.blocks_per_chunk)
    page_bytes = spec.page.page_bytes
    size = 9 * page_bytes + 64
    source = torch.randint(
        0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9)
    ).cuda()
    cases = [
        (range(4), [j * page_bytes for j in range(4)], None),
        (range(4), [(3 - j) * 2 * page_bytes + 8 for j in range(4)], None),
        ([1, 3], [page_bytes + 2, 5 * page_bytes + 2], None),
        ([0, 2, 3], [1, 3 * page_bytes + 1, 7 * page_bytes + 33], range(1, 3)),
        (range(1, 3), [4 * page_bytes + 16, 16], range(0, 1)),
    ]
    for chunks, offsets, layers in cases:
        plain_bases, plain = build(spec, "cuda", fill=0xA5, strided=strided)
        kvstore_kernels.scatter(spec, plain, table, chunks, source, offsets, layers)
        fast_bases, fast = build(spec, "cuda", fill=0xA5, strided=strided)
        registered = kvstore_kernels.register(spec, fast)
        checked = kvstore_kernels.check_blocks(spec, registered, table, 4, layers, writes_cache=True)
        kvstore_kernels.scatter(spec, registered, checked, chunks, source, offsets, layers)  # compiles if new
        taken = device_scatter.taken
        for base in fast_bases:
            base.view(torch.uint8).fill_(0xA5)
        kvstore_kernels.scatter(spec, registered, checked, chunks, source, offsets, layers)
        torch.cuda.synchronize()
        assert device_scatter.taken == taken + 1, (chunks, offsets)
        for got, want in zip(as_bytes(fast_bases), as_bytes(plain_bases), strict=True):
            assert torch.equal(got, want), (chunks, offsets, layers)
    side = torch.cuda.Stream()  # a given stream: the same bytes, moved there
    plain_bases, plain = build(spec, "cuda", fill=0xA5, strided=strided)
    kvstore_kernels.scatter(spec, plain, table, range(4), source, cases[1][1])
    fast_bases, fast = build(spec, "cuda", fill=0xA5, strided=strided)
    registered = kvstore_kernels.register(spec, fast)
    checked = kvstore_kernels.check_blocks(spec, registered, table, 4, writes_cache=True)
    taken = device_scatter.taken
    side.wait_stream(torch.cuda.current_stream())
    kvstore_kernels.scatter(spec, registered, checked, range(4), source, cases[1][1], stream=side)
    side.synchronize()
    assert device_scatter.taken == taken + 1
    for got, want in zip(as_bytes(fast_bases), as_bytes(plain_bases), strict=True):
        assert torch.equal(got, want)
    _, caches = build(spec, "cuda", fill=0xA5, strided=strided)
    registered = kvstore_kernels.register(spec, caches)
    checked = kvstore_kernels.check_blocks(spec, registered, table, 4, writes_cache=True)
    taken = device_scatter.taken
    kvstore_kernels.scatter(spec, registered, checked, [3, 1], source, [0, page_bytes])  # out of order
    options = kvstore_kernels.TransferOptions(max_programs=8)
    kvstore_kernels.scatter(spec, registered, checked, [0, 1], source, [0, page_bytes], options=options)
    with pytest.raises(ValueError, match=r"offsets\[1\]: page .* runs past the end"):
        kvstore_kernels.scatter(spec, registered, checked, [0, 1], source, [0, size - page_bytes + 1])
    torch.cuda.synchronize()
    assert device_scatter.taken == taken


def test_checked_blocks_refuse_what_the_table_refuses() -> None:
    """Checking ahead never lets through what a call with the plain table refuses: a table that
    fails is handed back as it is, and a call outside what was checked checks the table in full."""
    spec = make_spec("flash_attn", "bfloat16")
    page_bytes = spec.page.page_bytes
    _, caches = build(spec, "cpu")  # 12 blocks
    buffer = torch.zeros(4 * page_bytes, dtype=torch.uint8)
    offsets = [0, page_bytes]
    bad = [0, 1, 2, 12, 4, 5]  # chunk 1 holds block 12, outside 0..11
    assert kvstore_kernels.check_blocks(spec, caches, bad, 3, writes_cache=True) is bad
    ahead = kvstore_kernels.check_blocks(spec, caches, bad, 1, writes_cache=True)  # chunk 0 alone: fine
    assert isinstance(ahead, kvstore_kernels.CheckedBlocks)
    message = r"block_ids\[3\]: block 12 \(chunk 1\) is outside 0..11"
    for table in (bad, ahead):
        with pytest.raises(ValueError, match=message):
            kvstore_kernels.scatter(spec, caches, table, [0, 1], buffer, offsets)
    twice = [0, 1, 2, 1]  # block 1 in chunks 0 and 1: a scatter would write it twice
    assert kvstore_kernels.check_blocks(spec, caches, twice, 2, writes_cache=True) is twice
    for_gather = kvstore_kernels.check_blocks(spec, caches, twice, 2, writes_cache=False)
    assert isinstance(for_gather, kvstore_kernels.CheckedBlocks) and not for_gather.unique
    kvstore_kernels.gather(spec, caches, for_gather, [0, 1], buffer, offsets)  # a gather may read it twice
    with pytest.raises(ValueError, match="block 1 appears twice"):
        kvstore_kernels.scatter(spec, caches, for_gather, [0, 1], buffer, offsets)
    fine = kvstore_kernels.check_blocks(spec, caches, [0, 1, 2, 3], 2, writes_cache=True)
    with pytest.raises(ValueError, match="block 0 appears twice"):  # a chunk given twice: checked in full
        kvstore_kernels.scatter(spec, caches, fine, [0, 0], buffer, offsets)
    _, fewer = build(spec, "cpu", num_blocks=3)  # another cache: blocks 0..2 only
    with pytest.raises(ValueError, match=r"block_ids\[3\]: block 3 \(chunk 1\) is outside 0..2"):
        kvstore_kernels.scatter(spec, fewer, fine, [0, 1], buffer, offsets)
    device_table = torch.tensor([0, 1, 2, 3])  # a CPU tensor is checked ahead; hf has nothing to check
    assert isinstance(kvstore_kernels.check_blocks(spec, caches, device_table, 2, writes_cache=True), tuple)
    hf = make_spec("hf")
    assert kvstore_kernels.check_blocks(hf, build(hf, "cpu")[1], None, 2, writes_cache=True) is None


def test_register_checks_the_tensors_once_and_refuses_bad_ones() -> None:
    spec = make_spec("flash_attn", "bfloat16")
    _, caches = build(spec, "cpu")
    retyped = list(caches)
    retyped[1] = caches[1].view(torch.float16)
    with pytest.raises(ValueError, match=r"kv_caches\[1\]: dtype float16 does not match"):
        kvstore_kernels.register(spec, retyped)
    with pytest.raises(ValueError, match="expected a list of 3 layers"):
        kvstore_kernels.register(spec, caches[:2])
    cross = make_spec("cross_layer")
    _, one_tensor = build(cross, "cpu")
    assert kvstore_kernels.register(cross, one_tensor) is one_tensor  # one fingerprint: kept as it is
    # Registered under one geometry, used under another: checked in full like any tuple, and refused.
    registered = kvstore_kernels.register(spec, caches)
    other = make_spec("flash_attn", "float16")
    table, chunks, offsets, size = scenario(other)
    buffer = torch.zeros(size, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"kv_caches\[0\]: dtype bfloat16 does not match the spec's float16"):
        kvstore_kernels.gather(other, registered, table, chunks, buffer, offsets)
    table, chunks, offsets, size = scenario(spec)
    buffer = torch.zeros(size, dtype=torch.uint8)
    for _ in range(2):  # bad layers are refused every time, after calls whose layers were kept
        kvstore_kernels.gather(spec, registered, table, chunks, buffer, offsets, range(0, 2))
        with pytest.raises(ValueError, match=r"layers: range\(0, 9\) is outside 0..3"):
            kvstore_kernels.gather(spec, registered, table, chunks, buffer, offsets, range(0, 9))
        with pytest.raises(ValueError, match="layers: expected a range with step 1"):
            kvstore_kernels.gather(spec, registered, table, chunks, buffer, offsets, [0, 1])  # type: ignore[arg-type]


def test_remembered_cache_facts_hold_no_tensor() -> None:
    """What a call remembers about the cache keeps none of its memory alive."""
    import gc
    import weakref

    spec = make_spec("cross_layer")
    table, chunks, offsets, size = scenario(spec)
    bases, cache = build(spec, "cpu")
    kvstore_kernels.gather(spec, cache, table, chunks, torch.zeros(size, dtype=torch.uint8), offsets)
    gone = weakref.ref(cache)
    del bases, cache
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("impl", IMPLS)
def test_page_format_by_hand(impl: str) -> None:
    """DESIGN.md's page, built with loops: [stored_layer][k|v][token][kv_head][head_dim]."""
    spec = make_spec("flash_attn", "float32", block_size=2, chunk_tokens=4, sharing={1: 0})
    caches = [
        torch.arange(2 * 4 * 2 * 2 * 4, dtype=torch.float32).reshape(2, 4, 2, 2, 4) + 1000 * layer
        for layer in range(3)
    ]
    table = [3, 1, 0, 2]
    page: list[float] = []
    for layer in (0, 2):
        for kv in range(2):
            for token in range(4, 8):  # chunk 1
                for head in range(2):
                    for dim in range(4):
                        page.append(float(caches[layer][kv, table[token // 2], token % 2, head, dim]))
    device = device_of(impl)
    buffer = buffer_of(impl, torch.full((spec.page.page_bytes + 8,), 0xA5, dtype=torch.uint8))
    run(impl, "gather", spec, [c.to(device) for c in caches], table, [1], buffer, [8])
    assert torch.equal(buffer[8:].cpu().view(torch.float32), torch.tensor(page))
    assert torch.equal(buffer[:8].cpu(), torch.full((8,), 0xA5, dtype=torch.uint8))


@pytest.mark.parametrize("impl", IMPLS)
def test_mla_page_format_by_hand(impl: str) -> None:
    """MLA pages: [stored_layer][token][latent]."""
    spec = make_spec("mla", "float32", num_layers=2, block_size=1, chunk_tokens=2)
    caches = [
        torch.arange(3 * 1 * 4, dtype=torch.float32).reshape(3, 1, 4) + 100 * layer for layer in range(2)
    ]
    table = [2, 0, 1]
    expected = [
        float(caches[layer][table[token], 0, dim])
        for layer in range(2)
        for token in (0, 1)
        for dim in range(4)
    ]
    buffer = buffer_of(impl, torch.zeros(spec.page.page_bytes, dtype=torch.uint8))
    run(impl, "gather", spec, [c.to(device_of(impl)) for c in caches], table, [0], buffer, [0])
    assert buffer.cpu().view(torch.float32).tolist() == expected


# -- validation: every mismatch is a ValueError naming it, raised before any byte moves ----------


def _bad(**changes: Any) -> dict[str, Any]:
    return changes


def _layer(index: int, tensor: Callable[[list], Any]) -> Callable[[dict], None]:
    def change(args: dict) -> None:
        args["kv_caches"] = list(args["kv_caches"])
        args["kv_caches"][index] = tensor(args["kv_caches"])

    return change


BAD_INPUTS: list[tuple[str, Callable[[dict], None], str]] = [
    (
        "shape",
        _layer(2, lambda c: torch.zeros(2, 12, 2, 2, 8, dtype=torch.bfloat16)),
        "kv_caches[2]: shape [2, 12, 2, 2, 8]",
    ),
    (
        "dtype",
        _layer(0, lambda c: c[0].to(torch.float16)),
        "kv_caches[0]: dtype float16 does not match the spec's bfloat16",
    ),
    ("device", _layer(2, lambda c: c[2].to("meta")), "kv_caches[2]: on meta"),
    ("not a tensor", _layer(0, lambda c: "x"), "kv_caches[0]: expected a torch.Tensor"),
    ("layer count", lambda a: a.update(kv_caches=a["kv_caches"][:2]), "expected a list of 3 layers"),
    (
        "block id",
        lambda a: a["block_ids"].__setitem__(5, 12),
        "block_ids[5]: block 12 (chunk 2) is outside 0..11",
    ),
    ("negative block id", lambda a: a["block_ids"].__setitem__(0, -1), "block_ids[0]: block -1"),
    (
        "short table",
        lambda a: a.update(block_ids=a["block_ids"][:7]),
        "block table has 7 entries; chunk 3 needs 8",
    ),
    ("float table", lambda a: a.update(block_ids=a["block_ids"].float()), "block_ids: expected integer"),
    ("2-D table", lambda a: a.update(block_ids=a["block_ids"].reshape(2, 4)), "block_ids: expected a 1-D"),
    (
        "buffer dtype",
        lambda a: a.update(buffer=a["buffer"].view(torch.int16)),
        "buffer: expected a 1-D uint8 tensor, got int16",
    ),
    ("buffer 2-D", lambda a: a.update(buffer=a["buffer"].view(2, -1)), "buffer: expected a 1-D uint8 tensor"),
    (
        "buffer strided",
        lambda a: a.update(buffer=a["buffer"][::2]),
        "buffer: expected contiguous bytes, got stride 2",
    ),
    (
        "page past end",
        lambda a: a.update(offsets=[0, 6 * 256 - 255, 600]),
        "offsets[1]: page 1281..1537 (256 bytes) runs past",
    ),
    ("counts", lambda a: a.update(offsets=[0, 256]), "3 chunks but 2 offsets"),
    ("negative chunk", lambda a: a.update(chunks=[0, -1, 2]), "chunks[1]: -1 is negative"),
    ("layers past end", lambda a: a.update(layers=range(1, 4)), "layers: range(1, 4) is outside 0..3"),
    ("layers step", lambda a: a.update(layers=range(0, 3, 2)), "layers: expected a range with step 1"),
]


def _bad_args() -> dict[str, Any]:
    spec = make_spec("flash_attn", sharing={1: 0})  # page: 2 stored layers x 128 bytes
    _, caches = build(spec, "cpu")
    return dict(
        spec=spec,
        kv_caches=caches,
        block_ids=block_table(12, 8),
        chunks=[3, 0, 2],
        buffer=torch.full((6 * 256,), 0xA5, dtype=torch.uint8),
        offsets=[0, 256, 600],
    )


@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize(
    ("change", "message"), [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_input_is_a_value_error(change: Callable[[dict], None], message: str, direction: str) -> None:
    args = _bad_args()
    assert args["spec"].page.page_bytes == 256
    change(args)
    before = [t.clone() for t in args["kv_caches"] if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        getattr(kvstore_kernels, direction)(**args)
    after = [t for t in args["kv_caches"] if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    assert all(
        torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(before, after, strict=True)
    )
    if args["buffer"].dtype == torch.uint8:
        assert bool((args["buffer"] == 0xA5).all())


def test_overlapping_pages_are_refused_on_gather() -> None:
    args = _bad_args()
    args["offsets"] = [0, 255, 600]
    with pytest.raises(ValueError, match=r"offsets\[0\] and offsets\[1\]: pages at 0 and 255 overlap"):
        kvstore_kernels.gather(**args)
    kvstore_kernels.scatter(**args)  # reading overlapping pages is fine


def test_scatter_refuses_a_block_written_twice() -> None:
    args = _bad_args()
    args["block_ids"][1] = args["block_ids"][7]
    with pytest.raises(ValueError, match=f"block {int(args['block_ids'][7])} appears twice"):
        kvstore_kernels.scatter(**args)


def test_scatter_refuses_expanded_views() -> None:
    args = _bad_args()
    args["kv_caches"][2] = torch.zeros(2, 1, 2, 2, 4, dtype=torch.bfloat16).expand(2, 12, 2, 2, 4)
    with pytest.raises(ValueError, match=r"kv_caches\[2\]: has a zero stride"):
        kvstore_kernels.scatter(**args)


def test_hf_chunk_past_the_sequence_and_bad_batch_index() -> None:
    spec = make_spec("hf")
    _, caches = build(spec, "cpu", num_blocks=4)  # 9 positions: chunks 0 and 1 only
    buffer = torch.zeros(spec.page.page_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="chunk 2 needs seq positions up to 11"):
        kvstore_kernels.gather(spec, caches, None, [2], buffer, [0])
    with pytest.raises(ValueError, match=r"batch_index: 2 is outside 0..1 for kv_caches\[0\] key"):
        kvstore_kernels.gather(spec, caches, None, [1], buffer, [0], batch_index=2)


def test_cross_layer_takes_one_tensor() -> None:
    spec = make_spec("cross_layer")
    _, cache = build(spec, "cpu")
    with pytest.raises(ValueError, match="cross_layer layout takes one tensor, got list"):
        kvstore_kernels.gather(
            spec, [cache], [0, 1], [0], torch.zeros(spec.page.page_bytes, dtype=torch.uint8), [0]
        )


# -- dispatch ------------------------------------------------------------------------------------


def _small_call() -> tuple[KVSpec, Any, torch.Tensor, torch.Tensor]:
    spec = make_spec("flash_attn")
    _, caches = build(spec, "cpu")
    return spec, caches, block_table(12, 2), torch.zeros(spec.page.page_bytes, dtype=torch.uint8)


@pytest.mark.parametrize(("setting", "expected"), [("torch", "torch"), ("triton", "triton"), ("", "torch")])
def test_backend_choice(monkeypatch: pytest.MonkeyPatch, setting: str, expected: str) -> None:
    monkeypatch.setenv("KVSTORE_KERNELS", setting)
    calls: list[str] = []
    triton_copy = triton_module()
    monkeypatch.setattr(triton_copy, "launch", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(reference, "gather_plan", lambda *a, **k: calls.append("torch"))
    spec, caches, table, buffer = _small_call()
    kvstore_kernels.gather(spec, caches, table, [0], buffer, [0])
    assert calls == [expected]


def test_unknown_backend_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_KERNELS", "cuda")
    spec, caches, table, buffer = _small_call()
    with pytest.raises(ValueError, match="KVSTORE_KERNELS: expected one of auto, triton, torch, got 'cuda'"):
        kvstore_kernels.gather(spec, caches, table, [0], buffer, [0])


@pytest.mark.skipif(CUDA, reason="CPU tensors reach Triton only through the interpreter")
def test_forced_triton_on_cpu_runs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_KERNELS", "triton")
    assert triton_module().is_interpreted()
    spec, caches, table, buffer = _small_call()
    kvstore_kernels.gather(spec, caches, table, [0], buffer, [0])
    assert torch.equal(buffer.to(torch.int16), expected_buffer(spec, caches, table, [0], [0], buffer.numel()))


# -- CUDA: real kernels, pinned host pages, wide tiles -------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("buffer_on", ["pinned", "cuda", "pageable"])
def test_cuda_cache_with_each_buffer(monkeypatch: pytest.MonkeyPatch, buffer_on: str) -> None:
    """Auto dispatch: a GPU path for a pinned or device buffer, the reference for pageable memory."""
    spec = KVSpec(
        model="m",
        num_layers=4,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        block_size=16,
        layout="flash_attn",
        chunk_tokens=64,
        kv_sharing={3: 1},
    )
    table = block_table(40, 32)
    chunks, offsets = (
        [5, 1, 7, 0],
        [0, 3 * spec.page.page_bytes, spec.page.page_bytes, 6 * spec.page.page_bytes],
    )
    _, caches = build(spec, "cuda", num_blocks=40)
    size = 7 * spec.page.page_bytes
    from kvstore_kernels import copy_engine, staged

    launches: list[int] = []
    for module in (triton_module(), copy_engine, staged):  # a GPU path: kernel, copy engines, staged
        real_launch = module.launch

        def counting_launch(*args: Any, _real: Any = real_launch, **kwargs: Any) -> None:
            launches.append(1)
            _real(*args, **kwargs)

        monkeypatch.setattr(module, "launch", counting_launch)
    expected = expected_buffer(spec, caches, table, chunks, offsets, size)
    for poison in POISONS:
        buffer = torch.full(
            (size,), poison, dtype=torch.uint8, device="cuda" if buffer_on == "cuda" else "cpu"
        )
        buffer = buffer.pin_memory() if buffer_on == "pinned" else buffer
        kvstore_kernels.gather(spec, caches, table, chunks, buffer, offsets)
        torch.cuda.synchronize()
        assert torch.equal(buffer.cpu(), torch.where(expected < 0, poison, expected).to(torch.uint8))
        _, restored = build(spec, "cuda", num_blocks=40, fill=poison)
        kvstore_kernels.scatter(spec, restored, table, chunks, buffer, offsets)
        again = torch.full_like(buffer, poison)
        again = again.pin_memory() if buffer_on == "pinned" else again
        kvstore_kernels.gather(spec, restored, table, chunks, again, offsets)
        torch.cuda.synchronize()
        assert torch.equal(again.cpu(), buffer.cpu())
    assert len(launches) == (0 if buffer_on == "pageable" else 6)


@gpu
@needs_cuda
@pytest.mark.parametrize("max_programs", [1, 3, 1000])
def test_cuda_program_cap_covers_every_segment(max_programs: int) -> None:
    spec = make_spec("cross_layer", "float8_e4m3fn", num_layers=5, block_size=16, chunk_tokens=64)
    table, chunks, offsets, size = scenario(spec)
    table = block_table(40, 16)
    _, caches = build(spec, "cuda", num_blocks=40)
    buffer = torch.full((size,), 0xA5, dtype=torch.uint8, device="cuda")
    triton_module().gather(spec, caches, table, chunks, buffer, offsets, max_programs=max_programs)
    expected = expected_buffer(spec, caches, table, chunks, offsets, size)
    assert torch.equal(buffer.cpu(), torch.where(expected < 0, 0xA5, expected).to(torch.uint8))


@gpu
@needs_cuda
def test_cuda_many_calls_in_flight_reuse_the_table_slots() -> None:
    """More queued launches than pinned table slots: each launch still reads its own tables."""
    spec = make_spec("flash_attn", "float16", num_layers=2, block_size=16, chunk_tokens=16)
    table = block_table(200, 200)
    _, caches = build(spec, "cuda", num_blocks=200)
    chunks = list(range(150))
    offsets = [(149 - chunk) * spec.page.page_bytes for chunk in chunks]
    size = 150 * spec.page.page_bytes
    buffer = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    busy = torch.randn(4096, 4096, device="cuda")
    busy @ busy  # keep the stream busy so the launches queue up behind it
    for chunk, offset in zip(chunks, offsets, strict=True):
        kvstore_kernels.gather(spec, caches, table, [chunk], buffer, [offset])
    torch.cuda.synchronize()
    expected = expected_buffer(spec, caches, table, chunks, offsets, size)
    assert torch.equal(buffer, torch.where(expected < 0, 0xA5, expected).to(torch.uint8))


# -- options, the auto rule, copy lists and kernel tunings -----------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"engine": "dma"}, "engine: expected one of auto, kernel, copy_engine, staged, got 'dma'"),
        ({"max_programs": 0}, "max_programs: expected a positive integer or None, got 0"),
        ({"max_programs": 2.5}, "max_programs: expected a positive integer or None, got 2.5"),
        ({"staging_bytes": 0}, "staging_bytes: expected a positive integer, got 0"),
        ({"staging_bytes": True}, "staging_bytes: expected a positive integer, got True"),
    ],
)
def test_bad_options_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kvstore_kernels.TransferOptions(**fields)


def test_options_must_be_transfer_options() -> None:
    spec, caches, table, buffer = _small_call()
    with pytest.raises(ValueError, match="options: expected a TransferOptions, got dict"):
        kvstore_kernels.gather(spec, caches, table, [0], buffer, [0], options={"engine": "kernel"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("engine", "expected"),
    [("auto", "torch"), ("kernel", "triton"), ("copy_engine", "ce"), ("staged", "staged")],
)
def test_explicit_engine_wins_over_auto(monkeypatch: pytest.MonkeyPatch, engine: str, expected: str) -> None:
    from kvstore_kernels import copy_engine, staged

    calls: list[str] = []
    monkeypatch.setattr(triton_module(), "launch", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(copy_engine, "launch", lambda *a, **k: calls.append("ce"))
    monkeypatch.setattr(staged, "launch", lambda *a, **k: calls.append("staged"))
    monkeypatch.setattr(reference, "gather_plan", lambda *a, **k: calls.append("torch"))
    monkeypatch.setenv("KVSTORE_KERNELS", "torch")  # applies to engine="auto" only
    spec, caches, table, buffer = _small_call()
    options = kvstore_kernels.TransferOptions(engine=engine)
    kvstore_kernels.gather(spec, caches, table, [0], buffer, [0], options=options)
    assert calls == [expected]


@pytest.mark.parametrize(
    ("layout", "sharing", "rows"),
    [("cross_layer", {}, 6), ("cross_layer", {1: 0}, 1), ("flash_attn", {}, 1), ("flashinfer", {}, 1)],
)
def test_copy_lists(layout: str, sharing: dict[int, int], rows: int) -> None:
    """cross_layer blocks move as one 2-D copy of all their (layer, k|v) rows; the rest as 1-D runs."""
    from kvstore_kernels import copy_engine
    from kvstore_kernels.validate import plan_transfer

    spec = make_spec(layout, "float16", sharing=sharing)
    table, chunks, offsets, size = scenario(spec)
    _, caches = build(spec, "cpu")
    buffer = torch.zeros(size, dtype=torch.uint8)
    plan = plan_transfer(spec, caches, table, chunks, buffer, offsets, None, 0, writes_cache=False)
    copies = copy_engine.plan_copies(spec, plan, to_page=True)
    segment = spec.block_size * spec.page.token_bytes
    assert copies.rows == rows
    assert int(copies.sizes.sum()) * rows == len(chunks) * len(spec.page.stored_layers) * 2 * 2 * segment
    if rows > 1:
        assert len(copies.dsts) == len(chunks) * spec.blocks_per_chunk
        assert copies.dst_pitch == spec.page.chunk_tokens * spec.page.token_bytes  # K span to V span
        assert copies.src_pitch == segment
    one_d = copy_engine.plan_copies(spec, plan, to_page=True, shape="1d")
    assert one_d.rows == 1 and int(one_d.sizes.sum()) == int(copies.sizes.sum()) * rows
    _, caches = build(spec, device_of("copy_engine"))
    check_gather("copy_engine", spec, caches, table, chunks, offsets, size)
    check_scatter("copy_engine", spec, table, chunks, offsets, size)


def test_copy_list_merges_runs_contiguous_on_both_sides() -> None:
    from kvstore_kernels import copy_engine
    from kvstore_kernels.validate import plan_transfer

    spec = make_spec("flash_attn", "float16", num_layers=1)
    _, caches = build(spec, "cpu")
    table = [4, 5, 9, 2]  # chunk 0: blocks 4, 5 adjacent; chunk 1: 9, 2 apart
    buffer = torch.zeros(2 * spec.page.page_bytes, dtype=torch.uint8)
    offsets = [0, spec.page.page_bytes]
    plan = plan_transfer(spec, caches, table, [0, 1], buffer, offsets, None, 0, writes_cache=False)
    copies = copy_engine.plan_copies(spec, plan, to_page=True, shape="1d")
    segment = spec.block_size * spec.page.token_bytes
    # chunk 0: K (2 blocks) and V (2 blocks) each one run; chunk 1: four single blocks.
    assert copies.sizes.tolist() == [2 * segment, 2 * segment] + [segment] * 4


@pytest.mark.parametrize(
    "tuning",
    [
        {"segments_per_step": 2},
        {"segments_per_step": 4, "tile_bytes": 16},
        {"tile_bytes": 32, "eviction": "evict_first"},
        {"segments_per_step": 8, "num_warps": 2, "load_cache": ".cg", "store_cache": ".cs"},
    ],
)
@pytest.mark.parametrize("strided", [False, True])
def test_kernel_tunings_move_the_same_bytes(tuning: dict[str, Any], strided: bool) -> None:
    """Segments per step that do not divide the segment count, tiles that do not divide a segment."""
    from kvstore_kernels.triton_copy import Tuning

    spec = make_spec("flash_attn", "float16", block_size=5, chunk_tokens=10, sharing={1: 0})
    table, chunks, offsets, size = scenario(spec)
    device = device_of("triton")
    _, caches = build(spec, device, strided=strided)
    expected = expected_buffer(spec, caches, table, chunks, offsets, size)
    buffer = torch.full((size,), 0xA5, dtype=torch.uint8, device=device)
    triton_module().gather(
        spec, caches, table, chunks, buffer, offsets, max_programs=3, tuning=Tuning(**tuning)
    )
    assert torch.equal(buffer.cpu(), torch.where(expected < 0, 0xA5, expected).to(torch.uint8))
    bases, restored = build(spec, device, fill=0x5A, strided=strided)
    triton_module().scatter(
        spec, restored, table, chunks, buffer, offsets, max_programs=3, tuning=Tuning(**tuning)
    )
    again = torch.full((size,), 0xA5, dtype=torch.uint8, device=device)
    triton_module().gather(spec, restored, table, chunks, again, offsets)
    assert torch.equal(again.cpu(), buffer.cpu())


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


def test_cache_modifiers_refuse_an_eviction_policy() -> None:
    from kvstore_kernels.triton_copy import Tuning

    spec, caches, table, buffer = _small_call()
    with pytest.raises(ValueError, match="tuning: a cache modifier .* cannot be combined with an eviction"):
        triton_module().gather(
            spec, caches, table, [0], buffer, [0], tuning=Tuning(store_cache=".cs", eviction="evict_first")
        )


@pytest.mark.parametrize("impl", ["triton", "staged"])
def test_kernel_skips_block_ids_outside_the_cache(impl: str) -> None:
    """A device block table is not checked on the host: the kernel moves nothing for a bad id; the
    staged gather writes zeros there (never a slot's stale bytes, which belong to another page)."""
    from kvstore_kernels import staged
    from kvstore_kernels.validate import plan_transfer

    spec = make_spec("flash_attn", "float16", sharing={1: 0})
    table, chunks, offsets, size = scenario(spec)
    device = device_of("triton")
    _, caches = build(spec, device)
    buffer = buffer_of(impl, torch.full((size,), 0xA5, dtype=torch.uint8))
    plan = plan_transfer(spec, caches, table, chunks, buffer, offsets, None, 0, writes_cache=False)
    blocks = torch.as_tensor(plan.blocks).to(device)
    blocks[1, 0], blocks[2, 1] = 12, -3  # chunk 0's first block, chunk 2's second block
    if impl == "staged":
        # Stale bytes in every slot first: a full gather of other pages through the same ring.
        staged.launch(spec, plan, to_page=True, staging_bytes=staged_options(spec).staging_bytes)
        if CUDA:
            torch.cuda.synchronize()
        buffer.fill_(0xA5)
        staged.launch(
            spec, plan._replace(blocks=blocks), to_page=True, staging_bytes=staged_options(spec).staging_bytes
        )
    else:
        triton_module().launch(spec, plan._replace(blocks=blocks), to_page=True)
    if CUDA:
        torch.cuda.synchronize()
    expected = expected_with_skipped(spec, caches, table, chunks, offsets, size, [(1, 0), (2, 1)])
    skipped = 0xA5 if impl == "triton" else 0
    want = torch.where(expected == -2, skipped, torch.where(expected < 0, 0xA5, expected)).to(torch.uint8)
    assert torch.equal(buffer.cpu(), want)


# -- the staged path: pieces, ring slots, refusals ------------------------------------------------


@pytest.mark.parametrize("layers_per_slot", [1, 2, 100])
@pytest.mark.parametrize("layers", [None, range(1, 4), range(3, 5), range(2, 2)])
@pytest.mark.parametrize("layout", ["flashinfer", "cross_layer"])
def test_staged_pieces_outnumber_the_ring_slots(
    layout: str, layers: range | None, layers_per_slot: int
) -> None:
    """Pages cut into runs of layers, more pieces than slots; layer subsets; both directions."""
    from kvstore_kernels import staged
    from kvstore_kernels.validate import plan_transfer

    spec = make_spec(layout, "float16", num_layers=5, sharing={1: 0})  # 4 stored layers
    table, chunks, offsets, size = scenario(spec)
    options = staged_options(spec, layers_per_slot)
    _, caches = build(spec, device_of("staged"))
    buffer = torch.zeros(size, dtype=torch.uint8)
    plan = plan_transfer(spec, caches, table, chunks, buffer, offsets, layers, 0, writes_cache=False)
    moved = len(plan.layers)
    per_piece = min(moved, layers_per_slot)
    pieces = staged.pieces(spec, plan, options.staging_bytes)
    assert len(pieces) == (len(chunks) * -(-moved // per_piece) if moved else 0)
    assert all(0 < piece.stop_layer - piece.first_layer <= per_piece for piece in pieces)
    check_gather("staged", spec, caches, table, chunks, offsets, size, layers, options=options)
    check_scatter("staged", spec, table, chunks, offsets, size, layers, options=options)


def test_staged_refuses_slots_smaller_than_a_layer() -> None:
    from kvstore_kernels import staged

    spec, caches, table, buffer = _small_call()
    buffer = buffer_of("staged", buffer)
    too_small = staged.NUM_SLOTS * spec.page.layer_bytes - 1
    options = kvstore_kernels.TransferOptions(engine="staged", staging_bytes=too_small)
    with pytest.raises(ValueError, match="engine='staged': staging_bytes=.* less than one stored layer"):
        kvstore_kernels.gather(
            spec, [c.to(device_of("staged")) for c in caches], table, [0], buffer, [0], options=options
        )


def counted(calls: list[str], name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, noting `name` in `calls` at each call."""

    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return function(*args, **kwargs)

    return call


def _gpu_call(layout: str) -> tuple[KVSpec, Any, torch.Tensor, list[int], list[int], int]:
    spec = KVSpec(
        model="m",
        num_layers=4,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        block_size=16,
        layout=layout,
        chunk_tokens=64,
    )
    _, caches = build(spec, "cuda", num_blocks=40)
    page_bytes = spec.page.page_bytes
    chunks, offsets = [5, 1, 7, 0], [0, 3 * page_bytes, page_bytes, 6 * page_bytes]
    return spec, caches, block_table(40, 32), chunks, offsets, 7 * page_bytes


@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("layout", "table_on", "staging", "expected"),
    [
        ("cross_layer", "host", "default", "staged"),
        ("flash_attn", "host", "default", "staged"),
        ("flash_attn", "cuda", "default", "staged"),
        ("cross_layer", "host", "too small", "copy_engine"),
        ("flash_attn", "host", "too small", "kernel"),
        ("cross_layer", "cuda", "too small", "kernel"),
    ],
)
def test_cuda_auto_rule(
    monkeypatch: pytest.MonkeyPatch, layout: str, table_on: str, staging: str, expected: str
) -> None:
    """Pinned buffers go through the staging ring; where its slots cannot hold one stored layer,
    2-D copies where the blocks allow them, else the kernel."""
    from kvstore_kernels import copy_engine, staged
    from kvstore_kernels.validate import plan_transfer

    spec, caches, table, chunks, offsets, size = _gpu_call(layout)
    table = table.cuda() if table_on == "cuda" else table
    calls: list[str] = []
    for name, module in (("kernel", triton_module()), ("copy_engine", copy_engine), ("staged", staged)):
        monkeypatch.setattr(module, "launch", counted(calls, name, module.launch))
    buffer = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    options = kvstore_kernels.TransferOptions()
    if staging == "too small":
        options = kvstore_kernels.TransferOptions(staging_bytes=staged.NUM_SLOTS * spec.page.layer_bytes - 1)
        plan = plan_transfer(spec, caches, table, chunks, buffer, offsets, None, 0, writes_cache=False)
        if table_on == "host" and copy_engine.can_copy_2d(spec, plan):
            expected = "copy_engine"  # flash_attn layers that happen to sit at one pitch: 2-D copies too
    kvstore_kernels.gather(spec, caches, table, chunks, buffer, offsets, options=options)
    torch.cuda.synchronize()
    expected_bytes = expected_buffer(spec, caches, table.cpu(), chunks, offsets, size)
    assert torch.equal(buffer, torch.where(expected_bytes < 0, 0xA5, expected_bytes).to(torch.uint8))
    assert calls == [expected]


@gpu
@needs_cuda
@pytest.mark.parametrize("engine", ["kernel", "copy_engine", "staged"])
def test_cuda_side_stream(engine: str) -> None:
    """The copy is enqueued on `stream` behind its earlier work; an event after the call orders it."""
    spec, caches, table, chunks, offsets, size = _gpu_call("cross_layer")
    expected = expected_buffer(spec, caches, table, chunks, offsets, size)
    buffer = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    side = torch.cuda.Stream()
    busy = torch.randn(4096, 4096, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(8):
            busy = busy @ busy / 64  # keep the side stream busy
    options = kvstore_kernels.TransferOptions(engine=engine)
    kvstore_kernels.gather(spec, caches, table, chunks, buffer, offsets, stream=side, options=options)
    done = torch.cuda.Event()
    done.record(side)
    done.synchronize()
    assert torch.equal(buffer, torch.where(expected < 0, 0xA5, expected).to(torch.uint8))


@gpu
@needs_cuda
def test_cuda_device_block_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA block table is never read back: looked up on the GPU, bad ids move nothing."""
    spec, caches, table, chunks, offsets, size = _gpu_call("flash_attn")
    reads: list[str] = []
    monkeypatch.setattr(torch.Tensor, "cpu", counted(reads, "cpu", torch.Tensor.cpu))
    buffer = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    kvstore_kernels.gather(spec, caches, table.cuda(), chunks, buffer, offsets)
    _, restored = build(spec, "cuda", num_blocks=40, fill=0x5A)
    kvstore_kernels.scatter(spec, restored, table.cuda(), chunks, buffer, offsets)
    assert not reads
    monkeypatch.undo()
    torch.cuda.synchronize()
    expected = expected_buffer(spec, caches, table, chunks, offsets, size)
    assert torch.equal(buffer, torch.where(expected < 0, 0xA5, expected).to(torch.uint8))
    again = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    kvstore_kernels.gather(spec, restored, table, chunks, again, offsets)
    torch.cuda.synchronize()
    assert torch.equal(again, buffer)
    bad = table.cuda()
    bad[chunks[0] * spec.blocks_per_chunk + 1] = 40  # outside the cache: the kernel moves nothing
    expected = expected_with_skipped(spec, caches, table, chunks, offsets, size, [(0, 1)])
    for engine, skipped in (("kernel", 0xA5), ("auto", 0)):  # auto: staged, zeros for that block
        again.fill_(0xA5)
        options = kvstore_kernels.TransferOptions(engine=engine)
        kvstore_kernels.gather(spec, caches, bad, chunks, again, offsets, options=options)
        torch.cuda.synchronize()
        want = torch.where(expected == -2, skipped, torch.where(expected < 0, 0xA5, expected))
        assert torch.equal(again, want.to(torch.uint8))


@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("cuda table", "the block table is on the device"),
        ("pageable", "the buffer is pageable host memory"),
    ],
)
def test_cuda_copy_engine_refusals(change: str, message: str) -> None:
    spec, caches, table, chunks, offsets, size = _gpu_call("cross_layer")
    buffer = torch.zeros(size, dtype=torch.uint8)
    if change == "cuda table":
        table, buffer = table.cuda(), buffer.pin_memory()
    options = kvstore_kernels.TransferOptions(engine="copy_engine")
    with pytest.raises(ValueError, match=f"engine='copy_engine': {message}"):
        kvstore_kernels.gather(spec, caches, table, chunks, buffer, offsets, options=options)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("change", "message"), [("pageable", "pageable host memory"), ("cuda", "device memory")]
)
def test_cuda_staged_refusals(change: str, message: str) -> None:
    spec, caches, table, chunks, offsets, size = _gpu_call("flash_attn")
    buffer = torch.zeros(size, dtype=torch.uint8, device="cuda" if change == "cuda" else "cpu")
    options = kvstore_kernels.TransferOptions(engine="staged")
    with pytest.raises(ValueError, match=f"engine='staged': the buffer is (in )?{message}"):
        kvstore_kernels.gather(spec, caches, table, chunks, buffer, offsets, options=options)


def _many_pages(num_pages: int) -> tuple[KVSpec, Any, list[int], list[int], list[int], int]:
    """1 MiB pages (4 layers of 256 KiB), more of them than ring slots, out of order in the buffer."""
    spec = KVSpec(
        model="m",
        num_layers=4,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        block_size=16,
        layout="flash_attn",
        chunk_tokens=64,
    )
    num_blocks = num_pages * spec.blocks_per_chunk
    _, caches = build(spec, "cuda", num_blocks=num_blocks, seed=5)
    table = block_table(num_blocks, num_blocks, seed=6).tolist()
    chunks = list(range(num_pages))
    offsets = [(num_pages - 1 - chunk) * spec.page.page_bytes for chunk in chunks]
    return spec, caches, table, chunks, offsets, num_pages * spec.page.page_bytes


@gpu
@needs_cuda
@pytest.mark.parametrize(("overlap", "copy_streams"), [(True, 1), (True, 2), (False, 1)])
@pytest.mark.parametrize("layers_per_slot", [1, 4])
def test_cuda_staged_ring_is_not_overwritten_in_flight(
    overlap: bool, copy_streams: int, layers_per_slot: int
) -> None:
    """24 pages through 4 slots, queued behind a busy stream: each slot's copy (or unpack) runs
    before the slot is refilled, or pages would hold other pages' bytes (copies on one side
    stream, on two in turn, or on the caller's stream)."""
    from kvstore_kernels import staged
    from kvstore_kernels.validate import plan_transfer

    spec, caches, table, chunks, offsets, size = _many_pages(24)
    staging_bytes = staged_options(spec, layers_per_slot).staging_bytes
    expected = expected_buffer(spec, caches, table, chunks, offsets, size)
    buffer = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):
        busy = busy @ busy / 64  # the host queues every piece before the GPU starts
    plan = plan_transfer(spec, caches, table, chunks, buffer, offsets, None, 0, writes_cache=False)
    staged.launch(
        spec, plan, to_page=True, staging_bytes=staging_bytes, overlap=overlap, copy_streams=copy_streams
    )
    bases, restored = build(spec, "cuda", num_blocks=len(table), fill=0x5A)
    for _ in range(4):
        busy = busy @ busy / 64
    back = plan_transfer(spec, restored, table, chunks, buffer, offsets, None, 0, writes_cache=True)
    staged.launch(
        spec, back, to_page=False, staging_bytes=staging_bytes, overlap=overlap, copy_streams=copy_streams
    )
    torch.cuda.synchronize()
    assert torch.equal(buffer, torch.where(expected < 0, 0xA5, expected).to(torch.uint8))
    again = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    kvstore_kernels.gather(
        spec,
        restored,
        table,
        chunks,
        again,
        offsets,
        options=kvstore_kernels.TransferOptions(engine="kernel"),
    )
    torch.cuda.synchronize()
    assert torch.equal(again, buffer)


@gpu
@needs_cuda
def test_cuda_staged_both_directions_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gather and a scatter on two streams, each through its own ring and copy stream, and a
    gather whose slots outgrow the ring while the first transfers are still queued."""
    from kvstore_kernels import staged

    monkeypatch.setattr(staged, "_rings", {})  # fresh rings, sized by this test's first calls
    spec, caches, table, chunks, offsets, size = _many_pages(16)
    half = len(table) // 2
    pages = chunks[:8]
    stores, loads = table[:half], table[half:]  # disjoint blocks
    expected = expected_buffer(spec, caches, stores, pages, offsets[:8], size)
    incoming = torch.randint(0, 256, (size,), dtype=torch.uint8).pin_memory()
    outgoing = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    small = staged_options(spec, 1)
    with torch.cuda.stream(first):
        kvstore_kernels.gather(spec, caches, stores, pages, outgoing, offsets[:8], options=small)
    with torch.cuda.stream(second):
        kvstore_kernels.scatter(spec, caches, loads, pages, incoming, offsets[:8], options=small)
    grown = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    with torch.cuda.stream(first):  # slots of 4 layers: the ring is replaced once its slots are free
        kvstore_kernels.gather(
            spec, caches, stores, pages, grown, offsets[:8], options=staged_options(spec, 4)
        )
    torch.cuda.synchronize()
    assert torch.equal(outgoing, torch.where(expected < 0, 0xA5, expected).to(torch.uint8))
    assert torch.equal(grown, outgoing)
    loaded = torch.full((size,), 0xA5, dtype=torch.uint8).pin_memory()
    kvstore_kernels.gather(
        spec,
        caches,
        loads,
        pages,
        loaded,
        offsets[:8],
        options=kvstore_kernels.TransferOptions(engine="kernel"),
    )
    torch.cuda.synchronize()
    written = expected_buffer(spec, caches, loads, pages, offsets[:8], size) >= 0
    assert torch.equal(loaded[written], incoming[written])
