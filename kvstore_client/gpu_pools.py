"""The daemon's GPU-tier pools, opened in a worker through CUDA IPC.

- `GpuPools.open(pools)`: opens each pool of a ConnectResponse once, on this process's device
  with the pool's PCI bus id (device numbers differ between processes), and wraps it as a
  uint8 tensor on that device. A pool on another GPU that the current device (at Connect)
  reaches over peer access is opened for the current device instead (the import maps it there
  and turns peer access on), so its kernels read it in place over the link: a decode instance
  reading what a prefill instance on another GPU stored into the pool on its GPU. A pool on a
  device this process cannot see stays closed.
- `readable(device)`: the indices of the open pools a KV cache on `device` reads in place (the
  daemon copies pages of other pools into the arena for it).
- `on(device)`: the open pool on `device` (its index, and its PCI bus id), or None: where a
  store asked to land in the GPU tier (`KVStoreClient.store_to_gpu`) writes its pages.
- `pieces(acquired, arena)`: an Acquire reply cut by buffer: `(buffer, chunks, offsets)` for
  the arena and for each pool, so one load scatters chunks of both tiers.
- `scatter_for(buffer, arena_scatter)`: the scatter that reads `buffer`: `arena_scatter` for the
  arena, for a pool `routes.pool_scatter` with `max_programs` kernel programs when set.
- `close()`: waits for this process's work on those devices, then closes the mappings.
- `device_bus_id()`: the PCI bus id of this process's current CUDA device ("" without one),
  which Connect sends so that the namespace's pages go to the pool on that device.

Needs torch with CUDA; the IPC calls go through `kvstore.shared.cudart` on the CUDA runtime
library that torch already loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.cudart import CudaError, CudaRuntime, CudaUnavailable, load_runtime
from kvstore.shared.domain import Tier
from kvstore_client.routes import pool_scatter

log = logging.getLogger(__name__)


def device_bus_id() -> str:
    if not torch.cuda.is_available():
        return ""
    try:
        return load_runtime().pci_bus_id(torch.cuda.current_device())
    except RuntimeError:  # CudaError, CudaUnavailable, or torch's own
        return ""


class _DeviceBytes:
    """`size` bytes at a device address, in the CUDA array interface torch.as_tensor reads."""

    def __init__(self, address: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


class GpuPools:
    def __init__(
        self,
        runtime: CudaRuntime | None,
        tensors: dict[int, torch.Tensor],
        bus_ids: dict[int, str] | None = None,
        homes: dict[int, int] | None = None,
    ) -> None:
        self._runtime = runtime
        # pool index -> its bytes, as the device that reads them sees them: its own, or (a pool
        # on a peer GPU) this process's current device at Connect
        self.tensors = tensors
        self.bus_ids = bus_ids or {}  # pool index -> the PCI bus id of the GPU it is on
        self.homes = homes or {}  # pool index -> that GPU's device number in this process
        self.max_programs: int | None = None  # kernel programs of a load from a pool

    @classmethod
    def open(cls, pools: Sequence[pb.GpuPool]) -> GpuPools:
        if not pools or not torch.cuda.is_available():
            return cls(None, {})
        torch.cuda.init()
        try:
            runtime = load_runtime()
        except CudaUnavailable as exc:
            log.info("GPU-tier pools not opened (%s): their pages come through the arena", exc)
            return cls(None, {})
        current = torch.cuda.current_device()
        tensors: dict[int, torch.Tensor] = {}
        bus_ids: dict[int, str] = {}
        homes: dict[int, int] = {}
        for index, pool in enumerate(pools):
            try:
                home = runtime.device_by_pci_bus_id(pool.pci_bus_id)
                # A pool on another GPU that this one reaches over peer access is mapped for this
                # one (the import turns peer access on): its kernels read it in place, over the link.
                reader = (
                    current if home != current and torch.cuda.can_device_access_peer(current, home) else home
                )
                with torch.cuda.device(reader):
                    runtime.set_device(reader)
                    address = runtime.ipc_open(pool.ipc_handle)
            except CudaError as exc:
                log.info(
                    "GPU-tier pool on %s not opened (%s): its pages come through the arena",
                    pool.pci_bus_id,
                    exc,
                )
                continue
            finally:
                runtime.set_device(current)
            tensors[index] = torch.as_tensor(
                _DeviceBytes(address, pool.size), device=torch.device("cuda", reader)
            )
            bus_ids[index], homes[index] = pool.pci_bus_id, home
        return cls(runtime, tensors, bus_ids, homes)

    def readable(self, device: torch.device) -> list[int]:
        return [index for index, tensor in self.tensors.items() if tensor.device == device]

    def on(self, device: torch.device) -> tuple[int, str] | None:
        for index, tensor in self.tensors.items():
            if tensor.device == device and self.homes.get(index) == device.index:
                return index, self.bus_ids.get(index, "")
        return None

    def pieces(
        self, acquired: Any, arena: torch.Tensor
    ) -> list[tuple[torch.Tensor, Sequence[int], list[int]]]:
        """`(buffer, chunks, offsets)` per buffer holding some of an AcquireResponse's ready chunks."""
        ready = acquired.ready_chunks
        tiers = acquired.tiers or bytes([Tier.CPU]) * ready
        if ready and len(tiers) == ready and tiers.count(Tier.GPU) == ready:  # all in the GPU tier
            pools = list(acquired.pools)
            pool = pools[0]
            if pools.count(pool) == ready and pool in self.tensors:  # in one pool: the usual hit
                return [(self.tensors[pool], range(ready), list(acquired.offsets))]
        by_buffer: dict[int, tuple[list[int], list[int]]] = {-1: ([], [])}
        for chunk in range(ready):
            key = acquired.pools[chunk] if tiers[chunk] == Tier.GPU else -1
            chunks, offsets = by_buffer.setdefault(key, ([], []))
            chunks.append(chunk)
            offsets.append(acquired.offsets[chunk])
        return [
            (arena if key < 0 else self.tensors[key], chunks, offsets)
            for key, (chunks, offsets) in by_buffer.items()
            if chunks or key < 0 and len(by_buffer) == 1
        ]

    def scatter_for(self, buffer: torch.Tensor, arena_scatter: Callable[..., None]) -> Callable[..., None]:
        return arena_scatter if buffer.device.type != "cuda" else pool_scatter(self.max_programs)

    def close(self) -> None:
        runtime, tensors = self._runtime, self.tensors
        self.tensors = {}
        if runtime is None:
            return
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)  # reads of this process still in flight, from any device
        for tensor in tensors.values():
            with torch.cuda.device(tensor.device):  # the device it was opened for
                runtime.ipc_close(tensor.data_ptr())
