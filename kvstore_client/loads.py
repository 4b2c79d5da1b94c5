"""A load: a leased Lookup (answering the Acquire on the daemon's host) while the block table is
readied, the scatter of the pages (from the arena and the GPU pools, or inline through Get),
and the Release once the copy is done (`LoadHandle.wait`)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import kvstore_client.lent_tickets as lent_tickets
import kvstore_kernels
from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.channel import LocalChannel
from kvstore.shared.errors import KVStoreError, NotFound, Unavailable
from kvstore.shared.keys import pack_keys
from kvstore_client.connection import is_outage
from kvstore_client.handles import LoadHandle
from kvstore_client.inline import get_pages
from kvstore_client.routes import arena_scatter
from kvstore_client.session import Session, ignore, log
from kvstore_client.transfers import Streams, cache_device, layer_groups


@dataclass
class _LoadTargets:
    """Where a load's pages go: the block table and the stream, readied while its Lookup is in
    flight (`ready`) and taken as they are after it."""

    block_ids: Any
    stream: Any
    layerwise: bool = False  # moved in runs of layers: no scatter of every layer is prepared
    prepared: kvstore_kernels.Prepared | None = None  # the arena's scatter of every chunk, set up
    readied: bool = False

    def ready(self, client: Session, kv_caches: Any, chunks: int, layers: range) -> None:
        """Orders the side stream after the caller's, and checks and sets up the scatter of every
        chunk that can hit from the arena (its block table checked, as `check_blocks` does, for
        the GPU pools too). None of it depends on the Lookup's reply; nothing here may fail the
        call, whose reply holds a lease: what fails is done again after the reply, where an error
        releases it."""
        self.readied = True
        try:
            device = cache_device(kv_caches)
            if self.stream is None and device.type == "cuda":
                self.stream = client._streams.ordered_side(device)
            table = self.block_ids
            if not self.layerwise:
                self.prepared = self._prepared(client, kv_caches, table, chunks, layers)
            if self.prepared is not None:
                self.block_ids = self.prepared.checked_blocks(table)
            else:  # layer-wise (runs of layers), or a table shorter than every chunk
                self.block_ids = kvstore_kernels.check_blocks(
                    client.spec, kv_caches, table, chunks, layers, writes_cache=True
                )
        except Exception:
            log.debug("checking the block table ahead failed; it is checked with the scatter", exc_info=True)

    def _prepared(
        self, client: Session, kv_caches: Any, table: Any, chunks: int, layers: range
    ) -> kvstore_kernels.Prepared | None:
        """The arena's scatter of every chunk, checked and set up; None where it cannot be."""
        arena = client.arena
        if arena is None:
            return None
        try:
            return kvstore_kernels.prepare(
                client.spec,
                kv_caches,
                table,
                range(chunks),
                arena,
                layers,
                to_page=False,
                stream=self.stream,
            )
        except ValueError:
            return None

    def arena_scatter(self, arena: Any, layers: range) -> Callable[..., None] | None:
        """The prepared scatter (with `kvstore_kernels.scatter`'s signature) where it moves these
        layers out of this arena (not the mapping of a daemon that restarted meanwhile)."""
        prepared = self.prepared
        if prepared is None or prepared.plan.buffer is not arena or prepared.layers != layers:
            return None
        return prepared.transfer  # the load's chunk i is its prepared page i


class LoadPath:
    """A client's loads (`KVStoreClient.load`, `load_async`): leased Lookup, scatter, Release."""

    def __init__(self, session: Session) -> None:
        self._s = session  # the client: its namespace, spec and link

    def load_async(
        self,
        token_ids: Any,
        kv_caches: Any,
        block_ids: Any,
        *,
        stream: Any = None,
        layers: range | None = None,
        layerwise: bool = False,
        keys: Sequence[bytes] | None = None,
        tail: bool = False,
        lent: bytes | None = None,
    ) -> LoadHandle:
        """`KVStoreClient.load_async`."""
        moved = self._s._layer_range(layers)
        keys = self._s._keys_of(token_ids, keys, tail)
        asked = time.monotonic()  # the daemon's lease deadline is at least this + lease_ttl_s
        if lent is not None:  # a lender's ticket: copied now, the daemon asked meanwhile
            ticketed = lent_tickets.read_ticket(
                self._s, lent, token_ids, keys, kv_caches, block_ids, moved, stream, asked
            )
            if ticketed is not None:
                return ticketed
        targets = _LoadTargets(block_ids, stream, layerwise)
        reply = self._lookup_leased(keys, kv_caches, moved, targets, lent=True) if keys else None
        if reply is not None and not reply.HasField("lent"):
            self._s._lends.expect_lent = False
        if reply is not None and reply.HasField("lent"):  # another GPU's blocks: copied device to device
            copied = self._s._lends.read(
                reply, token_ids, kv_caches, block_ids, moved, stream, self._s._link.lent, asked
            )
            if copied is not None:
                return copied
            reply = self._lookup_leased(keys, kv_caches, moved, targets, lent=False)
        if reply is None or reply.hit_chunks == 0:
            return LoadHandle(None, lambda: 0, ignore, 0, moved)
        if not targets.readied and self._s.arena is not None:  # not while the Lookup was in flight
            targets.ready(self._s, kv_caches, len(keys), moved)
        return self._read(reply, token_ids, kv_caches, targets, moved, layerwise, asked)

    def _read(
        self,
        reply: Any,
        token_ids: Any,
        kv_caches: Any,
        targets: _LoadTargets,
        moved: range,
        layerwise: bool,
        asked: float,
    ) -> LoadHandle:
        """Holds the Lookup's lease and scatters its pages; the handle releases it (an empty
        load where the daemon went away or the lease expired)."""
        lease = pb.LeaseRequest(namespace=self._s.namespace, lease_id=reply.lease_id, epoch=self._s.epoch)
        self._s._renewer.hold(lease.lease_id, lease.namespace)
        try:
            ready, event, layer_events = self._scatter(reply, lease, kv_caches, targets, moved, layerwise)
        except KVStoreError as exc:
            if is_outage(exc):
                self._s._conn.lost(exc)  # the lease went with the daemon
            elif isinstance(exc, NotFound):  # it expired (pages read back too slowly), or was reaped
                log.warning("load lease %d: %s; loading nothing", lease.lease_id, exc)
            else:
                self._s._end_quietly("Release", lease)
                raise
            self._s._renewer.drop(lease.lease_id)
            return LoadHandle(None, lambda: 0, ignore, 0, moved)
        except BaseException:
            Streams.settle(kv_caches)
            self._s._end_quietly("Release", lease)
            raise
        tokens = self._s._covered(token_ids, ready)
        release = functools.partial(
            self._release,
            lease,
            tokens,
            asked,
            LocalChannel.frame("Release", lease),  # made while the copy runs
        )
        handle = LoadHandle(
            event, release, lambda exc: self._s._end_quietly("Release", lease), tokens, moved, layer_events
        )
        self._s._renewer.owned_by(lease.lease_id, handle)
        return handle

    def _lookup_leased(
        self, keys: Sequence[bytes], kv_caches: Any, layers: range, targets: _LoadTargets, lent: bool
    ) -> Any:
        """The leased Lookup of `keys` (with the Acquire on the daemon's host), or None in an
        outage; `targets` are readied while it is in flight. With `lent`, blocks lent from GPUs
        this cache's device reaches may answer it (`kvstore_client.lends`)."""
        device = cache_device(kv_caches)
        lent_devices = self._s._lends.devices(device) if lent and device.type == "cuda" else ()
        local = self._s._conn.local  # its read slots come with the first lent read that asks
        slots: list[int] | None = (
            [] if lent_devices and local is not None and local.read_slots is None else None
        )

        def request() -> pb.LookupRequest:
            return pb.LookupRequest(
                namespace=self._s.namespace,
                keys=pack_keys(keys),
                lease=True,
                gpu_pools=self._s._gpu_pools.readable(device),  # pools read in place
                acquire=self._s.arena is not None,
                epoch=self._s.epoch,
                lent_devices=lent_devices,
                read_slots=slots is not None,
            )

        meanwhile: Callable[[], None] | None = functools.partial(
            targets.ready, self._s, kv_caches, len(keys), layers
        )
        if self._s.arena is None or (lent_devices and self._s._lends.expect_lent):
            meanwhile = None  # readied after the reply, where it is needed
        try:
            return self._s._conn.call("Lookup", request, meanwhile, slots)
        except Unavailable:
            return None
        finally:
            if slots:  # mapped for the channel they came on, only
                self._s._lends.take_slots(slots, local)

    def _scatter(
        self,
        reply: Any,
        lease: pb.LeaseRequest,
        kv_caches: Any,
        targets: _LoadTargets,
        layers: range,
        layerwise: bool,
    ) -> tuple[int, torch.cuda.Event | None, dict[int, torch.cuda.Event | None] | None]:
        """Moves the leased pages into the KV cache: from the arena and the GPU pools (enqueued,
        per run of layers where `layerwise`), or inline through Get. Returns the chunks that
        are coming, the event after all of them and each layer's event (arena loads only)."""
        if self._s.arena is None:
            staging = get_pages(
                self._s._conn.stub,
                lease,
                reply.hit_chunks,
                self._s.page_bytes,
                self._s.timeout_s,
                self._s._conn.metadata,
                is_outage,
            )
            ready = len(staging) // self._s.page_bytes
            offsets = [i * self._s.page_bytes for i in range(ready)]
            kvstore_kernels.scatter(
                self._s.spec, kv_caches, targets.block_ids, range(ready), staging, offsets, layers
            )
            return ready, None, None
        # A daemon that answered the Acquire with the Lookup saves a round trip (older ones never do).
        acquired = reply.acquired if reply.HasField("acquired") else self._s._conn.rpc("Acquire", lease)
        pieces = self._s._gpu_pools.pieces(acquired, self._s.arena)  # the arena's chunks, each pool's
        groups = layer_groups(layers, self._s.layerwise_runs) if layerwise and layers else [layers]
        arena_offsets = [offset for buf, _, offsets in pieces if buf is self._s.arena for offset in offsets]
        on_cuda = (device := cache_device(kv_caches)).type == "cuda"
        on_gpu = layerwise and self._s._mapped.registered and on_cuda
        by_gpu = on_cuda and not (on_gpu and getattr(self._s.layerwise_options, "engine", "") == "torch")
        scatter = arena_scatter(
            self._s._mapped.transfer_options(arena_offsets, by_gpu, device.index),  # None: registered
            self._s.layerwise_options if on_gpu else None,
            targets.arena_scatter(self._s.arena, groups[0]) if len(groups) == 1 else None,
        )
        events = [
            [
                self._s._streams.enqueue(
                    self._s._gpu_pools.scatter_for(buf, arena_scatter=scatter),
                    self._s.spec,
                    kv_caches,
                    targets.block_ids,
                    chunks,
                    buf,
                    offsets,
                    group,
                    targets.stream,
                )
                for buf, chunks, offsets in pieces  # one stream: the last event follows them all
            ][-1]
            for group in groups
        ]
        layer_events = {layer: event for group, event in zip(groups, events, strict=True) for layer in group}
        return acquired.ready_chunks, events[-1], layer_events

    def _release(self, lease: pb.LeaseRequest, tokens: int, asked: float, release_frame: bytes) -> int:
        """Ends a load once its copy is done: the tokens it made valid (0 where the lease may have
        lapsed during the copy, or the daemon restarted)."""
        self._s._renewer.drop(lease.lease_id)
        if self._s.epoch != lease.epoch:  # the daemon restarted since the Lookup: trust nothing read
            log.debug("load lease %d: the daemon restarted during the copy; no tokens", lease.lease_id)
            return 0
        local = self._s._conn.local
        if local is not None and time.monotonic() < asked + self._s.lease_ttl_s:
            # The copy ended while the lease held its pages (same host, same monotonic clock):
            # the tokens are valid whatever the Release answers, so it is sent without waiting.
            try:
                local.send_frame("Release", release_frame)
            except Unavailable as exc:  # the lease expires on its own
                log.debug("release of lease %d failed: %s", lease.lease_id, exc)
            return tokens
        if self._s._end_quietly("Release", lease):
            return tokens
        log.warning("load lease %d expired during the copy; reporting no tokens loaded", lease.lease_id)
        return 0
