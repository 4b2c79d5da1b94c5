"""A read of lent blocks from the lender's ticket (`KVStoreClient.load_async(lent=ticket)`): the copy
first, the daemon's answer after, so that neither the Lend's nor the Lookup's round trip is on the
hand-over's critical path.

The lender hands its reader a ticket (`lends.ticket`: its cache's descriptor, its GPU, the block
ids) while the daemon records the lend (`lend(..., meanwhile=...)`: the Lend request is already
sent). The reader enqueues the copy from the ticket at once; the handle's `wait()` sends its
leased Lookup (`LocalChannel.begin`), whose answer comes during the copy, and reads it before it
blocks on the copy. Once the copy is done, the copied chunks count only where the daemon gave this reader a
read of that very lend (the same cache, GPU and block ids, and the lend's nonce) and the read's
slot still holds it (`kvstore.shared.read_slots`) within its TTL on the reader's clock; else the
load counts 0 and the caller loads again, or recomputes.

Why bytes counted so are the lender's: the lender wrote them before it sent the Lend, hence before
the ticket left it, and it may change them only once the daemon lets it (the lend done or
revoked, or the lender gone), which the daemon writes into the read's slot first. The nonce
makes the read one of the ticket's own lend: a later lend of the same blocks (reused meanwhile,
then lent again) does not vouch for a copy that may have overlapped the reuse. The copy
started after the ticket came and ended before the slot was found holding the read, so it ran
entirely while the blocks were the lend's. A ticket that names other blocks than the lend's,
or a lend the daemon never recorded, counts nothing (whatever was copied stays uncounted, as a
lapsed read's bytes do).

Used only where this connection already has its read slots (sent with an earlier lent read's
reply); otherwise, and without CUDA or the local channel, the load takes the keyed path
(`loads.LoadPath`), which asks for them.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Sequence
from typing import Any

from google.protobuf.message import DecodeError

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.channel import LocalChannel, Pending
from kvstore.shared.errors import KVStoreError
from kvstore.shared.keys import pack_keys
from kvstore_client.handles import LoadHandle
from kvstore_client.session import Session, log
from kvstore_client.transfers import cache_device


def read_ticket(
    session: Session,
    ticket: bytes,
    token_ids: Any,
    keys: Sequence[bytes],
    kv_caches: Any,
    block_ids: Any,
    layers: range,
    stream: Any,
    asked: float,
) -> LoadHandle | None:
    """The load of the chunks `ticket` names, copied at once; None where this reader cannot read
    it so (the caller loads through its Lookup instead). ValueError for a ticket that is not one."""
    local, lends = session._conn.local, session._lends
    device = cache_device(kv_caches)
    if local is None or local.read_slots is None or device.type != "cuda" or not keys:
        return None
    try:
        lent = pb.LentRead.FromString(bytes(ticket))
    except (DecodeError, TypeError) as exc:
        raise ValueError(f"lent: not a lender's ticket ({exc})") from None
    step = 4 * session.spec.blocks_per_chunk
    chunks = min(len(keys), len(lent.blocks) // step)
    if not chunks:
        return None
    lent.blocks = lent.blocks[: chunks * step]
    try:
        event = lends.copy(lent, chunks, kv_caches, block_ids, layers, stream, session._link.lent)
    except Exception as exc:  # noqa: BLE001 - a ticket or a device this reader cannot use
        log.warning("lent blocks of a ticket from %s not read (%s)", lent.device_pci_bus_id, exc)
        return None
    asking = _Asking(local, session.namespace, keys[:chunks], lends.devices(device))
    tokens = session._covered(token_ids, chunks)
    finish = functools.partial(_answered, session, local, asking, lent, chunks, asked, token_ids=token_ids)
    fail = functools.partial(_failed, session, local, asking, lent)
    return LoadHandle(event, finish, fail, tokens, layers, early=asking.ask)


class _Asking:
    """The Lookup that vouches for a ticket's copy: sent by the handle's first wait(), while the
    copy runs (the load returns without it; the daemon answers well before a copy of any size
    ends), its answer read before that wait blocks, so that only the slot is left to read after."""

    def __init__(self, local: LocalChannel, namespace: bytes, keys: Sequence[bytes], devices: Any) -> None:
        self._local, self._asked = local, (namespace, keys, devices)  # the request is made when sent
        self._pending: Pending | None = None

    def ask(self) -> None:
        with contextlib.suppress(KVStoreError):  # an error is raised again by `result()`
            self.result()

    def result(self) -> Any:
        if self._pending is None:
            namespace, keys, devices = self._asked
            request = pb.LookupRequest(
                namespace=namespace, keys=pack_keys(keys), lease=True, lent_devices=devices
            )
            self._pending = self._local.begin("Lookup", request)
        return self._pending.result()


def _answered(
    session: Session,
    local: LocalChannel,
    pending: _Asking,
    lent: Any,
    chunks: int,
    asked: float,
    token_ids: Any = None,
    unused: bool = False,
) -> int:
    """The copy is done (or was never made: `unused`): the tokens its chunks count by the
    Lookup's answer, and the read given back (Returned, or the tiers' lease released)."""
    try:
        reply = pending.result()
    except KVStoreError as exc:
        log.warning("the Lookup of a ticket's lend failed (%s): reporting no tokens loaded", exc)
        return 0
    namespace = session.namespace
    if not reply.HasField("lent"):
        if reply.lease_id:  # the tiers answered: nothing of theirs was read
            local_send(local, "Release", pb.LeaseRequest(namespace=namespace, lease_id=reply.lease_id))
        if not unused:
            log.warning("the daemon holds no lend of a ticket's blocks: reporting no tokens loaded")
        return 0
    got, step = reply.lent, 4 * session.spec.blocks_per_chunk
    counted = min(reply.hit_chunks, chunks)
    same = (
        got.nonce == lent.nonce != 0  # that very lend, not a later one of the same blocks
        and got.cache == lent.cache
        and got.device_pci_bus_id == lent.device_pci_bus_id
        and got.blocks[: counted * step] == lent.blocks[: counted * step]
    )
    in_time = time.monotonic() < asked + got.ttl_ms / 1000
    if same and not unused and not got.slot:  # no slot was free: the daemon's answer to Returned
        held = session._lends._returned(got.read_id) and in_time
    else:
        held = not unused and same and in_time and local.holds(got.slot - 1, got.read_id)
        given_back = not held  # a copy not counted: the lend stays for another read of its blocks
        returned = pb.ReturnedRequest(namespace=namespace, read_id=got.read_id, unused=given_back)
        local_send(local, "Returned", returned)
    if held:
        return session._covered(token_ids, counted)
    if not unused:
        log.warning(
            "a ticket's lent read %d does not count (%s): reporting no tokens loaded",
            got.read_id,
            "the lend holds other blocks than the ticket" if not same else "it lapsed during the copy",
        )
    return 0


def _failed(session: Session, local: LocalChannel, pending: _Asking, lent: Any, exc: BaseException) -> None:
    """The wait failed (`exc`): the read is given back, the Lookup's answer taken."""
    _answered(session, local, pending, lent, 0, time.monotonic(), unused=True)


def local_send(local: LocalChannel, method: str, request: Any) -> None:
    try:
        local.send(method, request)
    except KVStoreError as exc:  # the daemon is gone: what it held went with it
        log.debug("%s: %s", method, exc)
