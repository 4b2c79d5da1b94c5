"""A client's lends (`KVStoreClient.lend`, `lends_done`) and its reads of lent blocks (a load whose
leased Lookup named this process's GPUs in `lent_devices`): `kvstore.store.lends` is the daemon's
side, `kvstore_client.lent` the descriptor and the opened caches.

When the lender may reuse its blocks: when the daemon says the lend is done, or, whatever the
daemon says or whether it answers at all, once `hold_s` plus a read's TTL have passed since the
Lend's reply: the daemon lets no read start after the hold and answers a read returned after its
TTL with 0, so no reader can count bytes copied after that. An outage alone never frees blocks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import kvstore_kernels
from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.cudart import CudaError, CudaUnavailable
from kvstore.shared.errors import KVStoreError, Unavailable
from kvstore.shared.keys import pack_keys
from kvstore.shared.read_slots import SlotView
from kvstore_client.handles import LoadHandle
from kvstore_client.lent import LentCaches, describe
from kvstore_client.session import Session
from kvstore_client.transfers import cache_device
from kvstore_kernels.cache_facts import RegisteredCaches

log = logging.getLogger(__name__)

DEFAULT_HOLD_S = 30.0
MIN_HOLD_S, MAX_HOLD_S = 0.001, 600.0  # the daemon's bounds


def ticket(descriptor: bytes, bus: str, blocks: bytes, nonce: int) -> bytes:
    """What a reader needs to copy a lend's blocks before the daemon answers for them
    (`KVStoreClient.load_async(lent=...)`): the lender's cache, its GPU, the block ids, and the
    lend's nonce, which tells that lend from a later one of the same blocks."""
    return pb.LentRead(
        cache=descriptor, device_pci_bus_id=bus, blocks=blocks, nonce=nonce
    ).SerializeToString()


class LendPath:
    def __init__(self, session: Session) -> None:
        self._s = session
        self._described: dict[tuple[int, ...], tuple[bytes, str]] = {}
        self._last_described: tuple[Any, tuple[bytes, str]] | None = None
        self._safe_at: dict[int, float] = {}  # lend id -> when its blocks are free whatever happens
        self._devices: dict[torch.device, list[str]] = {}
        self._lock = threading.Lock()
        # The last load's Lookup was answered with lent blocks: the next one likely is too, so it
        # readies no scatter from the arena while the daemon answers (a decode worker's loads).
        self.expect_lent = False

    # -- the lender ----------------------------------------------------------------------------

    def lend(
        self,
        token_ids: Any,
        kv_caches: Any,
        block_ids: Any,
        *,
        keys: Sequence[bytes] | None = None,
        hold_s: float | None = None,
        tail: bool = False,
        meanwhile: Callable[[bytes], Any] | None = None,
        readers: int = 1,
    ) -> tuple[int, int]:
        """`KVStoreClient.lend`: (lend id, tokens lent); (0, 0) where nothing could be lent.
        `meanwhile(ticket)` runs once, while the daemon records the lend (its request sent)."""
        keys = self._s._keys_of(token_ids, keys, tail)
        per_chunk = self._s.spec.blocks_per_chunk
        table = np.asarray(
            block_ids.cpu() if isinstance(block_ids, torch.Tensor) else block_ids, dtype=np.int64
        )
        chunks = min(len(keys), table.size // per_chunk)
        if not chunks:
            return 0, 0
        moved = table.reshape(-1)[: chunks * per_chunk]
        if moved.min() < 0 or moved.max() >= 2**31:
            raise ValueError("block_ids: block ids must be in 0..2**31-1")
        descriptor, bus = self._descriptor(kv_caches)
        device = cache_device(kv_caches)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the KV is written before anyone reads it
        hold_ms = _hold_ms(hold_s)
        packed, blocks = pack_keys(keys[:chunks]), moved.astype("<i4").tobytes()
        nonce = secrets.randbits(63) | 1

        def request() -> pb.LendRequest:
            return pb.LendRequest(
                namespace=self._s.namespace,
                keys=packed,
                blocks=blocks,
                cache=descriptor,
                device_pci_bus_id=bus,
                hold_ms=hold_ms,
                nonce=nonce,
                readers=readers,
            )

        local = self._s._conn.local
        if meanwhile is None or local is None or self._s._conn.outage:
            reply = self._s._conn.call("Lend", request)
        else:
            reply = self._told(local, request(), meanwhile, ticket(descriptor, bus, blocks, nonce))
        with self._lock:
            if len(self._safe_at) >= 4096:  # lends never asked about: the daemon answers for them
                now = time.monotonic()
                self._safe_at = {i: t for i, t in self._safe_at.items() if t > now}
            # The daemon's hold ends hold_ms after it took the Lend, before this reply; its last
            # read's TTL after that (a millisecond for the TTL's rounding to milliseconds).
            self._safe_at[reply.lend_id] = time.monotonic() + hold_ms / 1000 + self._s.lease_ttl_s + 0.001
        return reply.lend_id, self._s._covered(token_ids, chunks)

    def _told(self, local: Any, request: Any, meanwhile: Callable[[bytes], Any], lent: bytes) -> Any:
        """The Lend's reply, `meanwhile(lent)` run once the request is sent, outside the channel
        (it may call the daemon itself). If it raises, the lend the daemon recorded is revoked
        before the error is: the caller, told the lend failed, may reuse its blocks at once. A
        channel found broken before anything was sent (a daemon restarted since the last call) is
        connected again first, as any call would."""
        try:
            pending = local.begin("Lend", request)
        except Unavailable as exc:
            self._s._conn.lost(exc)
            self._s._conn.reconnect()  # Unavailable again if the daemon still does not serve
            local = self._s._conn.local
            if local is None:  # no local channel now: a Lend over gRPC is refused, as without a ticket
                return self._s._conn.call("Lend", lambda: request)
            pending = local.begin("Lend", request)
        try:
            meanwhile(lent)
        except BaseException:
            with contextlib.suppress(KVStoreError):  # not recorded, or its connection closed: over
                self.done([pending.result().lend_id], revoke=True)
            raise
        return pending.result()

    def _descriptor(self, kv_caches: Any) -> tuple[bytes, str]:
        last = self._last_described  # a registered cache keeps its tensors: described once
        if last is not None and last[0] is kv_caches:
            return last[1]
        tensors = [kv_caches] if isinstance(kv_caches, torch.Tensor) else list(kv_caches)
        key = tuple(t.data_ptr() for t in tensors) + tuple(
            s for t in tensors for s in (*t.shape, *t.stride())
        )
        found = self._described.get(key)
        if found is None:
            found = self._described[key] = describe(self._s.spec, kv_caches)
        if type(kv_caches) is RegisteredCaches:
            self._last_described = (kv_caches, found)
        return found

    def done(self, lend_ids: Sequence[int], withdraw: bool = False, revoke: bool = False) -> list[int]:
        """`KVStoreClient.lends_done`."""
        ids = list(lend_ids)
        if not ids:
            return []

        def request() -> pb.LendsRequest:
            return pb.LendsRequest(
                namespace=self._s.namespace, lend_ids=ids, withdraw=withdraw, revoke=revoke
            )

        try:
            done = set(self._s._conn.call("Lends", request).done)
        except KVStoreError as exc:  # only time frees blocks now
            log.warning(
                "Lends: %s; the lends' blocks are free once their hold and a read's TTL have passed", exc
            )
            done = set()
            if revoke:  # the blocks are wanted now: wait until no read can count
                with self._lock:
                    latest = max((self._safe_at.get(i, 0.0) for i in ids), default=0.0)
                time.sleep(max(0.0, latest - time.monotonic()))
        now = time.monotonic()
        with self._lock:
            done |= {
                i for i in ids if self._safe_at.get(i, now + 1) <= now or (revoke and i not in self._safe_at)
            }
            for lend_id in done:
                self._safe_at.pop(lend_id, None)
        return [i for i in ids if i in done]

    # -- the reader ----------------------------------------------------------------------------

    def devices(self, device: torch.device) -> list[str]:
        """The PCI bus ids of the GPUs whose lent blocks a cache on `device` can copy in place."""
        found = self._devices.get(device)
        if found is None:
            found = []
            try:
                from kvstore.shared.cudart import load_runtime

                runtime = load_runtime()
                for other in range(torch.cuda.device_count()):
                    if other == device.index or torch.cuda.can_device_access_peer(device.index, other):
                        found.append(runtime.pci_bus_id(other))
            except (CudaError, CudaUnavailable, RuntimeError) as exc:
                log.debug("no lent reads: %s", exc)
            self._devices[device] = found
        return found

    def read(
        self,
        reply: Any,
        token_ids: Any,
        kv_caches: Any,
        block_ids: Any,
        layers: range,
        stream: Any,
        caches: LentCaches,
        asked: float,
    ) -> LoadHandle | None:
        """Copies the lent blocks of a Lookup's reply (asked for at `asked`, monotonic) into the KV
        cache; None where they cannot be read here (the read is returned, and the caller loads
        from the tiers)."""
        lent, chunks = reply.lent, reply.hit_chunks
        try:
            event = self.copy(lent, chunks, kv_caches, block_ids, layers, stream, caches)
        except Exception as exc:  # noqa: BLE001 - a descriptor or a device this reader cannot use
            log.warning(
                "lent blocks from %s not read (%s): loading from the tiers", lent.device_pci_bus_id, exc
            )
            self.expect_lent = False
            self._returned(lent.read_id, unused=True)  # the lend stays for a reader that can
            return None
        self.expect_lent = True
        tokens = self._s._covered(token_ids, chunks)
        local = self._s._conn.local
        if lent.slot and local is not None and local.read_slots is not None:  # checked in place
            deadline = asked + lent.ttl_ms / 1000  # the daemon's is later: it took the read after
            finish = functools.partial(
                self._finish_in_place, lent.read_id, tokens, local, lent.slot - 1, deadline
            )
        else:
            finish = functools.partial(self._finish, lent.read_id, tokens)
        return LoadHandle(event, finish, lambda exc: self._returned(lent.read_id), tokens, layers)

    def copy(
        self,
        lent: Any,
        chunks: int,
        kv_caches: Any,
        block_ids: Any,
        layers: range,
        stream: Any,
        caches: LentCaches,
    ) -> torch.cuda.Event:
        """Enqueues the copy of `chunks` chunks of the lent blocks `lent` names (a LentRead: a
        Lookup's, or a lender's ticket) into the KV cache; its event."""
        per_chunk = self._s.spec.blocks_per_chunk
        device = cache_device(kv_caches)
        source_blocks = np.frombuffer(lent.blocks, dtype="<i4").astype(np.int64)
        table = np.asarray(
            block_ids.cpu() if isinstance(block_ids, torch.Tensor) else block_ids, dtype=np.int64
        )
        if source_blocks.size != chunks * per_chunk or table.size < chunks * per_chunk:
            raise ValueError(f"{source_blocks.size} lent block ids for {chunks} chunks")
        source = caches.open(self._s.spec, lent.cache, lent.device_pci_bus_id, device, kv_caches)
        stream = stream or self._s._streams.ordered_side(device)
        kvstore_kernels.copy_blocks(
            self._s.spec,
            source,
            source_blocks,
            kv_caches,
            table.reshape(-1)[: chunks * per_chunk],
            layers=layers,
            stream=stream,
        )
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _finish_in_place(self, read_id: int, tokens: int, local: Any, slot: int, deadline: float) -> int:
        """`_finish`, its answer read from the read's slot (`kvstore.shared.read_slots`) with the
        read's TTL on this process's clock; the Returned is sent without waiting for its reply."""
        held = local.holds(slot, read_id) and time.monotonic() < deadline
        try:  # a copy not counted is given back unused: the lend stays for another read
            request = pb.ReturnedRequest(namespace=self._s.namespace, read_id=read_id, unused=not held)
            local.send("Returned", request)
        except KVStoreError as exc:  # the daemon is gone: the read lapses with it
            log.debug("Returned %d: %s", read_id, exc)
        return tokens if held else self._lapsed(read_id)

    def take_slots(self, fds: list[int], local: Any = None) -> None:
        """Maps the read slots a lent Lookup's reply on `local` (default: the current local
        channel) carried; none if another connection has replaced it since."""
        current = self._s._conn.local
        local = current if local is None else local
        try:
            if fds and local is current and local is not None and local.read_slots is None:
                local.read_slots = SlotView(fds.pop())
        except (OSError, ValueError) as exc:  # reads are then answered by Returned, as over gRPC
            log.warning("read slots not mapped: %s", exc)
        finally:
            for fd in fds:
                os.close(fd)

    def _finish(self, read_id: int, tokens: int) -> int:
        """The copy is done: its tokens if the lend held the blocks until now, else 0."""
        if self._returned(read_id):
            return tokens
        return self._lapsed(read_id)

    @staticmethod
    def _lapsed(read_id: int) -> int:
        log.warning(
            "lent read %d lapsed during the copy (the lender went away, or the read's TTL ended); "
            "reporting no tokens loaded",
            read_id,
        )
        return 0

    def _returned(self, read_id: int, unused: bool = False) -> bool:
        try:
            reply = self._s._conn.rpc(
                "Returned", pb.ReturnedRequest(namespace=self._s.namespace, read_id=read_id, unused=unused)
            )
        except KVStoreError as exc:
            log.debug("Returned %d: %s", read_id, exc)
            return False
        return bool(reply.pages)


def _hold_ms(hold_s: float | None) -> int:
    """A lend's hold in whole milliseconds (default `DEFAULT_HOLD_S`), checked."""
    hold = DEFAULT_HOLD_S if hold_s is None else hold_s
    if not MIN_HOLD_S <= hold <= MAX_HOLD_S:
        raise ValueError(f"hold_s: expected {MIN_HOLD_S}..{MAX_HOLD_S} seconds, got {hold!r}")
    return math.ceil(hold * 1000)
