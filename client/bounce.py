"""Stores into arena slabs CUDA has not registered yet, through a small pinned ring.

A worker that stores from its first second fills the arena faster than CUDA can register it:
on the H100 host the driver pins 16 GB/s of 2 MiB pages (less on 4 KiB ones) against stores at
~48 GB/s (bench/NOTES-connect.md), so a store that waits for its slabs' registration runs at a
third of its speed until the whole arena is registered. A store into slabs not yet registered
goes through this ring instead:

- `BounceRing(slot_bytes, num_slots, copiers)`: `num_slots` slots of pinned host memory (one
  allocation), and `copiers` threads that copy bytes on the CPU (`memmove`, the GIL released);
  `fits(page_bytes)`: whether a slot holds such a page.
- `gather(transfer, spec, kv_caches, block_ids, chunks, arena, offsets, stream, page_bytes)`:
  the store's pages in batches of one slot: the kernels gather a batch into a free slot at PCIe
  speed (the slot is pinned), and once that is done on the GPU the copiers move each page to
  its slot in the arena, in pieces, in parallel, while the next batch crosses PCIe. Returns a
  `HostCompletion` (what a store handle waits for in place of a CUDA event): done once every
  page is in the arena. A slot is reused only after its bytes were copied out, so the caller
  waits for a free slot when the CPU falls behind the link.
- `close()`: waits for the copies in flight and frees the ring.

Whole pages only: a store that writes some layers' spans of a page (a layer-wise gather) would
copy the slot's other bytes over spans written by another call, so such stores wait for the
registration as before. The slabs stay unregistered meanwhile; the registrar registers them once
transfers pause (`registrar.SlabRegistrar`), and the ring goes unused from then on.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from kvstore.spec import KVSpec

NUM_SLOTS = 4
SLOT_BYTES = 64 << 20  # a slot holds whole pages (two of the 8B geometry's 32 MiB pages)
PIECE_BYTES = 4 << 20  # one copier's share of a page at a time


def default_copiers() -> int:
    """CPU copy threads: half this process's CPUs, 2-8 (the registrar's faulters and the worker's
    own threads keep the rest)."""
    configured = os.environ.get("KVSTORE_BOUNCE_COPIERS", "").strip()
    if configured:
        copiers = int(configured)
        if copiers < 1:
            raise ValueError(f"KVSTORE_BOUNCE_COPIERS: expected a positive integer, got {configured!r}")
        return copiers
    return max(2, min(8, len(os.sched_getaffinity(0)) // 2))


class HostCompletion:
    """The end of a bounced store: `query()` without blocking, `synchronize()` waits (and raises
    what a copy raised), as a CUDA event's methods do."""

    def __init__(self, batches: list[Future[None]]) -> None:
        self._batches = batches

    def query(self) -> bool:
        return all(batch.done() for batch in self._batches)

    def synchronize(self) -> None:
        for batch in self._batches:
            batch.result()


class BounceRing:
    def __init__(
        self,
        slot_bytes: int = SLOT_BYTES,
        num_slots: int = NUM_SLOTS,
        copiers: int | None = None,
        pin: bool = True,
    ) -> None:
        if slot_bytes < 1 or num_slots < 1:
            raise ValueError(f"a bounce ring needs slots: {num_slots} of {slot_bytes} bytes")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.buffer = torch.empty(num_slots * slot_bytes, dtype=torch.uint8, pin_memory=pin)
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(num_slots):
            self._free.put(slot)
        self.num_copiers = default_copiers() if copiers is None else copiers
        # One thread per slot waits for its batch on the GPU and hands its pieces to the copiers.
        self._batches = ThreadPoolExecutor(num_slots, thread_name_prefix="kvstore-bounce")
        self._copiers = ThreadPoolExecutor(self.num_copiers, thread_name_prefix="kvstore-bounce-copy")
        self._lock = threading.Lock()
        self._in_flight: set[Future[None]] = set()
        self.num_stores = self.num_pages = 0

    def fits(self, page_bytes: int) -> bool:
        """Whether a slot holds a page of `page_bytes` (larger pages wait for the registration)."""
        return 0 < page_bytes <= self.slot_bytes

    def gather(
        self,
        transfer: Callable[..., None],
        spec: KVSpec,
        kv_caches: Any,
        block_ids: Any,
        chunks: Sequence[int],
        arena: torch.Tensor,
        offsets: Sequence[int],
        stream: Any,
        page_bytes: int,
    ) -> HostCompletion:
        """Writes chunk `chunks[j]`'s page to `arena[offsets[j]:]` through the ring (`transfer`:
        the kernels' gather, run on `stream`; None: a CPU cache, gathered in the call); returns
        once the last batch is on its way."""
        if not self.fits(page_bytes):
            raise ValueError(f"a page of {page_bytes} bytes does not fit a bounce slot of {self.slot_bytes}")
        per_slot = self.slot_bytes // page_bytes
        batches: list[Future[None]] = []
        for start in range(0, len(chunks), per_slot):
            batch = list(chunks[start : start + per_slot])
            slot = self._free.get()  # waits while every slot's bytes are still being copied out
            base = slot * self.slot_bytes
            slots = [base + j * page_bytes for j in range(len(batch))]
            try:
                gathered: torch.cuda.Event | None = None  # None: gathered already (a CPU cache)
                if stream is None:
                    transfer(spec, kv_caches, block_ids, batch, self.buffer, slots, None)
                else:
                    transfer(spec, kv_caches, block_ids, batch, self.buffer, slots, None, stream=stream)
                    gathered = torch.cuda.Event()
                    gathered.record(stream)
            except BaseException:
                self._free.put(slot)
                for earlier in batches:  # their slots come back once they are copied
                    earlier.exception()
                raise
            destinations = [arena.data_ptr() + offset for offset in offsets[start : start + len(batch)]]
            future = self._batches.submit(self._copy_out, gathered, slot, destinations, page_bytes)
            with self._lock:
                self._in_flight.add(future)
            future.add_done_callback(self._finished)
            batches.append(future)
        with self._lock:
            self.num_stores += 1
            self.num_pages += len(chunks)
        return HostCompletion(batches)

    def _copy_out(
        self, gathered: torch.cuda.Event | None, slot: int, destinations: list[int], page_bytes: int
    ) -> None:
        """Once the batch in `slot` is gathered, copies its pages to `destinations` in pieces on
        the copiers; then frees the slot."""
        try:
            if gathered is not None:
                gathered.synchronize()
            source = self.buffer.data_ptr() + slot * self.slot_bytes
            copy = ctypes.memmove
            pieces = [
                self._copiers.submit(
                    copy, to + at, source + j * page_bytes + at, min(PIECE_BYTES, page_bytes - at)
                )
                for j, to in enumerate(destinations)
                for at in range(0, page_bytes, PIECE_BYTES)
            ]
            wait(pieces)
            for piece in pieces:
                piece.result()
        finally:
            self._free.put(slot)

    def _finished(self, future: Future[None]) -> None:
        with self._lock:
            self._in_flight.discard(future)

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._in_flight

    def close(self) -> None:
        """Waits for the copies in flight, then ends the threads (the ring is freed with the last
        reference to it)."""
        with self._lock:
            in_flight = list(self._in_flight)
        wait(in_flight)
        self._batches.shutdown(wait=True)
        self._copiers.shutdown(wait=True)
