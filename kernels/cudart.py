"""The few CUDA runtime calls the copy-engine path makes, through ctypes on torch's libcudart.

- `runtime()`: the loaded runtime (`Runtime`), or a `RuntimeError` saying why there is none.
- `Runtime.memcpy_async(dst, src, size, stream)`, `Runtime.memcpy_2d_async(...)`.
- `Runtime.memcpy_batch_async(dsts, srcs, sizes, stream)`: many 1-D copies in one call
  (cudaMemcpyBatchAsync, CUDA 12.8+; its CUDA 13 form has no `failIdx` argument; it
  refuses the legacy default stream, handle 0).
- `Runtime.can_batch`: whether that call exists in this runtime.
- `Runtime.event_create()`, `event_record(event, stream)`, `stream_wait_event(stream, event)`,
  `event_synchronize(event)`: raw CUDA events (no timing) by handle, a microsecond a call
  where torch's `Event` wrappers take several; the staged path records and waits on four
  per piece.

The library is the one torch already loaded (found in /proc/self/maps), so the current
device and the streams are the ones torch uses; no extra package is needed, and nothing
here is imported on a machine without CUDA. Every call's status is checked.
"""

from __future__ import annotations

import ctypes
from functools import cache

import numpy as np

from kvstore.tiers.cudart import library_candidates

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the unified address space
_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: read the source in stream order
_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1  # cudaMemcpyFlagPreferOverlapWithCompute: leave the SMs alone
_EVENT_DISABLE_TIMING = 2  # cudaEventDisableTiming: the cheapest event to record and wait on
_BATCH_MIN_VERSION = 12080
_NO_FAIL_INDEX_VERSION = 13000


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


class Runtime:
    """libcudart's copy calls, with their argument types declared."""

    def __init__(self, library: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._lib = library
        library.cudaGetErrorString.restype = ctypes.c_char_p
        library.cudaGetErrorString.argtypes = [ctypes.c_int]
        library.cudaGetLastError.restype = ctypes.c_int
        version = ctypes.c_int()
        self._check(library.cudaRuntimeGetVersion(ctypes.byref(version)), "cudaRuntimeGetVersion")
        self.version = version.value
        size_t, ptr = ctypes.c_size_t, ctypes.c_void_p
        self._memcpy = library.cudaMemcpyAsync
        self._memcpy.argtypes = [ptr, ptr, size_t, ctypes.c_int, ptr]
        self._memcpy_2d = library.cudaMemcpy2DAsync
        self._memcpy_2d.argtypes = [ptr, size_t, ptr, size_t, size_t, size_t, ctypes.c_int, ptr]
        self._event_create = library.cudaEventCreateWithFlags
        self._event_create.argtypes = [ctypes.POINTER(ptr), ctypes.c_uint]
        self._event_record = library.cudaEventRecord
        self._event_record.argtypes = [ptr, ptr]
        self._stream_wait = library.cudaStreamWaitEvent
        self._stream_wait.argtypes = [ptr, ptr, ctypes.c_uint]
        self._event_sync = library.cudaEventSynchronize
        self._event_sync.argtypes = [ptr]
        self.can_batch = self.version >= _BATCH_MIN_VERSION and hasattr(library, "cudaMemcpyBatchAsync")
        if self.can_batch:
            self._batch = library.cudaMemcpyBatchAsync
            fail_index = [] if self.version >= _NO_FAIL_INDEX_VERSION else [ptr]
            self._batch.argtypes = [ptr, ptr, ptr, size_t, ptr, ptr, size_t, *fail_index, ptr]
        self._attrs = _MemcpyAttributes(
            srcAccessOrder=_SRC_ACCESS_ORDER_STREAM, flags=_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        )
        self._attrs_index = ctypes.c_size_t(0)

    def _check(self, status: int, call: str) -> None:
        if status:
            self._lib.cudaGetLastError()  # clear it, or torch reports it at its next check
            message = self._lib.cudaGetErrorString(status).decode(errors="replace")
            raise RuntimeError(f"{call} failed: {message} (cudaError {status})")

    def memcpy_async(self, dst: int, src: int, size: int, stream: int) -> None:
        self._check(self._memcpy(dst, src, size, _MEMCPY_DEFAULT, stream), "cudaMemcpyAsync")

    def event_create(self) -> int:
        """A new event on the current device (never destroyed: the callers keep theirs for good)."""
        event = ctypes.c_void_p()
        self._check(
            self._event_create(ctypes.byref(event), _EVENT_DISABLE_TIMING), "cudaEventCreateWithFlags"
        )
        return int(event.value or 0)

    def event_record(self, event: int, stream: int) -> None:
        self._check(self._event_record(event, stream), "cudaEventRecord")

    def stream_wait_event(self, stream: int, event: int) -> None:
        """`stream` waits for the event's latest record (none yet: no wait)."""
        self._check(self._stream_wait(stream, event, 0), "cudaStreamWaitEvent")

    def event_synchronize(self, event: int) -> None:
        self._check(self._event_sync(event), "cudaEventSynchronize")

    def memcpy_2d_async(
        self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int
    ) -> None:
        status = self._memcpy_2d(dst, dst_pitch, src, src_pitch, width, height, _MEMCPY_DEFAULT, stream)
        self._check(status, "cudaMemcpy2DAsync")

    def memcpy_batch_async(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """Copy `sizes[i]` bytes from `srcs[i]` to `dsts[i]` for every i, in one call (uint64 arrays).

        `stream` must not be 0, the legacy default stream."""
        if not self.can_batch:
            raise RuntimeError(f"cudaMemcpyBatchAsync needs CUDA 12.8+; this runtime is {self.version}")
        if not stream:
            raise ValueError("cudaMemcpyBatchAsync refuses the legacy default stream (handle 0)")
        arrays = [np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes)]
        fail_index = [] if self.version >= _NO_FAIL_INDEX_VERSION else [ctypes.byref(ctypes.c_size_t())]
        status = self._batch(
            *(a.ctypes.data for a in arrays),
            len(arrays[0]),
            ctypes.byref(self._attrs),
            ctypes.byref(self._attrs_index),
            1,
            *fail_index,
            stream,
        )
        self._check(status, "cudaMemcpyBatchAsync")


@cache
def runtime() -> Runtime:
    """torch's CUDA runtime library, loaded once; RuntimeError where there is none."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the copy engines need CUDA; torch sees no CUDA device")
    torch.cuda.init()
    for path in library_candidates():
        try:
            return Runtime(ctypes.CDLL(path), path)
        except (OSError, AttributeError):
            continue
    raise RuntimeError("cannot find libcudart (looked in this process's loaded libraries and torch's)")
