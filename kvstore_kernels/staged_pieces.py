"""The staged path's pieces (`staged`): what each staging slot moves.

- `Piece`: a run of a page's moved layers, or several whole pages that share a slot.
- `layers_per_piece(spec, plan, staging_bytes)`: the moved layers one slot holds.
- `pages_per_slot(plan, per_piece, staging_bytes)`: the whole pages one slot holds (1 where a
  page's layers take the slot or more).
- `pieces(spec, plan, staging_bytes)`: every page's pieces, page after page; `slot_pieces(pages,
  count, per_piece, per_slot)`: what each slot moves, for pages named in any order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from kvstore.shared.spec import KVSpec

from .staged_ring import NUM_SLOTS
from .validate import Transfer


class Piece(NamedTuple):
    """Stored layers `first_layer..stop_layer-1` (indices into the plan's moved layers) of page
    `page` and of the `pages - 1` pages after it (several only where whole pages share a slot)."""

    page: int
    first_layer: int
    stop_layer: int
    pages: int = 1


def layers_per_piece(spec: KVSpec, plan: Transfer, staging_bytes: int) -> int:
    """Moved layers one slot holds: all of them when a page fits, else as many as fit (0: none)."""
    slot_bytes = staging_bytes // NUM_SLOTS
    return min(len(plan.layers), slot_bytes // plan.page.layer_bytes)


def pieces(spec: KVSpec, plan: Transfer, staging_bytes: int) -> list[Piece]:
    """Every page's moved layers, in runs of at most `layers_per_piece`, page after page."""
    return list(_pieces(plan, layers_per_piece(spec, plan, staging_bytes)))


def _pieces(plan: Transfer, per_piece: int) -> Iterator[Piece]:
    for page in range(len(plan.offsets)):
        yield from page_pieces(page, len(plan.layers), per_piece)


def pages_per_slot(plan: Transfer, per_piece: int, staging_bytes: int) -> int:
    """Whole pages one slot (`staging_bytes / NUM_SLOTS`) holds where a page's moved layers fit
    it, else 1. One launch moves a slot's pages, and one copy each run of them that lies one
    after another in the buffer: a TP rank's small pages move in slots as large as a whole
    model's page."""
    span = per_piece * plan.page.layer_bytes
    contiguous = bool(plan.positions) and plan.positions[-1] - plan.positions[0] + 1 == len(plan.layers)
    if not span or per_piece != len(plan.layers) or not contiguous:
        return 1
    return max(1, (staging_bytes // NUM_SLOTS) // span)


def slot_pieces(
    pages: list[int], count: int, per_piece: int, per_slot: int, breaks: frozenset[int] = frozenset()
) -> Iterator[Piece]:
    """What each slot moves, in order: a run of a page's `count` moved layers (at most
    `per_piece`), or, where `per_slot` whole pages fit a slot, up to `per_slot` pages that follow
    one another in the plan (`pages[j + k] == pages[j] + k`: the kernel walks them in order). No
    slot holds both page j - 1 and page j for j in `breaks`."""
    if per_slot <= 1:
        for j in range(len(pages)):
            yield from page_pieces(j, count, per_piece)
        return
    j = 0
    while j < len(pages):
        run = 1
        while (
            run < per_slot
            and j + run < len(pages)
            and pages[j + run] == pages[j] + run
            and j + run not in breaks
        ):
            run += 1
        yield Piece(j, 0, count, run)
        j += run


def page_pieces(page: int, count: int, per_piece: int) -> Iterator[Piece]:
    """Page `page`'s `count` moved layers in runs of at most `per_piece`."""
    if not per_piece:
        return
    for first in range(0, count, per_piece):
        yield Piece(page, first, min(first + per_piece, count))
