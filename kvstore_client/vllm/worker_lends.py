"""A producer's saves as lends (`save_to: "lend"`): the worker lends a request's blocks
(`KVStoreClient.lend`) instead of copying them, and vLLM gets them back (`finished_sending`)
only once every lend of the request is done: copied by a decode instance, or unread for the
hold (30 s), or its daemon gone and that time passed. A lend that fails is logged and the
request's blocks go back at once, as with a save that fails (the consumer recomputes)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class Lending:
    def __init__(self) -> None:
        self._lends: dict[str, list[tuple[Any, int]]] = {}  # req id -> (client, lend id) of each lend
        self._held: set[str] = set()  # finished requests whose lends are not all done yet

    def lend(self, client: Any, side: Any, spec: Any, keys: Any) -> None:
        """Lends the blocks of one save (`SaveSpec`) of a request."""
        try:
            lend_id, _ = client.lend(
                None, side.registered, side.cache.kernel_blocks(spec.block_ids), keys=keys
            )
        except Exception:
            log.exception("lending the blocks of %s failed; a decode instance recomputes them", spec.req_id)
            return
        if lend_id:
            self._lends.setdefault(spec.req_id, []).append((client, lend_id))

    def finished(self, held: set[str]) -> set[str]:
        """Of `held` (finished requests) and those held before, the ones whose lends are done:
        one `lends_done` call per client a step, for every lend still pending."""
        self._held |= held
        asked: dict[int, tuple[Any, list[int]]] = {}
        for req_id in self._held:
            for client, lend_id in self._lends.get(req_id, ()):
                asked.setdefault(id(client), (client, []))[1].append(lend_id)
        done: set[int] = set()
        for client, ids in asked.values():
            try:
                done.update(client.lends_done(ids))
            except Exception:  # noqa: BLE001 - asked again next step
                log.debug("asking whether %d lends are done failed", len(ids), exc_info=True)
        finished = set()
        for req_id in list(self._held):
            pending = [
                (client, lend_id) for client, lend_id in self._lends.get(req_id, ()) if lend_id not in done
            ]
            if pending:
                self._lends[req_id] = pending
                continue
            self._lends.pop(req_id, None)
            self._held.discard(req_id)
            finished.add(req_id)
        return finished
