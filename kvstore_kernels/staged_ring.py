"""The staged path's device staging ring (`staged`): equal slots, handed out in turn.

- `StagingRing(device)`: slots of device memory (CPU memory for tests) and, on CUDA, an event
  per slot that says when its last use has run (`free`), one that hands a filled slot from one
  stream to the other (`ready`), and `started`; `reserve(slot_bytes, ring_bytes)` grows the
  slots, `take()` names the next slot, `address(slot)` where it starts.
- `NUM_SLOTS`, `MAX_SLOTS`: the fewest and most slots of a ring.
"""

from __future__ import annotations

import threading

import torch

# 4 slots of a whole page each: as fast alone as half-page slots, and faster beside matrix
# products (the H100 with 8B-geometry pages of 32 MiB: bench/NOTES-transfer.md, item 8).
# Slots smaller than a quarter of the ring (pages that fill a slot only partly, whole pages a slot
# as `staged_pieces.pages_per_slot` packs them) come as many as the ring's bytes hold, up to 16:
# beside a model's products each unpack (pack) waits for SMs, and the copy engines run only as
# far ahead as the ring holds bytes (bench/NOTES-host-gpus.md, beside a model).
NUM_SLOTS = 4
MAX_SLOTS = 16
_SLOT_ALIGN = 4096


class StagingRing:
    """`NUM_SLOTS` to `MAX_SLOTS` equal slots of device (or, for tests, CPU) memory, handed out
    in turn.

    Each slot has a `free` event, recorded after the last use of its contents, and a `ready`
    event that hands a filled slot from one stream to the other; `started` orders a scatter's
    copies after the caller's earlier work. They are raw CUDA events (`cudart`): handles,
    recorded and waited on through the runtime directly. The lock is held while a transfer is
    issued, so slot uses of concurrent calls never interleave on the host.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.lock = threading.Lock()
        self.memory = torch.empty(0, dtype=torch.uint8, device=device)
        self.slot_bytes = 0
        self.slots = NUM_SLOTS
        self._next = 0
        self.free: list[int] = []
        self.ready: list[int] = []
        self.started = 0
        if device.type == "cuda":
            from . import cudart

            runtime = cudart.runtime()
            with torch.cuda.device(device):
                self.free = [runtime.event_create() for _ in range(MAX_SLOTS)]
                self.ready = [runtime.event_create() for _ in range(MAX_SLOTS)]
                self.started = runtime.event_create()

    def reserve(self, slot_bytes: int, ring_bytes: int) -> None:
        """Slots of at least `slot_bytes`, as many as `ring_bytes` holds (`NUM_SLOTS` to
        `MAX_SLOTS`, of the largest slot asked for so far); a new ring replaces the old one once
        nothing uses it."""
        size = -(-max(slot_bytes, self.slot_bytes) // _SLOT_ALIGN) * _SLOT_ALIGN
        slots = min(MAX_SLOTS, max(NUM_SLOTS, ring_bytes // size))
        if size == self.slot_bytes and slots <= self.slots:
            return
        if self.free:
            from . import cudart

            runtime = cudart.runtime()
            for event in self.free:
                runtime.event_synchronize(event)  # the old slots' last uses have run (at once if never)
        self.memory = torch.empty(0, dtype=torch.uint8, device=self.device)  # the old ring goes first
        self.memory = torch.empty(slots * size, dtype=torch.uint8, device=self.device)
        self.slot_bytes, self.slots, self._next = size, slots, 0

    def take(self) -> int:
        """The next slot's index."""
        index = self._next
        self._next = (index + 1) % self.slots
        return index

    def address(self, slot: int) -> int:
        return self.memory.data_ptr() + slot * self.slot_bytes
