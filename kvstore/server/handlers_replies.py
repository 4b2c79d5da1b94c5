"""The reply messages the handlers build from the store's answers.

- `reserve_reply(result)`: a Reserve's slots, in the arena or in one GPU pool.
- `acquire_reply(result)`: an Acquire's ready pages (offsets, tiers, pools).
- `arena_message(store, boot_id)`: the arena a Connect's caller maps (path, size, identity).
- `arena_slabs_reply(store, request)` / `arena_slab_fds(store, reply)`: which slabs of a pinned
  arena an ArenaSlabs call gets, and their descriptors (`kvstore.tiers.pinned`).
- `gpu_pools(store)`: the GPU pools a Connect's caller may open through CUDA IPC.
"""

from __future__ import annotations

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.domain import ARENA_SLABS_PER_CALL
from kvstore.shared.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from kvstore.shared.peers import Peer
from kvstore.store.index import AcquireResult, ReserveResult
from kvstore.store.store import Store
from kvstore.tiers.pinned import PinnedArena


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


def arena_slabs_reply(
    store: Store, request: pb.ArenaSlabsRequest, peer: Peer | None
) -> pb.ArenaSlabsResponse:
    """Which of the slabs `request` asks for the daemon has pinned (their descriptors go with the
    reply on the local channel: `arena_slab_fds`), for a `peer` the arena's mode lets map it."""
    arena = store.cpu.arena
    if not isinstance(arena, PinnedArena):
        raise FailedPrecondition(
            f"ArenaSlabs: the arena {arena.path} is shared memory (tiers.cpu.pinned is off): "
            f"a worker maps it from its path"
        )
    if peer is None or peer.uid < 0 or not arena.may_map(peer.uid, peer.gid, peer.groups):
        who = (
            f"uid {peer.uid}" if peer is not None and peer.uid >= 0 else "a caller the daemon cannot identify"
        )
        raise PermissionDenied(
            f"ArenaSlabs: {who} may not map the arena (tiers.cpu.file_mode {arena.mode:#o}, as for "
            f"the file of a shared-memory arena): its page bytes go inline"
        )
    if not 0 < request.count <= ARENA_SLABS_PER_CALL:
        raise InvalidArgument(f"ArenaSlabs: count must be 1..{ARENA_SLABS_PER_CALL}, got {request.count}")
    if request.first >= arena.num_slabs:
        raise InvalidArgument(
            f"ArenaSlabs: the arena has slabs 0..{arena.num_slabs - 1}, got first={request.first}"
        )
    pinned = arena.num_pinned
    count = max(0, min(request.count, pinned - request.first))
    return pb.ArenaSlabsResponse(first=request.first, count=count, pinned=pinned, num_slabs=arena.num_slabs)


def arena_slab_fds(store: Store, reply: pb.ArenaSlabsResponse) -> list[int]:
    arena = store.cpu.arena
    return arena.slab_fds(reply.first, reply.count) if isinstance(arena, PinnedArena) else []


def gpu_pools(store: Store) -> list[pb.GpuPool]:
    placement = store.gpu_placement
    if placement is None:
        return []
    return [
        pb.GpuPool(device=p.device, pci_bus_id=p.pci_bus_id, ipc_handle=p.ipc_handle, size=p.size)
        for p in placement.gpu.pools
    ]
