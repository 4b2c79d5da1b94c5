"""Blocks copied from one paged KV cache straight into another (`kvstore_kernels.copy_blocks`: a
prompt's KV handed from a prefill GPU to a decode GPU): every supported layout and dtype, blocks
apart in the cache, layer subsets, shared layers, permuted and repeated source blocks, a copy
within one cache, and each refusal; for the torch reference and the Triton kernel (in Triton's
interpreter without CUDA, `tests.kernel_cases`), and across two GPUs over peer access where a
host has them.

Each scenario poisons the destination (0xA5, then 0x5A) and checks every byte of it against an
oracle that indexes both caches token by token: the named blocks hold the source's bytes, every
other byte still holds the poison.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

import kvstore_kernels
from kvstore.shared.spec import KVSpec
from tests.kernel_cases import CUDA, DTYPES, POISONS, _selector, as_bytes, build, device_of, gpu, make_spec

IMPLS = ["torch", "triton"]
# (layout, strided): every layout whose blocks copy_blocks moves, plain and with blocks apart.
SUPPORTED = [
    ("flash_attn", False),
    ("flashinfer", False),
    ("cross_layer", False),
    ("mla", False),
    ("vllm", False),
    ("vllm_rows", False),
    ("flashinfer", True),  # every other block of a larger tensor
    ("vllm_rows", True),  # a padding head after each block's heads
]
# Views whose blocks have gaps inside (heads transposed or padded, vLLM's LBNHC, a padded latent).
UNSUPPORTED = ["flash_attn", "cross_layer", "mla", "vllm"]
SRC_BLOCKS, DST_BLOCKS = 12, 9  # the caches' block counts differ
PEERS = CUDA and torch.cuda.device_count() >= 2 and torch.cuda.can_device_access_peer(0, 1)
needs_peers = pytest.mark.skipif(not PEERS, reason="needs two CUDA devices with peer access")


def kernel_module() -> ModuleType:
    """`kvstore_kernels.blocks`, its kernel in the interpreter where there is no CUDA."""
    from kvstore_kernels import blocks

    if not CUDA and not blocks.is_interpreted():
        importlib.reload(blocks)  # imported before TRITON_INTERPRET was set
    return blocks


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The path that moves the blocks: the torch reference (on the CPU) or the kernel."""
    monkeypatch.setenv("KVSTORE_KERNELS", "triton" if request.param == "triton" else "torch")
    kernel_module()
    yield request.param


def expected_copy(
    spec: KVSpec, src: Any, src_blocks: Any, dst: Any, dst_blocks: Any, layers: range | None = None
) -> None:
    """What copy_blocks must do, token by token, into `dst` (CPU tensors)."""
    stored = set(spec.stored_layers)
    for layer in layers if layers is not None else range(spec.num_layers):
        if layer not in stored:
            continue
        for kv in range(spec.page.kv_factor):
            source, target = _selector(spec, src, layer, kv, 0), _selector(spec, dst, layer, kv, 0)
            for src_block, dst_block in zip(src_blocks, dst_blocks, strict=True):
                target[int(dst_block)] = source[int(src_block)]


def synchronize(*devices: str) -> None:
    for device in devices:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)


def check_copy(
    impl: str,
    spec: KVSpec,
    src_blocks: Any,
    dst_blocks: Any,
    layers: range | None = None,
    *,
    src_on: str | None = None,
    dst_on: str | None = None,
    src_strided: bool = False,
    dst_strided: bool = False,
    register: bool = False,
) -> None:
    """Random source blocks copied into a poisoned destination: exactly the oracle's bytes."""
    src_on, dst_on = src_on or device_of(impl), dst_on or device_of(impl)
    _, src = build(spec, src_on, num_blocks=SRC_BLOCKS, seed=3, strided=src_strided)
    _, src_cpu = build(spec, "cpu", num_blocks=SRC_BLOCKS, seed=3, strided=src_strided)
    for poison in POISONS:
        bases, dst = build(spec, dst_on, num_blocks=DST_BLOCKS, fill=poison, strided=dst_strided)
        want_bases, want = build(spec, "cpu", num_blocks=DST_BLOCKS, fill=poison, strided=dst_strided)
        target = kvstore_kernels.register(spec, dst) if register else dst
        synchronize(src_on, dst_on)  # the source's bytes are there before the other GPU reads them
        kvstore_kernels.copy_blocks(spec, src, src_blocks, target, dst_blocks, layers=layers)
        synchronize(dst_on)
        expected_copy(spec, src_cpu, src_blocks, want, dst_blocks, layers)
        for index, (got, wanted) in enumerate(zip(as_bytes(bases), as_bytes(want_bases), strict=True)):
            assert torch.equal(got, wanted), (
                f"poison {poison:#x}, tensor {index}: {int((got != wanted).sum())} bytes differ"
            )


# -- scenarios -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("layout", "strided"), SUPPORTED)
def test_every_supported_layout_and_dtype(impl: str, layout: str, strided: bool, dtype: str) -> None:
    spec = make_spec(layout, dtype, sharing={1: 0})  # layer 1 is shared: never written
    check_copy(impl, spec, [7, 2, 11, 0], [1, 8, 0, 4], src_strided=strided, dst_strided=strided)


@pytest.mark.parametrize("layout", ["flashinfer", "vllm_rows"])
def test_blocks_apart_on_one_side_only(impl: str, layout: str) -> None:
    spec = make_spec(layout, "float8_e4m3fn")
    check_copy(impl, spec, [5, 9, 3], [2, 0, 7], dst_strided=True)
    check_copy(impl, spec, [5, 9, 3], [2, 0, 7], src_strided=True)


@pytest.mark.parametrize("layers", [range(1, 4), range(2, 3), range(0, 2), range(3, 3)])
def test_layer_subsets_skip_shared_layers(impl: str, layers: range) -> None:
    spec = make_spec("flashinfer", num_layers=4, sharing={2: 0})
    check_copy(impl, spec, [4, 10, 6], [6, 3, 5], layers)


def test_shared_layers_that_alias_their_source(impl: str) -> None:
    spec = make_spec("flash_attn", num_layers=4, sharing={1: 0, 3: 2})
    device = device_of(impl)
    _, src = build(spec, device, num_blocks=SRC_BLOCKS, seed=3, alias_shared=True)
    bases, dst = build(spec, device, num_blocks=DST_BLOCKS, fill=0xA5, alias_shared=True)
    want_bases, want = build(spec, "cpu", num_blocks=DST_BLOCKS, fill=0xA5, alias_shared=True)
    kvstore_kernels.copy_blocks(spec, src, [3, 8], dst, [6, 1])
    synchronize(device)
    expected_copy(spec, build(spec, "cpu", num_blocks=SRC_BLOCKS, seed=3)[1], [3, 8], want, [6, 1])
    assert all(torch.equal(a, b) for a, b in zip(as_bytes(bases), as_bytes(want_bases), strict=True))


@pytest.mark.parametrize(
    "ids",
    [
        lambda values: values,
        lambda values: np.asarray(values, dtype=np.int32),
        lambda values: torch.tensor(values, dtype=torch.int32),
        lambda values: tuple(np.uint16(value) for value in values),
    ],
    ids=["list", "numpy", "tensor", "numpy scalars"],
)
def test_block_id_forms_and_repeated_sources(impl: str, ids: Any) -> None:
    """A source block may go to several destinations; every form of host block ids is taken."""
    spec = make_spec("vllm", "bfloat16")
    check_copy(impl, spec, ids([4, 4, 11, 0]), ids([0, 8, 3, 5]))


@pytest.mark.parametrize("empty", [[], np.empty(0, dtype=np.int64), torch.empty(0, dtype=torch.int64)])
def test_no_blocks_move_nothing(impl: str, empty: Any) -> None:
    check_copy(impl, make_spec("flash_attn"), empty, empty)


def test_registered_destination(impl: str) -> None:
    check_copy(impl, make_spec("mla", "float8_e5m2"), [1, 2, 3], [8, 7, 6], register=True)


def test_registered_caches_copied_again(impl: str) -> None:
    """Registered caches keep the copy's checked plan (and the kernel's launcher): later copies
    with other block ids, layer ranges and pair counts, and from another source, move exactly
    their own blocks (a kept plan never serves another source)."""
    spec = make_spec("flashinfer", "bfloat16", num_layers=3)
    device = device_of(impl)
    sources = [build(spec, device, num_blocks=SRC_BLOCKS, seed=seed)[1] for seed in (3, 4)]
    sources_cpu = [build(spec, "cpu", num_blocks=SRC_BLOCKS, seed=seed)[1] for seed in (3, 4)]
    registered = [kvstore_kernels.register(spec, source) for source in sources]
    bases, dst = build(spec, device, num_blocks=DST_BLOCKS, fill=0xA5)
    want_bases, want = build(spec, "cpu", num_blocks=DST_BLOCKS, fill=0xA5)
    target = kvstore_kernels.register(spec, dst)
    rounds = [
        (0, [4, 1], [2, 6], None),
        (0, [9, 3, 10], [0, 5, 8], None),  # another pair count: the launcher's arguments change
        (1, [4, 1], [3, 7], None),  # another source into the same destination
        (0, [0, 11, 2, 6], [1, 4, 3, 2], range(1, 3)),  # a layer subset: its own plan
        (1, [5], [6], range(0, 1)),
    ]
    for source, src_blocks, dst_blocks, layers in rounds:
        kvstore_kernels.copy_blocks(spec, registered[source], src_blocks, target, dst_blocks, layers=layers)
        synchronize(device)
        expected_copy(spec, sources_cpu[source], src_blocks, want, dst_blocks, layers)
        for index, (got, wanted) in enumerate(zip(as_bytes(bases), as_bytes(want_bases), strict=True)):
            assert torch.equal(got, wanted), f"round {source, src_blocks}, tensor {index}: bytes differ"


@pytest.mark.parametrize(
    ("layout", "dtype", "block_size", "head_dim"),
    [
        ("mla", "float8_e4m3fn", 2, 3),  # 6-byte runs: 2-byte words
        ("mla", "float8_e4m3fn", 1, 5),  # 5-byte runs: bytes
        ("flash_attn", "float16", 3, 6),  # 72-byte runs, 8-byte words
        ("flash_attn", "float32", 64, 128),  # 64 KiB runs: two 32 KiB tiles
        ("vllm", "float32", 5, 1024),  # 80 KiB layer blocks: tiles of 32 KiB, the last one part full
    ],
)
def test_run_sizes_and_word_widths(
    impl: str, layout: str, dtype: str, block_size: int, head_dim: int
) -> None:
    spec = make_spec(layout, dtype, num_layers=2, block_size=block_size, head_dim=head_dim)
    check_copy(impl, spec, [11, 0, 5], [3, 8, 0])


def test_a_copy_within_one_cache(impl: str) -> None:
    """Blocks forked inside one cache (a shared prefix copied before it is written): the named
    destinations hold the sources' bytes, every other block is as it was."""
    spec = make_spec("cross_layer", "bfloat16")
    bases, caches = build(spec, device_of(impl), num_blocks=SRC_BLOCKS, seed=5)
    want_bases, want = build(spec, "cpu", num_blocks=SRC_BLOCKS, seed=5)
    _, before = build(spec, "cpu", num_blocks=SRC_BLOCKS, seed=5)
    kvstore_kernels.copy_blocks(spec, caches, [2, 9, 4], caches, [10, 0, 7])
    synchronize(device_of(impl))
    expected_copy(spec, before, [2, 9, 4], want, [10, 0, 7])
    assert all(torch.equal(a, b) for a, b in zip(as_bytes(bases), as_bytes(want_bases), strict=True))


# -- refusals ------------------------------------------------------------------------------------


def check_refused(impl: str, spec: KVSpec, match: str, src_blocks: Any, dst_blocks: Any, **args: Any) -> None:
    """The call raises `match`, and the destination still holds only the poison."""
    device = device_of(impl)
    _, src = build(spec, args.pop("src_on", device), num_blocks=SRC_BLOCKS, seed=3)
    dst_spec, dst_on = args.pop("dst_spec", spec), args.pop("dst_on", device)
    bases, dst = build(dst_spec, dst_on, num_blocks=DST_BLOCKS, fill=0xA5, **args.pop("build", {}))
    dst = args.pop("dst", lambda caches: caches)(dst)
    with pytest.raises(ValueError, match=match):
        kvstore_kernels.copy_blocks(spec, src, src_blocks, dst, dst_blocks, **args)
    synchronize(dst_on)
    assert all(bool((base == 0xA5).all()) for base in as_bytes(bases))


@pytest.mark.parametrize(
    ("src_blocks", "dst_blocks", "match"),
    [
        ([1, 2], [3, 4, 5], r"src_blocks and dst_blocks: 2 source blocks but 3 destination blocks"),
        ([1, 12], [3, 4], r"src_blocks\[1\]: block 12 is outside 0\.\.11, the blocks of src_caches"),
        ([1, 2], [3, 9], r"dst_blocks\[1\]: block 9 is outside 0\.\.8, the blocks of dst_caches"),
        ([1, 2], [-1, 4], r"dst_blocks\[0\]: -1 is negative"),
        ([1, 2, 5], [3, 6, 3], r"dst_blocks: block 3 appears twice"),
        ([1.0, 2.0], [3, 4], r"src_blocks: expected a sequence of integers"),
    ],
)
def test_block_ids_refused(impl: str, src_blocks: Any, dst_blocks: Any, match: str) -> None:
    check_refused(impl, make_spec("flash_attn"), match, src_blocks, dst_blocks)


@pytest.mark.parametrize(
    ("dst_spec", "match"),
    [
        (make_spec("flash_attn", head_dim=8), r"dst_caches\[0\]: shape \[2, 9, 2, 2, 8\] does not match"),
        (make_spec("flash_attn", "float16"), r"dst_caches\[0\]: dtype float16 does not match the spec's bf"),
        (make_spec("flash_attn", num_layers=2), r"dst_caches: expected a list of 3 layers"),
        (make_spec("flashinfer"), r"dst_caches\[0\]: shape \[9, 2, 2, 2, 4\] does not match the flash_attn"),
    ],
    ids=["head_dim", "dtype", "layers", "layout"],
)
def test_caches_unlike_the_spec_refused(impl: str, dst_spec: KVSpec, match: str) -> None:
    check_refused(impl, make_spec("flash_attn"), match, [1], [2], dst_spec=dst_spec)


@pytest.mark.parametrize("layout", UNSUPPORTED)
def test_layouts_whose_blocks_have_gaps_refused(impl: str, layout: str) -> None:
    """A plain source, a destination with gaps: refused, naming the destination."""
    match = rf"layout: {layout} with these strides is not supported by copy_blocks: dst_caches, layer 0"
    check_refused(impl, make_spec(layout), match, [1], [2], build={"strided": True})


def test_hf_refused(impl: str) -> None:
    spec = make_spec("hf")
    _, caches = build(spec, device_of(impl))
    with pytest.raises(ValueError, match=r"layout: hf is not supported by copy_blocks"):
        kvstore_kernels.copy_blocks(spec, caches, [0], caches, [1])


def test_other_refusals(impl: str) -> None:
    spec = make_spec("flash_attn")
    check_refused(
        impl, spec, r"layers: range\(0, 4\) is outside 0\.\.3 engine layers", [1], [2], layers=range(4)
    )

    def alias(caches: list[torch.Tensor]) -> list[torch.Tensor]:
        return [caches[0], caches[0], caches[2]]

    check_refused(impl, spec, r"dst_caches\[1\]: same memory as layer 0", [1], [2], dst=alias)
    _, caches = build(spec, device_of(impl), num_blocks=SRC_BLOCKS)
    with pytest.raises(ValueError, match=r"dst_blocks: block 2 is also among src_blocks, in the same cache"):
        kvstore_kernels.copy_blocks(spec, caches, [1, 2], caches, [2, 3])


@pytest.mark.parametrize(("setting", "expected"), [("torch", "torch"), ("triton", "triton"), ("", "torch")])
def test_backend_choice_on_the_cpu(monkeypatch: pytest.MonkeyPatch, setting: str, expected: str) -> None:
    """KVSTORE_KERNELS picks the path; CPU caches otherwise take the reference."""
    from kvstore_kernels import reference

    if CUDA and setting == "triton":
        pytest.skip("CPU tensors reach the kernel only through the interpreter (test_cuda_refusals)")
    monkeypatch.setenv("KVSTORE_KERNELS", setting)
    blocks = kernel_module()
    calls: list[str] = []
    monkeypatch.setattr(blocks, "_launch", lambda *args: calls.append("triton"))
    monkeypatch.setattr(reference, "copy_blocks", lambda *args: calls.append("torch"))
    spec = make_spec("flash_attn")
    _, caches = build(spec, "cpu", num_blocks=SRC_BLOCKS)
    kvstore_kernels.copy_blocks(spec, caches, [1], caches, [2])
    assert calls == [expected]


# -- CUDA ----------------------------------------------------------------------------------------


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = make_spec("flash_attn")
    check_refused("triton", spec, r"src_caches: on cpu, but dst_caches on cuda:0", [1], [2], src_on="cpu")
    ids = torch.tensor([1], device="cuda")
    check_refused("triton", spec, r"src_blocks: on cuda:0; pass the block ids on the host", ids, [2])
    monkeypatch.setenv("KVSTORE_KERNELS", "triton")
    match = r"KVSTORE_KERNELS=triton: the copy_blocks kernel needs the caches on CUDA"
    check_refused("torch", spec, match, [1], [2])  # CPU caches, the kernel compiled for the GPU


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("setting", ["", "torch"])
def test_cuda_caches(monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    """The kernel (the auto rule's choice for CUDA caches) and the reference, on one GPU."""
    monkeypatch.setenv("KVSTORE_KERNELS", setting)
    spec = make_spec("flash_attn", "bfloat16", num_layers=4, block_size=16, head_dim=128, sharing={3: 1})
    check_copy("triton", spec, [11, 3, 7, 0, 5], [0, 8, 2, 6, 1], src_on="cuda:0", dst_on="cuda:0")


@gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_the_copy_is_queued_on_the_current_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a side stream behind a long sleep: the default stream does not see the copy until the side
    stream has run it."""
    monkeypatch.delenv("KVSTORE_KERNELS", raising=False)
    spec = make_spec("vllm_rows")
    _, src = build(spec, "cuda", num_blocks=SRC_BLOCKS, seed=3)
    bases, dst = build(spec, "cuda", num_blocks=DST_BLOCKS, fill=0xA5)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(500_000_000)
        kvstore_kernels.copy_blocks(spec, src, [1, 2], dst, [3, 4])
    assert all(bool((base == 0xA5).all()) for base in as_bytes(bases))  # read on the default stream
    stream.synchronize()
    assert not all(bool((base == 0xA5).all()) for base in as_bytes(bases))


@gpu
@needs_peers
@pytest.mark.parametrize(("src_on", "dst_on"), [("cuda:1", "cuda:0"), ("cuda:0", "cuda:1")])
@pytest.mark.parametrize(
    ("layout", "dtype"),
    [
        ("vllm_rows", "bfloat16"),
        ("vllm", "float8_e4m3fn"),
        ("flash_attn", "float8_e5m2"),
        ("mla", "bfloat16"),
    ],
)
@pytest.mark.parametrize("setting", ["", "torch"])
def test_blocks_from_a_peer_gpu(
    monkeypatch: pytest.MonkeyPatch, setting: str, layout: str, dtype: str, src_on: str, dst_on: str
) -> None:
    """The destination's GPU reads the source's blocks over peer access (the reference: torch's
    copies between devices): the oracle's bytes."""
    monkeypatch.setenv("KVSTORE_KERNELS", setting)
    spec = make_spec(layout, dtype, num_layers=4, block_size=16, head_dim=128, sharing={3: 1})
    check_copy("triton", spec, [11, 3, 7, 0, 5], [0, 8, 2, 6, 1], src_on=src_on, dst_on=dst_on)


@gpu
@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_source_out_of_peer_reach_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore_kernels import peer

    monkeypatch.setattr(peer, "why_not", lambda device, other: "no NVLink or PCIe peer path")
    match = r"src_caches: on cuda:1, which the destination's cuda:0 cannot reach: no NVLink"
    check_refused("triton", make_spec("mla"), match, [1], [2], src_on="cuda:1", dst_on="cuda:0")
