"""Lease renewal: a background thread that keeps a live client's long-held leases alive.

A store lease that expires is fenced by the daemon: its pages are dropped, and a commit after it
stores nothing. A worker that is slow but alive (a gather queued behind a long forward, an engine
that commits later) keeps its leases by renewing them: `hold(lease_id, namespace)` when a lease is
taken, `drop(lease_id)` when it ends. One renewer serves every namespace of a worker's clients
(`by_namespace` groups the leases due: a Renew names one namespace). Every `ttl/6` the thread
renews, in one call per namespace, each lease held for a third of its TTL since it was taken or
last renewed; most leases end long before that, and then the thread sends nothing. A lease whose
handle was dropped without `wait()` (`owned_by`) is renewed no more, and the daemon caps every
lease at `leases.max_ttl_s`.

The thread never connects again and never raises: a lease it cannot renew expires as it would
have. A process that is stopped (SIGSTOP, or every thread paused) renews nothing, which is the
point: its leases expire and its slots stay fenced until it is gone.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)


class LeaseRenewer:
    def __init__(self, renew: Callable[[Sequence[int]], Sequence[int]], ttl_s: float = 30.0) -> None:
        # Renews the given leases and returns those still held. A bound method is held weakly:
        # the thread must not keep its client (and the client's arena mapping) alive.
        self._renew: Callable[[], Callable[[Sequence[int]], Sequence[int]] | None] = (
            weakref.WeakMethod(renew) if hasattr(renew, "__self__") else lambda: renew
        )
        self._lock = threading.Lock()
        self._held: dict[int, float] = {}  # lease id -> when it was taken or last renewed
        self._namespaces: dict[int, bytes] = {}  # lease id -> its namespace
        self._owners: dict[int, weakref.ref[Any]] = {}  # lease id -> the handle that ends it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ttl_s = ttl_s

    def hold(self, lease_id: int, namespace: bytes = b"") -> None:
        with self._lock:
            self._held[lease_id] = time.monotonic()
            self._namespaces[lease_id] = namespace
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="kvstore-lease-renewal", daemon=True)
                self._thread.start()

    def owned_by(self, lease_id: int, handle: object) -> None:
        """`handle` ends the lease: once it is gone (dropped without `wait()`), no renewal."""
        with self._lock:
            if lease_id in self._held:
                self._owners[lease_id] = weakref.ref(handle)

    def drop(self, lease_id: int) -> None:
        with self._lock:
            self._forget(lease_id)

    def forget(self) -> None:
        """Drops every lease (they belonged to a daemon that is gone)."""
        with self._lock:
            self._held.clear()
            self._namespaces.clear()
            self._owners.clear()

    def _forget(self, lease_id: int) -> None:
        self._held.pop(lease_id, None)
        self._namespaces.pop(lease_id, None)
        self._owners.pop(lease_id, None)

    def by_namespace(self, lease_ids: Sequence[int]) -> dict[bytes, list[int]]:
        """`lease_ids` grouped by the namespace each was held with (leases no longer held left out)."""
        groups: dict[bytes, list[int]] = {}
        with self._lock:
            for lease_id in lease_ids:
                if lease_id in self._namespaces:
                    groups.setdefault(self._namespaces[lease_id], []).append(lease_id)
        return groups

    def held(self) -> list[int]:
        with self._lock:
            return list(self._held)

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def renew_due(self) -> list[int]:
        """Renews the leases held a third of their TTL since taken or last renewed; returns them."""
        now = time.monotonic()
        with self._lock:
            for lease_id, owner in list(self._owners.items()):
                if owner() is None:  # its handle was dropped without wait(): let the lease expire
                    self._forget(lease_id)
            due = [lease_id for lease_id, since in self._held.items() if now - since >= self.ttl_s / 3]
        renew = self._renew()
        if not due or renew is None:
            return []
        try:
            renewed = set(renew(due))
        except Exception as exc:  # the daemon is not serving: the leases expire as they would have
            log.debug("renewing %d leases failed: %s", len(due), exc)
            return []
        with self._lock:
            for lease_id in due:
                if lease_id not in self._held:
                    continue  # ended meanwhile
                if lease_id in renewed:
                    self._held[lease_id] = now
                else:  # expired, ended, or at its longest on the daemon
                    self._forget(lease_id)
        return [lease_id for lease_id in due if lease_id in renewed]

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 6):
            if self._renew() is None:  # its client is gone
                return
            self.renew_due()
