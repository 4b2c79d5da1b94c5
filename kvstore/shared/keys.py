"""Chained chunk keys: the one definition shared by the daemon and every client.

`k_i = xxh3_128(k_{i-1} || tokens_i as little-endian int32)`, `k_{-1}` = namespace.
Keys are 16 bytes, identical in every process and rank, and a key identifies its
whole prefix. Only full chunks get keys unless `include_partial` asks for the
trailing partial chunk, whose key covers exactly its tokens.

An engine that names pages itself (SGLang's HiCache: a chained SHA-256 of each page's
prefix) gets keys derived from its names inside the namespace, `xxh3_128(namespace || scheme
|| name)` (`foreign_keys`): they name a whole prefix too, but they are not the keys computed
from token ids, so the two never match each other.

A chunk whose KV depends on more than its tokens (an engine's LoRA adapter, the images
behind its placeholder tokens, a per-tenant cache salt) carries extra bytes, hashed after
its tokens: `k_i = xxh3_128(k_{i-1} || tokens_i || extra_i)`. A chunk without them keys as
above, so an engine that knows only token ids shares those chunks; one with them can never
match one without (the hashed input is longer) nor one with other extras.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

KEY_BYTES = 16
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def token_array(token_ids: Any) -> np.ndarray:
    """Token ids (list, tuple, numpy or 1-D torch tensor) as little-endian int32."""
    if hasattr(token_ids, "detach"):  # torch tensor, without importing torch
        token_ids = token_ids.detach().cpu().numpy()
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids: expected a 1-D sequence of ints, got shape {tokens.shape}")
    if tokens.size and tokens.dtype.kind not in "iu":
        raise ValueError(f"token_ids: expected integers, got dtype {tokens.dtype}")
    if tokens.size and (int(tokens.min()) < _INT32_MIN or int(tokens.max()) > _INT32_MAX):
        raise ValueError("token_ids: every id must fit in a signed 32-bit integer")
    return tokens.astype("<i4", copy=False)


def chunk_keys(
    namespace: bytes, token_ids: Any, chunk_tokens: int, include_partial: bool = False
) -> list[bytes]:
    """Keys of the chunks of `token_ids`, in order."""
    if len(namespace) != KEY_BYTES:
        raise ValueError(f"namespace: expected {KEY_BYTES} bytes, got {len(namespace)}")
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens: expected a positive integer, got {chunk_tokens}")
    data = _token_bytes(token_ids)
    if include_partial and len(data) % (chunk_tokens * 4):
        whole = len(data) - len(data) % (chunk_tokens * 4)
        keys = chain_keys(namespace, data[:whole], chunk_tokens)
        return [*keys, xxhash.xxh3_128_digest((keys[-1] if keys else namespace) + data[whole:])]
    return chain_keys(namespace, data, chunk_tokens)


def chain_keys(
    prev: bytes,
    packed: bytes | bytearray | memoryview,
    chunk_tokens: int,
    extras: Sequence[bytes] | None = None,
) -> list[bytes]:
    """Keys of the whole chunks of `packed` (token ids already as int32 LE bytes), the chain
    continued from `prev`: the namespace, or the key of the chunk before `packed`'s first.
    `extras`, one per whole chunk, are hashed after their chunk's tokens (see above)."""
    step = chunk_tokens * 4
    starts = range(0, len(packed) - len(packed) % step, step)
    if extras is not None and len(extras) != len(starts):
        raise ValueError(f"extras: expected one per whole chunk ({len(starts)}), got {len(extras)}")
    keys: list[bytes] = []
    for index, start in enumerate(starts):
        data = prev + packed[start : start + step]
        prev = xxhash.xxh3_128_digest(data + extras[index] if extras is not None else data)
        keys.append(prev)
    return keys


def foreign_keys(namespace: bytes, names: Sequence[str], scheme: bytes) -> list[bytes]:
    """Keys of pages an engine names itself (`names`, e.g. SGLang's hex page hashes) in
    `namespace`; `scheme` (a fixed tag per engine) keeps two engines' names apart."""
    if len(namespace) != KEY_BYTES:
        raise ValueError(f"namespace: expected {KEY_BYTES} bytes, got {len(namespace)}")
    prefix = namespace + scheme
    return [xxhash.xxh3_128_digest(prefix + name.encode()) for name in names]


def _token_bytes(token_ids: Any) -> bytes:
    """`token_array(token_ids).tobytes()`; a list of ints is packed without numpy, which looks at
    each int's type first (bench/NOTES-gpu-tier.md). A list it cannot pack (floats, ids out of
    int32, a leading bool) goes through `token_array`, which accepts or refuses it as always."""
    if isinstance(token_ids, list) and token_ids and type(token_ids[0]) is not bool:
        try:
            return _int32_struct(len(token_ids)).pack(*token_ids)
        except struct.error:
            pass
    return token_array(token_ids).tobytes()


@functools.lru_cache(maxsize=64)
def _int32_struct(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}i")


def pack_keys(keys: Sequence[bytes]) -> bytes:
    """Keys concatenated, as the wire carries them."""
    for i, key in enumerate(keys):
        if len(key) != KEY_BYTES:
            raise ValueError(f"keys[{i}]: expected {KEY_BYTES} bytes, got {len(key)}")
    return b"".join(keys)


@functools.lru_cache(maxsize=256)
def _key_struct(count: int) -> struct.Struct:
    return struct.Struct(f"{KEY_BYTES}s" * count)


def unpack_keys(packed: bytes) -> Sequence[bytes]:
    """Split a concatenation of 16-byte keys; a length that is not a multiple is an error."""
    count, left = divmod(len(packed), KEY_BYTES)
    if left:
        raise ValueError(
            f"keys: expected a concatenation of {KEY_BYTES}-byte keys, got {len(packed)} bytes "
            f"({left} bytes left over)"
        )
    return _key_struct(count).unpack(packed)  # one C call, not a Python slice per key
