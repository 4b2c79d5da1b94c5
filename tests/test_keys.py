"""Namespace digests and chained chunk keys: pinned to literal values so they never change silently."""

from __future__ import annotations

import copy
import re
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from kvstore.shared.keys import chunk_keys, pack_keys, unpack_keys
from kvstore.shared.spec import KVSpec, PageSpec

LLAMA_8B = PageSpec(
    model="llama-3.1-8b", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", chunk_tokens=256
)


def test_namespace_and_chain_are_pinned() -> None:
    ns = LLAMA_8B.namespace()
    assert ns.hex() == "579cf7f068c65e11c28a8ab1dd816ffe"
    keys = chunk_keys(ns, list(range(600)), 256, include_partial=True)
    assert [k.hex() for k in keys] == [
        "dfaedc3504e23b407dc19f83b7fbe357",
        "5c8f81f9d1793db943d1b1f751d24887",
        "459516ae3f6bbeaa891f6811a3df2cb3",  # the 88-token tail covers exactly its tokens
    ]


def test_a_tenant_keys_its_namespaces_and_no_tenant_keys_as_before() -> None:
    plain = LLAMA_8B.namespace()
    assert LLAMA_8B.namespace("") == plain  # a daemon without tenants: the namespaces it always had
    alpha, beta = LLAMA_8B.namespace("alpha"), LLAMA_8B.namespace("beta")
    assert len({plain, alpha, beta}) == 3
    assert alpha.hex() == xxhash.xxh3_128_hexdigest(LLAMA_8B.canonical_bytes() + b"tenant=5:alpha\n")
    # A salt that would forge the tenant's line is refused (no control character in names) ...
    forging = LLAMA_8B.salt + "\ntenant=5:alpha"
    with pytest.raises(ValueError, match=re.escape("salt: control character U+000A at index 0")):
        replace(LLAMA_8B, salt=forging)
    # ... and the tenant is length-prefixed anyway: no model id or salt can stand in for it.
    forged = copy.copy(LLAMA_8B)
    object.__setattr__(forged, "salt", forging)  # past the check
    assert forged.namespace() != alpha
    tokens = list(range(512))
    assert set(chunk_keys(alpha, tokens, 256)).isdisjoint(chunk_keys(beta, tokens, 256))


def test_chain_definition_matches_design() -> None:
    ns = LLAMA_8B.namespace()
    tokens = list(range(1000, 1512))
    first = xxhash.xxh3_128_digest(ns + np.array(tokens[:256], dtype="<i4").tobytes())
    second = xxhash.xxh3_128_digest(first + np.array(tokens[256:], dtype="<i4").tobytes())
    assert chunk_keys(ns, tokens, 256) == [first, second]


def test_only_full_chunks_by_default_and_prefix_property() -> None:
    ns = LLAMA_8B.namespace()
    assert len(chunk_keys(ns, list(range(511)), 256)) == 1
    long = chunk_keys(ns, list(range(1024)), 256)
    assert chunk_keys(ns, list(range(600)), 256) == long[:2]
    diverged = list(range(1024))
    diverged[300] = 7
    other = chunk_keys(ns, diverged, 256)
    assert other[0] == long[0] and other[1:] != long[1:] and other[2] != long[2]


def test_token_containers_agree() -> None:
    ns = LLAMA_8B.namespace()
    tokens = [5, 2**31 - 1, 0, 77] * 64
    expected = chunk_keys(ns, tokens, 256)
    assert chunk_keys(ns, tuple(tokens), 256) == expected
    assert chunk_keys(ns, np.array(tokens, dtype=np.int64), 256) == expected
    assert chunk_keys(ns, torch.tensor(tokens), 256) == expected


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([[1, 2]], "1-D"),
        ([1.5, 2.0], "integers"),
        ([2**31], "32-bit"),
    ],
)
def test_bad_tokens_are_rejected(tokens: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chunk_keys(LLAMA_8B.namespace(), tokens, 256)


def test_namespace_changes_with_every_page_field() -> None:
    base = LLAMA_8B
    variants = [
        replace(base, model="llama-3.1-70b"),
        replace(base, dtype="float16"),
        replace(base, num_kv_heads=4),
        replace(base, head_dim=64),
        replace(base, chunk_tokens=512),
        replace(base, tp_rank=1, tp_size=2),
        replace(base, salt="lora-7"),
        replace(base, kv_sharing=((31, 30),)),
    ]
    digests = {v.namespace() for v in variants} | {base.namespace()}
    assert len(digests) == len(variants) + 1
    assert replace(base, tp_rank=1, tp_size=2).namespace().hex() == "8729c145ca784790029f316902f3c7e3"


def test_engine_layout_does_not_change_the_namespace() -> None:
    flash = KVSpec("m", 4, 2, 8, torch.float16, chunk_tokens=32, layout="flash_attn", block_size=16)
    infer = replace(flash, layout="flashinfer", block_size=32)
    cross = replace(flash, layout="cross_layer", block_size=8)
    assert flash.page.namespace() == infer.page.namespace() == cross.page.namespace()


def test_page_geometry() -> None:
    assert LLAMA_8B.page_bytes == 32 * 2 * 256 * 8 * 128 * 2
    assert LLAMA_8B.layer_span(2, 5) == (2 * LLAMA_8B.layer_bytes, 3 * LLAMA_8B.layer_bytes)
    shared = replace(LLAMA_8B, kv_sharing=((1, 0), (3, 2)))
    assert shared.stored_layers[:3] == (0, 2, 4) and shared.num_stored_layers == 30
    mla = PageSpec(
        model="ds", num_layers=2, num_kv_heads=1, head_dim=576, dtype="bfloat16", chunk_tokens=64, latent=True
    )
    assert mla.page_bytes == 2 * 64 * 576 * 2


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model": ""}, "model"),
        ({"num_layers": 0}, "num_layers"),
        ({"dtype": "int8"}, "dtype"),
        ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
        ({"kv_sharing": ((40, 0),)}, "kv_sharing"),
        ({"kv_sharing": ((2, 1), (1, 0))}, "kv_sharing"),
        ({"latent": True}, "num_kv_heads"),
    ],
)
def test_bad_page_specs(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(LLAMA_8B, **fields)


def test_kv_spec_checks_chunk_against_block() -> None:
    with pytest.raises(ValueError, match="multiple of block_size"):
        KVSpec(
            model="m",
            num_layers=2,
            num_kv_heads=2,
            head_dim=8,
            dtype="float16",
            block_size=16,
            chunk_tokens=40,
        )
    with pytest.raises(ValueError, match="layout"):
        KVSpec(model="m", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", layout="paged")


def test_pack_and_unpack() -> None:
    keys = chunk_keys(LLAMA_8B.namespace(), list(range(768)), 256)
    assert list(unpack_keys(pack_keys(keys))) == keys
    with pytest.raises(ValueError, match="16-byte"):
        unpack_keys(b"x" * 33)
    with pytest.raises(ValueError, match=r"keys\[1\]"):
        pack_keys([b"a" * 16, b"b" * 15])


def test_the_wire_bounds_requests_by_the_keys_own_size() -> None:
    """kvstore.shared.wire states the key size itself (importing kvstore.shared.keys would load numpy into
    every kvctl call): it must be the keys' size, or the request bound is wrong."""
    from kvstore.shared import domain, keys, wire

    assert wire.KEY_BYTES == keys.KEY_BYTES == 16
    assert wire.MAX_REQUEST_BYTES == domain.MAX_KEYS_PER_REQUEST * keys.KEY_BYTES + (64 << 10)
