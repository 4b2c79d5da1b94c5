"""The local channel: the unary calls of kvstore.v1.KVStore on a plain unix socket.

Same-host workers make several control calls per request (Lookup, Acquire,
Release, Reserve, Commit); through gRPC each costs a full HTTP/2 round trip
(about 0.5 ms on the GPU host). Here a call is one frame each way, carrying the
same protobuf messages to the same handlers:

    request:  u32 length (little-endian) | u8 method (index in UNARY_METHODS) | request message
    reply:    u32 length                 | u8 status (grpc.StatusCode value)  | reply message, or
                                                                                 the error text (UTF-8)

The socket is guarded by its file mode, like the gRPC socket; page bytes never
travel here (they go through the arena).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import struct
from pathlib import Path

from google.protobuf.message import DecodeError

from kvstore.errors import status_of
from kvstore.handlers import UNARY_METHODS, Handlers

log = logging.getLogger(__name__)

HEADER = struct.Struct("<IB")
METHOD_NAMES = tuple(UNARY_METHODS)
MAX_FRAME_BYTES = 16 << 20
_OK = 0
_INTERNAL = 13
_INVALID_ARGUMENT = 3


def frame(code: int, body: bytes) -> bytes:
    return HEADER.pack(len(body), code) + body


class LocalChannelServer:
    def __init__(self, handlers: Handlers, path: Path) -> None:
        self.handlers = handlers
        self.path = path
        self._server: asyncio.Server | None = None
        self._sessions: set[asyncio.StreamWriter] = set()

    async def start(self, mode: int) -> None:
        self.path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._session, path=str(self.path))
        self.path.chmod(mode)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._sessions):
            writer.close()
        self.path.unlink(missing_ok=True)

    async def call(self, method: int, payload: bytes) -> bytes:
        """One request frame's reply frame; every outcome is a frame, never an exception."""
        if method >= len(METHOD_NAMES):
            return frame(_INVALID_ARGUMENT, f"unknown local-channel method {method}".encode())
        name = METHOD_NAMES[method]
        request_type, _ = UNARY_METHODS[name]
        try:
            request = request_type.FromString(payload)  # type: ignore[attr-defined]
        except DecodeError as exc:
            return frame(
                _INVALID_ARGUMENT, f"{name}: the request is not a {request_type.__name__} ({exc})".encode()
            )
        try:
            reply = getattr(self.handlers, name)(request)
            if inspect.isawaitable(reply):
                reply = await reply
        except Exception as exc:
            status = status_of(exc)
            if status is None:
                log.error("internal error in %s", name, exc_info=exc)
                return frame(
                    _INTERNAL, f"internal error in kvstored: {exc!r} (see the daemon's log)".encode()
                )
            code, message = status
            return frame(code.value[0], message.encode())
        return frame(_OK, reply.SerializeToString())

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._sessions.add(writer)
        try:
            while True:
                try:
                    header = await reader.readexactly(HEADER.size)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length, method = HEADER.unpack(header)
                if length > MAX_FRAME_BYTES:
                    writer.write(frame(_INVALID_ARGUMENT, f"frame of {length} bytes is too large".encode()))
                    return
                payload = await reader.readexactly(length)
                writer.write(await self.call(method, payload))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            self._sessions.discard(writer)
            writer.close()
