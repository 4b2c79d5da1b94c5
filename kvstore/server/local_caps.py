"""The local channel's caps on connections: who gets one, and what a refused one is told.

- `ConnectionCaps(tenancy, counters, max_connections, max_connections_per_uid)`: `admit(c)`
  keeps a new connection within the caps (in all, per uid and, with tenants, per tenant: its
  share of the total), or an admin's within ADMIN_RESERVE past them; one refused is counted
  (`refused_local_connections`), with one warning at most every REFUSAL_WARNING_S.
  `admit_outsider(c)`: a process in no tenant, MAX_OUTSIDERS at most. `refusal(c)`: the frames
  a refused connection reads before it is closed. `forget(c)` once it is closed; `served()` and
  `every()` list the connections open.
- LOCAL_CHANNEL_FULL: in a refusal's message, which clients tell from a call's own
  RESOURCE_EXHAUSTED by (kvstore_client.connection, kvctl).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Generic, Protocol, TypeVar

from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.local_frames import OK, RESOURCE_EXHAUSTED
from kvstore.server.tenants import Caller, Tenancy
from kvstore.shared.peers import Peer
from kvstore.shared.wire import frame

log = logging.getLogger("kvstore.server.local")  # the channel's log lines, wherever its parts live

REFUSAL_WARNING_S = 10.0  # at most one warning this often about connections refused at the caps
MAX_OUTSIDERS = 16  # with tenants: connections of processes in no tenant open at once, at most
ADMIN_RESERVE = 16  # connections of admins past the caps, at most
# In a refusal's message: clients tell it from a call's own RESOURCE_EXHAUSTED by it
# (kvstore_client.connection, kvctl).
LOCAL_CHANNEL_FULL = "local channel is full"


class Connection(Protocol):
    """What the caps know of a connection: its peer, who that is, and why it was refused."""

    peer: Peer
    caller: Caller | None
    refused: str  # the cap it was refused at


C = TypeVar("C", bound=Connection)


class ConnectionCaps(Generic[C]):
    def __init__(
        self,
        tenancy: Tenancy,
        counters: Counter[str],
        max_connections: int = 1024,
        max_connections_per_uid: int = 256,
    ) -> None:
        self.tenancy = tenancy
        self.counters = counters  # the daemon's (Stats adds them)
        self.max_connections = max_connections
        self.max_connections_per_uid = max_connections_per_uid
        self.max_connections_per_tenant = max(1, max_connections // len(tenancy.names))
        self._sessions: set[C] = set()  # within the caps
        self._outsiders: set[C] = set()  # connections of processes in no tenant
        self._admins: set[C] = set()  # admins' connections past the caps
        self._per_uid: Counter[int] = Counter()
        self._per_tenant: Counter[str] = Counter()
        self._refused = 0  # connections closed at the caps since the last warning
        self._warned_at = -REFUSAL_WARNING_S

    def served(self) -> list[C]:
        """The connections whose calls are served: within the caps, and admins' past them."""
        return [*self._sessions, *self._admins]

    def every(self) -> list[C]:
        return [*self._sessions, *self._outsiders, *self._admins]

    def _tenant_of(self, session: C) -> str | None:
        """The tenant a connection counts against (None: none, without tenants or for an admin
        in no tenant)."""
        if not self.tenancy.enabled or session.caller is None:
            return None
        return session.caller.tenant

    def _cap_reached(self, session: C) -> str:
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
                f"{len(self.tenancy.names)} tenants)"
            )
        return ""

    def admit(self, session: C) -> bool:
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
        self._count_refusal(reached)
        return False

    def _count_refusal(self, reached: str) -> None:
        self._refused += 1
        self.counters["refused_local_connections"] += 1
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

    def refusal(self, session: C) -> bytes:
        """What a connection refused at the caps reads before it is closed: why, then the gRPC
        credential of the caller's tenant (it calls as itself there; none for an admin in no
        tenant, or without tenants, where gRPC needs none)."""
        message = (
            f"kvstored's {LOCAL_CHANNEL_FULL}: {session.refused}; this connection is refused: calls "
            f"go over gRPC"
        )
        frames = frame(RESOURCE_EXHAUSTED, message.encode())
        caller = session.caller
        credential = self.tenancy.credential(caller) if caller is not None else ""
        if credential and caller is not None:
            reply = pb.ConnectResponse(tenant=caller.tenant, credential=credential)
            frames += frame(OK, reply.SerializeToString())
        return frames

    def admit_outsider(self, session: C) -> bool:
        """A connection from a process in no tenant: kept (its calls are refused with the reason)
        while fewer than MAX_OUTSIDERS are open, else closed at once, counted."""
        if len(self._outsiders) < MAX_OUTSIDERS:
            self._outsiders.add(session)
            return True
        self.counters["refused_outsider_connections"] += 1
        return False

    def forget(self, session: C) -> None:
        self._outsiders.discard(session)
        self._admins.discard(session)
        if session in self._sessions:
            self._sessions.discard(session)
            _uncount(self._per_uid, session.peer.uid)
            tenant = self._tenant_of(session)
            if tenant is not None:
                _uncount(self._per_tenant, tenant)


def _uncount(counts: Counter[Any], key: Any) -> None:
    counts[key] -= 1
    if not counts[key]:
        del counts[key]
