"""Lent blocks: a worker's own KV-cache blocks, read by workers on other GPUs of the host.

A prefill worker that hands a prompt to a decode worker on another GPU need not copy the KV out
of its cache at all: it lends the blocks (`Lends.lend`: the chunks' keys, each chunk's block ids
in its cache, and its cache's descriptor, which readers open over CUDA IPC), and keeps them
unchanged until the lend is done. A reader's leased Lookup that names the lender's GPU
(`LookupRequest.lent_devices`) gets the block ids (`Lends.lookup`: a read, with a TTL) and copies
them into its own cache device to device: one copy over the link, where the GPU tier's hand-over
makes two (bench/NOTES-handover.md). Its `Returned` tells the daemon the copy is done.

What each side may rely on:
- A lend is **done** (`Lends.done`: its blocks may be reused) only when no read is in flight:
  after reads of its `readers` readers (1 unless the lender said more: each rank of a TP decode
  instance, a connection each, reading a group every rank holds alike) returned in time, after
  its hold ends (`hold_s`) with no read in flight, after the lender withdrew it, or once the
  lender's connection closed (it exited, or gave up on a call). A read in flight holds the lend
  past its hold until the read returns or its TTL ends; a revoked lend (the lender must reuse
  its blocks now) ends at once, its reads counting 0.
- A read that returns after its TTL, or whose lend was dropped (the lender gone, a Clear, a revoke), is
  answered 0 (`Lends.returned`): the reader discards what it copied and recomputes, so a lender
  that reused its blocks after a stalled read's TTL never hands wrong bytes to a user.
- Lends live in the daemon's memory: a restarted daemon knows none, answers their reads 0 and
  reports their ids done (`LendsResponse.done` includes unknown ids); ids are random per daemon
  start, so an id of the last run never names a lend of this one.
- A read taken on a local-channel connection also takes a slot in that connection's read slots
  (`kvstore.shared.read_slots`): the read's id while it holds its lend, 0 from the moment
  anything ends the lend or the read, written before that is answered to anyone. The reader
  checks it after its copy instead of waiting for Returned's answer.
- Bounded: at most `max_lends` lends, `max_keys` lent chunks and `max_bytes` at once, a descriptor of at most
  `lend_fields.MAX_CACHE_BYTES`, blocks of at most a chunk's tokens a chunk, `MAX_READS` reads in flight a
  lend; a lend past the caps is refused as ResourceExhausted, never stored. Ids are random.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.shared.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvstore.shared.peers import Peer
from kvstore.shared.read_slots import ReadSlots
from kvstore.store.lend_fields import MAX_READS, checked

MAX_HOLD_S = 600.0


@dataclass(eq=False)
class Lend:
    id: int
    ns: bytes
    keys: list[bytes]
    blocks: bytes  # int32 little-endian, blocks_per_chunk per key
    blocks_per_chunk: int
    cache: bytes
    device: str
    lender: Peer | None
    hold_until: float
    nonce: int = 0  # the lender's number for it (LendRequest.nonce)
    readers: int = 1  # readers (connections) whose reads returned in time end it
    reads: dict[int, float] = field(default_factory=dict)  # read id -> its deadline
    read_by: set[object] = field(default_factory=set)  # who returned a read in time
    withdrawn: bool = False
    done: bool = False


@dataclass(frozen=True)
class LentHit:
    chunks: int
    read_id: int
    cache: bytes
    device: str
    blocks: bytes
    ttl_s: float
    slot: int = 0  # 1 + its index in the reader's read slots; 0: none
    nonce: int = 0


class Lends:
    """One store's lends (a tenant's: another tenant's lends cannot be named)."""

    def __init__(
        self,
        read_ttl_s: float,
        hold_s: float = 30.0,
        max_lends: int = 4096,
        max_keys: int = 1 << 20,
        max_bytes: int = 256 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.read_ttl_s, self.hold_s = read_ttl_s, hold_s
        self.max_lends, self.max_keys, self.max_bytes = max_lends, max_keys, max_bytes
        self._bytes = 0
        self._clock = clock
        self._lends: dict[int, Lend] = {}
        self._by_key: dict[tuple[bytes, bytes], tuple[Lend, int]] = {}  # (ns, key) -> lend, position
        self._reads: dict[int, tuple[Lend, ...]] = {}  # read id -> the lends it holds
        self._readers: dict[int, object] = {}  # read id -> its reader's connection (else the id)
        self._slots: dict[int, tuple[ReadSlots, int]] = {}  # read id -> its slot, where it has one
        self._keys = 0
        self.counters = {"lends": 0, "lent_reads": 0, "lent_reads_returned": 0, "lent_reads_lapsed": 0}

    def __len__(self) -> int:
        return len(self._lends)

    def lend(
        self,
        ns: bytes,
        keys: Sequence[bytes],
        blocks: bytes,
        cache: bytes,
        device: str,
        hold_s: float | None,
        lender: Peer | None,
        max_blocks_per_chunk: int = 1 << 16,
        nonce: int = 0,
        readers: int = 1,
    ) -> int:
        """Records a lend of `keys` (each the same number of int32 block ids in `blocks`), done
        after `readers` reads returned in time; returns its id. A key lent before is read from
        this lend from now on."""
        blocks_per_chunk = checked(keys, blocks, cache, device, readers, max_blocks_per_chunk)
        hold = self.hold_s if hold_s is None else hold_s
        if not 0 < hold <= MAX_HOLD_S:
            raise InvalidArgument(f"Lend: hold_ms must be at most {int(MAX_HOLD_S * 1000)}")
        if lender is not None and lender.hung_up():  # it gave up on this call: it may be reusing the blocks
            raise FailedPrecondition("Lend: the lender's connection closed before its Lend was read")
        self._purge()
        size = len(blocks) + len(cache) + 64 * len(keys)
        if (
            len(self._lends) >= self.max_lends
            or self._keys + len(keys) > self.max_keys
            or self._bytes + size > self.max_bytes
        ):
            raise ResourceExhausted(
                f"Lend: this daemon holds {len(self._lends)} lends of {self._keys} chunks in "
                f"{self._bytes} bytes (at most {self.max_lends}, {self.max_keys} and {self.max_bytes}): "
                f"wait for some to be read or to expire, or store instead"
            )
        lend_id = self._new_id()
        until = self._clock() + hold
        lend = Lend(
            lend_id, ns, list(keys), blocks, blocks_per_chunk, cache, device, lender, until, nonce, readers
        )
        self._lends[lend_id] = lend
        for position, key in enumerate(lend.keys):
            self._by_key[(ns, key)] = (lend, position)
        self._keys += len(keys)
        self._bytes += size
        self.counters["lends"] += 1
        return lend_id

    def lookup(
        self,
        ns: bytes,
        keys: Sequence[bytes],
        devices: Sequence[str],
        at_least: Callable[[], int] = lambda: 1,
        slots: ReadSlots | None = None,
        reader: object | None = None,
    ) -> LentHit | None:
        """The longest leading run of `keys` lent in order by live lends of one cache on one of
        `devices` (a prompt lent a step at a time, as chunked prefill makes it, is read whole), as
        one read that holds each of them (in a slot of `slots`, the reader's connection's, where
        one is free); None when the first key is not lent so, or the run is shorter than
        `at_least()` (the stored prefix: asked only when the first key is lent). `reader`: its
        connection (a lend for several readers counts one read of each)."""
        now = self._clock()
        segments = self._segments(ns, keys, devices, now, reading=True)
        if not segments:
            return None
        chunks = sum(count for _, _, count in segments)
        if chunks < at_least():
            return None
        read_id = self._new_id()
        for lend, _, _ in segments:
            lend.reads[read_id] = now + self.read_ttl_s
        self._reads[read_id] = tuple(lend for lend, _, _ in segments)
        self._readers[read_id] = read_id if reader is None else reader
        self.counters["lent_reads"] += 1
        slot = slots.take(read_id) if slots is not None else None
        if slot is not None:
            self._slots[read_id] = (slots, slot)  # type: ignore[assignment]
        head = segments[0][0]
        step = 4 * head.blocks_per_chunk
        blocks = b"".join(
            lend.blocks[first * step : (first + count) * step] for lend, first, count in segments
        )
        slot_number = 0 if slot is None else slot + 1
        return LentHit(
            chunks, read_id, head.cache, head.device, blocks, self.read_ttl_s, slot_number, head.nonce
        )

    def peek(self, ns: bytes, keys: Sequence[bytes], devices: Sequence[str]) -> int:
        """How many leading `keys` live lends of one cache on one of `devices` ("*": any) hold,
        taking no read (a scheduler's query: it cannot know which GPUs its workers reach)."""
        segments = self._segments(ns, keys, devices, self._clock(), reading=False)
        return sum(count for _, _, count in segments)

    def _segments(
        self, ns: bytes, keys: Sequence[bytes], devices: Sequence[str], now: float, reading: bool
    ) -> list[tuple[Lend, int, int]]:
        """(lend, its position of the run's first key there, chunks) for each lend the leading run
        of `keys` goes through: each live, not withdrawn, in its hold, on one of `devices`, the
        later ones of the first's cache and GPU; with `reading`, each with room for a read."""
        segments: list[tuple[Lend, int, int]] = []
        covered = 0
        while covered < len(keys):
            found = self._by_key.get((ns, keys[covered]))
            if found is None:
                break
            lend, first = found
            if self._settle(lend, now) or lend.withdrawn or now >= lend.hold_until:
                break
            if lend.device not in devices and (reading or "*" not in devices):
                break
            if reading and len(lend.reads) >= MAX_READS:  # readers that never return: the tiers answer
                break
            if segments and not _continues(segments[0][0], lend, segments):
                break
            count = self._run(lend, first, keys[covered:])
            segments.append((lend, first, count))
            covered += count
            if first + count < len(lend.keys):  # the keys part from this lend's: the run ends here
                break
        return segments

    @staticmethod
    def _run(lend: Lend, first: int, keys: Sequence[bytes]) -> int:
        """How many of `keys` follow `lend`'s keys from position `first` on (the first does)."""
        chunks = 1
        while (
            chunks < len(keys)
            and first + chunks < len(lend.keys)
            and lend.keys[first + chunks] == keys[chunks]
        ):
            chunks += 1
        return chunks

    def returned(self, ns: bytes, read_id: int, unused: bool = False) -> bool:
        """Whether the read `read_id` held its lends until now (False: discard what it copied).
        `unused`: given back without a copy; the lends stay for other readers."""
        lends = self._reads.get(read_id)
        if lends is None or lends[0].ns != ns:  # unknown, lapsed, or another namespace's: not this caller's
            self.counters["lent_reads_lapsed"] += 1
            return False
        now = self._clock()
        held = all(
            now < lend.reads.get(read_id, now) and not lend.done and not self._lender_gone(lend)
            for lend in lends
        )
        who = self._readers.get(read_id, read_id)
        self._drop_read(read_id)
        if unused:
            held = False
        elif held:
            for lend in lends:
                lend.read_by.add(who)
            self.counters["lent_reads_returned"] += 1
        else:
            self.counters["lent_reads_lapsed"] += 1
        for lend in lends:
            self._settle(lend, now)
        return held

    def done(
        self, ns: bytes, lend_ids: Sequence[int], withdraw: bool = False, revoke: bool = False
    ) -> list[int]:
        """Of `lend_ids`, those whose blocks may be reused; with `withdraw`, the others end as
        soon as no read is in flight; with `revoke`, all end now and their reads in flight count
        0. A done lend is forgotten once reported."""
        now = self._clock()
        answer = []
        for lend_id in lend_ids:
            lend = self._lends.get(lend_id)
            if lend is None or lend.ns != ns:
                if lend is None:  # unknown here (another daemon run's, or reported before)
                    answer.append(lend_id)
                continue
            if withdraw:
                lend.withdrawn = True
            if revoke:
                self._end(lend)
            if self._settle(lend, now):
                answer.append(lend_id)
                self._forget(lend)
        return answer

    def clear(self, ns: bytes) -> None:
        """Drops every lend of `ns` (a Clear): its reads in flight will be answered 0."""
        for lend in [lend for lend in self._lends.values() if lend.ns == ns]:
            self._end(lend)

    def closed(self, peer: Peer) -> None:
        """`peer`'s connection closed: its lends end now (their readers' slots say so before
        anyone learns the lend is done)."""
        for lend in [lend for lend in self._lends.values() if lend.lender is peer and not lend.done]:
            self._end(lend)

    def _end(self, lend: Lend) -> None:
        """Done now: no new read, and a read in flight counts 0: its slot holds 0 from now on (and
        is free again), its Returned finds no such read."""
        lend.done = True
        for read_id in list(lend.reads):  # a read of several lends ends with any of them
            self._drop_read(read_id)
        lend.reads.clear()

    def _drop_read(self, read_id: int) -> None:
        """Forgets a read (returned, lapsed, or a lend of it ended) in each of its lends, and frees
        its slot."""
        self._readers.pop(read_id, None)
        for lend in self._reads.pop(read_id, ()):
            lend.reads.pop(read_id, None)
        found = self._slots.pop(read_id, None)
        if found is not None:
            found[0].free(found[1])

    def _settle(self, lend: Lend, now: float) -> bool:
        """Ends lapsed reads, and marks `lend` done when nothing holds it any more."""
        if lend.done:
            return True
        for read_id, deadline in list(lend.reads.items()):
            if deadline <= now:
                del lend.reads[read_id]
                self._drop_read(read_id)
        gone = self._lender_gone(lend)
        read_back = len(lend.read_by) >= lend.readers
        if gone or (not lend.reads and (read_back or lend.withdrawn or now >= lend.hold_until)):
            self._end(lend)
        return lend.done

    @staticmethod
    def _lender_gone(lend: Lend) -> bool:
        """The connection the lend was made on closed: the lender exited, or gave up on a call
        (a timed-out Lend it may not know was recorded) and holds nothing for it any more. Its
        socket says so before the event loop does: a read is never granted after that."""
        return lend.lender is not None and lend.lender.hung_up()

    def _unindex(self, lend: Lend) -> None:
        """Drops `lend`'s keys from the index, once it is forgotten: a done lend's keys stay
        indexed until then (a Lookup finds it done; a Returned costs nothing per chunk)."""
        for position, key in enumerate(lend.keys):
            if self._by_key.get((lend.ns, key)) == (lend, position):
                del self._by_key[(lend.ns, key)]

    def _forget(self, lend: Lend) -> None:
        self._unindex(lend)
        if self._lends.pop(lend.id, None) is not None:
            self._keys -= len(lend.keys)
            self._bytes -= len(lend.blocks) + len(lend.cache) + 64 * len(lend.keys)
        for read_id in list(lend.reads):
            self._drop_read(read_id)

    def _new_id(self) -> int:
        """A random id, unused here: not guessable by another reader, unknown to another daemon run."""
        while True:
            candidate = secrets.randbits(63) | 1
            if candidate not in self._lends and candidate not in self._reads:
                return candidate

    def _purge(self) -> None:
        """Forgets done lends when the caps are near: lenders that never asked are not owed more."""
        if (
            len(self._lends) < self.max_lends // 2
            and self._keys < self.max_keys // 2
            and self._bytes < self.max_bytes // 2
        ):
            return
        now = self._clock()
        for lend in list(self._lends.values()):
            if self._settle(lend, now) and now >= lend.hold_until:
                self._forget(lend)


def _continues(head: Lend, lend: Lend, segments: list[tuple[Lend, int, int]]) -> bool:
    """Whether a run read from `head` may go on into `lend`: the same cache and GPU (one copy
    reads them all), the same blocks a chunk, and not a lend the run went through already."""
    return (
        lend.cache == head.cache
        and lend.device == head.device
        and lend.blocks_per_chunk == head.blocks_per_chunk
        and all(lend is not seen for seen, _, _ in segments)
    )
