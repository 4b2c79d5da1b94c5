"""A KVStoreClient made once the daemon answers, so that vLLM starts whether kvstored is up or not.

A worker's clients for several namespaces (a hybrid model's KV-cache groups) are siblings of
the first (`parent`): one connection, one mapped and registered arena.

Until it connects, `get()` returns None (every lookup a miss, every save dropped) and a new
attempt is made at most every RETRY_S, with one warning for the whole wait. Once connected, the
client rides out restarts and outages on its own (`KVStoreClient`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvstore.shared.spec import KVSpec
from kvstore_client.client import KVStoreClient

log = logging.getLogger(__name__)

RETRY_S = 1.0


class LazyClient:
    """`parent`: a client of another namespace whose connection and arena this one shares
    (`KVStoreClient.sibling`): made once the parent is connected, and never without it."""

    def __init__(
        self, address: str | None, spec: KVSpec, *, parent: LazyClient | None = None, **options: Any
    ) -> None:
        self.address = address
        self.spec = spec
        self.parent = parent
        self._options = options
        self._client: KVStoreClient | None = None
        self._retry_at = 0.0
        self._warned = False

    def get(self) -> KVStoreClient | None:
        if self._client is not None or time.monotonic() < self._retry_at:
            return self._client
        try:
            if self.parent is not None:
                parent = self.parent.get()
                if parent is None:
                    return None  # the parent warned
                self._client = parent.sibling(self.spec, name=self._options.get("name", ""))
            else:
                self._client = KVStoreClient.connect(self.address, self.spec, **self._options)
        except Exception as exc:  # down, refusing this spec, or not there yet: try again later
            self._retry_at = time.monotonic() + RETRY_S
            if not self._warned:
                self._warned = True
                log.warning(
                    "kvstored at %s cannot be reached (%s): no KV is loaded or saved until it answers",
                    self.address or "the default socket",
                    exc,
                )
            return None
        if self._warned:
            log.info("kvstored at %s answers: KV is loaded and saved again", self._client.address)
        return self._client

    def with_spec(self, spec: KVSpec, parent: LazyClient | None = None) -> LazyClient:
        """A client like this one for `spec` (this one is closed)."""
        self.close()
        return LazyClient(self.address, spec, parent=parent, **self._options)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
