"""Client end of the daemon's local channel (see `kvstore.server.local`): one blocking socket, one
frame each way. `kvstore_client` and `kvctl` both call the daemon through it.

- `call(method, request, meanwhile=None)`: send a request, run `meanwhile()` while the daemon
  answers, wait for the reply.
- `send(method, request)`: send a request without waiting: its reply is read with the next
  call's (the daemon answers in order), and an error in it is logged then. For calls whose
  outcome the caller does not need (a load's Release once the copy is known to be valid).
  `frame(method, request)` makes the bytes ahead and `send_frame` sends them (a load makes
  its Release while the copy runs).
- `call_with_fds(method, request)`: the reply and the descriptors that came with it (an
  ArenaSlabs': the pinned arena's slabs), which the caller then owns.
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from kvstore.shared.domain import ARENA_SLABS_PER_CALL
from kvstore.shared.errors import ResourceExhausted, Unavailable, error_for
from kvstore.shared.wire import HEADER, METHOD_IDS, UNARY_METHODS

log = logging.getLogger(__name__)

RECV_BYTES = 1 << 16
_MAX_FDS = ARENA_SLABS_PER_CALL + 4  # room for descriptors with a reply (a Connect's one, an ArenaSlabs')
_WITH_FDS = ("Connect", "ArenaSlabs")


class Refused(Unavailable):
    """The channel closed before its first reply: the daemon refused the connection (at its caps
    on connections), or went away just then; the caller's calls go over gRPC instead.
    `ran_meanwhile`: the call's `meanwhile` ran before the channel failed."""

    def __init__(self, message: str, ran_meanwhile: bool) -> None:
        super().__init__(message)
        self.ran_meanwhile = ran_meanwhile


class LocalChannel:
    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.answered = False  # a reply came: a failure from now on is the daemon's outage
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        self._sock.connect(path)
        self._lock = threading.RLock()  # a failed call closes the channel while holding it
        self._unread: list[str] = []  # methods sent without waiting whose replies are still unread
        self._buffer = bytearray()  # received bytes not yet taken as a reply
        self._fds: list[int] = []  # descriptors received with replies (a Connect's: the arena)
        self._with_fds = False  # reading a reply that may carry descriptors
        self._fds_truncated = False  # the kernel dropped some (MSG_CTRUNC)

    def call(self, method: str, request: Any, meanwhile: Callable[[], Any] | None = None) -> Any:
        """The reply to `request`; `meanwhile()` runs while the daemon works on it (the channel
        stays held for this call: keep it short). An error it raises is raised once the reply
        is read, so the channel stays in step."""
        payload = request.SerializeToString()
        failed: BaseException | None = None
        ran = False
        try:
            with self._lock:
                self._with_fds = method in _WITH_FDS
                self._sock.sendall(HEADER.pack(len(payload), METHOD_IDS[method]) + payload)
                self._read_unread()  # the daemon works on this request meanwhile
                if meanwhile is not None:
                    ran = True
                    try:
                        meanwhile()
                    except BaseException as exc:  # raised below, once the reply is read
                        failed = exc
                status, body = self._reply()
                self.answered = True
        except OSError as exc:
            self.close()
            if not self.answered:
                raise Refused(
                    f"{method}: the daemon's local channel {self.path} closed at once ({exc})", ran
                ) from None
            raise Unavailable(
                f"{method}: the daemon's local channel {self.path} closed ({exc}); it stopped or restarted"
            ) from None
        if failed is not None:
            raise failed
        if status:
            raise error_for(status, method, body.decode(errors="replace"))
        return UNARY_METHODS[method][1].FromString(body)  # type: ignore[attr-defined]

    def call_with_fds(self, method: str, request: Any) -> tuple[Any, list[int]]:
        """`call`, and the descriptors its reply carried (the caller owns them). ResourceExhausted
        where the kernel dropped some: this process has no descriptor left (RLIMIT_NOFILE)."""
        with self._lock:
            before = len(self._fds)  # those of a Connect not taken yet stay its caller's
            self._fds_truncated = False
            try:
                reply = self.call(method, request)
            finally:
                fds, self._fds = self._fds[before:], self._fds[:before]
            if self._fds_truncated:
                for fd in fds:
                    os.close(fd)
                raise ResourceExhausted(
                    f"{method}: descriptors sent with the reply were dropped: this process is out of "
                    f"file descriptors (raise its RLIMIT_NOFILE, `ulimit -n`)"
                )
        return reply, fds

    @staticmethod
    def frame(method: str, request: Any) -> bytes:
        """`request` as the channel sends it: made ahead, it is sent later with `send_frame`."""
        payload = request.SerializeToString()
        return HEADER.pack(len(payload), METHOD_IDS[method]) + payload

    def send(self, method: str, request: Any) -> None:
        """Sends `request` without waiting for the reply (read, and an error logged, with the next call's)."""
        self.send_frame(method, self.frame(method, request))

    def send_frame(self, method: str, frame: bytes) -> None:
        """`send` of a request made ahead with `frame(method, request)`."""
        try:
            with self._lock:
                self._sock.sendall(frame)
                self._unread.append(method)
        except OSError as exc:
            self.close()
            raise Unavailable(
                f"{method}: the daemon's local channel {self.path} closed ({exc}); it stopped or restarted"
            ) from None

    def _read_unread(self) -> None:
        for method in self._unread:
            status, body = self._reply()
            if status:
                error = error_for(status, method, body.decode(errors="replace"))
                log.warning("%s (sent without waiting for its reply) failed: %s", method, error)
        self._unread.clear()

    def _reply(self) -> tuple[int, bytes]:
        """The next reply frame: (status, body). One recv usually brings a whole reply."""
        buffer = self._buffer
        while len(buffer) < HEADER.size:
            self._fill()
        length, status = HEADER.unpack_from(buffer)
        end = HEADER.size + length
        while len(buffer) < end:
            self._fill()
        body = bytes(buffer[HEADER.size : end])
        del buffer[:end]
        return status, body

    def _fill(self) -> None:
        if self._with_fds:
            part, ancillary, flags, _ = self._sock.recvmsg(RECV_BYTES, socket.CMSG_SPACE(_MAX_FDS * 4))
            if flags & socket.MSG_CTRUNC:  # the kernel dropped descriptors: this process is out of them
                self._fds_truncated = True
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                    self._fds.extend(fds)
        else:
            part = self._sock.recv(RECV_BYTES)
        if not part:
            raise ConnectionError("connection closed")
        self._buffer += part

    def take_fd(self) -> int | None:
        """The descriptor the last Connect's reply carried (the caller owns it), if any."""
        with self._lock:
            fds, self._fds = self._fds, []
        for extra in fds[:-1]:
            os.close(extra)
        return fds[-1] if fds else None

    def close(self) -> None:
        """Closes the channel; a call blocked on it in another thread (the lease renewal) wakes
        with an error first, so its descriptor is never closed under it (nor reused)."""
        with contextlib.suppress(OSError):  # not connected any more
            self._sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self._sock.close()
            for fd in self._fds:
                os.close(fd)
            self._fds = []
