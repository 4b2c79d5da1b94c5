"""Lent blocks' calls (`kvstore.store.lends`): a Lend, and a leased Lookup answered from lent blocks.

- `lend_reply(store, request, peer)`: records a Lend; only a local-channel caller (`peer`) may
  lend, since the lend ends with the lender's process.
- `lent_reply(store, request, caller)`: a Lookup that names `lent_devices`, answered from lent
  blocks when they cover at least the stored prefix (the lent copy is device to device): with a
  lease, a read of them; without, their count (a scheduler's query, "*" for any GPU). None
  otherwise, and the Lookup is answered from the tiers. A read on the local channel takes a slot
  in its connection's read slots (`kvstore.shared.read_slots`, made at the first Lookup that
  asks for them, and sent with its reply by `kvstore.server.local`).
"""

from __future__ import annotations

import logging

from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.tenants import Caller
from kvstore.shared.domain import Tier
from kvstore.shared.errors import FailedPrecondition
from kvstore.shared.keys import unpack_keys
from kvstore.shared.peers import Peer
from kvstore.shared.read_slots import ReadSlots
from kvstore.store.store import Store

log = logging.getLogger(__name__)
MAX_SLOTS_SENT = 8  # a connection's read slots go with at most this many replies


def lend_reply(store: Store, request: pb.LendRequest, peer: Peer | None) -> pb.LendResponse:
    if peer is None:
        raise FailedPrecondition(
            "Lend: answered on the daemon's local channel only (ConnectResponse.local_socket), "
            "where the lender's process is known"
        )
    ns = store.namespaces.registered(request.namespace)
    lend_id = store.lends.lend(
        request.namespace,
        unpack_keys(request.keys),
        request.blocks,
        request.cache,
        request.device_pci_bus_id,
        request.hold_ms / 1000 if request.hold_ms else None,
        peer,
        max_blocks_per_chunk=ns.spec.chunk_tokens,  # a block holds at least a token
        nonce=request.nonce,
        readers=request.readers or 1,
    )
    return pb.LendResponse(lend_id=lend_id)


def read_slots(caller: Caller | None, asked: bool) -> ReadSlots | None:
    """The caller's connection's read slots: local-channel callers only, made when first asked for."""
    peer = caller.peer if caller is not None else None
    if peer is None or not peer.connected:  # gRPC: no connection of its own to check against
        return None
    if peer.read_slots is None and asked:
        try:
            peer.read_slots = ReadSlots()
        except OSError as exc:  # out of descriptors or memory: its reads wait for Returned's answer
            log.warning("read slots for pid %d not made (its reads wait for Returned): %s", peer.pid, exc)
            peer.read_slots = False  # not tried again on this connection
    return peer.read_slots or None


def lent_reply(
    store: Store, request: pb.LookupRequest, caller: Caller | None = None
) -> pb.LookupResponse | None:
    keys = unpack_keys(request.keys)
    store.namespaces.registered(request.namespace)

    def stored() -> int:  # a query of the tiers: neither a use nor a lease
        return store.lookup(request.namespace, keys, False, None, touch=False).hit_chunks

    if not request.lease:  # a query: the longer of the lent run and the stored prefix, nothing held
        lent_chunks = store.lends.peek(request.namespace, keys, request.lent_devices)
        if not lent_chunks or lent_chunks <= stored():
            return None
        return pb.LookupResponse(hit_chunks=lent_chunks, tiers=bytes([Tier.LENT]) * lent_chunks)

    slots, peer = read_slots(caller, request.read_slots), caller.peer if caller is not None else None
    hit = store.lends.lookup(
        request.namespace, keys, request.lent_devices, lambda: max(1, stored()), slots, reader=peer
    )
    if hit is None:
        return None
    reply = pb.LookupResponse(hit_chunks=hit.chunks, tiers=bytes([Tier.LENT]) * hit.chunks)
    lent = reply.lent  # filled in place: the descriptor copied once
    lent.read_id, lent.cache, lent.device_pci_bus_id = hit.read_id, hit.cache, hit.device
    lent.blocks, lent.ttl_ms, lent.slot = hit.blocks, int(hit.ttl_s * 1000), hit.slot
    if hit.slot and request.read_slots and peer is not None and peer.read_slots_sent < MAX_SLOTS_SENT:
        peer.read_slots_sent += 1  # a worker that asks and never reads holds a few in flight, no more
        lent.read_slots_sent = True
    lent.nonce = hit.nonce
    return reply
