"""Storage tiers: each knows bytes and slots, never policy.

`Tier` numbers match the wire's `kvstore.v1.Tier` enum; a Lookup reports one
per hit chunk, packed as bytes.
"""

from enum import IntEnum


class Tier(IntEnum):
    NONE = 0
    GPU = 1
    CPU = 2
    DISK = 3
    REMOTE = 4
