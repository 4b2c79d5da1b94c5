"""Lent blocks on the worker's side (`kvstore.store.lends` on the daemon's): a prefill worker
lends its own KV-cache blocks, and a decode worker on another GPU of the host copies them into
its cache device to device, in one copy over the link.

- `describe(kv_caches)`: the lender's cache as a reader opens it: each tensor's allocation,
  exported by its base over CUDA IPC, and the tensor's offset, dtype, shape and strides there
  (JSON: a reader parses it, never unpickles it, and checks every number against its own cache).
- `LentCaches`: the lenders' caches a process opened (CUDA IPC, once per allocation, mapped for
  the reading GPU, which reaches the lender's over peer access), closed with the client's link.

The calls themselves are `kvstore_client.lends`.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import torch

from kvstore.shared.cudart import CudaError, load_runtime
from kvstore_client.gpu_pools import _DeviceBytes
from kvstore_kernels.cache_facts import RegisteredCaches

log = logging.getLogger(__name__)

VERSION = 1
MAX_OPEN = 256  # allocations of lenders kept open; the oldest is closed past it
MAX_ALLOCATIONS = 64  # in one descriptor (vLLM's cache is one)
_DTYPES = {
    name: getattr(torch, name)
    for name in ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8", "int8")
    if hasattr(torch, name)
}


def _no_constant(name: str) -> Any:
    raise ValueError(f"lent cache descriptor: {name} is not a number")


def _tensors(kv_caches: Any) -> tuple[list[torch.Tensor], str]:
    if isinstance(kv_caches, torch.Tensor):
        return [kv_caches], "tensor"
    tensors = list(kv_caches)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError("kv_caches: expected a tensor or a sequence of tensors")
    return tensors, "list"


def describe(spec: Any, kv_caches: Any) -> tuple[bytes, str]:
    """(the descriptor, the PCI bus id of the GPU that holds the cache)."""
    from kvstore.shared.cuda_vmm import load_vmm

    tensors, form = _tensors(kv_caches)
    device = tensors[0].device
    if device.type != "cuda" or any(t.device != device for t in tensors):
        raise ValueError("lend: the KV cache must be on one CUDA device")
    runtime, vmm = load_runtime(), load_vmm()
    bases: dict[int, int] = {}
    allocations: list[dict[str, Any]] = []
    entries = []
    with vmm.on_device(device.index), torch.cuda.device(device):
        for tensor in tensors:
            base, size = vmm.address_range(tensor.data_ptr())
            if base not in bases:
                bases[base] = len(allocations)
                allocations.append({"handle": runtime.ipc_handle(base).hex(), "size": size})
            entries.append(
                {
                    "allocation": bases[base],
                    "offset": tensor.data_ptr() - base,
                    "dtype": str(tensor.dtype).removeprefix("torch."),
                    "shape": list(tensor.shape),
                    "stride": list(tensor.stride()),
                }
            )
        bus = runtime.pci_bus_id(device.index)
    descriptor = {
        "version": VERSION,
        "layout": spec.layout,
        "dtype": spec.dtype,
        "block_size": spec.block_size,
        "form": form,
        "allocations": allocations,
        "tensors": entries,
    }
    return json.dumps(descriptor, separators=(",", ":")).encode(), bus


class LentCaches:
    """Lenders' allocations opened in this process: (handle, reading device) -> address."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, int], tuple[int, int, str]] = {}  # -> (address, size, lender's GPU)
        # (descriptor, reading device, this cache's shapes) -> the lender's cache, registered
        self._caches: dict[tuple[bytes, int, tuple[Any, ...]], Any] = {}
        self._last: tuple[bytes, Any, int, Any] | None = None  # (descriptor, mine, reader, cache)
        self._lock = threading.Lock()

    def open(self, spec: Any, descriptor: bytes, bus: str, reader: torch.device, mine: Any) -> Any:
        """The cache of the lender on GPU `bus` as tensors on `reader` (in the form of `mine`, this
        worker's cache), after checking the descriptor against `spec` and `mine`; ValueError for
        one that differs. Made once per descriptor and registered (`kvstore_kernels.register`): a
        lender's cache keeps its tensors, so a later read of it checks nothing again."""
        last = self._last  # a decode worker reads one lender's cache into its own, again and again
        if last is not None and last[1] is mine and last[2] == reader.index and last[0] == descriptor:
            return last[3]
        tensors, _ = _tensors(mine)
        key = (descriptor, reader.index, tuple((t.dtype, *t.shape) for t in tensors))
        found = self._caches.get(key)
        if found is None:
            import kvstore_kernels

            with self._lock:
                if len(self._caches) >= MAX_OPEN:
                    self._caches.clear()
                    self._last = None
                opened = self._opened(spec, descriptor, bus, reader, mine)
                elsewhere = bus.lower() != load_runtime().pci_bus_id(reader.index).lower()  # the peer's GPU
                found = self._caches[key] = kvstore_kernels.register(spec, opened, elsewhere=elsewhere)
        if type(mine) is RegisteredCaches:  # its tensors stay as they are: the same object, the same form
            self._last = (descriptor, mine, reader.index, found)
        return found

    def _opened(self, spec: Any, descriptor: bytes, bus: str, reader: torch.device, mine: Any) -> Any:
        try:
            info = json.loads(descriptor, parse_constant=_no_constant)
            tensors, form = _tensors(mine)
            if info["version"] != VERSION or info["form"] != form or len(info["tensors"]) != len(tensors):
                raise ValueError("another form or version")
            geometry = (info["layout"], info["dtype"], info["block_size"])
            if geometry != (spec.layout, spec.dtype, spec.block_size):
                raise ValueError(f"another geometry: {geometry}")
            if not 0 < len(info["allocations"]) <= MAX_ALLOCATIONS:
                raise ValueError(f"{len(info['allocations'])} allocations, at most {MAX_ALLOCATIONS}")
            keep = {(str(a["handle"]), reader.index) for a in info["allocations"]}
            self._retire(bus, keep)
            views = [
                self._view(info, entry, mine_t, reader, bus, keep)
                for entry, mine_t in zip(info["tensors"], tensors, strict=True)
            ]
        except (KeyError, TypeError, IndexError, OverflowError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"lent cache descriptor: malformed ({exc!r})") from None
        return views[0] if form == "tensor" else views

    def _retire(self, bus: str, keep: set[tuple[str, int]]) -> None:
        """Closes the allocations of another cache lent from `bus`: a lender restarted or replaced
        there, whose memory this process's mappings would keep alive."""
        for key, value in list(self._open.items()):
            if value[2] == bus and key not in keep:
                self._close(key, value)

    def _view(
        self,
        info: dict[str, Any],
        entry: dict[str, Any],
        mine: torch.Tensor,
        reader: torch.device,
        bus: str,
        keep: set[tuple[str, int]],
    ) -> Any:
        dtype = _DTYPES.get(entry["dtype"])
        shape, stride, offset = (
            [int(v) for v in entry["shape"]],
            [int(v) for v in entry["stride"]],
            int(entry["offset"]),
        )
        if dtype != mine.dtype or len(shape) != mine.dim() or len(stride) != len(shape):
            raise ValueError(
                f"lent cache descriptor: a tensor of {entry['dtype']} {shape}, this cache's "
                f"{mine.dtype} {list(mine.shape)}"
            )
        allocation = info["allocations"][int(entry["allocation"])]
        size = int(allocation["size"])
        itemsize = mine.element_size()
        extent = (
            (sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1) * itemsize if all(shape) else 0
        )
        if (
            min(shape, default=0) < 0
            or min(stride, default=0) < 0
            or offset < 0
            or offset % itemsize
            or offset + extent > size
        ):
            raise ValueError("lent cache descriptor: a tensor outside its allocation")
        address = self._address(str(allocation["handle"]), size, reader, bus, keep)
        whole = torch.as_tensor(_DeviceBytes(address, size), device=reader)
        usable = whole[: size - size % itemsize].view(dtype)
        return usable.as_strided(shape, stride, offset // itemsize)

    def _address(
        self, handle: str, size: int, reader: torch.device, bus: str, keep: set[tuple[str, int]]
    ) -> int:
        """The allocation `handle` names, mapped for `reader` (opened once; the oldest other than
        `keep`, the descriptor's own, closed past MAX_OPEN). Called under the lock."""
        key = (handle, reader.index)
        found = self._open.get(key)
        if found is not None:
            if found[1] != size:
                raise ValueError(f"lent cache descriptor: an allocation of {size} bytes, {found[1]} open")
            self._open[key] = self._open.pop(key)  # most recently used last
            return found[0]
        from kvstore.shared.cuda_vmm import load_vmm

        runtime = load_runtime()
        with torch.cuda.device(reader):
            runtime.set_device(reader.index)
            address = runtime.ipc_open(bytes.fromhex(handle))  # mapped for the reader: peer access on
            with load_vmm().on_device(reader.index):
                base, mapped = load_vmm().address_range(address)
        if base != address or mapped < size:  # a descriptor that claims more than was exported
            with torch.cuda.device(reader):
                runtime.ipc_close(address)
            raise ValueError(f"lent cache descriptor: an allocation of {size} bytes, {mapped} exported")
        for other, value in list(self._open.items()):
            if len(self._open) < MAX_OPEN:
                break
            if other not in keep:
                self._close(other, value)
        self._open[key] = (address, size, bus)
        return address

    def _close(self, key: tuple[str, int], value: tuple[int, int, str]) -> None:
        del self._open[key]
        self._caches.clear()  # some hold views of it
        self._last = None
        try:
            with torch.cuda.device(key[1]):
                torch.cuda.synchronize()  # reads of this process still in flight
                load_runtime().ipc_close(value[0])
        except (CudaError, RuntimeError) as exc:
            log.warning("closing a lender's allocation: %s", exc)

    def close(self) -> None:
        with self._lock:
            for key, value in list(self._open.items()):
                self._close(key, value)
