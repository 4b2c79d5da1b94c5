"""The local channel's lease calls, answered one a turn of the event loop (`kvstore.server.local`).

Reserve, Commit, Abort and Release, and a Lookup that takes a lease, cost the daemon tens of
microseconds each (a prompt's pages reserved, committed, leased or released). When four TP ranks
store or load at once their calls reach the loop together, and a Lookup that came with them
would wait for all of them. Here they are answered one per turn of the loop, in the order they
came: a callback queued from a turn's callbacks runs at the next turn, after its poll, so every
socket is read between two, and the calls that came meanwhile are answered first. Each
connection holds its frames behind its own call that waits here, so its replies stay in order
(bench/NOTES-host-gpus.md: the Lookup p99 while TP ranks store).

- `triage(method, payload)`: whether a frame waits its turn, and its request (a Lookup's parsed,
  to tell; the others' bytes).
- `LeaseTurns.defer(session, method, request)`: queues the call; a future done once answered
  (`session.answer_deferred(method, request)`). `keep(reply)`: a reply awaited for a connection
  that closed meanwhile, kept until its handler's work ends.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable
from typing import Any, Protocol

from google.protobuf.message import Message

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.wire import METHOD_IDS, parse_request

LEASE_METHODS = frozenset(METHOD_IDS[name] for name in ("Reserve", "Commit", "Abort", "Release"))
LOOKUP = METHOD_IDS["Lookup"]


class Answers(Protocol):
    def answer_deferred(self, method: int, request: bytes | Message) -> None: ...


def triage(method: int, payload: bytes) -> tuple[bool, bytes | Message]:
    """Whether a frame is answered at a later turn (a lease call, or a Lookup that takes a lease),
    and its request: parsed where telling needed it (a Lookup's), else its bytes."""
    if method in LEASE_METHODS:
        return True, payload
    if method != LOOKUP:
        return False, payload
    try:
        request: Any = parse_request("Lookup", pb.LookupRequest, payload)
    except Exception:  # noqa: BLE001 - the channel parses it again and answers why
        return False, payload
    return request.lease, request


class LeaseTurns:
    def __init__(self) -> None:
        self._queued: collections.deque[tuple[Answers, int, bytes | Message, asyncio.Future[None]]] = (
            collections.deque()
        )
        self._pending: set[asyncio.Future[Any]] = set()

    def defer(self, session: Answers, method: int, request: bytes | Message) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._queued.append((session, method, request, done))
        if len(self._queued) == 1:
            loop.call_soon(self._answer_one)
        return done

    def _answer_one(self) -> None:
        session, method, request, done = self._queued.popleft()
        if self._queued:  # the next at the next turn, after its poll
            asyncio.get_running_loop().call_soon(self._answer_one)
        try:
            session.answer_deferred(method, request)
        finally:
            done.set_result(None)

    def keep(self, reply: Awaitable[bytes]) -> None:
        task = asyncio.ensure_future(reply)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
