"""KVStoreClient: a worker's connection to kvstored.

- `lookup(tokens)`: tokens in the longest stored prefix.
- `store(tokens, kv_caches, block_ids)`: Reserve -> gather pages -> Commit.
- `load(tokens, kv_caches, block_ids)`: Lookup(lease) -> Acquire -> scatter -> Release (on the
  daemon's host the Lookup also answers the Acquire when no page must be waited for).

On the daemon's host the client maps the daemon's shared-memory arena and the
kernels read and write pages in place; otherwise (`shared_memory=False`, or a
remote daemon) page bytes travel inline through Put/Get.

A daemon that is down, stopping, restarting or too slow never raises out of
`lookup`, `load` or `store` (or their handles): they count a miss or store
nothing, one warning per outage, one info line when it serves again. The client
connects again by itself, at most every RECONNECT_INTERVAL_S, and after a restart
maps the new arena before it moves a byte: every call that names offsets carries
the epoch of the arena it was made for (`kvstore.handlers`). Leases held longer
than a third of their TTL are renewed by a background thread (`LeaseRenewer`).

The parts: `connection` (gRPC, the local channel, outages), `arena` (the mapped arena),
`transfers` (streams and the gather/scatter calls), `inline` (Put/Get bytes), `gpu_pools` (the
GPU tier's pools, read in place); this module is the façade that runs the protocol over them.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import kvstore_kernels
from kvstore.errors import FailedPrecondition, KVStoreError, NotFound, Unavailable
from kvstore.keys import chunk_keys, pack_keys
from kvstore.peers import process_start_time
from kvstore.proto import kvstore_pb2 as pb
from kvstore.spec import KVSpec
from kvstore.wire import page_spec_message, stats_to_dict
from kvstore_client.arena import MappedArena
from kvstore_client.connection import Connection, default_address, is_outage
from kvstore_client.gpu_pools import GpuPools, device_bus_id
from kvstore_client.handles import LoadHandle, StoreHandle
from kvstore_client.inline import get_pages, put_pages
from kvstore_client.local import LocalChannel
from kvstore_client.renewal import LeaseRenewer
from kvstore_client.transfers import Streams, cache_device, layer_groups

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
# How a layer-wise load moves each run of layers: the auto rule (its staged path). The Triton
# kernel reading the arena issues faster (one launch per run, against a copy and a launch per
# page) but moves the hf layout's 4 KiB rows at a fraction of the link's rate: about as soon
# to the first token at 8k tokens, far later at 32k (bench/NOTES-ttft.md).
LAYERWISE_TRANSFER = kvstore_kernels.TransferOptions()
# Runs of a layer-wise load: the first layer, then the rest. Each run is a call whose host
# time the forward waits for where the forward is host-bound (HF eager), so few runs are best
# there; more runs pay only where the copy outlasts the forward (32k tokens).
# bench/NOTES-ttft.md.
LAYERWISE_RUNS = 2


def _ignore(exc: BaseException) -> None:
    pass


@dataclass
class _LoadTargets:
    """Where a load's pages go: the block table and the stream, readied while its Lookup is in
    flight (`ready`) and taken as they are after it."""

    block_ids: Any
    stream: Any

    def ready(self, client: KVStoreClient, kv_caches: Any, chunks: int, layers: range) -> None:
        """Checks the block table of every chunk that can hit and orders the side stream after the
        caller's. None of it depends on the Lookup's reply; nothing here may fail the call, whose
        reply holds a lease: what fails is done again after the reply, where an error releases it."""
        try:
            self.block_ids = kvstore_kernels.check_blocks(
                client.spec, kv_caches, self.block_ids, chunks, layers, writes_cache=True
            )
            device = cache_device(kv_caches)
            if self.stream is None and device.type == "cuda":
                self.stream = client._streams.ordered_side(device)
        except Exception:
            log.debug("checking the block table ahead failed; it is checked with the scatter", exc_info=True)


class KVStoreClient:
    def __init__(
        self,
        address: str,
        spec: KVSpec,
        shared_memory: bool | None = None,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        name: str = "",
        pin_arena: bool | None = None,
        local_channel: bool | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.name = name or f"pid-{os.getpid()}"
        self._want_local_channel = local_channel
        self._requested_spec = spec
        self._mapped = MappedArena(shared_memory, pin_arena)
        self._writer = (os.getpid(), process_start_time(os.getpid()) or 0)
        self._streams = Streams()
        # How a layer-wise load moves each run of layers (with the arena registered), and
        # into how many runs it cuts the layers (`layer_groups`).
        self.layerwise_options = LAYERWISE_TRANSFER
        self.layerwise_runs = LAYERWISE_RUNS
        self._gpu_pools = GpuPools(None, {})
        self._renewer = LeaseRenewer(self._renew)
        self._conn = Connection(address, timeout_s, token, self._handshake, self._drop_arena)
        try:
            self._handshake()
        except BaseException:
            self.close()
            raise

    @classmethod
    def connect(
        cls,
        address: str | None = None,
        spec: KVSpec | None = None,
        *,
        shared_memory: bool | None = None,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        name: str = "",
        pin_arena: bool | None = None,
        local_channel: bool | None = None,
    ) -> KVStoreClient:
        """Connect to kvstored at `address` (default: the default config's unix socket).

        `shared_memory`: None maps the arena when the daemon's is reachable on this host,
        True requires it, False always sends page bytes inline. `pin_arena`: None registers the
        mapped arena with CUDA when a GPU is present (the kernels then move pages at PCIe speed).
        `local_channel`: None sends control calls over the daemon's local channel when the arena is
        mapped (same host), False always uses gRPC.
        """
        if spec is None:
            raise ValueError("spec: a KVSpec describing this worker's KV cache is required")
        return cls(
            address or default_address(),
            spec,
            shared_memory,
            token,
            timeout_s,
            name,
            pin_arena,
            local_channel,
        )

    # -- the parts, as tests and benchmarks reach them ----------------------

    @property
    def arena(self) -> torch.Tensor | None:
        """The daemon's arena mapped here, as uint8 (None: page bytes go inline)."""
        return self._mapped.tensor

    @property
    def epoch(self) -> int:
        """The mapped arena's epoch (0: none mapped)."""
        return self._mapped.epoch

    @property
    def shared_memory(self) -> bool:
        return self._mapped.tensor is not None

    @property
    def _registered(self) -> bool:
        return self._mapped.registered

    @property
    def _local(self) -> LocalChannel | None:
        return self._conn.local

    @property
    def _rpc(self) -> Any:
        return self._conn.rpc

    # -- connection ---------------------------------------------------------

    def _handshake(self) -> None:
        spec = self._requested_spec
        page = spec._page(spec.chunk_tokens or spec.block_size)
        request = pb.ConnectRequest(
            client_name=self.name,
            spec=page_spec_message(page, chunk_tokens=spec.chunk_tokens or 0),  # 0: the daemon's
            device_pci_bus_id=device_bus_id(),
        )
        reply = self._conn.rpc("Connect", request)
        # Checked before anything is kept: a daemon restarted with an incompatible config leaves
        # this client as it was (and in an outage, when it connects again).
        if reply.chunk_tokens % spec.block_size:
            raise ValueError(
                f"chunk_tokens: the daemon's {reply.chunk_tokens} is not a multiple of "
                f"block_size {spec.block_size}; pass KVSpec(chunk_tokens=...)"
            )
        new_spec = spec.with_chunk_tokens(reply.chunk_tokens)
        if new_spec.page.namespace() != reply.namespace or new_spec.page.page_bytes != reply.page_bytes:
            raise RuntimeError(
                "the daemon computed another namespace or page size for this spec: "
                "client and daemon run incompatible kvstore versions"
            )
        self.spec = new_spec
        self.namespace: bytes = reply.namespace
        self.page_bytes: int = reply.page_bytes
        self.max_message_bytes: int = reply.max_message_bytes
        self.lease_ttl_s: float = reply.lease_ttl_ms / 1000  # a lease's life when the request names none
        self._renewer.ttl_s = self.lease_ttl_s
        identity = (reply.arena.device, reply.arena.inode)
        mapped = self._mapped
        # A daemon without epochs (epoch 0) cannot prove its arena unchanged: map it again.
        if (
            not reply.epoch
            or reply.epoch != mapped.epoch
            or identity != mapped.identity
            or mapped.tensor is None
        ):
            self._renewer.forget()  # leases of another daemon
            self._gpu_pools.close()
            mapped.map(reply.arena, identity, self._streams)
            mapped.identity = identity
            mapped.epoch = reply.epoch if mapped.tensor is not None else 0
            if mapped.tensor is not None:  # same host: the GPU tier's pools can be opened too
                self._gpu_pools = GpuPools.open(reply.gpu_pools)
        same_host = self._want_local_channel is not False and mapped.tensor is not None
        self._conn.open_local(reply.local_socket if same_host else "")
        self._conn.serving(reply.epoch)

    def _drop_arena(self) -> None:
        """The daemon is gone: its leases and arena with it."""
        self._renewer.forget()
        self._gpu_pools.close()
        self._gpu_pools = GpuPools(None, {})
        self._mapped.unmap(self._streams)
        self._mapped.identity = None

    def _renew(self, lease_ids: Sequence[int]) -> Sequence[int]:
        """Renews leases on the daemon (from the renewal thread); returns those still held."""
        request = pb.RenewRequest(namespace=self.namespace, lease_ids=lease_ids, epoch=self.epoch)
        renewed: Sequence[int] = self._conn.rpc("Renew", request).renewed
        return renewed

    def close(self) -> None:
        self._renewer.stop()
        self._conn.close_local()
        self._gpu_pools.close()
        self._mapped.unmap(self._streams)
        self._conn.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- API ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> Any:
        """The engine's KV cache, checked once now: pass what this returns to store/load.

        As with vLLM's `register_kv_caches`, the engine keeps the tensors' storage, shape and
        strides while it uses them; each call then skips checking and fingerprinting every
        layer's tensors (`kvstore_kernels.register`). A bad tensor is a ValueError here.
        """
        return kvstore_kernels.register(self.spec, kv_caches)

    def keys(self, token_ids: Any) -> list[bytes]:
        """Keys of the whole chunks of `token_ids`."""
        return chunk_keys(self.namespace, token_ids, self.spec.page.chunk_tokens)

    def _keys_of(self, token_ids: Any, keys: Sequence[bytes] | None) -> Sequence[bytes]:
        """The whole chunks' keys: `keys` (the caller's, the first ones when it has more; all of
        them where `token_ids` is None: the keys alone name the chunks), or hashed."""
        if keys is None:
            if token_ids is None:
                raise ValueError("token_ids: None needs keys, one per chunk")
            return self.keys(token_ids)
        if token_ids is None:
            return keys
        chunks = len(token_ids) // self.spec.page.chunk_tokens
        if len(keys) < chunks:
            raise ValueError(f"keys: {len(keys)} keys for {chunks} whole chunks of token_ids")
        return keys[:chunks]

    def lookup(self, token_ids: Any, *, keys: Sequence[bytes] | None = None) -> int:
        """Number of leading tokens whose KV is stored (a multiple of chunk_tokens).

        A daemon that cannot be reached counts as a miss (logged), as it does for `load` and
        `store`: the worker recomputes rather than fails. `keys`: `self.keys(token_ids)` where
        the caller already has them (here and in `store_async` and `load_async`, where
        `token_ids` may then be None: the keys alone name the chunks).
        """
        return self.lookup_chunks(self._keys_of(token_ids, keys)) * self.spec.page.chunk_tokens

    def lookup_chunks(self, keys: Sequence[bytes]) -> int:
        """How many leading chunks of `keys` (any run of consecutive chunk keys, not only from the
        first chunk of a prompt) are stored; 0 when the daemon cannot be reached (logged)."""
        if not keys:
            return 0
        try:
            reply = self._conn.call(
                "Lookup", lambda: pb.LookupRequest(namespace=self.namespace, keys=pack_keys(keys))
            )
        except Unavailable:
            return 0
        hit: int = reply.hit_chunks
        return hit

    def store(
        self,
        token_ids: Any,
        kv_caches: Any,
        block_ids: Any,
        layers: range | None = None,
        *,
        keys: Sequence[bytes] | None = None,
    ) -> int:
        """Store the whole chunks of `token_ids` from the KV cache; returns how many were new."""
        return self.store_async(token_ids, kv_caches, block_ids, layers=layers, keys=keys).wait()

    def load(
        self,
        token_ids: Any,
        kv_caches: Any,
        block_ids: Any,
        layers: range | None = None,
        *,
        keys: Sequence[bytes] | None = None,
    ) -> int:
        """Load the longest stored prefix of `token_ids` into the KV cache; returns tokens loaded."""
        return self.load_async(token_ids, kv_caches, block_ids, layers=layers, keys=keys).wait()

    def stats(self) -> dict[str, Any]:
        return stats_to_dict(self._conn.call("Stats", pb.StatsRequest))

    def clear(self) -> int:
        """Drop every page of this client's namespace; returns how many."""
        pages: int = self._conn.call("Clear", lambda: pb.ClearRequest(namespace=self.namespace)).pages
        return pages

    # -- store: Reserve, gather, Commit -------------------------------------

    def store_async(
        self,
        token_ids: Any,
        kv_caches: Any,
        block_ids: Any,
        *,
        stream: Any = None,
        layers: range | None = None,
        keys: Sequence[bytes] | None = None,
    ) -> StoreHandle:
        """Reserve the new chunks and enqueue their gather; `wait()` commits them.

        On CUDA the gather runs on `stream` (default: this client's side stream, which first
        waits for the caller's current stream), so the caller's stream is never blocked.
        """
        keys = self._keys_of(token_ids, keys)
        reply = self._reserve(keys) if keys else None
        chunks = [i for i, offset in enumerate(reply.offsets) if offset >= 0] if reply else []
        if reply is None or not chunks:
            return StoreHandle(None, lambda: 0, _ignore, 0)
        lease = pb.LeaseRequest(namespace=self.namespace, lease_id=reply.lease_id, epoch=self.epoch)
        self._renewer.hold(lease.lease_id)
        try:
            event = self._gather(reply, chunks, kv_caches, block_ids, layers, stream)
        except (Unavailable, NotFound) as exc:  # an inline Put the daemon did not take
            if isinstance(exc, Unavailable):
                self._conn.lost(exc)
            else:  # the lease expired while the bytes were sent, or the daemon restarted
                log.warning("store lease %d: %s; nothing stored", lease.lease_id, exc)
            self._renewer.drop(lease.lease_id)
            return StoreHandle(None, lambda: 0, _ignore, 0)
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
            return self._streams.enqueue(
                kvstore_kernels.gather,
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

    # -- load: Lookup(lease), scatter, Release ------------------------------

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
    ) -> LoadHandle:
        """Pin the longest stored prefix and enqueue its scatter; `wait()` releases it.

        `handle.tokens` is what is being loaded: whole chunks, as many as the daemon could
        deliver (a chunk that could not be read back from disk ends the prefix). `wait()`
        returns the number of leading tokens that are valid in the KV cache: that, or 0 if the
        lease lapsed while the pages were read (their slots may have been reused meanwhile).
        With `layerwise`, runs of layers (`layer_groups`: 1, 1, 2, 4, ... layers, at most
        `layerwise_runs` of them) are moved and signalled on their own (`wait_layer(i)`), so a
        forward can start on layer 0 while later layers are still in flight. A daemon that
        cannot be reached gives an empty load (0 tokens, logged), never an exception.
        """
        moved = self._layer_range(layers)
        keys = self._keys_of(token_ids, keys)
        asked = time.monotonic()  # the daemon's lease deadline is at least this + lease_ttl_s
        targets = _LoadTargets(block_ids, stream)
        reply = self._lookup_leased(keys, kv_caches, moved, targets) if keys else None
        if reply is None or reply.hit_chunks == 0:
            return LoadHandle(None, lambda: 0, _ignore, 0, moved)
        lease = pb.LeaseRequest(namespace=self.namespace, lease_id=reply.lease_id, epoch=self.epoch)
        self._renewer.hold(lease.lease_id)
        try:
            ready, event, layer_events = self._scatter(reply, lease, kv_caches, targets, moved, layerwise)
        except KVStoreError as exc:
            if is_outage(exc):
                self._conn.lost(exc)  # the lease went with the daemon
            elif isinstance(exc, NotFound):  # it expired (pages read back too slowly), or was reaped
                log.warning("load lease %d: %s; loading nothing", lease.lease_id, exc)
            else:
                self._end_quietly("Release", lease)
                raise
            self._renewer.drop(lease.lease_id)
            return LoadHandle(None, lambda: 0, _ignore, 0, moved)
        except BaseException:
            Streams.settle(kv_caches)
            self._end_quietly("Release", lease)
            raise
        tokens = ready * self.spec.page.chunk_tokens
        release = functools.partial(
            self._release,
            lease,
            tokens,
            asked,
            LocalChannel.frame("Release", lease),  # made while the copy runs
        )
        handle = LoadHandle(
            event, release, lambda exc: self._end_quietly("Release", lease), tokens, moved, layer_events
        )
        self._renewer.owned_by(lease.lease_id, handle)
        return handle

    def _lookup_leased(
        self, keys: Sequence[bytes], kv_caches: Any, layers: range, targets: _LoadTargets
    ) -> Any:
        """The leased Lookup of `keys` (with the Acquire on the daemon's host), or None in an
        outage; `targets` are readied while it is in flight."""
        device = cache_device(kv_caches)

        def request() -> pb.LookupRequest:
            return pb.LookupRequest(
                namespace=self.namespace,
                keys=pack_keys(keys),
                lease=True,
                gpu_pools=self._gpu_pools.readable(device),  # pools read in place
                acquire=self.arena is not None,
                epoch=self.epoch,
            )

        meanwhile = functools.partial(targets.ready, self, kv_caches, len(keys), layers)
        try:
            return self._conn.call("Lookup", request, meanwhile if self.arena is not None else None)
        except Unavailable:
            return None

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
        if self.arena is None:
            staging = get_pages(
                self._conn.stub,
                lease,
                reply.hit_chunks,
                self.page_bytes,
                self.timeout_s,
                self._conn.metadata,
                is_outage,
            )
            ready = len(staging) // self.page_bytes
            offsets = [i * self.page_bytes for i in range(ready)]
            kvstore_kernels.scatter(
                self.spec, kv_caches, targets.block_ids, range(ready), staging, offsets, layers
            )
            return ready, None, None
        # A daemon that answered the Acquire with the Lookup saves a round trip (older ones never do).
        acquired = reply.acquired if reply.HasField("acquired") else self._conn.rpc("Acquire", lease)
        pieces = self._gpu_pools.pieces(acquired, self.arena)  # the arena's chunks, each pool's
        groups = layer_groups(layers, self.layerwise_runs) if layerwise and layers else [layers]
        scatter = kvstore_kernels.scatter
        if layerwise and self._mapped.registered and cache_device(kv_caches).type == "cuda":
            scatter = functools.partial(scatter, options=self.layerwise_options)
        events = [
            [
                self._streams.enqueue(
                    self._gpu_pools.scatter_for(buf, arena_scatter=scatter),
                    self.spec,
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
        self._renewer.drop(lease.lease_id)
        if self.epoch != lease.epoch:  # the daemon restarted since the Lookup: trust nothing read
            log.debug("load lease %d: the daemon restarted during the copy; no tokens", lease.lease_id)
            return 0
        local = self._conn.local
        if local is not None and time.monotonic() < asked + self.lease_ttl_s:
            # The copy ended while the lease held its pages (same host, same monotonic clock):
            # the tokens are valid whatever the Release answers, so it is sent without waiting.
            try:
                local.send_frame("Release", release_frame)
            except Unavailable as exc:  # the lease expires on its own
                log.debug("release of lease %d failed: %s", lease.lease_id, exc)
            return tokens
        if self._end_quietly("Release", lease):
            return tokens
        log.warning("load lease %d expired during the copy; reporting no tokens loaded", lease.lease_id)
        return 0

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
