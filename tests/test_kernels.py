"""Page gather/scatter moves exactly the right bytes: every layout, dtype and direction, layer
subsets, shared layers, block sizes, odd offsets, strided views, registered caches, for the
torch reference, Triton, the copy engines and the staged path (`tests.kernel_cases`).
"""

from __future__ import annotations

import pytest
import torch

import kvstore_kernels
from tests.kernel_cases import (
    CUDA,
    DTYPES,
    IMPLS,
    LAYOUTS,
    REFUSAL,
    _selector,
    _spans,
    _token_index,
    as_bytes,
    block_table,
    buffer_of,
    build,
    check_gather,
    check_scatter,
    copy_engine_refuses,
    device_of,
    make_spec,
    run,
    scenario,
)

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
@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "mla", "hf", "vllm_rows"])
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


@pytest.mark.parametrize("impl", IMPLS)
def test_vllm_rows_page_format_by_hand(impl: str) -> None:
    """vLLM's CPU attention backend: per (block, head), the block's K rows then its V rows. K of
    (block b, head h, token t) is `view(blocks, heads, 2 * block_size, head_dim)[b, h, t]`, V is
    `[b, h, block_size + t]`; the page is [stored_layer][k|v][token][kv_head][head_dim], and a
    scatter of it writes those rows back and nothing else."""
    spec = make_spec("vllm_rows", "float32", num_layers=2, block_size=2, chunk_tokens=4)
    blocks, heads, block_size, dim = 4, spec.num_kv_heads, spec.block_size, spec.head_dim
    caches = [
        torch.arange(blocks * heads * block_size * 2 * dim, dtype=torch.float32).reshape(
            blocks, heads, block_size, 2 * dim
        )
        + 1000 * layer
        for layer in range(2)
    ]
    table = [3, 1, 0, 2]
    device = device_of(impl)
    buffer = buffer_of(impl, torch.full((spec.page.page_bytes + 8,), 0xA5, dtype=torch.uint8))
    if impl == "copy_engine":  # a block's K rows of one head sit apart from the next head's
        with pytest.raises(ValueError, match=REFUSAL):
            run(impl, "gather", spec, [c.to(device) for c in caches], table, [1], buffer, [8])
        return
    page: list[float] = []
    for layer in range(2):
        rows = caches[layer].view(blocks, heads, 2 * block_size, dim)
        for kv in range(2):
            for token in range(4, 8):  # chunk 1: blocks 0 and 2
                block, offset = table[token // block_size], token % block_size
                for head in range(heads):
                    page.extend(rows[block, head, kv * block_size + offset].tolist())
    run(impl, "gather", spec, [c.to(device) for c in caches], table, [1], buffer, [8])
    assert torch.equal(buffer[8:].cpu().view(torch.float32), torch.tensor(page))
    assert torch.equal(buffer[:8].cpu(), torch.full((8,), 0xA5, dtype=torch.uint8))
    restored = [torch.full_like(c, -1.0).to(device) for c in caches]
    run(impl, "scatter", spec, restored, table, [1], buffer, [8])
    for got, original in zip(restored, caches, strict=True):
        want = torch.full_like(original, -1.0)
        want[[0, 2]] = original[[0, 2]]
        assert torch.equal(got.cpu(), want)


def test_vllm_rows_refuses_rows_that_are_not_dense() -> None:
    """vLLM's LBNHC stride order cannot hold a block's K rows then its V rows: refused, never
    read through the wrong strides."""
    spec = make_spec("vllm_rows", "bfloat16")
    table, chunks, offsets, size = scenario(spec)
    caches = [torch.zeros(12, spec.block_size, 2, 8, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]
    with pytest.raises(ValueError, match="the vllm_rows layout needs each .* dense"):
        kvstore_kernels.gather(spec, caches, table, chunks, torch.zeros(size, dtype=torch.uint8), offsets)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_mla_at_deepseek_latent_width(direction: str, dtype: str, impl: str) -> None:
    """DeepSeek-V3's MLA page: one 576-wide latent (512 compressed KV + 64 rope) per token, at
    vLLM's MLA block size of 64."""
    spec = make_spec("mla", dtype, num_layers=2, block_size=64, head_dim=576)
    table, chunks, offsets, size = scenario(spec)
    if direction == "gather":
        _, caches = build(spec, device_of(impl))
        check_gather(impl, spec, caches, table, chunks, offsets, size)
    else:
        check_scatter(impl, spec, table, chunks, offsets, size)
