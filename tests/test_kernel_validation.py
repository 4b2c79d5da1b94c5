"""Page gather/scatter refuses bad input: every mismatch is a ValueError naming it, raised
before any byte moves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import kvstore_kernels
from tests.kernel_cases import (
    block_table,
    build,
    make_spec,
)

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
