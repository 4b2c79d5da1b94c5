"""Pinned staging for the small int64 tables a kernel launch reads (addresses, block ids).

`to_device(values, device)` returns the values as an int64 tensor on `device`, copied
asynchronously on the current stream. The copy must not stall the host: a fresh
`pin_memory()` per call allocates pinned memory whenever earlier copies are still queued
(the allocator frees a block only once its copy ran), and a copy from pageable memory can
wait for the stream. So each device keeps a ring of pinned slots, and a slot is refilled
only after the copy out of it has run (its event), which also bounds how far the host runs
ahead of the GPU. The slots of the usual size are carved out of one pinned allocation made
with the ring: a `cudaHostAlloc` per slot on its first use cost the first `NUM_SLOTS`
calls of a process each a pinned allocation (a larger table still gets its own).
"""

from __future__ import annotations

import threading
from functools import cache

import numpy as np
import torch

NUM_SLOTS = 64
MIN_SLOT_VALUES = 4096


class TableStaging:
    """A ring of pinned host slots feeding one CUDA device; the copies and events go through the
    runtime directly (`cudart`), a few microseconds less per launch than torch's wrappers."""

    def __init__(self, device: torch.device, num_slots: int = NUM_SLOTS) -> None:
        from . import cudart

        self.device = device
        self._runtime = cudart.runtime()
        ring = torch.empty(num_slots * MIN_SLOT_VALUES, dtype=torch.int64, pin_memory=True)
        self._slots: list[np.ndarray] = list(ring.numpy().reshape(num_slots, MIN_SLOT_VALUES))
        self._pinned: list[torch.Tensor] = [ring] * num_slots  # keeps each slot's memory
        with torch.cuda.device(device):
            self._events = [self._runtime.event_create() for _ in range(num_slots)]
        self._next = 0
        self._lock = threading.Lock()

    def to_device(self, values: np.ndarray, stream: int | None = None) -> torch.Tensor:
        """`values` (int64) as a tensor on the device, ordered on the current stream (`stream`: its
        handle, when the caller has it)."""
        count = values.size
        runtime = self._runtime
        if stream is None:
            stream = torch.cuda.current_stream(self.device).cuda_stream
        with self._lock:
            index = self._next
            self._next = (index + 1) % len(self._slots)
            done = self._events[index]
            runtime.event_synchronize(done)  # the copy out of this slot has run (at once if never)
            slot = self._slots[index]
            if slot.size < count:
                pinned = torch.empty(max(count, MIN_SLOT_VALUES), dtype=torch.int64, pin_memory=True)
                self._pinned[index], slot = pinned, pinned.numpy()
                self._slots[index] = slot
            slot[:count] = values
            result = torch.empty(count, dtype=torch.int64, device=self.device)
            if count:
                runtime.memcpy_async(result.data_ptr(), slot.ctypes.data, count * 8, stream)
            runtime.event_record(done, stream)
        return result


@cache
def staging_for(device: torch.device) -> TableStaging:
    """The staging ring of one device, made on first use."""
    return TableStaging(device)


def to_device(values: np.ndarray, device: torch.device, stream: int | None = None) -> torch.Tensor:
    """int64 `values` on `device`: shared with numpy on the CPU, through the pinned ring for CUDA
    (on the current stream; `stream`: its handle, when the caller has it)."""
    if device.type != "cuda":
        return torch.from_numpy(values)
    return staging_for(device).to_device(values, stream)
