"""The repository's one binding of the CUDA runtime, through ctypes on libcudart: the daemon's GPU
tier, the client's GPU pools and the kernels' copy-engine paths all call it (no torch needed).

- `load_runtime()`: the runtime, loaded once (`CudaRuntime`), or `CudaUnavailable` saying why
  there is none (no library, no driver, no device).
- devices: `device_count()`, `set_device(d)`, `pci_bus_id(d)`, `device_by_pci_bus_id(bus_id)`.
- memory: `malloc(size)`, `free(ptr)`, `memset(ptr, value, size)`, `host_register(ptr, size, portable=False)`,
  `host_unregister(ptr)`.
- CUDA IPC: `ipc_handle(ptr)` (64 bytes), `ipc_open(handle)` (on the current device), `ipc_close(ptr)`.
- streams and events: `stream_create()`, `stream_destroy(s)`, `stream_synchronize(s)`;
  `event_create()`, `event_record(event, stream)`, `stream_wait_event(stream, event)`,
  `event_synchronize(event)`: raw events (no timing) by handle, a microsecond a call where
  torch's `Event` wrappers take several.
- copies: `memcpy_async(dst, src, size, stream)`, `memcpy_2d_async(...)`, and
  `memcpy_batch_async(dsts, srcs, sizes, stream)`: many 1-D copies in one call
  (cudaMemcpyBatchAsync, CUDA 12.8+, `can_batch`; its CUDA 13 form has no `failIdx` argument;
  it refuses the legacy default stream, handle 0).

The library is the one this process already loaded (a worker's torch: then the current device
and the streams are the ones torch uses), else an nvidia wheel's, else the system's. Every
call's status is checked; a failure is a `CudaError` naming the call.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from functools import cache
from typing import Any

import numpy as np

IPC_HANDLE_BYTES = 64
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the unified address space
_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: read the source in stream order
_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1  # cudaMemcpyFlagPreferOverlapWithCompute: leave the SMs alone
_EVENT_DISABLE_TIMING = 2  # cudaEventDisableTiming: the cheapest event to record and wait on
_BATCH_MIN_VERSION = 12080
_NO_FAIL_INDEX_VERSION = 13000
_IPC_LAZY_ENABLE_PEER_ACCESS = 1
_STREAM_NON_BLOCKING = 1
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
_NO_DEVICE = 100  # cudaErrorNoDevice
_PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
_INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver


_LIBRARY_PATTERNS = ("nvidia/cu*/lib/libcudart.so*", "nvidia/*/lib/libcudart.so*", "torch/lib/libcudart*.so*")


class CudaUnavailable(RuntimeError):
    """No usable CUDA runtime or device in this process."""


class CudaError(RuntimeError):
    """A CUDA runtime call failed."""


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


class CudaRuntime:
    """libcudart's calls, with their argument types declared."""

    def __init__(self, library: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._lib = lib = library
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetLastError.restype = ctypes.c_int
        size_t, ptr, c_int = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int
        signatures: dict[str, list[type]] = {
            "cudaRuntimeGetVersion": [ctypes.POINTER(c_int)],
            "cudaGetDeviceCount": [ctypes.POINTER(c_int)],
            "cudaSetDevice": [c_int],
            "cudaDeviceGetPCIBusId": [ctypes.c_char_p, c_int, c_int],
            "cudaDeviceGetByPCIBusId": [ctypes.POINTER(c_int), ctypes.c_char_p],
            "cudaMalloc": [ctypes.POINTER(ptr), size_t],
            "cudaFree": [ptr],
            "cudaMemset": [ptr, c_int, size_t],
            "cudaHostRegister": [ptr, size_t, ctypes.c_uint],
            "cudaHostUnregister": [ptr],
            "cudaIpcGetMemHandle": [ctypes.POINTER(_IpcHandle), ptr],
            "cudaIpcOpenMemHandle": [ctypes.POINTER(ptr), _IpcHandle, ctypes.c_uint],
            "cudaIpcCloseMemHandle": [ptr],
            "cudaDeviceCanAccessPeer": [ctypes.POINTER(c_int), c_int, c_int],
            "cudaDeviceEnablePeerAccess": [c_int, ctypes.c_uint],
            "cudaStreamCreateWithFlags": [ctypes.POINTER(ptr), ctypes.c_uint],
            "cudaStreamDestroy": [ptr],
            "cudaStreamSynchronize": [ptr],
            "cudaMemcpyAsync": [ptr, ptr, size_t, c_int, ptr],
            "cudaMemcpy2DAsync": [ptr, size_t, ptr, size_t, size_t, size_t, c_int, ptr],
            "cudaEventCreateWithFlags": [ctypes.POINTER(ptr), ctypes.c_uint],
            "cudaEventRecord": [ptr, ptr],
            "cudaStreamWaitEvent": [ptr, ptr, ctypes.c_uint],
            "cudaEventSynchronize": [ptr],
        }
        for name, argtypes in signatures.items():
            function = getattr(lib, name)
            function.argtypes = argtypes
            function.restype = c_int
        version = ctypes.c_int()
        self._check(lib.cudaRuntimeGetVersion(ctypes.byref(version)), "cudaRuntimeGetVersion")
        self.version = version.value
        self.can_batch = self.version >= _BATCH_MIN_VERSION and hasattr(lib, "cudaMemcpyBatchAsync")
        if self.can_batch:
            fail_index = [] if self.version >= _NO_FAIL_INDEX_VERSION else [ptr]
            lib.cudaMemcpyBatchAsync.argtypes = [ptr, ptr, ptr, size_t, ptr, ptr, size_t, *fail_index, ptr]
            lib.cudaMemcpyBatchAsync.restype = c_int
        self._attrs = _MemcpyAttributes(
            srcAccessOrder=_SRC_ACCESS_ORDER_STREAM, flags=_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        )
        self._attrs_index = ctypes.c_size_t(0)

    def _check(self, status: int, call: str) -> None:
        if status:
            self._lib.cudaGetLastError()  # clear it, or the next unrelated check (torch's) reports it
            message = self._lib.cudaGetErrorString(status).decode(errors="replace")
            raise CudaError(f"{call} failed: {message} (cudaError {status})")

    def device_count(self) -> int:
        count = ctypes.c_int()
        status = self._lib.cudaGetDeviceCount(ctypes.byref(count))
        if status in (_NO_DEVICE, _INSUFFICIENT_DRIVER):
            self._lib.cudaGetLastError()
            return 0
        self._check(status, "cudaGetDeviceCount")
        return count.value

    def set_device(self, device: int) -> None:
        self._check(self._lib.cudaSetDevice(device), f"cudaSetDevice({device})")

    def pci_bus_id(self, device: int) -> str:
        text = ctypes.create_string_buffer(32)
        self._check(self._lib.cudaDeviceGetPCIBusId(text, len(text), device), "cudaDeviceGetPCIBusId")
        return text.value.decode().lower()

    def device_by_pci_bus_id(self, bus_id: str) -> int:
        device = ctypes.c_int()
        status = self._lib.cudaDeviceGetByPCIBusId(ctypes.byref(device), bus_id.encode())
        self._check(status, f"cudaDeviceGetByPCIBusId({bus_id})")
        return device.value

    def can_access_peer(self, device: int, peer: int) -> bool:
        """Whether kernels on `device` can address memory of `peer` once peer access is enabled."""
        allowed = ctypes.c_int()
        status = self._lib.cudaDeviceCanAccessPeer(ctypes.byref(allowed), device, peer)
        self._check(status, f"cudaDeviceCanAccessPeer({device}, {peer})")
        return bool(allowed.value)

    def enable_peer_access(self, peer: int) -> None:
        """Lets the current device's kernels address memory of `peer` (already enabled: fine)."""
        status = self._lib.cudaDeviceEnablePeerAccess(peer, 0)
        if status == _PEER_ACCESS_ALREADY_ENABLED:
            self._lib.cudaGetLastError()  # clear it
            return
        self._check(status, f"cudaDeviceEnablePeerAccess({peer})")

    def malloc(self, size: int) -> int:
        pointer = ctypes.c_void_p()
        self._check(self._lib.cudaMalloc(ctypes.byref(pointer), size), f"cudaMalloc({size})")
        return pointer.value or 0

    def free(self, pointer: int) -> None:
        self._check(self._lib.cudaFree(pointer), "cudaFree")

    def memset(self, pointer: int, value: int, size: int) -> None:
        self._check(self._lib.cudaMemset(pointer, value, size), "cudaMemset")

    def host_register(self, pointer: int, size: int, portable: bool = False) -> None:
        """Pins host memory; `portable`: for every CUDA context, not only the current one."""
        flags = _HOST_REGISTER_PORTABLE if portable else 0
        self._check(self._lib.cudaHostRegister(pointer, size, flags), "cudaHostRegister")

    def host_unregister(self, pointer: int) -> None:
        self._check(self._lib.cudaHostUnregister(pointer), "cudaHostUnregister")

    def ipc_handle(self, pointer: int) -> bytes:
        handle = _IpcHandle()
        self._check(self._lib.cudaIpcGetMemHandle(ctypes.byref(handle), pointer), "cudaIpcGetMemHandle")
        return ctypes.string_at(ctypes.byref(handle), IPC_HANDLE_BYTES)

    def ipc_open(self, handle: bytes) -> int:
        """Maps another process's allocation on the current device; returns its address here."""
        if len(handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        raw = _IpcHandle()
        ctypes.memmove(ctypes.byref(raw), handle, IPC_HANDLE_BYTES)
        pointer = ctypes.c_void_p()
        status = self._lib.cudaIpcOpenMemHandle(ctypes.byref(pointer), raw, _IPC_LAZY_ENABLE_PEER_ACCESS)
        self._check(status, "cudaIpcOpenMemHandle")
        return pointer.value or 0

    def ipc_close(self, pointer: int) -> None:
        self._check(self._lib.cudaIpcCloseMemHandle(pointer), "cudaIpcCloseMemHandle")

    def stream_create(self) -> int:
        stream = ctypes.c_void_p()
        status = self._lib.cudaStreamCreateWithFlags(ctypes.byref(stream), _STREAM_NON_BLOCKING)
        self._check(status, "cudaStreamCreateWithFlags")
        return stream.value or 0

    def stream_destroy(self, stream: int) -> None:
        self._check(self._lib.cudaStreamDestroy(stream), "cudaStreamDestroy")

    def stream_synchronize(self, stream: int) -> None:
        self._check(self._lib.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    @property
    def memcpy_async_unchecked(self) -> Any:
        """libcudart's cudaMemcpyAsync itself (dst, src, size, kind, stream) -> status, argument
        types declared, no status check: for a loop that checks the statuses after it."""
        return self._lib.cudaMemcpyAsync

    def memcpy_async(self, dst: int, src: int, size: int, stream: int) -> None:
        self._check(self._lib.cudaMemcpyAsync(dst, src, size, _MEMCPY_DEFAULT, stream), "cudaMemcpyAsync")

    def memcpy_2d_async(
        self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int
    ) -> None:
        status = self._lib.cudaMemcpy2DAsync(
            dst, dst_pitch, src, src_pitch, width, height, _MEMCPY_DEFAULT, stream
        )
        self._check(status, "cudaMemcpy2DAsync")

    def memcpy_batch_async(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """Copy `sizes[i]` bytes from `srcs[i]` to `dsts[i]` for every i, in one call (uint64 arrays).

        `stream` must not be 0, the legacy default stream."""
        if not self.can_batch:
            raise CudaError(f"cudaMemcpyBatchAsync needs CUDA 12.8+; this runtime is {self.version}")
        if not stream:
            raise ValueError("cudaMemcpyBatchAsync refuses the legacy default stream (handle 0)")
        arrays = [np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes)]
        fail_index = [] if self.version >= _NO_FAIL_INDEX_VERSION else [ctypes.byref(ctypes.c_size_t())]
        status = self._lib.cudaMemcpyBatchAsync(
            *(a.ctypes.data for a in arrays),
            len(arrays[0]),
            ctypes.byref(self._attrs),
            ctypes.byref(self._attrs_index),
            1,
            *fail_index,
            stream,
        )
        self._check(status, "cudaMemcpyBatchAsync")

    def event_create(self) -> int:
        """A new event on the current device (never destroyed: the callers keep theirs for good)."""
        event = ctypes.c_void_p()
        status = self._lib.cudaEventCreateWithFlags(ctypes.byref(event), _EVENT_DISABLE_TIMING)
        self._check(status, "cudaEventCreateWithFlags")
        return int(event.value or 0)

    def event_record(self, event: int, stream: int) -> None:
        self._check(self._lib.cudaEventRecord(event, stream), "cudaEventRecord")

    def stream_wait_event(self, stream: int, event: int) -> None:
        """`stream` waits for the event's latest record (none yet: no wait)."""
        self._check(self._lib.cudaStreamWaitEvent(stream, event, 0), "cudaStreamWaitEvent")

    def event_synchronize(self, event: int) -> None:
        self._check(self._lib.cudaEventSynchronize(event), "cudaEventSynchronize")


@cache
def load_runtime() -> CudaRuntime:
    """The CUDA runtime, loaded once; `CudaUnavailable` (saying why) where there is none."""
    tried: list[str] = []
    for path in library_candidates():
        try:
            return CudaRuntime(ctypes.CDLL(path), path)
        except (OSError, AttributeError) as exc:
            tried.append(f"{path} ({exc})")
    raise CudaUnavailable("no CUDA runtime library (libcudart) found; tried: " + "; ".join(tried[-3:]))


def library_candidates() -> list[str]:
    """Paths of libcudart to try in turn: ones this process loaded, then the nvidia and torch wheels'."""
    loaded: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(maxsplit=1)[-1]
                if "libcudart.so" in os.path.basename(path) and path not in loaded:
                    loaded.append(path)
    except OSError:
        pass
    found = [
        path
        for root in sys.path
        for pattern in _LIBRARY_PATTERNS
        for path in sorted(glob.glob(os.path.join(root, pattern)))
    ]
    return list(dict.fromkeys([*loaded, *found, "libcudart.so.13", "libcudart.so.12", "libcudart.so"]))
