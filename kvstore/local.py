"""The local channel: the unary calls of kvstore.v1.KVStore on a plain unix socket.

Same-host workers make several control calls per request (Lookup, Acquire,
Release, Reserve, Commit); through gRPC each costs a full HTTP/2 round trip,
several times this channel's (bench/NOTES-control-plane.md). Here a call is one
frame each way, carrying the same protobuf messages to the same handlers:

    request:  u32 length (little-endian) | u8 method (index in UNARY_METHODS) | request message
    reply:    u32 length                 | u8 status (grpc.StatusCode value)  | reply message, or
                                                                                 the error text (UTF-8)

Replies come in the order of the requests, so a client may send a request without
reading its reply (it reads it with the next one's). The daemon answers each frame in
the event loop's read callback (an asyncio Protocol, no coroutine per frame); only a
handler that must wait (an Acquire of pages coming from disk) holds the frames behind it.
A request frame over `wire.MAX_REQUEST_BYTES` is refused before its body is read, and its
connection closed. The socket is guarded by its
file mode, like the gRPC socket; page bytes never travel here (they go through the arena).
A tenant's arena has no path (a sealed memfd, `kvstore.tiers.cpu.Arena`): the reply to a Connect
carries its descriptor (SCM_RIGHTS) to the tenant's member that asked.
Each connection knows its peer (pid, uid, gid and groups from the socket's credentials): that is
who the caller is (`kvstore.tenants`: its tenant, whether an admin), and a store lease taken on
it is fenced, if it expires, until that connection is closed and that process gone.
Connections are capped in all (`server.max_local_connections`), per uid
(`server.max_local_connections_per_uid`) and, with tenants, per tenant (its share: the total
over the number of tenants, so that no tenant's uids, however many, keep another's out). Past a
cap a new connection is answered with two frames and closed at once: a RESOURCE_EXHAUSTED that
says which cap (what a client reads as its first call's reply), then the caller's gRPC
credential (`tenants.Tenancy.credential`, in a ConnectResponse), so that a member still calls as
itself over gRPC. Refusals are counted (`refused_local_connections`), with one warning at most
every 10 s. Admins get ADMIN_RESERVE connections past the caps (`kvctl` while members fill
them); processes in no tenant get MAX_OUTSIDERS of their own, outside the members' caps.

`stop()` closes the listener and then the connections once the replies being awaited have
been sent (the daemon drains its leases before that: see `kvstore.daemon`).

With `poll_s` (`server.local_poll_ms`), the event loop does not sleep for that long after a
frame: a callback that queues itself again keeps the loop's select at a zero timeout, so the
daemon's thread stays on its core and a worker's next call is read as soon as it arrives,
where a loop that slept may first wait for its core to wake (slowest on virtual machines).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from google.protobuf.message import Message

from kvstore.claim import remove_stale_socket
from kvstore.errors import status_of
from kvstore.handlers import Handlers
from kvstore.peers import Peer
from kvstore.proto import kvstore_pb2 as pb
from kvstore.tenants import Caller
from kvstore.wire import (
    HEADER,
    MAX_REQUEST_BYTES,
    MEMFD_PREFIX,
    METHOD_NAMES,
    UNARY_METHODS,
    frame,
    parse_request,
)

log = logging.getLogger(__name__)

REFUSAL_WARNING_S = 10.0  # at most one warning this often about connections refused at the caps
MAX_OUTSIDERS = 16  # with tenants: connections of processes in no tenant open at once, at most
ADMIN_RESERVE = 16  # connections of admins past the caps, at most
# In a refusal's message: clients tell it from a call's own RESOURCE_EXHAUSTED by it
# (kvstore_client.connection, kvctl).
LOCAL_CHANNEL_FULL = "local channel is full"

_OK = 0
_INTERNAL = 13
_INVALID_ARGUMENT = 3
_RESOURCE_EXHAUSTED = 8


class LocalChannelServer:
    def __init__(
        self,
        handlers: Handlers,
        path: Path,
        poll_s: float = 0.0,
        max_connections: int = 1024,
        max_connections_per_uid: int = 256,
    ) -> None:
        self.handlers = handlers
        self.path = path
        self.poll_s = poll_s
        self.max_connections = max_connections
        self.max_connections_per_uid = max_connections_per_uid
        self._server: asyncio.Server | None = None
        self._sessions: set[_Session] = set()  # within the caps
        self._outsiders: set[_Session] = set()  # connections of processes in no tenant
        self._admins: set[_Session] = set()  # admins' connections past the caps
        self._per_uid: Counter[int] = Counter()
        self._per_tenant: Counter[str] = Counter()
        tenancy = handlers.tenancy
        self.max_connections_per_tenant = max(1, max_connections // len(tenancy.names))
        self._refused = 0  # connections closed at the caps since the last warning
        self._warned_at = -REFUSAL_WARNING_S
        self._poll_until = 0.0
        self._polling = False
        self.polls = 0  # turns of the loop spent polling (stats, tests)
        # Each method by its wire index: its name, request type and handler, looked up once here
        # rather than by name for every frame.
        self._methods = tuple(
            (name, request_type, getattr(handlers, name)) for name, (request_type, _) in UNARY_METHODS.items()
        )

    def _tenant_of(self, session: _Session) -> str | None:
        """The tenant a connection counts against (None: none, without tenants or for an admin
        in no tenant)."""
        if not self.handlers.tenancy.enabled or session.caller is None:
            return None
        return session.caller.tenant

    def _cap_reached(self, session: _Session) -> str:
        """The cap a new connection of `session`'s peer would pass, in words ("": none)."""
        uid, tenant = session.peer.uid, self._tenant_of(session)
        if len(self._sessions) >= self.max_connections:
            return f"{len(self._sessions)} connections are open (server.max_local_connections)"
        if self._per_uid[uid] >= self.max_connections_per_uid:
            return f"uid {uid} has {self._per_uid[uid]} open (server.max_local_connections_per_uid)"
        if tenant is not None and self._per_tenant[tenant] >= self.max_connections_per_tenant:
            return (
                f"tenant {tenant!r} has {self._per_tenant[tenant]} open, its share of "
                f"server.max_local_connections ({self.max_connections} over "
                f"{len(self.handlers.tenancy.names)} tenants)"
            )
        return ""

    def admit(self, session: _Session) -> bool:
        """Whether a new connection is within the caps (or an admin's, within ADMIN_RESERVE); one
        that is not is counted, `session.refused` says why, and a warning says so at most every
        REFUSAL_WARNING_S."""
        reached = self._cap_reached(session)
        if not reached:
            self._sessions.add(session)
            self._per_uid[session.peer.uid] += 1
            tenant = self._tenant_of(session)
            if tenant is not None:
                self._per_tenant[tenant] += 1
            return True
        if session.caller is not None and session.caller.admin and len(self._admins) < ADMIN_RESERVE:
            self._admins.add(session)
            return True
        session.refused = reached
        self._refused += 1
        self.handlers.counters["refused_local_connections"] += 1
        now = time.monotonic()
        if now - self._warned_at >= REFUSAL_WARNING_S:
            log.warning(
                "local channel: %d connection(s) refused in %.0f s at the caps (the last: %s); their "
                "calls go over gRPC",
                self._refused,
                min(now - self._warned_at, REFUSAL_WARNING_S),
                reached,
            )
            self._warned_at, self._refused = now, 0
        return False

    def refusal(self, session: _Session) -> bytes:
        """What a connection refused at the caps reads before it is closed: why, then the gRPC
        credential of the caller's tenant (it calls as itself there; none for an admin in no
        tenant, or without tenants, where gRPC needs none)."""
        message = (
            f"kvstored's {LOCAL_CHANNEL_FULL}: {session.refused}; this connection is refused: calls "
            f"go over gRPC"
        )
        frames = frame(_RESOURCE_EXHAUSTED, message.encode())
        caller = session.caller
        credential = self.handlers.tenancy.credential(caller) if caller is not None else ""
        if credential and caller is not None:
            reply = pb.ConnectResponse(tenant=caller.tenant, credential=credential)
            frames += frame(_OK, reply.SerializeToString())
        return frames

    def admit_outsider(self, session: _Session) -> bool:
        """A connection from a process in no tenant: kept (its calls are refused with the reason)
        while fewer than MAX_OUTSIDERS are open, else closed at once, counted."""
        if len(self._outsiders) < MAX_OUTSIDERS:
            self._outsiders.add(session)
            return True
        self.handlers.counters["refused_outsider_connections"] += 1
        return False

    def forget(self, session: _Session) -> None:
        self._outsiders.discard(session)
        self._admins.discard(session)
        if session in self._sessions:
            self._sessions.discard(session)
            _uncount(self._per_uid, session.peer.uid)
            tenant = self._tenant_of(session)
            if tenant is not None:
                _uncount(self._per_tenant, tenant)

    def keep_polling(self) -> None:
        """The loop polls, not sleeps, until `poll_s` after now (a frame just came)."""
        if self.poll_s <= 0:
            return
        loop = asyncio.get_running_loop()
        self._poll_until = loop.time() + self.poll_s
        if not self._polling:
            self._polling = True
            loop.call_soon(self._poll)

    def _poll(self) -> None:
        # A ready callback makes the loop's next select return at once: queued again, it keeps
        # the loop turning (reading every socket each turn) until the window ends.
        loop = asyncio.get_running_loop()
        if loop.time() < self._poll_until and self._server is not None:
            self.polls += 1
            loop.call_soon(self._poll)
        else:
            self._polling = False

    async def start(self, mode: int) -> None:
        remove_stale_socket(self.path)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Session(self), path=str(self.path))
        self.path.chmod(mode)

    async def stop(self, grace_s: float = 0.0) -> None:
        """Stops listening; each connection is closed once its awaited reply (if any) is sent,
        or after `grace_s`."""
        if self._server is not None:
            self._server.close()
            self._server = None  # ends a polling window
        waiting = [s._waiting for s in (*self._sessions, *self._admins) if s._waiting is not None]
        if waiting:
            await asyncio.wait(waiting, timeout=grace_s)
        for session in [*self._sessions, *self._outsiders, *self._admins]:
            session.close()
        self.path.unlink(missing_ok=True)

    def respond(self, method: int, payload: bytes, caller: Caller | None = None) -> bytes | Awaitable[bytes]:
        """The reply frame, or an awaitable of it where the handler must wait (Acquire)."""
        if method >= len(METHOD_NAMES):
            return frame(_INVALID_ARGUMENT, f"unknown local-channel method {method}".encode())
        name, request_type, handle = self._methods[method]
        started = time.perf_counter()
        try:
            reply = handle(parse_request(name, request_type, payload), caller)
        except Exception as exc:
            answer = _error_frame(name, exc)
        else:
            if not isinstance(reply, Message):  # an awaitable (isinstance is a tenth of isawaitable's cost)
                return self._later(name, reply, started)
            answer = frame(_OK, reply.SerializeToString())
            if name == "Connect" and reply.arena.shm_path.startswith(MEMFD_PREFIX):
                answer = WithFd(answer)
                answer.fd = self.handlers.arena_fd(caller)
        self.handlers.timings.observe("local", name, time.perf_counter() - started)
        return answer

    async def _later(self, name: str, pending: Awaitable[Any], started: float) -> bytes:
        try:
            reply = await pending
        except Exception as exc:
            answer = _error_frame(name, exc)
        else:
            answer = frame(_OK, reply.SerializeToString())
        self.handlers.timings.observe("local", name, time.perf_counter() - started)
        return answer


def _uncount(counts: Counter[Any], key: Any) -> None:
    counts[key] -= 1
    if not counts[key]:
        del counts[key]


class WithFd(bytes):
    """A reply frame sent with a descriptor (SCM_RIGHTS): a Connect's, with the sealed arena."""

    fd = -1


def _error_frame(name: str, exc: Exception) -> bytes:
    status = status_of(exc)
    if status is None:
        log.error("internal error in %s", name, exc_info=exc)
        return frame(_INTERNAL, f"internal error in kvstored: {exc!r} (see the daemon's log)".encode())
    code, message = status
    return frame(int(code), message.encode())


class _Session(asyncio.Protocol):
    """One worker's connection: frames answered in order, on the event loop's callbacks.

    A call whose handler answers at once (all but an Acquire that waits for pages) is answered
    inside `data_received`, with no task or stream coroutine per frame: the channel exists to
    make these calls cheap. A call that must wait holds the frames behind it until it is answered.
    """

    def __init__(self, server: LocalChannelServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._waiting: asyncio.Task[None] | None = None  # a reply being awaited: later frames queue
        self._paused_writing = False
        self.peer = Peer()
        self.caller: Caller | None = None
        self.refused = ""  # the cap it was refused at

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.peer = Peer.of_socket(sock)
        tenancy = self._server.handlers.tenancy
        self.caller = tenancy.of_peer(self.peer)
        # With tenants, a process in none (and no admin) takes no room under the caps from the
        # members: a few such connections at most, each answered with why it may do nothing.
        outsider = tenancy.enabled and self.caller.tenant is None and not self.caller.admin
        if outsider:
            admitted = self._server.admit_outsider(self)
        else:
            admitted = self._server.admit(self)
            if not admitted:  # told why, and how to call as itself over gRPC, before it is closed
                transport.write(self._server.refusal(self))  # type: ignore[attr-defined]
        if not admitted:
            transport.close()
            self._transport = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.forget(self)
        self._transport = None
        self.peer.connected = False

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # A worker that sends without reading fills the socket, and one whose reply is awaited (an
    # Acquire) may keep sending: its requests are not read meanwhile, so its buffer stays bounded.
    def pause_writing(self) -> None:
        self._paused_writing = True
        self._read_when_free()

    def resume_writing(self) -> None:
        self._paused_writing = False
        self._read_when_free()

    def _read_when_free(self) -> None:
        if self._transport is not None:
            if self._paused_writing or self._waiting is not None:
                self._transport.pause_reading()
            else:
                self._transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        transport = self._transport
        if not self._buffer and self._waiting is None and transport is not None and len(data) >= HEADER.size:
            length, method = HEADER.unpack_from(data)
            # One whole frame, as a worker's call sends it: answered from the bytes received, not
            # copied through the buffer (one over MAX_REQUEST_BYTES is refused by `_answer`).
            if len(data) == HEADER.size + length and length <= MAX_REQUEST_BYTES:
                server = self._server
                reply = server.respond(method, data[HEADER.size :], self.caller)
                server.keep_polling()
                if type(reply) is bytes:  # the usual reply: no descriptor, nothing to await
                    transport.write(reply)
                else:
                    self._send(reply)
                return
        self._buffer += data
        if self._waiting is None:
            self._answer()

    def _answer(self) -> None:
        buffer = self._buffer
        while self._transport is not None and len(buffer) >= HEADER.size:
            length, method = HEADER.unpack_from(buffer)
            if length > MAX_REQUEST_BYTES:  # refused before its bytes are read: the stream cannot go on
                message = f"a request frame of {length} bytes; at most {MAX_REQUEST_BYTES}: split it"
                self._transport.write(frame(_INVALID_ARGUMENT, message.encode()))
                self._transport.close()
                self._buffer = bytearray()
                return
            end = HEADER.size + length
            if len(buffer) < end:
                return
            payload = bytes(buffer[HEADER.size : end])
            if len(buffer) == end:
                buffer = self._buffer = bytearray()  # a bytearray never gives its capacity back
            else:
                del buffer[:end]
            reply = self._server.respond(method, payload, self.caller)
            self._server.keep_polling()
            if not self._send(reply):
                return

    def _send(self, reply: bytes | Awaitable[bytes]) -> bool:
        """Sends a reply frame; a reply still awaited holds the frames behind it (False)."""
        assert self._transport is not None
        if not isinstance(reply, bytes):
            self._waiting = asyncio.ensure_future(self._send_later(reply))
            self._read_when_free()
            return False
        if isinstance(reply, WithFd):
            self._send_with_fd(reply, reply.fd)
        else:
            self._transport.write(reply)
        return True

    def _send_with_fd(self, data: bytes, fd: int) -> None:
        """Sends `data` with `fd` attached, on a duplicate of the connection's socket (transports
        cannot send descriptors) while nothing is queued before it; else without it (the worker
        then sends page bytes inline)."""
        transport = self._transport
        assert transport is not None
        sock = transport.get_extra_info("socket")
        sent = 0
        if fd >= 0 and sock is not None and not transport.get_write_buffer_size():
            rights = array.array("i", [fd])
            with (
                socket.socket(fileno=os.dup(sock.fileno())) as dup,
                contextlib.suppress(BlockingIOError, InterruptedError),
            ):
                sent = dup.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
        if sent < len(data):
            transport.write(data[sent:])

    async def _send_later(self, pending: Awaitable[bytes]) -> None:
        try:
            reply = await pending
            if self._transport is not None:
                self._transport.write(reply)
        finally:
            self._waiting = None
            self._read_when_free()
        self._answer()
