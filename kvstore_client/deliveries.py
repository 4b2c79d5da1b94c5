"""Pushed hand-overs between the GPUs of one host (`KVStoreClient.expect` and `deliver`): the
sender's copy engines write a prompt's KV straight into the blocks the receiver set aside, and its
GPU tells the receiver's inbox when the last byte has landed.

The receiver (a decode worker) calls `expect(token_ids, kv_caches, block_ids)` for the blocks it
allocated to a prompt and hands the receipt to the sender (a prefill worker): its cache's CUDA IPC
descriptor, its GPU, the block ids, the prompt's chunk keys and a slot of its inbox
(`kvstore_client.inbox`) with a random nonce. The sender's `deliver(receipt, token_ids, kv_caches,
block_ids)` claims the slot, enqueues the copy of the leading chunks whose keys match its own
on a side stream ordered after its current one (no wait for its forward on the host), then an
8-byte copy of `nonce + chunks` into the slot. The receiver's `Receiving.wait()` reads the slot.

Neither side calls the daemon: nothing the daemon owns is read or written, and the hand-over's
critical path is the sender's enqueue and the copy. What holds without it:
- no partial page counts: the slot's `done` is written by the sender's GPU after its copy, in
  stream order, and only the chunks it names count; a sender that dies never writes it;
- the right prompt: chunks count only while the sender's keys (chained hashes of the tokens and
  namespace) equal the receipt's;
- no late write into reused blocks: a receiver reuses the blocks of a receipt it gave up on
  (`Receiving.cancel()`) only once no sender claimed it, its delivery landed, or the sender that
  claimed it is gone (`inbox`);
- a receipt is delivered at most once; a stale or cancelled one delivers nothing (`tokens` 0).
A host without peer access between the two GPUs gets a ValueError from `deliver` before anything
is claimed (hand over through the arena instead: `store`, then `load`, or `lend`).
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import kvstore_kernels
from kvstore.shared.cudart import CudaError
from kvstore.shared.keys import KEY_BYTES, pack_keys
from kvstore_client.inbox import SIZE, Inbox, Inboxes
from kvstore_client.inbox import mine as my_inbox
from kvstore_client.lent import LentCaches
from kvstore_client.session import Session
from kvstore_client.transfers import cache_device

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<4sHHQIIQ16sIIIHI")  # magic, version, 0, nonce, pid, fd, inode, id, slot,
MAGIC, VERSION = b"KVRC", 1  # chunks, blocks per chunk, bus bytes, descriptor bytes; then the
MAX_CHUNKS, MAX_DESCRIPTOR = 1 << 16, 1 << 20  # keys, the block ids (i32), the bus, the descriptor
MAX_PER_CHUNK = 1 << 12
FLAGS = 256  # words of `done` a sender's GPU copies from, per device, used in turn
SPIN_S = 0.05  # a wait reads the slot without sleeping this long, then sleeps a little between reads


class Receipt:
    """A receiver's receipt, parsed and checked (ValueError for bytes that are not one)."""

    def __init__(self, data: bytes) -> None:
        data = bytes(data)
        if len(data) < _HEAD.size:
            raise ValueError("receipt: too short to be one")
        head = _HEAD.unpack_from(data)
        magic, version, _, self.nonce, pid, fd, inode, inbox_id, self.slot, self.chunks, per_chunk = head[:11]
        bus_bytes, descriptor_bytes = head[11:]
        if magic != MAGIC or version != VERSION:
            raise ValueError("receipt: not a kvstore receipt (or another version's)")
        if not 0 < self.chunks <= MAX_CHUNKS or descriptor_bytes > MAX_DESCRIPTOR or not self.nonce:
            raise ValueError("receipt: malformed")
        if not 0 < per_chunk <= MAX_PER_CHUNK:
            raise ValueError("receipt: malformed")
        self.raw, self.inbox = data, (pid, fd, inode, inbox_id)
        self.per_chunk = per_chunk
        sizes = (self.chunks * KEY_BYTES, self.chunks * per_chunk * 4, bus_bytes, descriptor_bytes)
        if len(data) != _HEAD.size + sum(sizes):
            raise ValueError("receipt: its parts do not add up to its length")
        at = _HEAD.size
        parts = []
        for size in sizes:
            parts.append(data[at : at + size])
            at += size
        self.keys, blocks, bus, self.descriptor = parts  # the keys packed
        self.blocks = np.frombuffer(blocks, dtype="<i4").astype(np.int64)
        self.bus = bus.decode("ascii", "replace")

    @staticmethod
    def make(
        nonce: int, address: Any, slot: int, keys: Sequence[bytes], blocks: Any, bus: str, desc: bytes
    ) -> bytes:
        per_chunk = len(blocks) // len(keys)
        pid, fd, inode, inbox_id = address
        sizes = (len(keys), per_chunk, len(bus), len(desc))
        head = _HEAD.pack(MAGIC, VERSION, 0, nonce, pid, fd, inode, inbox_id, slot, *sizes)
        return head + pack_keys(keys) + np.asarray(blocks, dtype="<i4").tobytes() + bus.encode() + desc


class Receiving:
    """A receipt handed out (`KVStoreClient.expect`): the receiver's side of one hand-over. Its
    inbox slot is held until `wait()` (or `poll()`) returns tokens or `cancel()` returns True."""

    def __init__(
        self, box: Inbox, slot: int, nonce: int, chunks: int, tokens: list[int], receipt: bytes
    ) -> None:
        self.receipt = receipt
        self._box, self._slot, self._nonce, self._chunks = box, slot, nonce, chunks
        self._tokens = tokens  # tokens covered by 0..chunks chunks
        self._result: int | None = None
        self._closed = False

    def __del__(self) -> None:  # a receipt dropped unread: its slot back once nothing can land
        if self._result is None and not self._closed:
            self._box.drop(self._slot, self._nonce, self._chunks)

    def poll(self) -> int | None:
        """The tokens delivered, or None while nothing has landed."""
        if self._result is None and not self._closed:
            got = self._box.delivered(self._slot, self._nonce, self._chunks)
            if got is not None:
                self._result = self._tokens[got]
                self._box.release(self._slot, self._nonce)
                self._closed = True
        return self._result

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Blocks until the delivery lands: the tokens now in the blocks (0: the sender had none
        of them); None if it has not landed by `timeout_s` (then `cancel()` or wait again)."""
        started = time.monotonic()
        pause = 0.0
        while (got := self.poll()) is None and not self._closed:
            now = time.monotonic()
            if timeout_s is not None and now - started >= timeout_s:
                return None
            if now - started > SPIN_S:
                pause = min(0.001, pause + 0.0001)
            time.sleep(pause)
        return got

    def cancel(self) -> bool:
        """Gives the receipt up: True where the blocks are the receiver's again and nothing will be
        written into them; False where a delivery has landed (`wait()` returns it) or may still
        land (a sender copying now: call again, or wait)."""
        if self._result is not None:
            return False
        if self._closed:
            return True
        freed = self._box.cancel(self._slot, self._nonce, self._chunks)
        if freed is None:
            return False
        if not freed:  # landed just now
            self.poll()
            return False
        self._closed = True
        return True


class Delivery:
    """A hand-over sent (`KVStoreClient.deliver`): `tokens` pushed; the sender's blocks may change
    once `done()` (or after `wait()`)."""

    def __init__(self, tokens: int, event: Any = None, finished: Any = None) -> None:
        self.tokens = tokens
        self._event, self._finished = event, finished

    def done(self) -> bool:
        if self._event is not None and not self._event.query():
            return False
        self._finish()
        return True

    def wait(self) -> int:
        if self._event is not None:
            self._event.synchronize()
        self._finish()
        return self.tokens

    def _finish(self) -> None:
        if self._finished is not None:
            finished, self._finished = self._finished, None
            finished()


class _Sender:
    """A sending process's opened inboxes and receivers' caches, and the values its GPUs copy
    into the inboxes (one process-wide set: a worker's clients share them)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.inboxes = Inboxes()
        self.caches = LentCaches()
        self._flags: dict[torch.device, tuple[torch.Tensor, list[Any]]] = {}
        self._turn = 0
        self._lock = threading.Lock()

    def register(self, opened: Any) -> None:
        """Pins a receiver's inbox here, once, so that this process's GPUs can write into it."""
        with self._lock:
            if not opened.registered:
                from kvstore.shared.cudart import load_runtime

                load_runtime().host_register(opened.base, SIZE, portable=True)
                opened.registered = True

    def tell(self, device: torch.device, value: int, address: int, stream: Any) -> Any:
        """Enqueues on `stream` the write of `value` (8 bytes) to `address` (a receiver's inbox):
        a device word filled with it, then copied there by the copy engines, in stream order.
        The event after it."""
        from kvstore.shared.cudart import load_runtime

        with self._lock:
            found = self._flags.get(device)
            if found is None:
                words = torch.zeros(FLAGS, dtype=torch.int64, device=device)
                found = self._flags[device] = (words, [None] * FLAGS)
            words, events = found
            turn = self._turn = (self._turn + 1) % FLAGS
            if events[turn] is not None:
                events[turn].synchronize()  # that word's last value was copied: it may change
            event = events[turn] = torch.cuda.Event()
        with torch.cuda.stream(stream):
            words[turn].fill_(value)
        load_runtime().memcpy_async(address, words.data_ptr() + 8 * turn, 8, stream.cuda_stream)
        event.record(stream)
        return event


class HandOver(Session):
    """`KVStoreClient`'s pushed hand-overs (a part of the client: its own module for its size)."""

    def expect(
        self,
        token_ids: Any,
        kv_caches: Any,
        block_ids: Any,
        *,
        keys: Sequence[bytes] | None = None,
        tail: bool = False,
    ) -> Receiving:
        """Sets blocks of this worker's KV cache aside for a prompt's KV pushed by another worker
        of this host (`deliver`): hand `.receipt` to it, then `wait()` for the tokens that landed.
        The blocks are the sender's to write until `wait()` returns tokens or `cancel()` returns
        True: the caller neither writes nor frees them before. The cache must be one CUDA IPC
        can export (as for `lend`)."""
        if cache_device(kv_caches).type != "cuda":
            raise ValueError(
                "expect: the KV cache must be on a CUDA device (a pushed hand-over is GPU to GPU)"
            )
        keys = self._keys_of(token_ids, keys, tail)
        per_chunk = self.spec.blocks_per_chunk
        table = _table(block_ids)
        chunks = min(len(keys), table.size // per_chunk, MAX_CHUNKS)
        if not chunks:
            raise ValueError("block_ids: no whole chunk's blocks to receive a prompt into")
        blocks = table[: chunks * per_chunk]
        if blocks.min() < 0 or blocks.max() >= 2**31:
            raise ValueError("block_ids: block ids must be in 0..2**31-1")
        descriptor, bus = self._lends._descriptor(kv_caches)
        box = my_inbox()
        nonce = secrets.randbits(62) | 1
        address = box.address()
        slot, receipt = box.post(
            nonce, lambda slot: Receipt.make(nonce, address, slot, keys[:chunks], blocks, bus, descriptor)
        )
        tokens = [self._covered(token_ids, n) for n in range(chunks + 1)]
        return Receiving(box, slot, nonce, chunks, tokens, receipt)

    def deliver(
        self,
        receipt: bytes,
        token_ids: Any,
        kv_caches: Any,
        block_ids: Any,
        *,
        keys: Sequence[bytes] | None = None,
        tail: bool = False,
    ) -> Delivery:
        """Pushes the KV of the leading chunks of `token_ids` whose keys the receipt's prompt
        shares (from blocks `block_ids` of this worker's cache) into the receiver's blocks, device
        to device, after the work queued on the cache's current stream; returns at once. The
        blocks must not change until the Delivery is `done()`. `tokens` 0: nothing was sent (a
        receipt delivered, cancelled, or of another prompt). ValueError for a receipt that is not
        one, of another geometry, or of a GPU this one cannot reach."""
        got = Receipt(receipt)
        per_chunk = self.spec.blocks_per_chunk
        if got.per_chunk != per_chunk:
            raise ValueError(f"receipt: {got.per_chunk} blocks a chunk, this worker's cache {per_chunk}")
        keys = self._keys_of(token_ids, keys, tail)
        table = _table(block_ids)
        limit = min(got.chunks, len(keys), table.size // per_chunk)
        chunks = _shared(pack_keys(keys[:limit]), got.keys, limit)
        device, state = cache_device(kv_caches), sender()
        # The receiver's cache, opened before the claim: one this GPU cannot reach claims nothing.
        theirs = _theirs(self.spec, state, got, device, kv_caches, chunks)
        try:
            opened = state.inboxes.claim(got.inbox, got.slot, got.nonce, got.raw)
        except OSError as exc:
            raise ValueError(
                f"receipt: the receiver's inbox (process {got.inbox[0]}) is out of reach: {exc}"
            ) from None
        if opened is None:
            log.debug("receipt of slot %d: delivered, cancelled or replaced before", got.slot)
            return Delivery(0)
        finished = functools.partial(state.inboxes.finished, opened, got.slot)
        if not chunks:  # nothing to copy: said from the host
            state.inboxes.abandon(opened, got.slot, got.nonce)
            return Delivery(0)
        moved, stream = chunks * per_chunk, None
        try:
            stream = self._streams.ordered_side(device)
            with torch.cuda.device(device):
                event = self._push(
                    state, opened, got, chunks, device, stream, table[:moved], kv_caches, theirs
                )
        except BaseException:
            _abandon(state, stream, opened, got)
            raise
        return Delivery(self._covered(token_ids, chunks), event, finished)

    def _push(
        self, state: _Sender, opened: Any, got: Receipt, chunks: int, device: torch.device, stream: Any,
        mine: np.ndarray, kv_caches: Any, theirs: Any,
    ) -> Any:  # fmt: skip
        """Enqueues the copy, then the inbox's word after it, on `stream`; the event after both
        (the copy first: what follows it costs host time while the first bytes move)."""
        their_ids = got.blocks[: mine.size]
        kvstore_kernels.copy_blocks(self.spec, kv_caches, mine, theirs, their_ids, stream=stream)
        state.register(opened)
        return state.tell(device, got.nonce + chunks, opened.done_address(got.slot), stream)


def _theirs(
    spec: Any, state: _Sender, got: Receipt, device: torch.device, kv_caches: Any, chunks: int
) -> Any:
    """The receiver's KV cache, opened on `device` (this worker's cache's); None for no chunks."""
    if device.type != "cuda":
        raise ValueError("deliver: the KV cache must be on a CUDA device (a pushed hand-over is GPU to GPU)")
    if not chunks:
        return None
    try:
        return state.caches.open(spec, got.descriptor, got.bus, device, kv_caches)
    except CudaError as exc:  # a cache of this very process, or of a GPU out of reach
        raise ValueError(f"receipt: the receiver's KV cache cannot be opened here ({exc})") from None


def _abandon(state: _Sender, stream: Any, opened: Any, got: Receipt) -> None:
    """A delivery that failed after its claim: once what it enqueued has run, the receiver is told
    that nothing landed. Where the stream cannot be waited for, the claim stays: the receiver's
    blocks stay set aside until this process is gone."""
    try:
        if stream is not None:
            stream.synchronize()
    except Exception:  # noqa: BLE001 - the caller gets the first error
        log.error("a failed delivery's copies cannot be waited for: slot %d stays claimed", got.slot)
        return
    state.inboxes.abandon(opened, got.slot, got.nonce)


def _shared(mine: bytes, theirs: bytes, limit: int) -> int:
    """How many of the first `limit` packed keys the two share, from the first on."""
    if mine[: limit * KEY_BYTES] == theirs[: limit * KEY_BYTES]:
        return limit
    chunks = 0
    while (
        mine[chunks * KEY_BYTES : (chunks + 1) * KEY_BYTES]
        == theirs[chunks * KEY_BYTES : (chunks + 1) * KEY_BYTES]
    ):
        chunks += 1
    return chunks


def _table(block_ids: Any) -> np.ndarray:
    ids = block_ids.cpu() if isinstance(block_ids, torch.Tensor) else block_ids
    return np.asarray(ids, dtype=np.int64).reshape(-1)


_sender: _Sender | None = None
_sender_lock = threading.Lock()


def sender() -> _Sender:
    """This process's sending state (a forked child makes its own: locks are not inherited)."""
    global _sender
    with _sender_lock:
        if _sender is None or _sender.pid != os.getpid():
            _sender = _Sender()
        return _sender
