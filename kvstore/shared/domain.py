"""What the daemon and its clients mean by a tier, a request and an arena, whatever carries them.

- `Tier`: the tiers by number (NONE, GPU, CPU, DISK, REMOTE), as a Lookup reports one per hit
  chunk (packed as bytes on the wire), events name them and the store indexes pages by them.
- `MAX_KEYS_PER_REQUEST`: the most keys one request may name (a Lookup, Reserve, Pin, Clear).
- `MEMFD_PREFIX`: the `shm_path` of a sealed arena (a tenant's: no path in the filesystem; its
  members get its descriptor on the local channel).

`kvstore.shared.wire` sizes its frames and requests from these; the tiers, the store and the client
take them from here, not from the wire.
"""

from __future__ import annotations

from enum import IntEnum

MAX_KEYS_PER_REQUEST = 1 << 16
MEMFD_PREFIX = "memfd:"
PINNED_PREFIX = "cuda:"  # an arena the daemon pinned (`kvstore.tiers.pinned`): its slabs by ArenaSlabs
ARENA_SLABS_PER_CALL = 64  # descriptors one ArenaSlabs reply carries at most


class Tier(IntEnum):
    NONE = 0
    GPU = 1
    CPU = 2
    DISK = 3
    REMOTE = 4
    LENT = 5  # a worker's own KV-cache blocks, lent to readers on other GPUs (not a tier of pages)
