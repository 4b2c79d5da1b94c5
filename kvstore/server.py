"""gRPC servicer: authorizes, calls the shared handlers (`handlers.py`), maps errors. Nothing else.

`_abort` is where errors become gRPC statuses (through `errors.status_of`). Inline page
bytes (Put/Get) go through the CPU tier's read/write, checked against the lease
before every write so a lease that expired mid-stream can never write a slot
that has been handed to someone else.
"""

from __future__ import annotations

import hmac
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.errors import InvalidArgument, NotFound, Unauthenticated, status_of
from kvstore.handlers import Handlers
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Ends the call with the status code for `exc`: the one place errors become statuses."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    status = status_of(exc)
    if status is not None:
        await context.abort(*status)
    log.error("internal error", exc_info=exc)
    await context.abort(
        grpc.StatusCode.INTERNAL, f"internal error in kvstored: {exc!r} (see the daemon's log)"
    )


def _unary(name: str) -> Callable[..., Awaitable[Any]]:
    """The gRPC method `name`: authorize, call the shared handler, map any error to a status."""

    async def rpc(self: KVStoreServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            self._authorize(context)
            reply = getattr(self.handlers, name)(request)
            return await reply if inspect.isawaitable(reply) else reply
        except Exception as exc:
            await _abort(context, exc)
            raise  # unreachable: _abort always raises

    rpc.__name__ = name
    return rpc


class KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(self, handlers: Handlers, auth_token: str | None) -> None:
        self.handlers = handlers
        self.store = handlers.store
        self.max_message_bytes = handlers.max_message_bytes
        self.data_bytes = handlers.max_message_bytes - 1024  # room for the message's own framing
        self.auth_token = auth_token

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if self.auth_token is None or context.peer().startswith("unix:"):
            return
        sent = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(str(sent), f"Bearer {self.auth_token}"):
            raise Unauthenticated(
                "TCP clients must send 'authorization: Bearer <token>' metadata "
                "with the daemon's server.auth_token"
            )

    Connect = _unary("Connect")
    Lookup = _unary("Lookup")
    Reserve = _unary("Reserve")
    Commit = _unary("Commit")
    Abort = _unary("Abort")
    Acquire = _unary("Acquire")
    Release = _unary("Release")
    Stats = _unary("Stats")
    Clear = _unary("Clear")
    Pin = _unary("Pin")
    Renew = _unary("Renew")

    async def Put(self, request_iterator: AsyncIterator[pb.PutRequest], context: Any) -> pb.PutResponse:
        try:
            self._authorize(context)
            return await self._put(request_iterator)
        except Exception as exc:
            await _abort(context, exc)
            raise  # unreachable: _abort always raises

    async def _put(self, request_iterator: AsyncIterator[pb.PutRequest]) -> pb.PutResponse:
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
            if inspect.isawaitable(result):
                result = await result
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
