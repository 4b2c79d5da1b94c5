"""Storage tiers: each knows bytes and slots, never policy.

`Tier` (`kvstore.shared.domain`, importable from here too) numbers the tiers as the wire's
`kvstore.v1.Tier` enum does; a Lookup reports one per hit chunk, packed as bytes.
"""

from kvstore.shared.domain import Tier

__all__ = ["Tier"]
