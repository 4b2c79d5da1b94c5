"""The local channel: the unary calls of kvstore.v1.KVStore on a plain unix socket.

Same-host workers make several control calls per request (Lookup, Acquire,
Release, Reserve, Commit); through gRPC each costs a full HTTP/2 round trip,
several times this channel's (bench/NOTES-control-plane.md). Here a call is one
frame each way, carrying the same protobuf messages to the same handlers:

    request:  u32 length (little-endian) | u8 method (index in UNARY_METHODS) | request message
    reply:    u32 length                 | u8 status (grpc.StatusCode value)  | reply message, or
                                                                                 the error text (UTF-8)

One method is not a message: QUERY, a plain Lookup's namespace and keys, answered with its hit
count and tiers (`wire.QUERY`), the call a scheduler makes most.

Replies come in the order of the requests, so a client may send a request without
reading its reply (it reads it with the next one's). The daemon answers each frame in
the event loop's read callback (an asyncio Protocol, no coroutine per frame), but for the
lease calls (`local_turns`), answered one a turn of the loop after the calls that came with
them, and a handler that must wait (an Acquire of pages coming from disk): either holds the
frames behind it. A request frame over `wire.MAX_REQUEST_BYTES` is refused before its body is
read, and its connection closed. The socket is guarded by its file mode, like the gRPC socket;
page bytes never travel here (they go through the arena).
A tenant's arena has no path (a sealed memfd, `kvstore.tiers.cpu.Arena`): the reply to a Connect
carries its descriptor (SCM_RIGHTS) to the tenant's member that asked.
Each connection knows its peer (pid, uid, gid and groups from the socket's credentials): that is
who the caller is (`kvstore.server.tenants`: its tenant, whether an admin), and a store lease taken on
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
been sent (the daemon drains its leases before that: see `kvstore.server.daemon`).

With `poll_s` (`server.local_poll_ms`), the loop does not sleep for that long after a frame
(a callback queuing itself keeps its select at a zero timeout): a worker's next call is read
at once, not after the daemon's core wakes (slowest on virtual machines).

Here: `LocalChannelServer` (listen, answer, poll, stop) and each connection's protocol; the
caps and refusals in `local_caps`, the status codes, error replies and descriptors in `local_frames`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from google.protobuf.message import Message

from kvstore.config.claim import remove_stale_socket
from kvstore.server.handlers import Handlers
from kvstore.server.local_caps import ADMIN_RESERVE, LOCAL_CHANNEL_FULL, ConnectionCaps
from kvstore.server.local_frames import INVALID_ARGUMENT, OK, WithFd, error_frame, send_with_fd
from kvstore.server.local_turns import LeaseTurns, triage
from kvstore.server.tenants import Caller
from kvstore.shared.domain import MEMFD_PREFIX
from kvstore.shared.peers import Peer
from kvstore.shared.wire import (
    HEADER,
    MAX_REQUEST_BYTES,
    METHOD_NAMES,
    NAMESPACE_BYTES,
    QUERY,
    UNARY_METHODS,
    UNKNOWN_METHOD,
    QueryRequest,
    frame,
    parse_request,
)

__all__ = ["ADMIN_RESERVE", "LOCAL_CHANNEL_FULL", "METHOD_NAMES", "LocalChannelServer", "WithFd"]


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
        self.caps: ConnectionCaps[_Session] = ConnectionCaps(
            handlers.tenancy, handlers.counters, max_connections, max_connections_per_uid
        )
        self._server: asyncio.Server | None = None
        self._poll_until = 0.0
        self._polling = False
        self.turns = LeaseTurns()  # the lease calls, one a turn of the loop
        self.polls = 0  # turns of the loop spent polling (stats, tests)
        # Each method by its wire index: its name, request type and handler, looked up once here
        # rather than by name for every frame.
        self._methods = tuple(
            (name, request_type, getattr(handlers, name)) for name, (request_type, _) in UNARY_METHODS.items()
        )

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
        waiting = [s._waiting for s in self.caps.served() if s._waiting is not None]
        if waiting:
            await asyncio.wait(waiting, timeout=grace_s)
        for session in self.caps.every():
            session.close()
        self.path.unlink(missing_ok=True)

    def respond(
        self, method: int, payload: bytes | Message, caller: Caller | None = None
    ) -> bytes | Awaitable[bytes]:
        """The reply frame, or an awaitable of it where the handler must wait (Acquire).
        `payload`: the request's bytes, or the request parsed already."""
        if method >= len(METHOD_NAMES):
            if method == QUERY:
                return self._query(payload, caller)  # type: ignore[arg-type]
            return frame(INVALID_ARGUMENT, f"{UNKNOWN_METHOD} {method}".encode())
        name, request_type, handle = self._methods[method]
        started = time.perf_counter()
        try:
            request = payload if isinstance(payload, Message) else parse_request(name, request_type, payload)
            reply = handle(request, caller)
        except Exception as exc:
            answer = error_frame(name, exc)
        else:
            if not isinstance(reply, Message):  # an awaitable (isinstance is a tenth of isawaitable's cost)
                return self._later(name, reply, started)
            answer = frame(OK, reply.SerializeToString())
            if name == "Connect" and reply.arena.shm_path.startswith(MEMFD_PREFIX):
                answer = WithFd(answer)
                answer.fds = [self.handlers.arena_fd(caller)]
            elif (
                name == "Lookup" and reply.lent.read_slots_sent and (slots := _read_slots(caller)) is not None
            ):
                answer = WithFd(answer)  # the connection's read slots, with the first lent read that asks
                answer.fds = [slots.fd]
            elif name == "ArenaSlabs" and reply.count:
                answer = WithFd(answer)
                answer.fds = self.handlers.arena_slab_fds(caller, reply)
                answer.when_read = True
        self.handlers.timings.observe("local", name, time.perf_counter() - started)
        return answer

    def _query(self, payload: bytes, caller: Caller | None) -> bytes:
        """A Query's reply frame (`wire.QUERY`): a plain Lookup's, timed as a Lookup."""
        started = time.perf_counter()
        try:
            request = QueryRequest(payload[:NAMESPACE_BYTES], payload[NAMESPACE_BYTES:])
            reply = self.handlers.Query(request, caller)
        except Exception as exc:
            answer = error_frame("Query", exc)
        else:
            body = reply.to_bytes()
            answer = HEADER.pack(len(body), OK) + body
        self.handlers.timings.observe("local", "Lookup", time.perf_counter() - started)
        return answer

    async def _later(self, name: str, pending: Awaitable[Any], started: float) -> bytes:
        try:
            reply = await pending
        except Exception as exc:
            answer = error_frame(name, exc)
        else:
            answer = frame(OK, reply.SerializeToString())
        self.handlers.timings.observe("local", name, time.perf_counter() - started)
        return answer


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
        # a reply being awaited, or a lease call answered later: the frames behind it queue
        self._waiting: asyncio.Future[None] | None = None
        self._paused_writing = False
        self._paused_reading = False
        self.peer = Peer()
        self.caller: Caller | None = None
        self.refused = ""  # the cap it was refused at

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.peer = Peer.of_socket(sock)
            self.peer.socket_fd = sock.fileno()
        tenancy, caps = self._server.handlers.tenancy, self._server.caps
        self.caller = tenancy.of_peer(self.peer)
        # With tenants, a process in none (and no admin) takes no room under the caps from the
        # members: a few such connections at most, each answered with why it may do nothing.
        outsider = tenancy.enabled and self.caller.tenant is None and not self.caller.admin
        if outsider:
            admitted = caps.admit_outsider(self)
        else:
            admitted = caps.admit(self)
            if not admitted:  # told why, and how to call as itself over gRPC, before it is closed
                transport.write(caps.refusal(self))  # type: ignore[attr-defined]
        if not admitted:
            transport.close()
            self._transport = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.caps.forget(self)
        self._transport = None
        peer = self.peer
        peer.connected = False
        peer.socket_fd = -1
        for store in self._server.handlers.stores.values():
            if len(store.lends):  # its lends end, and their readers' slots say so, now
                store.lends.closed(peer)
        if peer.read_slots:
            peer.read_slots.close()

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
            pause = self._paused_writing or self._waiting is not None
            if pause != self._paused_reading:
                self._paused_reading = pause
                if pause:
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
                later, request = triage(method, data[HEADER.size :])
                if later:
                    self._waiting = server.turns.defer(self, method, request)
                    return
                reply = server.respond(method, request, self.caller)
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
                self._transport.write(frame(INVALID_ARGUMENT, message.encode()))
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
            later, request = triage(method, payload)
            if later:
                self._waiting = self._server.turns.defer(self, method, request)
                return
            reply = self._server.respond(method, request, self.caller)
            self._server.keep_polling()
            if not self._send(reply):
                return

    def answer_deferred(self, method: int, payload: bytes | Message) -> None:
        """A lease call's turn (`LeaseTurns.defer`): answered, then the frames behind it.
        A call that came is answered even where its connection has closed since, as it would
        have been at once: only the reply goes nowhere."""
        self._waiting = None
        reply = self._server.respond(method, payload, self.caller)
        self._server.keep_polling()
        if self._transport is None:
            if not isinstance(reply, bytes):
                self._server.turns.keep(reply)
            return
        if self._send(reply):
            self._read_when_free()
            self._answer()

    def _send(self, reply: bytes | Awaitable[bytes]) -> bool:
        """Sends a reply frame; a reply still awaited holds the frames behind it (False)."""
        assert self._transport is not None
        if not isinstance(reply, bytes):
            self._waiting = asyncio.ensure_future(self._send_later(reply))
            self._read_when_free()
            return False
        if isinstance(reply, WithFd):
            send_with_fd(self._transport, reply, reply.fds, reply.when_read)
        else:
            self._transport.write(reply)
        return True

    async def _send_later(self, pending: Awaitable[bytes]) -> None:
        try:
            reply = await pending
            if self._transport is not None:
                self._transport.write(reply)
        finally:
            self._waiting = None
            self._read_when_free()
        self._answer()


def _read_slots(caller: Caller | None) -> Any:
    """The caller's connection's read slots, or None (a lent Lookup's reply says they are sent only
    where the connection has them)."""
    peer = caller.peer if caller is not None else None
    return (peer.read_slots or None) if peer is not None else None
