"""CUDA's virtual memory API for pinned host memory shared between processes, through ctypes on
the driver (libcuda): the daemon's pinned arena (`kvstore.tiers.pinned`) and the workers that
map it (`kvstore_client.imported`).

One process allocates host memory pinned (`create`: `cuMemCreate` of a pinned allocation on a
host NUMA node, exportable as a POSIX file descriptor) and maps it (`reserve`, `map`,
`set_access`); another imports the descriptor (`import_fd`) and maps it the same way. Neither
pays a registration: the memory is pinned once, by the allocation. A mapping is made of whole
allocations only (`cuMemMap` at an offset into one is refused), so an arena mapped slab by slab
is one allocation per slab.

- `load_vmm()`: the driver, initialised once (`Vmm`), or `CudaUnavailable` saying why not.
- `Vmm.use_device(d)`: makes device d's primary context current on this thread (every call
  below needs one); `with vmm.on_device(d):` does so for a block, then restores the one before.
- `granularity(numa_node)`: the size every allocation and mapping is a multiple of.
- `create(size, numa_node)` -> handle; `export_fd(handle)` -> a descriptor the caller owns;
  `import_fd(fd)` -> handle; `release(handle)`.
- `reserve(size)` -> address; `map(address, size, handle)`; `set_access(address, size,
  devices, host)`: read-write for those GPUs and, with `host`, the CPU; `unmap(address, size)`;
  `free(address, size)`.
- `address_range(address)` -> (base, size) of the device allocation holding it (a lender's KV
  cache, exported over CUDA IPC by its base: `kvstore_client.lent`).

Every call's status is checked; a failure is a `CudaError` naming the call and the driver's
name for the error.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterable, Iterator
from functools import cache

from kvstore.shared.cudart import CudaError, CudaUnavailable

_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_LOCATION_DEVICE, _LOCATION_HOST, _LOCATION_HOST_NUMA = 1, 2, 3
_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_RECOMMENDED = 1
_NO_DEVICE = 100  # CUDA_ERROR_NO_DEVICE


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def _host_prop(numa_node: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _PINNED
    prop.requestedHandleTypes = _POSIX_FD
    prop.location = _Location(_LOCATION_HOST_NUMA, numa_node)
    return prop


class Vmm:
    """The driver's virtual memory calls, with their argument types declared."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        u64, size_t, p = ctypes.c_ulonglong, ctypes.c_size_t, ctypes.POINTER
        signatures = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGetCount": [p(ctypes.c_int)],
            "cuDeviceGet": [p(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [p(ctypes.c_void_p), ctypes.c_int],
            "cuCtxSetCurrent": [ctypes.c_void_p],
            "cuCtxGetCurrent": [p(ctypes.c_void_p)],
            "cuMemGetAllocationGranularity": [p(size_t), p(_AllocationProp), ctypes.c_int],
            "cuMemCreate": [p(u64), size_t, p(_AllocationProp), u64],
            "cuMemExportToShareableHandle": [ctypes.c_void_p, u64, ctypes.c_int, u64],
            "cuMemImportFromShareableHandle": [p(u64), ctypes.c_void_p, ctypes.c_int],
            "cuMemRelease": [u64],
            "cuMemAddressReserve": [p(u64), size_t, size_t, u64, u64],
            "cuMemAddressFree": [u64, size_t],
            "cuMemMap": [u64, size_t, size_t, u64, u64],
            "cuMemUnmap": [u64, size_t],
            "cuMemSetAccess": [u64, size_t, p(_AccessDesc), size_t],
            "cuGetErrorName": [ctypes.c_int, p(ctypes.c_char_p)],
            "cuMemGetAddressRange_v2": [p(u64), p(size_t), u64],
        }
        for name, args in signatures.items():
            function = getattr(lib, name)
            function.argtypes = args
            function.restype = ctypes.c_int
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()
        self._check("cuInit", lib.cuInit(0))
        count = ctypes.c_int()
        self._check("cuDeviceGetCount", lib.cuDeviceGetCount(ctypes.byref(count)))
        self.device_count = count.value

    def _check(self, name: str, status: int) -> None:
        if status:
            text = ctypes.c_char_p()
            self._lib.cuGetErrorName(status, ctypes.byref(text))
            label = text.value.decode() if text.value else str(status)
            if status == _NO_DEVICE:
                raise CudaUnavailable(f"{name}: {label}")
            raise CudaError(f"{name} failed: {label}")

    def use_device(self, device: int) -> None:
        with self._lock:
            context = self._contexts.get(device)
            if context is None:
                handle, context = ctypes.c_int(), ctypes.c_void_p()
                self._check("cuDeviceGet", self._lib.cuDeviceGet(ctypes.byref(handle), device))
                self._check(
                    "cuDevicePrimaryCtxRetain",
                    self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle),
                )
                self._contexts[device] = context
        self._check("cuCtxSetCurrent", self._lib.cuCtxSetCurrent(context))

    @contextlib.contextmanager
    def on_device(self, device: int) -> Iterator[None]:
        """Device `device`'s primary context current on this thread for the block, then the one
        that was (a worker's thread may be on another device's: torch's current device stays)."""
        before = ctypes.c_void_p()
        self._check("cuCtxGetCurrent", self._lib.cuCtxGetCurrent(ctypes.byref(before)))
        self.use_device(device)
        try:
            yield
        finally:
            self._lib.cuCtxSetCurrent(before)

    def granularity(self, numa_node: int = 0) -> int:
        value = ctypes.c_size_t()
        prop = _host_prop(numa_node)
        self._check(
            "cuMemGetAllocationGranularity",
            self._lib.cuMemGetAllocationGranularity(
                ctypes.byref(value), ctypes.byref(prop), _GRANULARITY_RECOMMENDED
            ),
        )
        return value.value

    def create(self, size: int, numa_node: int = 0) -> int:
        handle, prop = ctypes.c_ulonglong(), _host_prop(numa_node)
        self._check("cuMemCreate", self._lib.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), 0))
        return handle.value

    def export_fd(self, handle: int) -> int:
        fd = ctypes.c_int(-1)
        self._check(
            "cuMemExportToShareableHandle",
            self._lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, _POSIX_FD, 0),
        )
        return fd.value

    def import_fd(self, fd: int) -> int:
        """The allocation `fd` was exported from (the caller still owns and closes `fd`)."""
        handle = ctypes.c_ulonglong()
        self._check(
            "cuMemImportFromShareableHandle",
            self._lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), _POSIX_FD),
        )
        return handle.value

    def release(self, handle: int) -> None:
        self._check("cuMemRelease", self._lib.cuMemRelease(handle))

    def reserve(self, size: int) -> int:
        address = ctypes.c_ulonglong()
        self._check(
            "cuMemAddressReserve", self._lib.cuMemAddressReserve(ctypes.byref(address), size, 0, 0, 0)
        )
        return address.value

    def free(self, address: int, size: int) -> None:
        self._check("cuMemAddressFree", self._lib.cuMemAddressFree(address, size))

    def map(self, address: int, size: int, handle: int) -> None:
        self._check("cuMemMap", self._lib.cuMemMap(address, size, 0, handle, 0))

    def unmap(self, address: int, size: int) -> None:
        self._check("cuMemUnmap", self._lib.cuMemUnmap(address, size))

    def address_range(self, address: int) -> tuple[int, int]:
        """The allocation that holds device address `address`: (its base, its size); the
        context of the device that holds it must be current."""
        base, size = ctypes.c_ulonglong(), ctypes.c_size_t()
        status = self._lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), address)
        self._check("cuMemGetAddressRange", status)
        return base.value, size.value

    def set_access(self, address: int, size: int, devices: Iterable[int], host: bool) -> None:
        locations = [(_LOCATION_DEVICE, device) for device in devices]
        if host:
            locations.append((_LOCATION_HOST, 0))
        descs = (_AccessDesc * len(locations))(
            *(_AccessDesc(_Location(kind, ident), _READ_WRITE) for kind, ident in locations)
        )
        self._check("cuMemSetAccess", self._lib.cuMemSetAccess(address, size, descs, len(locations)))


@cache
def load_vmm() -> Vmm:
    """The driver, initialised; `CudaUnavailable` where this host has no driver or no GPU."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaUnavailable(f"no CUDA driver (libcuda.so.1: {exc})") from None
    vmm = Vmm(lib)
    if not vmm.device_count:
        raise CudaUnavailable("the CUDA driver sees no GPU")
    return vmm
