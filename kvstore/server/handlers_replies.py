"""The reply messages the handlers build from the store's answers.

- `reserve_reply(result)`: a Reserve's slots, in the arena or in one GPU pool.
- `acquire_reply(result)`: an Acquire's ready pages (offsets, tiers, pools).
- `arena_message(store, boot_id)`: the arena a Connect's caller maps (path, size, identity).
- `gpu_pools(store)`: the GPU pools a Connect's caller may open through CUDA IPC.
"""

from __future__ import annotations

from kvstore.proto import kvstore_pb2 as pb
from kvstore.store.index import AcquireResult, ReserveResult
from kvstore.store.store import Store


def reserve_reply(result: ReserveResult) -> pb.ReserveResponse:
    """A Reserve's reply: the slots, in the arena or in one GPU pool."""
    if result.pool < 0:
        return pb.ReserveResponse(lease_id=result.lease_id, offsets=result.offsets)
    return pb.ReserveResponse(
        lease_id=result.lease_id, offsets=result.offsets, in_gpu_pool=True, gpu_pool=result.pool
    )


def acquire_reply(result: AcquireResult) -> pb.AcquireResponse:
    return pb.AcquireResponse(
        ready_chunks=len(result.offsets),
        offsets=result.offsets,
        page_bytes=result.page_bytes,
        tiers=result.tiers,
        pools=result.pools,
    )


def arena_message(store: Store, boot_id: str) -> pb.Arena:
    arena = store.cpu.arena
    return pb.Arena(
        shm_path=str(arena.path),
        size=arena.size,
        device=arena.identity[0],
        inode=arena.identity[1],
        boot_id=boot_id,
        slab_bytes=store.cpu.slots.slab_bytes,
    )


def gpu_pools(store: Store) -> list[pb.GpuPool]:
    placement = store.gpu_placement
    if placement is None:
        return []
    return [
        pb.GpuPool(device=p.device, pci_bus_id=p.pci_bus_id, ipc_handle=p.ipc_handle, size=p.size)
        for p in placement.gpu.pools
    ]
