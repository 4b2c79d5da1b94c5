"""Stores into arena slabs CUDA has not registered yet, through a small pinned ring.

A worker that stores from its first second fills the arena faster than CUDA can register it:
on the H100 host the driver pins 16 GB/s of 2 MiB pages (less on 4 KiB ones) against stores at
~48 GB/s (bench/NOTES-connect.md), so a store that waits for its slabs' registration runs at a
third of its speed until the whole arena is registered. A store into slabs not yet registered
goes through this ring instead:

- `BounceRing(slot_bytes, num_slots, copiers, host, device)`: `num_slots` slots of host memory
  in one allocation, pinned with `host` (a `registrar.HostRegistrar`; None: not pinned, tests on
  CPU), and `copiers` threads that copy bytes on the CPU (`memmove`, the GIL released), their
  CUDA calls made on `device`. `fits(page_bytes)`: whether a slot holds such a page.
- `gather(transfer, spec, kv_caches, block_ids, chunks, arena, offsets, stream, page_bytes)`:
  the store's pages in batches of one slot: the kernels gather a batch into a free slot at PCIe
  speed (the slot is pinned), and once that is done on the GPU the copiers move each page to
  its slot in the arena, in pieces, in parallel, while the next batch crosses PCIe. Returns a
  `HostCompletion` (what a store handle waits for in place of a CUDA event): done once every
  page is in the arena; None where the ring was closed meanwhile (the store then takes the
  kernels' way). The arena offsets are checked as the kernels check them (in the arena, no two
  pages overlapping) before any byte moves. A slot is reused only after its bytes were copied
  out (and, where its gather failed, after the stream finished with it), so the caller waits
  for a free slot when the CPU falls behind the link.
- `close()`: no new store comes in; waits for the stores inside and the copies in flight, then
  ends the threads and unpins the ring (its memory goes back with the last reference).

Whole pages only: a store that writes some layers' spans of a page (a layer-wise gather) would
copy the slot's other bytes over spans written by another call, so such stores wait for the
registration as before. The slabs stay unregistered meanwhile; the registrar registers them in
pauses, and while transfers keep coming for a share of the time (`registrar.SlabRegistrar`); the
ring goes unused once they are. A store larger than the ring holds the caller until its last
batches have a slot: during the warm-up a large store returns once all but 4 slots of it are
copied out.
"""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

import numpy as np
import torch

from kvstore.shared.spec import KVSpec
from kvstore_client.faulting import populate
from kvstore_kernels.validate_args import check_buffer

NUM_SLOTS = 4
SLOT_BYTES = 64 << 20  # a slot holds whole pages (two of the 8B geometry's 32 MiB pages)
PIECE_BYTES = 4 << 20  # one copier's share of a page at a time


class Pinner(Protocol):
    def register(self, address: int, size: int) -> None: ...

    def unregister(self, address: int) -> None: ...


def default_copiers() -> int:
    """CPU copy threads: half this process's CPUs, 2-8 (the registrar's faulters and the worker's
    own threads keep the rest)."""
    configured = os.environ.get("KVSTORE_BOUNCE_COPIERS", "").strip()
    if configured:
        copiers = int(configured) if configured.isdigit() else 0
        if copiers < 1:
            raise ValueError(f"KVSTORE_BOUNCE_COPIERS: expected a positive integer, got {configured!r}")
        return copiers
    return max(2, min(8, len(os.sched_getaffinity(0)) // 2))


class HostCompletion:
    """The end of a bounced store: `query()` without blocking, `synchronize()` waits for every
    batch (and raises what a copy raised), as a CUDA event's methods do; `gathered`: the CUDA
    event after the last batch's gather (None on CPU), what a stream waits for before it may
    write the KV cache blocks the store reads."""

    def __init__(self, batches: list[Future[None]], gathered: torch.cuda.Event | None) -> None:
        self._batches = batches
        self.gathered = gathered

    def query(self) -> bool:
        return all(batch.done() for batch in self._batches)

    def synchronize(self) -> None:
        wait(self._batches)  # every copy has ended before a failure lets the lease go
        for batch in self._batches:
            batch.result()


class BounceRing:
    def __init__(
        self,
        slot_bytes: int = SLOT_BYTES,
        num_slots: int = NUM_SLOTS,
        copiers: int | None = None,
        host: Pinner | None = None,
        device: int | None = None,
    ) -> None:
        if slot_bytes < 1 or num_slots < 1:
            raise ValueError(f"a bounce ring needs slots: {num_slots} of {slot_bytes} bytes")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.buffer = torch.empty(num_slots * slot_bytes, dtype=torch.uint8)
        self._host = host
        if host is not None:  # faulted in first, so the registration holds the driver for the pinning alone
            populate(self.buffer.data_ptr(), self.buffer.numel())
            host.register(self.buffer.data_ptr(), self.buffer.numel())
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(num_slots):
            self._free.put(slot)
        self.num_copiers = default_copiers() if copiers is None else copiers
        # One thread per slot waits for its batch on the GPU and hands its pieces to the copiers.
        on_device = (lambda: torch.cuda.set_device(device)) if device is not None else None
        self._batches = ThreadPoolExecutor(num_slots, "kvstore-bounce", initializer=on_device)
        self._copiers = ThreadPoolExecutor(self.num_copiers, "kvstore-bounce-copy")
        self._lock = threading.Condition()
        self._users = 0  # stores inside gather()
        self._in_flight: set[Future[None]] = set()
        self.closed = False
        self.num_stores = self.num_pages = 0

    def fits(self, page_bytes: int) -> bool:
        """Whether a slot holds a page of `page_bytes` (larger pages wait for the registration)."""
        return 0 < page_bytes <= self.slot_bytes

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._users and not self._in_flight

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
    ) -> HostCompletion | None:
        """Writes chunk `chunks[j]`'s page to `arena[offsets[j]:]` through the ring (`transfer`:
        the kernels' gather, run on `stream`; None: a CPU cache, gathered in the call); returns
        once the last batch is on its way (None: the ring is closed, nothing was done)."""
        if not self.fits(page_bytes):
            raise ValueError(f"a page of {page_bytes} bytes does not fit a bounce slot of {self.slot_bytes}")
        check_buffer(arena, arena.device, np.asarray(offsets, dtype=np.int64), page_bytes, overlap_ok=False)
        with self._lock:
            if self.closed:
                return None
            self._users += 1
        # The gather of one batch into one slot: `transfer` with its engine-side arguments bound.
        gather_batch = functools.partial(transfer, spec, kv_caches, block_ids)
        try:
            return self._batched(
                gather_batch, chunks, [arena.data_ptr() + o for o in offsets], stream, page_bytes
            )
        finally:
            with self._lock:
                self._users -= 1
                self._lock.notify_all()

    def _batched(
        self,
        gather_batch: Callable[..., None],
        chunks: Sequence[int],
        addresses: list[int],
        stream: Any,
        page_bytes: int,
    ) -> HostCompletion:
        per_slot = self.slot_bytes // page_bytes
        batches: list[Future[None]] = []
        gathered: torch.cuda.Event | None = None
        for start in range(0, len(chunks), per_slot):
            batch = list(chunks[start : start + per_slot])
            destinations = addresses[start : start + len(batch)]
            slot = self._free.get()  # waits while every slot's bytes are still being copied out
            try:
                gathered = self._gather_into(slot, gather_batch, batch, stream, page_bytes)
                future = self._batches.submit(self._copy_out, gathered, slot, destinations, page_bytes)
            except BaseException:
                if stream is not None:  # the slot goes back once nothing enqueued can still write it
                    stream.synchronize()
                self._free.put(slot)
                wait(batches)  # the earlier batches' copies end before the store's lease is let go
                raise
            with self._lock:
                self._in_flight.add(future)
            future.add_done_callback(self._finished)
            batches.append(future)
        with self._lock:
            self.num_stores += 1
            self.num_pages += len(chunks)
        return HostCompletion(batches, gathered)

    def _gather_into(
        self, slot: int, gather_batch: Callable[..., None], batch: list[int], stream: Any, page_bytes: int
    ) -> torch.cuda.Event | None:
        """Gathers `batch` into `slot`: the event after it on `stream` (None: done, a CPU cache)."""
        slots = [slot * self.slot_bytes + j * page_bytes for j in range(len(batch))]
        if stream is None:
            gather_batch(batch, self.buffer, slots, None)
            return None
        gather_batch(batch, self.buffer, slots, None, stream=stream)
        gathered = torch.cuda.Event(blocking=True)  # its waiter sleeps rather than spins
        gathered.record(stream)
        return gathered

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
            self._lock.notify_all()

    def close(self) -> None:
        """Lets no new store in, waits for those inside and their copies, then ends the threads
        and unpins the ring."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            while self._users or self._in_flight:
                self._lock.wait()
        self._batches.shutdown(wait=True)
        self._copiers.shutdown(wait=True)
        if self._host is not None:
            self._host.unregister(self.buffer.data_ptr())
