"""What the connector's scheduler side keeps of each request's prompt: its chunk keys per
namespace, made once and only as far as a lookup or a save needs them, and the memo that finds
the keys of a prefix seen before by vLLM's own block hashes.

- `chunk_extras(request, chunks, chunk_tokens)`: what a request's chunks depend on beside their
  tokens (LoRA, media, cache salt, prompt embeddings), as extra key bytes.
- `PromptKeys`: one request's prompt, packed tokens and keys per namespace.
- `KeyMemo`: chunk keys of one namespace by vLLM's block hash of the chunk's last block.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from kvstore.shared.keys import chain_keys

MEMO_CHUNKS = 1 << 16  # chunk keys remembered per TP rank by vLLM's block hash (~10 MiB)


def chunk_extras(request: Any, chunks: int, chunk_tokens: int) -> list[bytes] | None:
    """What chunks `[0, chunks)` of `request` depend on beside their tokens, as extra key bytes
    (`kvstore.shared.keys`): vLLM's own per-block identity (its LoRA adapter's name and path, the
    images or other media behind the chunk's placeholder tokens with their offsets, the
    request's cache salt on the first chunk, the prompt embeddings a mixed prompt puts in place
    of some tokens), taken over the chunk's tokens. None for a request of token ids alone: its
    chunks key by their tokens, shared with any engine."""
    if not (
        request.lora_request
        or request.mm_features
        or request.cache_salt
        or getattr(request, "prompt_embeds", None) is not None
    ):
        return None
    extras = []
    for index in range(chunks):
        keys, _ = generate_block_hash_extra_keys(request, index * chunk_tokens, (index + 1) * chunk_tokens, 0)
        extras.append(repr(keys).encode() if keys else b"")
    return extras


class PromptKeys:
    """What the scheduler side keeps of one request. Its chunk keys come first from the memo of
    keys already made for a vLLM block hash (`SchedulerSide._memo`: a prompt that shares a
    prefix with an earlier one shares its keys, found with one dict lookup per chunk); the
    rest are hashed from the prompt, packed (int32 LE) only as far as a lookup or a save
    needs: packing is most of that cost (bench/NOTES-vllm.md)."""

    __slots__ = (
        "request",
        "hashes",
        "prompt",
        "packed",
        "packed_from",
        "num_prompt",
        "keys",
        "_extras",
        "local",
        "block_ids",
        "saved",
        "saving",
        "loading",
        "limit",
        "answer",
    )

    def __init__(self, request: Any, prompt: list[int], hashes: Sequence[bytes]) -> None:
        self.request = request
        self.hashes = hashes  # vLLM's block hashes of the request, or () where they cannot be used
        self.prompt = prompt
        self.packed = bytearray()  # tokens [packed_from, ...), packed
        self.packed_from = 0
        self.num_prompt = len(prompt)
        self.keys: dict[bytes, list[bytes]] = {}  # per namespace (TP rank): its first chunks' keys
        self._extras: list[bytes] | None | bool = False  # not yet made
        self.local = 0  # tokens vLLM had computed when the lookup was made
        self.block_ids: list[list[int]] = []  # per KV-cache group
        self.saved = 0  # leading chunks saved
        self.saving = False  # some save was handed to the workers
        self.loading = (-1, 0)  # chunks [first, stop) being loaded (stored: no need to save them)
        self.limit = len(prompt)  # tokens a lookup may offer: a failed load cuts it
        self.answer: tuple[int, int, int] | None = None  # (computed tokens, answer, step) of the last lookup

    def window(self, start: int, stop: int) -> bytes | bytearray:
        """The prompt's tokens `[start, stop)`, packed. Packed tokens are kept from where the first
        window began, so that another rank's keys over the same tokens pack nothing again."""
        if not self.packed:
            self.packed_from = start
        begin, end = self.packed_from, self.packed_from + len(self.packed) // 4
        if start < begin:  # before what is kept (a rank whose memo holds less): packed apart
            return struct.pack(f"<{stop - start}i", *self.prompt[start:stop])
        if end < stop:
            self.packed += struct.pack(f"<{stop - end}i", *self.prompt[end:stop])
        return self.packed

    def extras(self, chunk_tokens: int) -> list[bytes] | None:
        """`chunk_extras` of the prompt's whole chunks (made once)."""
        if self._extras is False:
            self._extras = chunk_extras(self.request, self.num_prompt // chunk_tokens, chunk_tokens)
        return self._extras  # type: ignore[return-value]

    def known(self, client: Any, stop: int, memo: KeyMemo) -> int:
        """How many leading chunks' keys under `client`'s namespace are made or in the memo (up to
        `stop`), taken from it."""
        keys = self.keys.setdefault(client.namespace, [])
        if len(keys) < stop:
            memo.extend(keys, self.hashes, stop)
        return len(keys)

    def chunk_keys(self, client: Any, stop: int, memo: KeyMemo) -> list[bytes]:
        """The keys of chunks `[0, stop)` under `client`'s namespace (made once, extended as needed)."""
        keys = self.keys.setdefault(client.namespace, [])
        if self.known(client, stop, memo) < stop:
            chunk, have = client.spec.page.chunk_tokens, len(keys)
            packed = self.window(have * chunk, stop * chunk)
            offset = (have * chunk - self.packed_from) * 4 if packed is self.packed else 0
            extras = self.extras(chunk)
            with memoryview(packed) as view, view[offset : offset + (stop - have) * chunk * 4] as new:
                prev = keys[-1] if keys else client.namespace
                keys += chain_keys(prev, new, chunk, extras[have:stop] if extras is not None else None)
            memo.add(keys, self.hashes, have)
        return keys[:stop]


class KeyMemo:
    """Chunk keys of one namespace by vLLM's block hash of the chunk's last block. vLLM hashes
    every request's blocks (chained, with the same extras as `chunk_extras`) before the
    scheduler sees it; equal hashes mean an equal prefix, so its chunk keys are equal too. At
    most `capacity` entries, the oldest dropped first."""

    def __init__(self, hashes_per_chunk: int, capacity: int = MEMO_CHUNKS) -> None:
        self.per_chunk = hashes_per_chunk
        self.capacity = capacity
        self.keys: dict[bytes, bytes] = {}

    def extend(self, keys: list[bytes], block_hashes: Sequence[bytes], stop: int) -> None:
        """Appends the memo's keys for chunks `len(keys)..` up to `stop` or the first it lacks."""
        per_chunk, memo = self.per_chunk, self.keys
        if not per_chunk:
            return
        end = min(stop * per_chunk, len(block_hashes))
        for index in range((len(keys) + 1) * per_chunk - 1, end, per_chunk):
            key = memo.get(block_hashes[index])
            if key is None:
                return
            keys.append(key)

    def add(self, keys: list[bytes], block_hashes: Sequence[bytes], first: int) -> None:
        """Remembers chunks `[first, len(keys))`' keys by their last block's hash."""
        per_chunk, memo = self.per_chunk, self.keys
        if not per_chunk:
            return
        for chunk in range(first, min(len(keys), len(block_hashes) // per_chunk)):
            memo[block_hashes[(chunk + 1) * per_chunk - 1]] = keys[chunk]
        while len(memo) > self.capacity:
            del memo[next(iter(memo))]
