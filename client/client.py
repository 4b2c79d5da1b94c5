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
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import torch

import kvstore_kernels
from kvstore.errors import (
    DAEMON_STOPPING,
    DeadlineExceeded,
    FailedPrecondition,
    KVStoreError,
    NotFound,
    StaleEpoch,
    Unavailable,
    from_rpc_error,
)
from kvstore.keys import chunk_keys, pack_keys
from kvstore.peers import boot_id, process_start_time
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.spec import KVSpec
from kvstore.wire import page_spec_message, stats_to_dict
from kvstore_client.gpu_pools import GpuPools, device_bus_id
from kvstore_client.handles import LoadHandle, StoreHandle
from kvstore_client.local import LocalChannel
from kvstore_client.renewal import LeaseRenewer

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
# How a layer-wise load moves each run of layers. The auto rule's staged path, measured
# against the Triton kernel reading the arena (4 programs) in bench/ttft.py on the H100:
# 8k tokens 58.8 vs 55.5 ms, 32k tokens 118.6 vs 195.8 ms to the first token. The kernel
# issues faster (one launch per run, against a copy and a launch per page) but moves the
# hf layout's 4 KiB rows at a fraction of the link's rate.
LAYERWISE_TRANSFER = kvstore_kernels.TransferOptions()
# Runs of a layer-wise load: the first layer, then the rest. Each run is a call whose host
# time the forward waits for where the forward is host-bound (HF eager: 8k tokens, runs of
# 1 / 2 / 6: 51-56 / 54 / 58-62 ms to the first token); at 32k, where the copy outlasts the
# forward, 6 runs were best (104-108 against 110-117 ms). bench/NOTES-ttft.md.
LAYERWISE_RUNS = 2
_CHANNEL_LIMIT = 64 << 20
_NOT_REGISTERED = "is not registered with this daemon"
RECONNECT_INTERVAL_S = 0.25  # in an outage, the least time between two attempts to connect again
# gRPC's own reconnection backoff (default: up to 120 s) would keep a restarted daemon unused.
_RECONNECT_BACKOFF_MS = 250


def is_outage(exc: KVStoreError) -> bool:
    """Whether `exc` says the daemon cannot serve now (down, stopping, restarted, too slow),
    as opposed to a fault of the request."""
    if isinstance(exc, Unavailable | DeadlineExceeded | StaleEpoch):
        return True
    if isinstance(exc, NotFound):
        return _NOT_REGISTERED in str(exc)
    return getattr(exc, "code", None) is grpc.StatusCode.CANCELLED


def _ignore(exc: BaseException) -> None:
    pass


def cache_device(kv_caches: Any) -> torch.device:
    """The device of an engine's KV cache (a tensor, a list of them, or a list of (k, v) pairs)."""
    first = kv_caches
    while isinstance(first, list | tuple) and first:
        first = first[0]
    return first.device if isinstance(first, torch.Tensor) else torch.device("cpu")


def layer_groups(layers: range, runs: int) -> list[range]:
    """`layers` cut into at most `runs` consecutive runs of 1, 1, 2, 4, ... layers, the last
    run taking the rest.

    A layer-wise load moves and signals each run on its own: the first layers arrive first,
    and the host issues `runs` calls. Each call costs host time that the model's own forward
    would otherwise use, so few runs are best where the forward is host-bound
    (`KVStoreClient.layerwise_runs`, measured in bench/NOTES-ttft.md).
    """
    if runs < 1:
        raise ValueError(f"runs: expected a positive integer, got {runs}")
    groups: list[range] = []
    start, size = layers.start, 1
    while start < layers.stop:
        stop = layers.stop if len(groups) == runs - 1 else min(start + size, layers.stop)
        groups.append(range(start, stop))
        size = size * 2 if len(groups) > 1 else 1
        start = stop
    return groups


def default_address() -> str:
    from kvstore.paths import default_socket_path

    return f"unix://{default_socket_path()}"


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
        self._want_shared_memory = shared_memory
        self._want_local_channel = local_channel
        self._local: LocalChannel | None = None
        self._pin_arena = pin_arena
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        options = [
            ("grpc.max_receive_message_length", _CHANNEL_LIMIT),
            ("grpc.max_send_message_length", _CHANNEL_LIMIT),
            ("grpc.initial_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS),
            ("grpc.min_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS),
            ("grpc.max_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS),
        ]
        self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._requested_spec = spec
        self._arena: mmap.mmap | None = None
        self.arena: torch.Tensor | None = None
        self._registered = False
        self.epoch = 0  # the mapped arena's epoch (0: none mapped)
        self._arena_identity: tuple[int, int] | None = None
        self._outage = False  # a call found the daemon not serving since the last connect
        self._reconnect_at = 0.0  # in an outage: no attempt to connect again before this
        self._writer = (os.getpid(), process_start_time(os.getpid()) or 0)
        self._streams: dict[torch.device, Any] = {}
        # How a layer-wise load moves each run of layers (with the arena registered), and
        # into how many runs it cuts the layers (`layer_groups`).
        self.layerwise_options = LAYERWISE_TRANSFER
        self.layerwise_runs = LAYERWISE_RUNS
        self._gpu_pools = GpuPools(None, {})
        self._renewer = LeaseRenewer(self._renew)
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

    # -- connection ---------------------------------------------------------

    def _rpc(self, method: str, request: Any, meanwhile: Callable[[], Any] | None = None) -> Any:
        """The reply to `request`; `meanwhile()` runs while the daemon answers (over the local
        channel; before the call over gRPC)."""
        if self._local is not None:
            return self._local.call(method, request, meanwhile)
        if meanwhile is not None:
            meanwhile()
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, method) from None

    def _lost(self, exc: BaseException) -> None:
        """A call found the daemon not serving: the outage begins (one warning; the next call may
        try to connect again at once), and the local channel closes."""
        if not self._outage:
            self._outage = True
            self._reconnect_at = 0.0
            log.warning(
                "kvstored at %s is not serving (%s): lookups and loads are misses and stores are "
                "dropped until it serves again",
                self.address,
                exc,
            )
        else:
            log.debug("kvstored still not serving: %s", exc)
        self._close_local_channel()

    def _reconnect(self) -> None:
        """Connects again (at most every RECONNECT_INTERVAL_S); Unavailable if it cannot now.

        Whatever fails here is the outage going on (a daemon restarted with a config this client
        cannot use included), never an error of the caller's call. Where nothing answers at the
        socket the daemon is gone: its arena is let go at once, so that its memory is free for
        the next daemon's."""
        if time.monotonic() < self._reconnect_at:
            raise Unavailable(f"kvstored at {self.address} is not serving; trying again shortly")
        try:
            self._handshake()
        except Exception as exc:
            self._reconnect_at = time.monotonic() + RECONNECT_INTERVAL_S
            if isinstance(exc, Unavailable) and DAEMON_STOPPING not in str(exc):
                self._drop_arena()
            self._lost(exc)
            raise Unavailable(f"kvstored at {self.address}: {exc}") from None

    def _drop_arena(self) -> None:
        self._renewer.forget()  # leases of a daemon that is gone
        self._gpu_pools.close()
        self._gpu_pools = GpuPools(None, {})
        self._unmap_arena()
        self._arena_identity = None

    def _call(self, method: str, make_request: Any, meanwhile: Callable[[], Any] | None = None) -> Any:
        """`_rpc` with the outage handled: in an outage it first connects again; a call that finds
        the daemon restarted (a stale epoch, a forgotten namespace, a closed channel) connects
        again and is made once more, with a request made anew. Raises Unavailable when the
        daemon cannot serve it now (a slow one included: a miss, not a second wait); other
        errors are the request's own."""
        if self._outage:
            self._reconnect()
        for again in (False, True):
            try:
                return self._rpc(method, make_request(), meanwhile)
            except KVStoreError as exc:
                if not is_outage(exc):
                    raise
                self._lost(exc)
                if again or isinstance(exc, DeadlineExceeded):
                    raise Unavailable(str(exc)) from None
            self._reconnect()
        raise AssertionError("unreachable")

    def _handshake(self) -> None:
        spec = self._requested_spec
        page = spec._page(spec.chunk_tokens or spec.block_size)
        request = pb.ConnectRequest(
            client_name=self.name,
            spec=page_spec_message(page, chunk_tokens=spec.chunk_tokens or 0),  # 0: the daemon's
            device_pci_bus_id=device_bus_id(),
        )
        reply = self._rpc("Connect", request)
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
        # A daemon without epochs (epoch 0) cannot prove its arena unchanged: map it again.
        if (
            not reply.epoch
            or reply.epoch != self.epoch
            or identity != self._arena_identity
            or self.arena is None
        ):
            self._renewer.forget()  # leases of another daemon
            self._gpu_pools.close()
            self._map_arena(reply.arena, identity)
            self._arena_identity = identity
            self.epoch = reply.epoch if self.arena is not None else 0
            if self.arena is not None:  # same host: the GPU tier's pools can be opened too
                self._gpu_pools = GpuPools.open(reply.gpu_pools)
        self._open_local_channel(reply.local_socket)
        if self._outage:
            log.info("kvstored at %s serves again (arena epoch %#x)", self.address, reply.epoch)
            self._outage = False

    def _open_local_channel(self, path: str) -> None:
        """Unary calls go over the daemon's local channel when it is reachable (a same-host client)."""
        self._close_local_channel()
        if not path or self._want_local_channel is False or self.arena is None:
            return
        try:
            self._local = LocalChannel(path, self.timeout_s)
        except OSError as exc:
            log.info("local channel %s not reachable (%s): control calls use gRPC", path, exc)

    def _close_local_channel(self) -> None:
        if self._local is not None:
            self._local.close()
            self._local = None

    def _map_arena(self, arena: Any, identity: tuple[int, int]) -> None:
        """Maps the daemon's arena (`pb.Arena`), once the file at its path is proven to be the one
        the daemon maps: on this host (boot id) and the same file (`identity`: st_dev, st_ino).
        Otherwise page bytes go inline, or (shared_memory=True) ConnectionError."""
        self._unmap_arena()
        if self._want_shared_memory is False:
            return
        path, size = arena.shm_path, arena.size
        if arena.boot_id and arena.boot_id != boot_id():
            if self._want_shared_memory:
                raise ConnectionError(f"the daemon runs on another host: its arena {path!r} cannot be mapped")
            log.info("the daemon runs on another host: page bytes go inline")
            return
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            if self._want_shared_memory:
                raise ConnectionError(
                    f"cannot map the daemon's arena {path!r}: {exc.strerror}; "
                    f"connect with shared_memory=False to send bytes instead"
                ) from exc
            log.info("arena %s not reachable (%s): page bytes go inline", path, exc.strerror)
            return
        try:
            st = os.fstat(fd)
            if identity != (0, 0) and (st.st_dev, st.st_ino) != identity:
                message = f"the file at {path} is not the daemon's arena (the daemon restarted meanwhile?)"
                if self._want_shared_memory:
                    raise ConnectionError(message)
                log.warning("%s: page bytes go inline until the client connects again", message)
                return
            self._arena = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.arena = torch.frombuffer(self._arena, dtype=torch.uint8)
        if self._pin_arena is not False:
            self._register_arena()

    def _register_arena(self) -> None:
        """Pins the arena for DMA (cudaHostRegister) so kernels read and write it at PCIe speed."""
        if self.arena is None or not torch.cuda.is_available():
            return
        started = time.perf_counter()
        code = torch.cuda.cudart().cudaHostRegister(self.arena.data_ptr(), self.arena.numel(), 0)
        if int(code) != 0:
            log.warning(
                "cudaHostRegister of the %d MiB arena failed (error %d): transfers fall back to "
                "pageable speed; raise the memlock limit (LimitMEMLOCK=infinity)",
                self.arena.numel() >> 20,
                int(code),
            )
            return
        self._registered = True
        log.info(
            "registered the %d MiB arena with CUDA in %.2f s",
            self.arena.numel() >> 20,
            time.perf_counter() - started,
        )

    def _unmap_arena(self) -> None:
        """Drops the arena mapping once no transfer can touch it. The mapping itself goes when the
        last tensor viewing it does (closing it under a live view would fault)."""
        if self._registered and self.arena is not None:
            for stream in self._streams.values():
                stream.synchronize()
            for device in range(torch.cuda.device_count()):  # transfers on the caller's streams too
                torch.cuda.synchronize(device)
            torch.cuda.cudart().cudaHostUnregister(self.arena.data_ptr())
            self._registered = False
        self.arena = None
        self._arena = None
        self.epoch = 0

    @property
    def shared_memory(self) -> bool:
        return self.arena is not None

    def _renew(self, lease_ids: Sequence[int]) -> Sequence[int]:
        """Renews leases on the daemon (from the renewal thread); returns those still held."""
        request = pb.RenewRequest(namespace=self.namespace, lease_ids=lease_ids, epoch=self.epoch)
        renewed: Sequence[int] = self._rpc("Renew", request).renewed
        return renewed

    def close(self) -> None:
        self._renewer.stop()
        self._close_local_channel()
        self._gpu_pools.close()
        self._unmap_arena()
        self._channel.close()

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
            reply = self._call(
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
        pid, start_time = self._writer

        def reserve() -> pb.ReserveRequest:
            # The epoch says the pages are written in place (and fenced if the lease expires).
            return pb.ReserveRequest(
                namespace=self.namespace,
                keys=pack_keys(keys),
                epoch=self.epoch,
                writer_pid=pid if self.epoch else 0,
                writer_start_time=start_time if self.epoch else 0,
            )

        try:
            reply = self._call("Reserve", reserve) if keys else None
        except Unavailable:
            reply = None
        chunks = [i for i, offset in enumerate(reply.offsets) if offset >= 0] if reply else []
        if reply is None or not chunks:
            return StoreHandle(None, lambda: 0, _ignore, 0)
        epoch = self.epoch
        lease = pb.LeaseRequest(namespace=self.namespace, lease_id=reply.lease_id, epoch=epoch)
        self._renewer.hold(lease.lease_id)
        try:
            if self.arena is not None:
                offsets = [reply.offsets[i] for i in chunks]
                event = self._enqueue(
                    kvstore_kernels.gather, kv_caches, block_ids, chunks, self.arena, offsets, layers, stream
                )
            else:
                staging = torch.empty(len(chunks) * self.page_bytes, dtype=torch.uint8)
                offsets = [i * self.page_bytes for i in range(len(chunks))]
                kvstore_kernels.gather(self.spec, kv_caches, block_ids, chunks, staging, offsets, layers)
                self._put(reply.lease_id, staging)
                event = None
        except (Unavailable, NotFound) as exc:  # an inline Put the daemon did not take
            if isinstance(exc, Unavailable):
                self._lost(exc)
            else:  # the lease expired while the bytes were sent, or the daemon restarted
                log.warning("store lease %d: %s; nothing stored", lease.lease_id, exc)
            self._renewer.drop(lease.lease_id)
            return StoreHandle(None, lambda: 0, _ignore, 0)
        except BaseException:
            self._settle_transfers(kv_caches)
            self._abort_quietly(lease)
            raise

        handle = StoreHandle(
            event, lambda: self._commit(lease), lambda exc: self._abort_quietly(lease), len(chunks), chunks
        )
        self._renewer.owned_by(lease.lease_id, handle)  # a handle dropped unwaited: no more renewals
        return handle

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
            committed: int = self._rpc("Commit", lease).committed
        except KVStoreError as exc:
            if is_outage(exc):
                self._lost(exc)
            elif isinstance(exc, NotFound | FailedPrecondition):
                log.warning("store lease %d: %s; nothing stored", lease.lease_id, exc)
            else:
                raise
            return 0
        return committed

    def _settle_transfers(self, kv_caches: Any) -> None:
        """Waits for transfers a failed call may have enqueued, before its slots are given up."""
        device = cache_device(kv_caches)
        if device.type == "cuda":
            try:
                torch.cuda.synchronize(device)
            except Exception:
                log.debug("synchronizing after a failed transfer failed", exc_info=True)

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
        device = cache_device(kv_caches)
        asked = time.monotonic()  # the daemon's lease deadline is at least this + lease_ttl_s
        ahead = [block_ids, stream]

        def prepare() -> None:
            # While the Lookup is in flight (none of it depends on the reply): the block table of
            # every chunk that can hit, checked, and the side stream ordered after the caller's.
            # Nothing here may fail the call, whose reply holds a lease: what fails is done again
            # after the reply, where an error releases the lease.
            try:
                ahead[0] = kvstore_kernels.check_blocks(
                    self.spec, kv_caches, block_ids, len(keys), moved, writes_cache=True
                )
                if stream is None and device.type == "cuda":
                    side = self._side_stream(device)
                    side.wait_stream(torch.cuda.current_stream(device))
                    ahead[1] = side
            except Exception:
                log.debug(
                    "checking the block table ahead failed; it is checked with the scatter", exc_info=True
                )

        try:
            reply = (
                self._call(
                    "Lookup",
                    lambda: pb.LookupRequest(
                        namespace=self.namespace,
                        keys=pack_keys(keys),
                        lease=True,
                        gpu_pools=self._gpu_pools.readable(device),  # pools read in place
                        acquire=self.arena is not None,
                        epoch=self.epoch,
                    ),
                    prepare if self.arena is not None else None,
                )
                if keys
                else None
            )
        except Unavailable:
            reply = None
        if reply is None or reply.hit_chunks == 0:
            return LoadHandle(None, lambda: 0, _ignore, 0, moved)
        epoch = self.epoch
        lease = pb.LeaseRequest(namespace=self.namespace, lease_id=reply.lease_id, epoch=epoch)
        self._renewer.hold(lease.lease_id)
        layer_events: dict[int, torch.cuda.Event | None] | None = None
        block_ids, stream = ahead
        try:
            if self.arena is not None:
                # A daemon that answered the Acquire with the Lookup saves a round trip (older ones never do).
                acquired = reply.acquired if reply.HasField("acquired") else self._rpc("Acquire", lease)
                ready = acquired.ready_chunks
                pieces = self._gpu_pools.pieces(acquired, self.arena)  # the arena's chunks, each pool's
                runs = self.layerwise_runs
                groups = layer_groups(moved, runs) if layerwise and moved else [moved]
                scatter = kvstore_kernels.scatter
                if layerwise and self._registered and device.type == "cuda":
                    scatter = functools.partial(scatter, options=self.layerwise_options)
                scatter_for = functools.partial(self._gpu_pools.scatter_for, arena_scatter=scatter)
                events = [
                    [
                        self._enqueue(
                            scatter_for(buf), kv_caches, block_ids, chunks, buf, offsets, group, stream
                        )
                        for buf, chunks, offsets in pieces  # one stream: the last event follows them all
                    ][-1]
                    for group in groups
                ]
                event = events[-1]
                layer_events = {
                    layer: ev for group, ev in zip(groups, events, strict=True) for layer in group
                }
            else:
                staging = self._get(lease, reply.hit_chunks)
                ready = len(staging) // self.page_bytes
                offsets = [i * self.page_bytes for i in range(ready)]
                kvstore_kernels.scatter(
                    self.spec, kv_caches, block_ids, range(ready), staging, offsets, moved
                )
                event = None
        except KVStoreError as exc:
            if is_outage(exc):
                self._lost(exc)  # the lease went with the daemon
            elif isinstance(exc, NotFound):  # it expired (pages read back too slowly), or was reaped
                log.warning("load lease %d: %s; loading nothing", lease.lease_id, exc)
            else:
                self._release_quietly(lease)
                raise
            self._renewer.drop(lease.lease_id)
            return LoadHandle(None, lambda: 0, _ignore, 0, moved)
        except BaseException:
            self._settle_transfers(kv_caches)
            self._release_quietly(lease)
            raise
        tokens = ready * self.spec.page.chunk_tokens
        release_frame = LocalChannel.frame("Release", lease)  # made while the copy runs

        def release() -> int:
            self._renewer.drop(lease.lease_id)
            if self.epoch != epoch:  # the daemon restarted since the Lookup: trust nothing read
                log.debug("load lease %d: the daemon restarted during the copy; no tokens", lease.lease_id)
                return 0
            local = self._local
            if local is not None and time.monotonic() < asked + self.lease_ttl_s:
                # The copy ended while the lease held its pages (same host, same monotonic clock):
                # the tokens are valid whatever the Release answers, so it is sent without waiting.
                try:
                    local.send_frame("Release", release_frame)
                except Unavailable as exc:  # the lease expires on its own
                    log.debug("release of lease %d failed: %s", lease.lease_id, exc)
                return tokens
            if self._release_quietly(lease):
                return tokens
            log.warning("load lease %d expired during the copy; reporting no tokens loaded", lease.lease_id)
            return 0

        fail = lambda exc: self._release_quietly(lease)  # noqa: E731
        handle = LoadHandle(event, release, fail, tokens, moved, layer_events)
        self._renewer.owned_by(lease.lease_id, handle)
        return handle

    def _layer_range(self, layers: range | None) -> range:
        if layers is None:
            return range(self.spec.num_layers)
        if not isinstance(layers, range) or layers.step != 1:
            raise ValueError(f"layers: expected a range with step 1, got {layers!r}")
        if not 0 <= layers.start <= layers.stop <= self.spec.num_layers:
            raise ValueError(f"layers: {layers!r} is outside 0..{self.spec.num_layers} engine layers")
        return layers

    def _enqueue(
        self,
        transfer: Callable[..., None],
        kv_caches: Any,
        block_ids: Any,
        chunks: Sequence[int],
        buffer: torch.Tensor,
        offsets: list[int],
        layers: range | None,
        stream: Any,
    ) -> torch.cuda.Event | None:
        """Runs `transfer`; on CUDA enqueues it on a stream and returns its completion event."""
        device = cache_device(kv_caches)
        if device.type != "cuda":
            transfer(self.spec, kv_caches, block_ids, chunks, buffer, offsets, layers)
            return None
        if stream is None:
            stream = self._side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
        transfer(self.spec, kv_caches, block_ids, chunks, buffer, offsets, layers, stream=stream)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _side_stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def stats(self) -> dict[str, Any]:
        return stats_to_dict(self._call("Stats", pb.StatsRequest))

    def clear(self) -> int:
        """Drop every page of this client's namespace; returns how many."""
        pages: int = self._call("Clear", lambda: pb.ClearRequest(namespace=self.namespace)).pages
        return pages

    # -- inline data plane --------------------------------------------------

    def _put(self, lease_id: int, staging: torch.Tensor) -> None:
        data = memoryview(staging.numpy().data)
        step = self.max_message_bytes - 1024

        def messages() -> Iterator[pb.PutRequest]:
            yield pb.PutRequest(header=pb.PutHeader(namespace=self.namespace, lease_id=lease_id))
            for start in range(0, len(data), step):
                yield pb.PutRequest(data=bytes(data[start : start + step]))

        try:
            self._stub.Put(messages(), timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            error = from_rpc_error(exc, "Put")
            raise (Unavailable(str(error)) if is_outage(error) else error) from None

    def _get(self, lease: pb.LeaseRequest, pages: int) -> torch.Tensor:
        """A load lease's pages, streamed straight into one buffer; a short stream yields whole pages only."""
        staging = torch.empty(pages * self.page_bytes, dtype=torch.uint8)
        view, position = memoryview(staging.numpy().data).cast("B"), 0
        try:
            for message in self._stub.Get(lease, timeout=self.timeout_s, metadata=self._metadata):
                end = position + len(message.data)
                if end > len(view):
                    raise RuntimeError(f"Get returned more than the lease's {pages} pages")
                view[position:end] = message.data
                position = end
        except grpc.RpcError as exc:
            error = from_rpc_error(exc, "Get")
            raise (Unavailable(str(error)) if is_outage(error) else error) from None
        return staging[: position - position % self.page_bytes]

    def _abort_quietly(self, lease: pb.LeaseRequest) -> None:
        self._end_quietly("Abort", lease)

    def _release_quietly(self, lease: pb.LeaseRequest) -> bool:
        return self._end_quietly("Release", lease)

    def _end_quietly(self, method: str, lease: pb.LeaseRequest) -> bool:
        """Ends a lease (Abort or Release); whether the daemon did. A failure is logged only: the
        lease expires on its own, and the caller's own error matters more."""
        self._renewer.drop(lease.lease_id)
        if lease.epoch != self.epoch:
            return False  # the daemon that held it is gone
        try:
            self._rpc(method, lease)
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
