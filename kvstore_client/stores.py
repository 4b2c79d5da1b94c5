"""A store: Reserve the chunks not stored yet, gather their pages (into the arena's slots, or
inline through Put), Commit once the gather is done (`StoreHandle.wait`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

import kvstore_kernels
from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.errors import FailedPrecondition, KVStoreError, NotFound, Unavailable
from kvstore.shared.keys import pack_keys
from kvstore_client.connection import is_outage
from kvstore_client.handles import StoreHandle
from kvstore_client.inline import put_pages
from kvstore_client.routes import arena_route, store_route, with_options
from kvstore_client.session import Session, ignore, log
from kvstore_client.transfers import Streams, cache_device

# A store committed in parts (`_early_parts`): parts of ~1.2 ms of copy at ~50 GB/s, and a last part
# of ~0.5 ms, about what the daemon needs to commit the part before it and answer; at most
# `EARLY_COMMIT_MAX_PARTS` before the last. The prepared gather moves every part in one transfer,
# marked at each part's end (`_gather_in_parts`); the other paths move each part in turn, and the
# copy engines idle between two (1 GiB in 16 parts: 0.94 of memcpy on an H200, in 4: 0.97).
EARLY_COMMIT_PART_BYTES = 64 << 20
EARLY_COMMIT_TAIL_BYTES = 24 << 20
EARLY_COMMIT_MAX_PARTS = 3


class StorePath:
    """A client's stores (`KVStoreClient.store`, `store_async`): Reserve, gather, Commit."""

    def __init__(self, session: Session) -> None:
        self._s = session  # the client: its namespace, spec and link

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
        """`KVStoreClient.store_async`."""
        keys = self._s._keys_of(token_ids, keys, tail)
        ahead = _GatherAhead(kv_caches, block_ids, layers, stream)
        pool = (
            self._s._gpu_pools.on(cache_device(kv_caches))
            if self._s.store_to_gpu and self._s.arena is not None
            else None
        )
        meanwhile = ahead.meanwhile(self._s, len(keys)) if pool is None else None  # an arena gather's setup
        reply = self._reserve(keys, meanwhile, pool[1] if pool else "") if keys else None
        chunks = [i for i, offset in enumerate(reply.offsets) if offset >= 0] if reply else []
        if reply is None or not chunks:
            return StoreHandle(None, lambda: 0, ignore, 0)
        return self._write(reply, chunks, pool[0] if pool else None, kv_caches, block_ids, layers, ahead)

    def _write(
        self,
        reply: Any,
        chunks: list[int],
        pool_id: int | None,
        kv_caches: Any,
        block_ids: Any,
        layers: range | None,
        ahead: _GatherAhead,
    ) -> StoreHandle:
        """Holds the Reserve's lease and writes its new `chunks` (into the GPU pool `pool_id`
        asked for, or the arena); the handle commits them, or aborts where the write failed."""
        lease = pb.LeaseRequest(namespace=self._s.namespace, lease_id=reply.lease_id, epoch=self._s.epoch)
        if reply.in_gpu_pool and reply.gpu_pool != pool_id:
            # Not the pool asked for: the daemon's pools changed since this client opened them.
            log.warning(
                "store lease %d: its pages are in a GPU pool this client has not opened", lease.lease_id
            )
            self._s._end_quietly("Abort", lease)
            return StoreHandle(None, lambda: 0, ignore, 0)
        self._s._renewer.hold(lease.lease_id, lease.namespace)
        try:
            event, early = self._gather(reply, chunks, kv_caches, block_ids, layers, ahead)
        except (Unavailable, NotFound) as exc:  # an inline Put the daemon did not take
            if isinstance(exc, Unavailable):
                self._s._conn.lost(exc)
            else:  # the lease expired while the bytes were sent, or the daemon restarted
                log.warning("store lease %d: %s; nothing stored", lease.lease_id, exc)
            self._s._renewer.drop(lease.lease_id)
            return StoreHandle(None, lambda: 0, ignore, 0)
        except BaseException:
            Streams.settle(kv_caches)
            self._s._end_quietly("Abort", lease)
            raise
        handle = StoreHandle(
            event,
            functools.partial(self._commit, lease, early),
            lambda exc: self._s._end_quietly("Abort", lease),
            len(chunks),
            chunks,
            early=functools.partial(self._commit_early, lease, early) if early else None,
            progress=functools.partial(self._commit_early, lease, early, False) if early else None,
        )
        self._s._renewer.owned_by(lease.lease_id, handle)  # a handle dropped unwaited: no more renewals
        return handle

    def _reserve(
        self, keys: Sequence[bytes], meanwhile: Callable[[], Any] | None = None, gpu_bus_id: str = ""
    ) -> Any:
        """The Reserve reply for `keys` (slots for the new ones, in the GPU pool on `gpu_bus_id`
        where the daemon has room there), or None in an outage; `meanwhile()` runs while the
        daemon answers."""
        pid, start_time = self._s._writer

        def request() -> pb.ReserveRequest:
            # The epoch says the pages are written in place (and fenced if the lease expires).
            return pb.ReserveRequest(
                namespace=self._s.namespace,
                keys=pack_keys(keys),
                epoch=self._s.epoch,
                writer_pid=pid if self._s.epoch else 0,
                writer_start_time=start_time if self._s.epoch else 0,
                gpu_bus_id=gpu_bus_id,
            )

        try:
            return self._s._conn.call("Reserve", request, meanwhile)
        except Unavailable:
            return None

    def _gather(
        self,
        reply: Any,
        chunks: list[int],
        kv_caches: Any,
        block_ids: Any,
        layers: range | None,
        ahead: _GatherAhead,
    ) -> tuple[Any, _EarlyCommits | None]:
        """Writes the reserved chunks' pages: into the GPU pool or the arena's slots (enqueued:
        what to wait for after them, and where the first pages are committed early, the event
        after those), or inline through Put (done: None)."""
        offsets = [reply.offsets[i] for i in chunks]
        device = cache_device(kv_caches)
        mapped = self._s._mapped if self._s.arena is not None else None
        on_cuda = device.type == "cuda"
        route = store_route(
            reply.in_gpu_pool, mapped, offsets, self._s.page_bytes, on_cuda, layers is None, device.index
        )
        if route.way == "pool":  # device to device, into the pool: one Commit once written
            pool, gather = self._s._gpu_pools.tensors[reply.gpu_pool], kvstore_kernels.gather
            return self._s._streams.enqueue(
                gather, self._s.spec, kv_caches, block_ids, chunks, pool, offsets, layers, ahead.stream
            ), None
        if route.way == "inline" or self._s.arena is None:
            self._put_inline(reply, chunks, kv_caches, block_ids, layers)
            return None, None
        if route.way == "bounce":  # slabs not registered yet: through the pinned ring, no wait
            stream = ahead.stream
            if device.type == "cuda" and stream is None:
                stream = self._s._streams.ordered_side(device)
            completion = route.ring.gather(
                kvstore_kernels.gather,
                self._s.spec,
                kv_caches,
                block_ids,
                chunks,
                self._s.arena,
                offsets,
                stream if device.type == "cuda" else None,
                self._s.page_bytes,
            )
            if completion is not None:
                return completion, None
            # The ring closed meanwhile: every slab registered.
            route = arena_route(self._s._mapped, offsets, on_cuda, device.index)
        return self._gather_to_arena(
            self._s.arena, route.options, chunks, offsets, kv_caches, block_ids, layers, ahead
        )

    def _gather_to_arena(
        self,
        arena: torch.Tensor,
        options: kvstore_kernels.TransferOptions | None,
        chunks: list[int],
        offsets: list[int],
        kv_caches: Any,
        block_ids: Any,
        layers: range | None,
        ahead: _GatherAhead,
    ) -> tuple[torch.cuda.Event | None, _EarlyCommits | None]:
        """Enqueues the gather into the arena's slots at `offsets` with `options` (None: their
        slabs are registered): the setup prepared during the Reserve where it applies (in parts
        committed early where the daemon takes them)."""
        enqueue = functools.partial(self._s._streams.enqueue, with_options(kvstore_kernels.gather, options))
        prepared = ahead.prepared_in(arena) if options is None else None
        if prepared is not None:  # the store's chunk i is its prepared page i
            enqueue = functools.partial(self._s._streams.enqueue, prepared.transfer)
            parts = self._early_parts(len(chunks))
            if parts:  # one transfer, each part's pages committed once they are written
                return self._gather_in_parts(prepared, parts, chunks, offsets, kv_caches, ahead)
        return enqueue(self._s.spec, kv_caches, block_ids, chunks, arena, offsets, layers, ahead.stream), None

    def _gather_in_parts(
        self,
        prepared: kvstore_kernels.Prepared,
        parts: list[int],
        chunks: list[int],
        offsets: list[int],
        kv_caches: Any,
        ahead: _GatherAhead,
    ) -> tuple[Any, _EarlyCommits]:
        """Enqueues the prepared gather of `chunks` as one transfer marked at the ends of the
        `parts` before the last: the event after it all, and each part's mark and pages."""
        marks: list[Any] = []

        def marked(spec: Any, caches: Any, blocks: Any, *args: Any, **kwargs: Any) -> None:
            marks.extend(prepared.run(chunks, offsets, parts))

        streams = self._s._streams
        event = streams.enqueue(
            marked, self._s.spec, kv_caches, None, chunks, prepared.plan.buffer, offsets, None, ahead.stream
        )
        early = _EarlyCommits()
        early.parts = [
            (mark, stop - start) for mark, start, stop in zip(marks, [0, *parts[:-1]], parts, strict=True)
        ]
        return event, early

    def _put_inline(
        self, reply: Any, chunks: list[int], kv_caches: Any, block_ids: Any, layers: range | None
    ) -> None:
        """Gathers the pages into a staging buffer and sends them through Put (no mapped arena)."""
        staging = torch.empty(len(chunks) * self._s.page_bytes, dtype=torch.uint8)
        offsets = [i * self._s.page_bytes for i in range(len(chunks))]
        kvstore_kernels.gather(self._s.spec, kv_caches, block_ids, chunks, staging, offsets, layers)
        put_pages(
            self._s._conn.stub,
            self._s.namespace,
            reply.lease_id,
            staging,
            self._s.max_message_bytes,
            self._s.timeout_s,
            self._s._conn.metadata,
            is_outage,
        )

    def _early_parts(self, pages: int) -> list[int]:
        """Where to cut a store's `pages` into parts committed as each is written: the ends of the
        parts before the last (none: one Commit at the end).

        A Commit after the copy is on the store's critical path, and it costs the daemon work per
        page and, when the daemon slept through the copy, its wake-up. Where the daemon commits
        leases in parts and the local channel is open, the pages are committed in parts of
        `EARLY_COMMIT_PART_BYTES` as soon as each is written, while later ones still cross PCIe,
        so the daemon does that work in the copy's shadow and stays awake; the last part, at
        least `EARLY_COMMIT_TAIL_BYTES` (and a page), is what the final Commit carries
        (bench/NOTES-transfer.md). Where that would make more than `EARLY_COMMIT_MAX_PARTS` parts
        before the last, the pages before a last part of the tail's size are cut into that many
        parts of (nearly) equal size instead (bench/NOTES-host-gpus.md)."""
        if not self._s.commits_in_parts or self._s._conn.local is None or pages < 2:
            return []
        tail = max(1, -(-EARLY_COMMIT_TAIL_BYTES // self._s.page_bytes))
        part = max(1, EARLY_COMMIT_PART_BYTES // self._s.page_bytes)
        if pages <= tail:
            return []
        head = pages - tail
        cuts = list(range(part, head + 1, part))
        parts = EARLY_COMMIT_MAX_PARTS
        return cuts if len(cuts) <= parts else [head * i // parts for i in range(1, parts + 1)]

    def _commit_early(self, lease: pb.LeaseRequest, early: _EarlyCommits, wait: bool = True) -> None:
        """Each part but the last not committed yet, once its pages are written (`wait`: waited
        for; else only those written already, in order: `StoreHandle.progress`): its Commit, sent
        without waiting (the replies are read with the next call's). Nothing here fails the store:
        where one cannot go, none after it does, and the final Commit takes the rest."""
        try:
            while early.next < len(early.parts):
                event, pages = early.parts[early.next]
                if event is not None:  # None: written already (a CPU cache)
                    if wait:
                        event.synchronize()
                    elif not event.query():
                        return
                local = self._s._conn.local
                if local is None or lease.epoch != self._s.epoch:
                    early.next = len(early.parts)
                    return
                request = pb.LeaseRequest(
                    namespace=lease.namespace, lease_id=lease.lease_id, epoch=lease.epoch, commit_count=pages
                )
                local.send("Commit", request)
                early.sent += pages
                early.next += 1
        except Exception:
            early.next = len(early.parts)
            log.debug("store lease %d: an early Commit failed", lease.lease_id, exc_info=True)

    def _commit(self, lease: pb.LeaseRequest, early: _EarlyCommits | None = None) -> int:
        """Commits a store lease whose pages are written (the rest of it, after an early Commit of
        its first pages); 0 where nothing could be stored (the daemon restarted, stopped, or the
        lease expired), with a warning."""
        self._s._renewer.drop(lease.lease_id)
        if lease.epoch != self._s.epoch:
            log.debug(
                "store lease %d: the daemon restarted before its Commit; nothing stored", lease.lease_id
            )
            return 0
        try:
            committed: int = self._s._conn.rpc("Commit", lease).committed
            if early is not None:
                committed += early.sent  # the lease still held them: the early Commits took them
        except KVStoreError as exc:
            if is_outage(exc):
                self._s._conn.lost(exc)
            elif isinstance(exc, NotFound | FailedPrecondition):
                log.warning("store lease %d: %s; nothing stored", lease.lease_id, exc)
            else:
                raise
            return 0
        return committed


class _GatherAhead:
    """A store's gather, checked and set up while its Reserve is in flight (`meanwhile`), for every
    chunk it asks about: after the reply only the new chunks' slots are checked and their pages
    issued (`run`). Nothing here may fail the store: where it cannot be prepared, the gather
    after the reply checks and sets up everything, as without it."""

    def __init__(self, kv_caches: Any, block_ids: Any, layers: range | None, stream: Any) -> None:
        self.kv_caches, self.block_ids, self.layers, self.stream = kv_caches, block_ids, layers, stream
        self.prepared: kvstore_kernels.Prepared | None = None

    def meanwhile(self, session: Session, chunks: int) -> Callable[[], None] | None:
        if session.arena is None:
            return None
        return functools.partial(self._prepare, session, chunks)

    def _prepare(self, session: Session, chunks: int) -> None:
        try:
            device, arena = cache_device(self.kv_caches), session.arena
            if arena is None:  # the daemon restarted meanwhile and nothing is mapped yet
                return
            if self.stream is None and device.type == "cuda":
                self.stream = session._streams.ordered_side(device)
            self.prepared = kvstore_kernels.prepare(
                session.spec,
                self.kv_caches,
                self.block_ids,
                range(chunks),
                arena,
                self.layers,
                to_page=True,
                stream=self.stream,
            )
        except Exception:
            self.prepared = None
            log.debug("preparing the gather ahead failed; it is checked after the reply", exc_info=True)

    def prepared_in(self, arena: Any) -> kvstore_kernels.Prepared | None:
        """The gather prepared into this arena (None: none, or one into the mapping of a daemon
        that restarted while the Reserve was answered)."""
        prepared = self.prepared
        return prepared if prepared is not None and prepared.plan.buffer is arena else None


class _EarlyCommits:
    """A store's gather issued in parts: `parts`, the event after each part but the last and its
    pages; `sent`, the pages whose early Commits went out; `next`, the first part whose Commit
    has not."""

    def __init__(self) -> None:
        self.parts: list[tuple[Any, int]] = []
        self.sent = 0
        self.next = 0
