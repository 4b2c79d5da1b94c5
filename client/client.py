"""KVStoreClient: a worker's connection to kvstored.

- `lookup(tokens)`: tokens in the longest stored prefix.
- `store(tokens, kv_caches, block_ids)`: Reserve -> gather pages -> Commit.
- `load(tokens, kv_caches, block_ids)`: Lookup(lease) -> Acquire -> scatter -> Release.

On the daemon's host the client maps the daemon's shared-memory arena and the
kernels read and write pages in place; otherwise (`shared_memory=False`, or a
remote daemon) page bytes travel inline through Put/Get.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterator
from typing import Any

import grpc
import torch

import kvstore_kernels
from kvstore.errors import NotFound, from_rpc_error
from kvstore.keys import chunk_keys, pack_keys
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.spec import KVSpec
from kvstore.stats import stats_to_dict

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
_CHANNEL_LIMIT = 64 << 20
_NOT_REGISTERED = "is not registered with this daemon"


def default_address() -> str:
    from kvstore.config import default_socket_path

    return f"unix://{default_socket_path()}"


class KVStoreClient:
    def __init__(self, address: str, spec: KVSpec, shared_memory: bool | None = None,
                 token: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, name: str = "") -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.name = name or f"pid-{os.getpid()}"
        self._want_shared_memory = shared_memory
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        options = [("grpc.max_receive_message_length", _CHANNEL_LIMIT),
                   ("grpc.max_send_message_length", _CHANNEL_LIMIT)]
        self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._requested_spec = spec
        self._arena: mmap.mmap | None = None
        self.arena: torch.Tensor | None = None
        try:
            self._handshake()
        except BaseException:
            self.close()
            raise

    @classmethod
    def connect(cls, address: str | None = None, spec: KVSpec | None = None, *,
                shared_memory: bool | None = None, token: str | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S, name: str = "") -> KVStoreClient:
        """Connect to kvstored at `address` (default: the default config's unix socket).

        `shared_memory`: None maps the arena when the daemon's is reachable on this host,
        True requires it, False always sends page bytes inline.
        """
        if spec is None:
            raise ValueError("spec: a KVSpec describing this worker's KV cache is required")
        return cls(address or default_address(), spec, shared_memory, token, timeout_s, name)

    # -- connection ---------------------------------------------------------

    def _rpc(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, method) from None

    def _handshake(self) -> None:
        spec = self._requested_spec
        page = spec._page(spec.chunk_tokens or spec.block_size)
        request = pb.ConnectRequest(client_name=self.name, spec=pb.PageSpec(
            model=page.model, num_layers=page.num_layers, num_kv_heads=page.num_kv_heads,
            head_dim=page.head_dim, dtype=page.dtype, chunk_tokens=spec.chunk_tokens or 0,
            latent=page.latent, kv_sharing=dict(page.kv_sharing), tp_rank=page.tp_rank,
            tp_size=page.tp_size, salt=page.salt))
        reply = self._rpc("Connect", request)
        self.spec = spec.with_chunk_tokens(reply.chunk_tokens)
        if reply.chunk_tokens % spec.block_size:
            raise ValueError(f"chunk_tokens: the daemon's {reply.chunk_tokens} is not a multiple of "
                             f"block_size {spec.block_size}; pass KVSpec(chunk_tokens=...)")
        self.namespace: bytes = reply.namespace
        self.page_bytes: int = reply.page_bytes
        self.max_message_bytes: int = reply.max_message_bytes
        if self.spec.page.namespace() != self.namespace or self.spec.page.page_bytes != self.page_bytes:
            raise RuntimeError("the daemon computed another namespace or page size for this spec: "
                               "client and daemon run incompatible kvstore versions")
        self._map_arena(reply.arena.shm_path, reply.arena.size)

    def _map_arena(self, path: str, size: int) -> None:
        self._unmap_arena()
        if self._want_shared_memory is False:
            return
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            if self._want_shared_memory:
                raise ConnectionError(f"cannot map the daemon's arena {path!r}: {exc.strerror}; "
                                      f"connect with shared_memory=False to send bytes instead") from exc
            log.info("arena %s not reachable (%s): page bytes go inline", path, exc.strerror)
            return
        try:
            self._arena = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.arena = torch.frombuffer(self._arena, dtype=torch.uint8)

    def _unmap_arena(self) -> None:
        self.arena = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    @property
    def shared_memory(self) -> bool:
        return self.arena is not None

    def _first_rpc(self, method: str, make_request: Any) -> Any:
        """Call `method`, reconnecting once if the daemon restarted and forgot our namespace."""
        try:
            return self._rpc(method, make_request())
        except NotFound as exc:
            if _NOT_REGISTERED not in str(exc):
                raise
            log.warning("kvstored restarted: connecting again")
            self._handshake()
            return self._rpc(method, make_request())

    def close(self) -> None:
        self._unmap_arena()
        self._channel.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- API ----------------------------------------------------------------

    def keys(self, token_ids: Any) -> list[bytes]:
        """Keys of the whole chunks of `token_ids`."""
        return chunk_keys(self.namespace, token_ids, self.spec.page.chunk_tokens)

    def lookup(self, token_ids: Any) -> int:
        """Number of leading tokens whose KV is stored (a multiple of chunk_tokens)."""
        keys = self.keys(token_ids)
        if not keys:
            return 0
        reply = self._first_rpc("Lookup", lambda: pb.LookupRequest(namespace=self.namespace,
                                                                    keys=pack_keys(keys)))
        return reply.hit_chunks * self.spec.page.chunk_tokens

    def store(self, token_ids: Any, kv_caches: Any, block_ids: Any, layers: range | None = None) -> int:
        """Store the whole chunks of `token_ids` from the KV cache; returns how many were new."""
        keys = self.keys(token_ids)
        if not keys:
            return 0
        reply = self._first_rpc("Reserve", lambda: pb.ReserveRequest(namespace=self.namespace,
                                                                      keys=pack_keys(keys)))
        chunks = [i for i, offset in enumerate(reply.offsets) if offset >= 0]
        if not chunks:
            return 0
        lease = pb.LeaseRequest(namespace=self.namespace, lease_id=reply.lease_id)
        try:
            if self.arena is not None:
                offsets = [reply.offsets[i] for i in chunks]
                kvstore_kernels.gather(self.spec, kv_caches, block_ids, chunks, self.arena, offsets, layers)
            else:
                staging = torch.empty(len(chunks) * self.page_bytes, dtype=torch.uint8)
                offsets = [i * self.page_bytes for i in range(len(chunks))]
                kvstore_kernels.gather(self.spec, kv_caches, block_ids, chunks, staging, offsets, layers)
                self._put(reply.lease_id, staging)
        except BaseException:
            self._abort_quietly(lease)
            raise
        committed: int = self._rpc("Commit", lease).committed
        return committed

    def load(self, token_ids: Any, kv_caches: Any, block_ids: Any, layers: range | None = None) -> int:
        """Load the longest stored prefix of `token_ids` into the KV cache; returns tokens loaded."""
        keys = self.keys(token_ids)
        if not keys:
            return 0
        reply = self._first_rpc("Lookup", lambda: pb.LookupRequest(namespace=self.namespace,
                                                                    keys=pack_keys(keys), lease=True))
        if reply.hit_chunks == 0:
            return 0
        lease = pb.LeaseRequest(namespace=self.namespace, lease_id=reply.lease_id)
        try:
            if self.arena is not None:
                acquired = self._rpc("Acquire", lease)
                ready = acquired.ready_chunks
                kvstore_kernels.scatter(self.spec, kv_caches, block_ids, range(ready), self.arena,
                                        list(acquired.offsets)[:ready], layers)
            else:
                staging = self._get(lease)
                ready = len(staging) // self.page_bytes
                offsets = [i * self.page_bytes for i in range(ready)]
                kvstore_kernels.scatter(self.spec, kv_caches, block_ids, range(ready), staging, offsets, layers)
        finally:
            released = self._release_quietly(lease)
        if not released:
            # The lease lapsed while we read: its slots may have been reused, so trust nothing.
            log.warning("load lease %d expired during the copy; reporting no tokens loaded", lease.lease_id)
            return 0
        return ready * self.spec.page.chunk_tokens

    def stats(self) -> dict[str, Any]:
        return stats_to_dict(self._rpc("Stats", pb.StatsRequest()))

    def clear(self) -> int:
        """Drop every page of this client's namespace; returns how many."""
        pages: int = self._rpc("Clear", pb.ClearRequest(namespace=self.namespace)).pages
        return pages

    # -- inline data plane --------------------------------------------------

    def _put(self, lease_id: int, staging: torch.Tensor) -> None:
        data = memoryview(staging.numpy().data)
        step = self.max_message_bytes - 1024

        def messages() -> Iterator[pb.PutRequest]:
            yield pb.PutRequest(header=pb.PutHeader(namespace=self.namespace, lease_id=lease_id))
            for start in range(0, len(data), step):
                yield pb.PutRequest(data=bytes(data[start : start + step]))

        self._rpc("Put", messages())

    def _get(self, lease: pb.LeaseRequest) -> torch.Tensor:
        try:
            parts = [m.data for m in self._stub.Get(lease, timeout=self.timeout_s, metadata=self._metadata)]
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, "Get") from None
        data = bytearray(b"".join(parts))
        usable = len(data) - len(data) % self.page_bytes
        return torch.frombuffer(data, dtype=torch.uint8)[:usable] if usable else torch.empty(0, dtype=torch.uint8)

    def _abort_quietly(self, lease: pb.LeaseRequest) -> None:
        try:
            self._rpc("Abort", lease)
        except Exception as exc:  # the lease expires on its own; the caller's error matters more
            log.warning("abort of lease %d failed: %s", lease.lease_id, exc)

    def _release_quietly(self, lease: pb.LeaseRequest) -> bool:
        try:
            self._rpc("Release", lease)
            return True
        except Exception as exc:
            log.warning("release of lease %d failed: %s", lease.lease_id, exc)
            return False
