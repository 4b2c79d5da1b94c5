"""How `kvstored` stops: the leases drain, then each part closes on its own.

- `drain(stores, grace_s)`: waits until no lease is held in any store, or `grace_s` passed;
  returns the time left of it (the servers' own grace).
- `cleanup(what, step)`: awaits one closing step; a failure is logged (naming `what`), not
  raised, so that the steps after it still run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence

from kvstore.store.store import Store

log = logging.getLogger("kvstored")

DRAIN_POLL_S = 0.01


async def cleanup(what: str, step: Awaitable[object]) -> None:
    try:
        await step
    except Exception:
        log.exception("closing %s failed", what)


async def drain(stores: Sequence[Store], grace_s: float) -> float:
    """Waits until no lease is held (stores committed or aborted, loads released) or `grace_s`
    passed; returns the time left of it."""
    deadline = time.monotonic() + grace_s

    def held() -> int:
        return sum(len(store.leases) for store in stores)

    while held() and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    if held():
        log.warning("%d leases still held after %.1f s: their calls are cut off", held(), grace_s)
    return max(0.0, deadline - time.monotonic())
