"""The checks of a Lend's fields (`kvstore.store.lends`), each refusal an InvalidArgument that names
its field, and the bounds they hold a lend to."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.shared.errors import InvalidArgument

MAX_CACHE_BYTES = 256 << 10
MAX_READS = 16  # reads in flight of one lend, and readers a lend may wait for


def checked(keys: Sequence[bytes], blocks: bytes, cache: bytes, device: str, readers: int, most: int) -> int:
    """A Lend's fields checked, each refusal naming its field; the block ids a chunk (at most `most`)."""
    if not keys:
        raise InvalidArgument("Lend: no keys")
    if not 1 <= readers <= MAX_READS:
        raise InvalidArgument(
            f"Lend: readers must be 1..{MAX_READS} (the ranks that each read the lend), got {readers}"
        )
    blocks_per_chunk = len(blocks) // (4 * len(keys))
    if not 0 < blocks_per_chunk <= most or len(blocks) != 4 * blocks_per_chunk * len(keys):
        raise InvalidArgument(
            f"Lend: blocks must hold the same number (1..{most}) of int32 block ids "
            f"for each of the {len(keys)} keys, got {len(blocks)} bytes"
        )
    if not cache or len(cache) > MAX_CACHE_BYTES:
        raise InvalidArgument(f"Lend: cache must be 1..{MAX_CACHE_BYTES} bytes, got {len(cache)}")
    if not device:
        raise InvalidArgument("Lend: device_pci_bus_id must name the lender's GPU")
    return blocks_per_chunk
