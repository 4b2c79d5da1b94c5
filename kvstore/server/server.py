"""gRPC servicer: authorizes, calls the shared handlers (`handlers.py`), maps errors. Nothing else.

The caller is known by the bearer token its call carries (`kvstore.server.tenants`): none on the
unix socket is an anonymous caller (the one tenant of a daemon without tenants; nobody's, with
them); over TCP a token is required.

`_abort` is where errors become gRPC statuses (through `errors.status_of`). The inline page
bytes of Put and Get stream through `Handlers.put` / `Handlers.get` too.

Requests arrive as bytes and are parsed here (`wire.parse_request`), after the caller is
authorized: a unary request over `wire.MAX_REQUEST_BYTES` is refused before it is parsed, and
one that does not decode is INVALID_ARGUMENT with the parser's reason, never UNKNOWN.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection as grpc_reflection

from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.server.handlers import Handlers
from kvstore.server.tenants import Caller
from kvstore.shared.errors import InvalidArgument, Unauthenticated, status_of
from kvstore.shared.wire import MAX_FRAME_BYTES, UNARY_METHODS, parse_request

log = logging.getLogger(__name__)

_BEARER = "Bearer "
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Ends the call with the status code for `exc`: the one place errors become statuses."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    status = status_of(exc)
    if status is not None:
        code, message = status
        await context.abort(grpc.StatusCode[code.name], message)
    log.error("internal error", exc_info=exc)
    await context.abort(
        grpc.StatusCode.INTERNAL, f"internal error in kvstored: {exc!r} (see the daemon's log)"
    )


def _unary(name: str) -> Callable[..., Awaitable[Any]]:
    """The gRPC method `name`: authorize, call the shared handler, map any error to a status."""

    request_type = UNARY_METHODS[name][0]

    async def rpc(self: KVStoreServicer, payload: bytes, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        try:
            caller = self._caller(context)
            reply = getattr(self.handlers, name)(parse_request(name, request_type, payload), caller)
            return await reply if inspect.isawaitable(reply) else reply
        except Exception as exc:
            await _abort(context, exc)
            raise  # unreachable: _abort always raises
        finally:
            self.handlers.timings.observe("grpc", name, time.perf_counter() - started)

    rpc.__name__ = name
    return rpc


class KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(self, handlers: Handlers, auth_token: str | None) -> None:
        self.handlers = handlers
        self.max_message_bytes = handlers.max_message_bytes
        self.data_bytes = handlers.max_message_bytes - 1024  # room for the message's own framing
        self.auth_token = auth_token

    def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        sent = dict(context.invocation_metadata() or ()).get("authorization")
        unix = context.peer().startswith("unix:")
        token = None
        if sent is not None:
            if not isinstance(sent, str) or not sent.startswith(_BEARER):
                raise Unauthenticated("the authorization metadata must be 'Bearer <token>'")
            token = sent[len(_BEARER) :]
        elif self.auth_token is not None and not unix:
            raise Unauthenticated(
                "TCP clients must send 'authorization: Bearer <token>' metadata "
                "with the daemon's server.auth_token or their tenant's token"
            )
        return self.handlers.tenancy.of_token(token, unix)

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
    Lend = _unary("Lend")  # refused there: the lender's process is known on the local channel only
    Lends = _unary("Lends")
    Returned = _unary("Returned")

    async def ArenaSlabs(self, payload: bytes, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            "ArenaSlabs hands descriptors: it is answered on the daemon's local channel only "
            "(ConnectResponse.local_socket)",
        )

    async def Put(self, payloads: AsyncIterator[bytes], context: Any) -> pb.PutResponse:
        started = time.perf_counter()
        try:
            caller = self._caller(context)
            return await self.handlers.put(_parsed_puts(payloads), caller)
        except Exception as exc:
            await _abort(context, exc)
            raise  # unreachable: _abort always raises
        finally:
            self.handlers.timings.observe("grpc", "Put", time.perf_counter() - started)

    async def Get(self, payload: bytes, context: grpc.aio.ServicerContext) -> None:
        started = time.perf_counter()
        try:
            caller = self._caller(context)
            request = parse_request("Get", pb.LeaseRequest, payload)
            async for data in self.handlers.get(request, self.data_bytes, caller):
                await context.write(pb.GetResponse(data=data))
        except Exception as exc:
            await _abort(context, exc)
        finally:
            self.handlers.timings.observe("grpc", "Get", time.perf_counter() - started)

    async def Events(self, payload: bytes, context: grpc.aio.ServicerContext) -> None:
        try:
            caller = self._caller(context)
            request = parse_request("Events", pb.EventsRequest, payload)
            # Closed here, not when collected: the stream stops counting against the caps at once.
            async with contextlib.aclosing(self.handlers.follow(request, caller)) as batches:
                async for batch in batches:
                    await context.write(batch)
        except Exception as exc:
            await _abort(context, exc)


async def _parsed_puts(payloads: AsyncIterator[bytes]) -> AsyncIterator[pb.PutRequest]:
    """A Put's messages, each parsed as it comes (a data message may be up to max_message_bytes)."""
    async for payload in payloads:
        try:
            yield pb.PutRequest.FromString(payload)
        except DecodeError as exc:
            raise InvalidArgument(f"Put: a message is not a PutRequest ({exc})") from None


def _raw_handlers(servicer: KVStoreServicer) -> grpc.GenericRpcHandler:
    """kvstore.v1.KVStore's methods taking their requests as bytes (no deserializer): the
    servicer parses them, so a bad one is its error to report."""
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            response_serializer=reply_type.SerializeToString,  # type: ignore[attr-defined]
        )
        for name, (_, reply_type) in UNARY_METHODS.items()
    }
    handlers["Put"] = grpc.stream_unary_rpc_method_handler(
        servicer.Put, response_serializer=pb.PutResponse.SerializeToString
    )
    handlers["Get"] = grpc.unary_stream_rpc_method_handler(
        servicer.Get, response_serializer=pb.GetResponse.SerializeToString
    )
    handlers["Events"] = grpc.unary_stream_rpc_method_handler(
        servicer.Events, response_serializer=pb.EventBatch.SerializeToString
    )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def create_server(
    servicer: KVStoreServicer, health_servicer: health.aio.HealthServicer, reflection: bool = True
) -> grpc.aio.Server:
    """A server with the KV store, health and (unless `reflection` is False: the TCP listener, where
    it would answer without a token) reflection services; ports are added by the caller."""
    limit = servicer.max_message_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),  # what a caller can make the daemon read
            ("grpc.max_send_message_length", max(limit, MAX_FRAME_BYTES)),  # a Stats of many namespaces
        ]
    )
    server.add_generic_rpc_handlers((_raw_handlers(servicer),))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflection:
        grpc_reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                grpc_reflection.SERVICE_NAME,
            ),
            server,
        )
    return server
