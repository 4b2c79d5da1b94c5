"""gRPC servicer: converts messages, calls the store, converts results. Nothing else.

`_abort` is the one place where errors become status codes (`errors.STATUS_CODES`). Inline page
bytes (Put/Get) go through the CPU tier's read/write, checked against the lease
before every write so a lease that expired mid-stream can never write a slot
that has been handed to someone else.
"""

from __future__ import annotations

import functools
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore import __version__
from kvstore.errors import STATUS_CODES, InvalidArgument, KVStoreError, NotFound, Unauthenticated
from kvstore.keys import unpack_keys
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.spec import PageSpec
from kvstore.stats import stats_message
from kvstore.store import Store

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
R = TypeVar("R")


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Ends the call with the status code for `exc`: the one place errors become statuses."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    if type(exc) is ValueError:  # validation in shared modules (keys, spec) raises ValueError
        exc = InvalidArgument(str(exc))
    if isinstance(exc, KVStoreError):
        await context.abort(STATUS_CODES[type(exc)], str(exc))
    log.error("internal error", exc_info=exc)
    await context.abort(
        grpc.StatusCode.INTERNAL, f"internal error in kvstored: {exc!r} (see the daemon's log)"
    )


def _unary(method: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    @functools.wraps(method)
    async def wrapper(self: KVStoreServicer, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            self._authorize(context)
            return await method(self, request, context)
        except Exception as exc:
            await _abort(context, exc)
            raise  # unreachable: _abort always raises

    return wrapper


def _ttl(ms: int) -> float | None:
    return ms / 1000 if ms else None


def page_spec(msg: pb.PageSpec, default_chunk_tokens: int) -> PageSpec:
    return PageSpec(
        model=msg.model,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        dtype=msg.dtype,
        chunk_tokens=msg.chunk_tokens or default_chunk_tokens,
        latent=msg.latent,
        kv_sharing=tuple(msg.kv_sharing.items()),
        tp_rank=msg.tp_rank,
        tp_size=msg.tp_size or 1,
        salt=msg.salt,
    )


class KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(
        self, store: Store, chunk_tokens: int, max_message_bytes: int, shm_path: str, auth_token: str | None
    ) -> None:
        self.store = store
        self.chunk_tokens = chunk_tokens
        self.max_message_bytes = max_message_bytes
        self.data_bytes = max_message_bytes - 1024  # room for the message's own framing
        self.shm_path = shm_path
        self.auth_token = auth_token
        self.started = time.monotonic()

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if self.auth_token is None or context.peer().startswith("unix:"):
            return
        sent = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(str(sent), f"Bearer {self.auth_token}"):
            raise Unauthenticated(
                "TCP clients must send 'authorization: Bearer <token>' metadata "
                "with the daemon's server.auth_token"
            )

    @_unary
    async def Connect(self, request: pb.ConnectRequest, context: Any) -> pb.ConnectResponse:
        ns = self.store.connect(page_spec(request.spec, self.chunk_tokens))
        return pb.ConnectResponse(
            namespace=ns.id,
            chunk_tokens=ns.spec.chunk_tokens,
            page_bytes=ns.spec.page_bytes,
            arena=pb.Arena(shm_path=self.shm_path, size=self.store.cpu.arena.size),
            lease_ttl_ms=int(self.store.lease_ttl_s * 1000),
            max_message_bytes=self.max_message_bytes,
        )

    @_unary
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        result = self.store.lookup(
            request.namespace, unpack_keys(request.keys), request.lease, _ttl(request.lease_ttl_ms)
        )
        return pb.LookupResponse(
            hit_chunks=result.hit_chunks, tiers=result.tiers, lease_id=result.lease_id
        )

    @_unary
    async def Reserve(self, request: pb.ReserveRequest, context: Any) -> pb.ReserveResponse:
        result = self.store.reserve(request.namespace, unpack_keys(request.keys), _ttl(request.lease_ttl_ms))
        return pb.ReserveResponse(lease_id=result.lease_id, offsets=result.offsets)

    @_unary
    async def Commit(self, request: pb.LeaseRequest, context: Any) -> pb.CommitResponse:
        return pb.CommitResponse(committed=self.store.commit(request.namespace, request.lease_id))

    @_unary
    async def Abort(self, request: pb.LeaseRequest, context: Any) -> pb.LeaseResponse:
        return pb.LeaseResponse(pages=self.store.abort(request.namespace, request.lease_id))

    @_unary
    async def Acquire(self, request: pb.LeaseRequest, context: Any) -> pb.AcquireResponse:
        result = self.store.acquire(request.namespace, request.lease_id)
        return pb.AcquireResponse(
            ready_chunks=len(result.offsets), offsets=result.offsets, page_bytes=result.page_bytes
        )

    @_unary
    async def Release(self, request: pb.LeaseRequest, context: Any) -> pb.LeaseResponse:
        return pb.LeaseResponse(pages=self.store.release(request.namespace, request.lease_id))

    @_unary
    async def Put(self, request_iterator: AsyncIterator[pb.PutRequest], context: Any) -> pb.PutResponse:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidArgument("Put: the first message must be a PutHeader naming the store lease")
        lease, slots = self.store.begin_put(first.header.namespace, first.header.lease_id)
        try:
            position = await self._write_pages(lease.id, slots.offsets, slots.page_bytes, request_iterator)
        except BaseException as exc:
            self.store.end_put(lease, f"its Put failed part-way ({exc})")
            raise
        self.store.end_put(lease)
        return pb.PutResponse(bytes_written=position)

    async def _write_pages(
        self, lease_id: int, offsets: list[int], page_bytes: int, messages: AsyncIterator[pb.PutRequest]
    ) -> int:
        lease = self.store.leases.get(lease_id)
        total, position = len(offsets) * page_bytes, 0
        async for message in messages:
            if message.WhichOneof("part") != "data":
                raise InvalidArgument("Put: only the first message may be a PutHeader; the rest carry data")
            data = memoryview(message.data)
            if position + len(data) > total:
                raise InvalidArgument(
                    f"Put: more than the {total} bytes of the lease's "
                    f"{len(offsets)} pages of {page_bytes} bytes"
                )
            if self.store.leases.get(lease_id) is not lease:
                raise NotFound(f"lease {lease_id} expired while its pages were being written")
            while data:
                page, within = divmod(position, page_bytes)
                n = min(page_bytes - within, len(data))
                self.store.cpu.write(offsets[page], data[:n], within)
                data, position = data[n:], position + n
        if position != total:
            raise InvalidArgument(
                f"Put: received {position} bytes; the lease's {len(offsets)} pages "
                f"of {page_bytes} bytes need exactly {total}"
            )
        return position

    async def Get(self, request: pb.LeaseRequest, context: grpc.aio.ServicerContext) -> None:
        try:
            self._authorize(context)
            result = self.store.acquire(request.namespace, request.lease_id)
            lease = self.store.leases.get(request.lease_id)
            for offset in result.offsets:
                for start in range(0, result.page_bytes, self.data_bytes):
                    if self.store.leases.get(request.lease_id) is not lease:
                        raise NotFound(f"lease {request.lease_id} expired while its pages were being read")
                    length = min(self.data_bytes, result.page_bytes - start)
                    await context.write(
                        pb.GetResponse(data=bytes(self.store.cpu.read(offset + start, length)))
                    )
        except Exception as exc:
            await _abort(context, exc)

    @_unary
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        return stats_message(self.store.stats(), __version__, time.monotonic() - self.started)

    @_unary
    async def Clear(self, request: pb.ClearRequest, context: Any) -> pb.ClearResponse:
        return pb.ClearResponse(pages=self.store.clear(request.namespace or None))


def create_server(servicer: KVStoreServicer, health_servicer: health.aio.HealthServicer) -> grpc.aio.Server:
    """A server with the KV store, health and reflection services; ports are added by the caller."""
    limit = servicer.max_message_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ]
    )
    pb_grpc.add_KVStoreServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    return server
