"""Storage tiers: each knows bytes and slots, never policy.

`Tier` numbers match the wire's `kvstore.v1.Tier` enum; a Lookup reports one
per hit chunk, packed as bytes.
"""

from kvstore.wire import Tier

__all__ = ["Tier"]
