"""A producer's saves as lends (`save_to: "lend"`): the worker lends a request's blocks
(`KVStoreClient.lend`) instead of copying them, and vLLM gets them back (`finished_sending`)
only once every lend of the request is done: copied by a decode instance, or unread for the
hold (30 s), or its daemon gone and that time passed. A save that cannot be lent is stored
instead (a cache CUDA IPC cannot export, no local channel: from then on, said once). A
preempted request's blocks go back to vLLM at once: its lends are revoked first (`revoke`), so a
read in flight counts nothing."""

from __future__ import annotations

import logging
from typing import Any

from kvstore.shared.errors import FailedPrecondition

log = logging.getLogger(__name__)


class Lending:
    def __init__(self) -> None:
        self._lends: dict[str, list[tuple[Any, int]]] = {}  # req id -> (client, lend id) of each lend
        self._held: set[str] = set()  # finished requests whose lends are not all done yet
        self._refused: set[int] = set()  # groups whose caches cannot be lent

    def lend(self, client: Any, side: Any, spec: Any, keys: Any, readers: int = 1) -> bool:
        """Lends the blocks of one save (`SaveSpec`) of a request, held until `readers` workers
        have read them; False where it cannot (the caller stores the save instead). A cache that
        cannot be lent (no CUDA IPC export, no local channel) is not tried again: its saves are
        stored from then on, said once."""
        if id(side) in self._refused:
            return False
        try:
            blocks = side.cache.kernel_blocks(spec.block_ids)
            lend_id, _ = client.lend(None, side.registered, blocks, keys=keys, readers=readers)
        except (ValueError, RuntimeError, FailedPrecondition) as exc:  # this cache or channel, every time
            self._refused.add(id(side))
            log.warning(
                "the KV cache of %s cannot be lent (%s): its saves are stored instead", spec.req_id, exc
            )
            return False
        except Exception:  # noqa: BLE001 - this lend only (the daemon's caps, an outage)
            log.exception("lending the blocks of %s failed; its chunks are stored instead", spec.req_id)
            return False
        if lend_id:
            self._lends.setdefault(spec.req_id, []).append((client, lend_id))
        return True

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

    def revoke(self, req_ids: set[str]) -> None:
        """Ends the lends of `req_ids` (preempted: vLLM reuses their blocks from this step on)
        before returning; where the daemon cannot be reached, once no read of them can count."""
        asked: dict[int, tuple[Any, list[int]]] = {}
        for req_id in req_ids:
            for client, lend_id in self._lends.pop(req_id, ()):
                asked.setdefault(id(client), (client, []))[1].append(lend_id)
            self._held.discard(req_id)
        for client, ids in asked.values():
            try:
                client.lends_done(ids, revoke=True)
            except Exception:  # noqa: BLE001 - never into vLLM; `lends_done` waited out the reads
                log.exception("revoking %d lends failed", len(ids))
