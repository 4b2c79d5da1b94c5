"""Who is calling: the process on the other end of a connection, and whether it is gone.

- `Peer.of_socket(sock)`: pid, uid and gid from a unix socket's peer credentials (SO_PEERCRED),
  its supplementary groups (SO_PEERGROUPS), and the process's start time, read once per connection.
- `Peer.declared(pid, start_time)`: what a gRPC caller says of itself (gRPC does not expose
  the socket's credentials); used only to end a fence sooner, never to grant anything.
- `peer.gone()`: the process can no longer write: its connection is closed and no process
  with its pid and start time exists. A peer whose identity is unknown is never gone.

The start time (field 22 of /proc/<pid>/stat, clock ticks since boot) tells a process from a
later one that reused its pid.
"""

from __future__ import annotations

import select
import socket
import struct
from dataclasses import dataclass
from typing import Any

_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid (ids unsigned: 2^31 and up are ids too)
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13+
_CLOSED = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0x2000)
_MAX_GROUPS = 1024


def _peer_groups(sock: Any) -> tuple[int, ...]:
    """The peer's supplementary groups, as the kernel recorded them at connect (none if unknown)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * _MAX_GROUPS)
    except OSError:
        return ()
    return struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) - len(raw) % 4])


def boot_id() -> str:
    """This host's boot id: two processes that read the same one share a kernel (and /dev/shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot); None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: count after its end.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return None


@dataclass(eq=False)
class Peer:
    pid: int = 0  # 0: unknown (a process in another pid namespace, or a caller that did not say)
    uid: int = -1
    gid: int = -1
    start_time: int = 0  # 0: unknown
    connected: bool = False  # its connection is open (known for local-channel peers only)
    groups: tuple[int, ...] = ()  # supplementary groups (local-channel peers only)
    read_slots: Any = None  # its connection's `kvstore.shared.read_slots.ReadSlots`, once it read lent blocks
    read_slots_sent: int = 0  # times that table's descriptor went with a reply
    socket_fd: int = -1  # its connection's socket here (local-channel peers), while connected

    def hung_up(self) -> bool:
        """Its end of the connection is closed, though the daemon may not have seen it yet (a
        worker whose call timed out closes its channel before it goes on): known at once."""
        if not self.connected:
            return True
        if self.socket_fd < 0:
            return False
        poller = select.poll()
        poller.register(self.socket_fd, _CLOSED)
        return bool(poller.poll(0))

    @classmethod
    def of_socket(cls, sock: Any) -> Peer:
        try:
            pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        except OSError:
            return cls(connected=True)
        start_time = (process_start_time(pid) or 0) if pid else 0
        return cls(pid, uid, gid, start_time, connected=True, groups=_peer_groups(sock))

    @classmethod
    def declared(cls, pid: int, start_time: int) -> Peer:
        """A gRPC caller's word for itself, checked against this host's /proc: a pid that is not
        there with that start time (a caller in another pid namespace, or a wrong one) gives
        an unknown peer, which is never taken for gone."""
        if pid and start_time and process_start_time(pid) == start_time:
            return cls(pid=pid, start_time=start_time)
        return cls()

    def gone(self) -> bool:
        """Whether this process can no longer write (False while that cannot be known)."""
        if self.connected or not self.pid or not self.start_time:
            return False
        return process_start_time(self.pid) != self.start_time
