"""A store: Reserve the chunks not stored yet, gather their pages (into the arena's slots, or
inline through Put), Commit once the gather is done (`StoreHandle.wait`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

import kvstore_kernels
from kvstore.errors import FailedPrecondition, KVStoreError, NotFound, Unavailable
from kvstore.keys import pack_keys
from kvstore.proto import kvstore_pb2 as pb
from kvstore_client.connection import is_outage
from kvstore_client.handles import StoreHandle
from kvstore_client.inline import put_pages
from kvstore_client.session import Session, ignore, log
from kvstore_client.transfers import Streams


class StorePath(Session):
    def store(
        self,
        token_ids: Any,
        kv_caches: Any,
        block_ids: Any,
        layers: range | None = None,
        *,
        keys: Sequence[bytes] | None = None,
        tail: bool = False,
    ) -> int:
        """Store the whole chunks of `token_ids` from the KV cache; returns how many were new."""
        return self.store_async(token_ids, kv_caches, block_ids, layers=layers, keys=keys, tail=tail).wait()

    def store_async(
        self,
        token_ids: Any,
        kv_caches: Any,
        block_ids: Any,
        *,
        stream: Any = None,
        layers: range | None = None,
        keys: Sequence[bytes] | None = None,
        tail: bool = False,
    ) -> StoreHandle:
        """Reserve the new chunks and enqueue their gather; `wait()` commits them.

        On CUDA the gather runs on `stream` (default: this client's side stream, which first
        waits for the caller's current stream), so the caller's stream is never blocked.
        With `tail`, the trailing partial chunk of `token_ids` is stored too, as a page of its
        own (keyed by exactly its tokens): the KV cache and block table must then reach to the
        end of that chunk (the positions past the prompt are stored but never served).
        """
        keys = self._keys_of(token_ids, keys, tail)
        reply = self._reserve(keys) if keys else None
        chunks = [i for i, offset in enumerate(reply.offsets) if offset >= 0] if reply else []
        if reply is None or not chunks:
            return StoreHandle(None, lambda: 0, ignore, 0)
        lease = pb.LeaseRequest(namespace=self.namespace, lease_id=reply.lease_id, epoch=self.epoch)
        self._renewer.hold(lease.lease_id, lease.namespace)
        try:
            event = self._gather(reply, chunks, kv_caches, block_ids, layers, stream)
        except (Unavailable, NotFound) as exc:  # an inline Put the daemon did not take
            if isinstance(exc, Unavailable):
                self._conn.lost(exc)
            else:  # the lease expired while the bytes were sent, or the daemon restarted
                log.warning("store lease %d: %s; nothing stored", lease.lease_id, exc)
            self._renewer.drop(lease.lease_id)
            return StoreHandle(None, lambda: 0, ignore, 0)
        except BaseException:
            Streams.settle(kv_caches)
            self._end_quietly("Abort", lease)
            raise
        handle = StoreHandle(
            event,
            functools.partial(self._commit, lease),
            lambda exc: self._end_quietly("Abort", lease),
            len(chunks),
            chunks,
        )
        self._renewer.owned_by(lease.lease_id, handle)  # a handle dropped unwaited: no more renewals
        return handle

    def _reserve(self, keys: Sequence[bytes]) -> Any:
        """The Reserve reply for `keys` (slots for the new ones), or None in an outage."""
        pid, start_time = self._writer

        def request() -> pb.ReserveRequest:
            # The epoch says the pages are written in place (and fenced if the lease expires).
            return pb.ReserveRequest(
                namespace=self.namespace,
                keys=pack_keys(keys),
                epoch=self.epoch,
                writer_pid=pid if self.epoch else 0,
                writer_start_time=start_time if self.epoch else 0,
            )

        try:
            return self._conn.call("Reserve", request)
        except Unavailable:
            return None

    def _gather(
        self, reply: Any, chunks: list[int], kv_caches: Any, block_ids: Any, layers: range | None, stream: Any
    ) -> torch.cuda.Event | None:
        """Writes the reserved chunks' pages: into the arena's slots (enqueued; its event), or
        inline through Put (done)."""
        if self.arena is not None:
            offsets = [reply.offsets[i] for i in chunks]
            options = self._mapped.transfer_options(offsets)  # None: their slabs are registered
            gather = (
                kvstore_kernels.gather
                if options is None
                else functools.partial(kvstore_kernels.gather, options=options)
            )
            return self._streams.enqueue(
                gather,
                self.spec,
                kv_caches,
                block_ids,
                chunks,
                self.arena,
                offsets,
                layers,
                stream,
            )
        staging = torch.empty(len(chunks) * self.page_bytes, dtype=torch.uint8)
        offsets = [i * self.page_bytes for i in range(len(chunks))]
        kvstore_kernels.gather(self.spec, kv_caches, block_ids, chunks, staging, offsets, layers)
        put_pages(
            self._conn.stub,
            self.namespace,
            reply.lease_id,
            staging,
            self.max_message_bytes,
            self.timeout_s,
            self._conn.metadata,
            is_outage,
        )
        return None

    def _commit(self, lease: pb.LeaseRequest) -> int:
        """Commits a store lease whose pages are written; 0 where nothing could be stored (the
        daemon restarted, stopped, or the lease expired), with a warning."""
        self._renewer.drop(lease.lease_id)
        if lease.epoch != self.epoch:
            log.debug(
                "store lease %d: the daemon restarted before its Commit; nothing stored", lease.lease_id
            )
            return 0
        try:
            committed: int = self._conn.rpc("Commit", lease).committed
        except KVStoreError as exc:
            if is_outage(exc):
                self._conn.lost(exc)
            elif isinstance(exc, NotFound | FailedPrecondition):
                log.warning("store lease %d: %s; nothing stored", lease.lease_id, exc)
            else:
                raise
            return 0
        return committed
