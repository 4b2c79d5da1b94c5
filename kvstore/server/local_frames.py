"""The local channel's reply frames: status codes, errors, and a reply that carries a descriptor.

- OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, INTERNAL: the grpc.StatusCode values a reply's
  status byte takes (without importing grpc).
- `error_frame(name, exc)`: the reply to a call that raised: its status and message
  (`errors.status_of`), or INTERNAL, logged, for an exception no status maps.
- `WithFd`: a reply frame sent with descriptors (a Connect's, with the tenant's sealed arena; an
  ArenaSlabs', with slabs of the pinned arena); `send_with_fd(transport, data, fds)` sends it so.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import termios

from kvstore.shared.errors import status_of
from kvstore.shared.wire import frame

log = logging.getLogger("kvstore.server.local")  # the channel's log lines, wherever its parts live

OK = 0
INVALID_ARGUMENT = 3
RESOURCE_EXHAUSTED = 8
INTERNAL = 13


class WithFd(bytes):
    """A reply frame sent with descriptors (SCM_RIGHTS): a Connect's, with the sealed arena; an
    ArenaSlabs', with the pinned arena's slabs."""

    fds: list[int] = []
    when_read = False  # sent with them only once the peer has read every earlier reply


def error_frame(name: str, exc: Exception) -> bytes:
    status = status_of(exc)
    if status is None:
        log.error("internal error in %s", name, exc_info=exc)
        return frame(INTERNAL, f"internal error in kvstored: {exc!r} (see the daemon's log)".encode())
    code, message = status
    return frame(int(code), message.encode())


def send_with_fd(transport: asyncio.Transport, data: bytes, fds: list[int], when_read: bool = False) -> None:
    """Sends `data` with `fds` attached, on a duplicate of the connection's socket (transports
    cannot send descriptors) while nothing is queued before it; else without them (the worker
    then sends page bytes inline, or asks for the slabs again). `when_read`: only once the peer
    has read every earlier reply (an ArenaSlabs' many descriptors: a peer that never reads
    holds one reply's worth in flight at most, not the daemon's whole descriptor table)."""
    sock = transport.get_extra_info("socket")
    sent = 0
    fds = [fd for fd in fds if fd >= 0]
    ready = sock is not None and not transport.get_write_buffer_size()
    if fds and ready and not (when_read and _unread(sock)):
        rights = array.array("i", fds)
        with (
            socket.socket(fileno=os.dup(sock.fileno())) as dup,
            contextlib.suppress(OSError),  # full, or too many descriptors in flight: sent without
        ):
            sent = dup.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
    if sent < len(data):
        transport.write(data[sent:])


def _unread(sock: socket.socket) -> int:
    """Bytes sent on `sock` that its peer has not read yet (SIOCOUTQ): descriptors go only with a
    reply sent into an empty queue, so a peer that never reads holds one reply's worth at most."""
    out = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, out)
    except OSError:
        return 0
    return out[0]
