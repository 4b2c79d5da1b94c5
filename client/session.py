"""What a connected client's store and load paths share (`stores`, `loads`): its parts and a few
checks. `KVStoreClient` (`client`) makes and owns the parts; this class only names them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from kvstore.errors import KVStoreError
from kvstore.keys import chunk_keys
from kvstore.proto import kvstore_pb2 as pb
from kvstore.spec import KVSpec
from kvstore_client.arena import MappedArena
from kvstore_client.connection import Connection, is_outage
from kvstore_client.gpu_pools import GpuPools
from kvstore_client.renewal import LeaseRenewer
from kvstore_client.transfers import Streams

log = logging.getLogger("kvstore_client.client")


def ignore(exc: BaseException) -> None:
    pass


class Session:
    spec: KVSpec
    namespace: bytes
    page_bytes: int
    max_message_bytes: int
    lease_ttl_s: float
    timeout_s: float
    layerwise_options: Any
    layerwise_runs: int
    _conn: Connection
    _mapped: MappedArena
    _streams: Streams
    _renewer: LeaseRenewer
    _gpu_pools: GpuPools
    _writer: tuple[int, int]

    @property
    def arena(self) -> torch.Tensor | None:
        """The daemon's arena mapped here, as uint8 (None: page bytes go inline)."""
        return self._mapped.tensor

    @property
    def epoch(self) -> int:
        """The mapped arena's epoch (0: none mapped)."""
        return self._mapped.epoch

    def keys(self, token_ids: Any, *, tail: bool = False) -> list[bytes]:
        """Keys of the whole chunks of `token_ids`; with `tail`, then of the trailing partial
        chunk, keyed by exactly its tokens (it matches only the same tail after the same prefix)."""
        return chunk_keys(self.namespace, token_ids, self.spec.page.chunk_tokens, include_partial=tail)

    def _keys_of(self, token_ids: Any, keys: Sequence[bytes] | None, tail: bool = False) -> Sequence[bytes]:
        """The chunks' keys: `keys` (the caller's, the first ones when it has more; all of them
        where `token_ids` is None: the keys alone name the chunks), or hashed. With `tail`, a
        trailing partial chunk of `token_ids` counts as a chunk."""
        if keys is None:
            if token_ids is None:
                raise ValueError("token_ids: None needs keys, one per chunk")
            return self.keys(token_ids, tail=tail)
        if token_ids is None:
            return keys
        chunk_tokens = self.spec.page.chunk_tokens
        chunks = len(token_ids) // chunk_tokens
        kind = "whole chunks"
        if tail and len(token_ids) % chunk_tokens:
            chunks, kind = chunks + 1, "chunks (the tail's included)"
        if len(keys) < chunks:
            raise ValueError(f"keys: {len(keys)} keys for {chunks} {kind} of token_ids")
        return keys[:chunks]

    def _covered(self, token_ids: Any, chunks: int) -> int:
        """Tokens of `token_ids` that its first `chunks` chunks hold (a tail holds fewer than a
        chunk); without `token_ids`, whole chunks."""
        tokens = chunks * self.spec.page.chunk_tokens
        return tokens if token_ids is None else min(tokens, len(token_ids))

    def _layer_range(self, layers: range | None) -> range:
        if layers is None:
            return range(self.spec.num_layers)
        if not isinstance(layers, range) or layers.step != 1:
            raise ValueError(f"layers: expected a range with step 1, got {layers!r}")
        if not 0 <= layers.start <= layers.stop <= self.spec.num_layers:
            raise ValueError(f"layers: {layers!r} is outside 0..{self.spec.num_layers} engine layers")
        return layers

    def _end_quietly(self, method: str, lease: pb.LeaseRequest) -> bool:
        """Ends a lease (Abort or Release); whether the daemon did. A failure is logged only: the
        lease expires on its own, and the caller's own error matters more."""
        self._renewer.drop(lease.lease_id)
        if lease.epoch != self.epoch:
            return False  # the daemon that held it is gone
        try:
            self._conn.rpc(method, lease)
            return True
        except Exception as exc:
            quiet = isinstance(exc, KVStoreError) and is_outage(exc)
            log.log(
                logging.DEBUG if quiet else logging.WARNING,
                "%s of lease %d failed: %s",
                method,
                lease.lease_id,
                exc,
            )
            return False
