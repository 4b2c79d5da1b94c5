"""Client end of the daemon's local channel (see `kvstore.server.local`): one blocking socket, one
frame each way. `kvstore_client` and `kvctl` both call the daemon through it.

- `call(method, request, meanwhile=None)`: send a request, run `meanwhile()` while the daemon
  answers, wait for the reply.
- `send(method, request)`: send a request without waiting: its reply is read with the next
  call's (the daemon answers in order), and an error in it is logged then. For calls whose
  outcome the caller does not need (a load's Release once the copy is known to be valid).
- `begin(method, request)`: send a request now and take its reply later (`Pending.result()`),
  the channel free for other calls meanwhile (a reader's Lookup while its copy of lent blocks
  runs: `kvstore_client.lends`).
  `frame(method, request)` makes the bytes ahead and `send_frame` sends them (a load makes
  its Release while the copy runs).
- `call_with_fds(method, request)`: the reply and the descriptors that came with it (an
  ArenaSlabs': the pinned arena's slabs), which the caller then owns; `call(..., fds=[])` the
  same for a call that may carry some (a lent Lookup's: the connection's read slots).
- `holds(slot, read_id)`: whether a lent read still holds its lend, read in place from this
  connection's read slots (`kvstore.shared.read_slots`, kept in `read_slots`), while the
  connection is open: a closed one (a daemon gone) holds nothing.

A call's reply is awaited spinning for up to `spin_s` (`$KVSTORE_LOCAL_SPIN_US`, default
`DEFAULT_SPIN_US`) before the thread sleeps in recv: the daemon answers most calls in tens of
microseconds, less than a sleeping thread takes to be woken on a virtual machine's vCPU
(bench/NOTES-handover.md), so a worker's call costs about the daemon's time, not a wake-up.
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvstore.shared.domain import ARENA_SLABS_PER_CALL
from kvstore.shared.errors import ResourceExhausted, Unavailable, error_for
from kvstore.shared.wire import HEADER, LOCAL_IDS, LOCAL_REPLIES

log = logging.getLogger(__name__)

RECV_BYTES = 1 << 16
_MAX_FDS = ARENA_SLABS_PER_CALL + 4  # room for descriptors with a reply (a Connect's one, an ArenaSlabs')
_WITH_FDS = ("Connect", "ArenaSlabs")
DEFAULT_SPIN_US = 0.0
_CLOSED = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0x2000)


def spin_from_env() -> float:
    """Seconds a call spins for its reply: `$KVSTORE_LOCAL_SPIN_US` (0 never spins)."""
    raw = os.environ.get("KVSTORE_LOCAL_SPIN_US", "").strip()
    if not raw:
        return DEFAULT_SPIN_US / 1e6
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1e6:
        raise ValueError(f"KVSTORE_LOCAL_SPIN_US: expected 0..1000000 microseconds, got {raw!r}")
    return value / 1e6


class Refused(Unavailable):
    """The channel closed before its first reply: the daemon refused the connection (at its caps
    on connections), or went away just then; the caller's calls go over gRPC instead.
    `ran_meanwhile`: the call's `meanwhile` ran before the channel failed."""

    def __init__(self, message: str, ran_meanwhile: bool) -> None:
        super().__init__(message)
        self.ran_meanwhile = ran_meanwhile


class Pending:
    """A call sent with `LocalChannel.begin`: `result()` is its reply (read then, if no later
    call on the channel read it first), or raises its error."""

    def __init__(self, channel: LocalChannel, method: str) -> None:
        self._channel, self.method = channel, method
        self._answer: tuple[int, bytes] | None = None
        self._reply: Any = None

    def result(self) -> Any:
        if self._reply is not None:
            return self._reply
        if self._answer is None:
            self._channel._read_until(self)
        assert self._answer is not None
        status, body = self._answer
        if status:
            raise error_for(status, self.method, body.decode(errors="replace"))
        self._reply = LOCAL_REPLIES[self.method].FromString(body)
        return self._reply


class LocalChannel:
    def __init__(self, path: str, timeout_s: float, spin_s: float | None = None) -> None:
        self.path = path
        self.answered = False  # a reply came: a failure from now on is the daemon's outage
        self.queries = True  # the daemon answers a Query (`wire.QUERY`); False once it said it does not
        self.spin_s = spin_from_env() if spin_s is None else spin_s
        self.read_slots: Any = None  # this connection's `kvstore.shared.read_slots.SlotView`, once sent
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        self._sock.connect(path)
        self._poller = select.poll()
        self._poller.register(self._sock.fileno(), select.POLLIN | _CLOSED)
        self._closed = False
        self._lock = threading.RLock()  # a failed call closes the channel while holding it
        self._unread: list[str | Pending] = []  # calls sent without waiting whose replies are still unread
        self._buffer = bytearray()  # received bytes not yet taken as a reply
        self._fds: list[int] = []  # descriptors received with replies (a Connect's: the arena)
        self._with_fds = False  # reading a reply that may carry descriptors
        self._fds_truncated = False  # the kernel dropped some (MSG_CTRUNC)

    def call(
        self,
        method: str,
        request: Any,
        meanwhile: Callable[[], Any] | None = None,
        fds: list[int] | None = None,
    ) -> Any:
        """The reply to `request`; `meanwhile()` runs while the daemon works on it (the channel
        stays held for this call: keep it short). An error it raises is raised once the reply
        is read, so the channel stays in step. `fds`: a list the descriptors the reply carries
        are added to (the caller owns them)."""
        payload = request.SerializeToString()
        failed: BaseException | None = None
        ran = False
        try:
            with self._lock:
                self._with_fds = fds is not None or method in _WITH_FDS
                before = len(self._fds)
                self._sock.sendall(HEADER.pack(len(payload), LOCAL_IDS[method]) + payload)
                self._read_unread()  # the daemon works on this request meanwhile
                if meanwhile is not None:
                    ran = True
                    try:
                        meanwhile()
                    except BaseException as exc:  # raised below, once the reply is read
                        failed = exc
                status, body = self._reply()
                self.answered = True
                if fds is not None:
                    fds.extend(self._fds[before:])
                    del self._fds[before:]
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
        return LOCAL_REPLIES[method].FromString(body)

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
        return HEADER.pack(len(payload), LOCAL_IDS[method]) + payload

    def send(self, method: str, request: Any) -> None:
        """Sends `request` without waiting for the reply (read, and an error logged, with the next call's)."""
        self.send_frame(method, self.frame(method, request))

    def send_frame(self, method: str, frame: bytes) -> None:
        """`send` of a request made ahead with `frame(method, request)`."""
        self._sent(method, frame, method)

    def begin(self, method: str, request: Any) -> Pending:
        """Sends `request`; its reply is the returned `Pending`'s `result()`."""
        pending = Pending(self, method)
        self._sent(method, self.frame(method, request), pending)
        return pending

    def _sent(self, method: str, frame: bytes, awaited: str | Pending) -> None:
        """Sends `frame`, its reply awaited as `awaited` (the method: logged if it failed; a
        `Pending`: kept for its `result()`)."""
        try:
            with self._lock:
                self._sock.sendall(frame)
                self._unread.append(awaited)
        except OSError as exc:
            self.close()
            raise Unavailable(
                f"{method}: the daemon's local channel {self.path} closed ({exc}); it stopped or restarted"
            ) from None

    def _read_until(self, pending: Pending) -> None:
        try:
            with self._lock:
                self._with_fds = False  # replies of calls begun or sent carry none
                while pending._answer is None:
                    if not self._unread:  # the channel failed, and dropped what it awaited
                        raise OSError("the reply was lost with the connection")
                    self._take_one()
        except OSError as exc:
            self.close()
            raise Unavailable(
                f"{pending.method}: the daemon's local channel {self.path} closed ({exc}); "
                "it stopped or restarted"
            ) from None

    def _take_one(self) -> None:
        entry = self._unread[0]
        status, body = self._reply()
        del self._unread[0]
        if isinstance(entry, Pending):
            entry._answer = (status, body)
        elif status:
            error = error_for(status, entry, body.decode(errors="replace"))
            log.warning("%s (sent without waiting for its reply) failed: %s", entry, error)

    def _read_unread(self) -> None:
        while self._unread:
            self._take_one()

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
        if self.spin_s > 0:  # the reply usually comes before a sleeping thread would be woken
            deadline = time.perf_counter() + self.spin_s
            poll = self._poller.poll
            while not poll(0) and time.perf_counter() < deadline:
                pass
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

    def holds(self, slot: int, read_id: int) -> bool:
        """Whether the lent read `read_id` (in `slot` of this connection's read slots) still holds
        its lend: the daemon has not ended it, and the connection is open."""
        with self._lock:
            if self._closed or self.read_slots is None:
                return False
            for _, events in self._poller.poll(0):
                if events & _CLOSED:  # the daemon is gone: it writes no slot any more
                    return False
            return bool(self.read_slots.holds(slot, read_id))

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
            self._closed = True
            self._unread.clear()
            self._sock.close()
            for fd in self._fds:
                os.close(fd)
            self._fds = []
            if self.read_slots is not None:
                self.read_slots.close()
                self.read_slots = None
