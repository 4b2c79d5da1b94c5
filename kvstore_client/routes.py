"""How a store's or a load's pages move: the one place that decides, from what the client knows
when the transfer is issued. The paths move bytes (`stores.py`, `loads.py`, `bounce.py`, the
kernels); the facts come from the mapped arena's registration (`arena.py`) and the GPU pools
(`gpu_pools.py`); the choice is made here.

- `store_route(in_pool, arena, offsets, page_bytes, on_cuda, whole_pages)`: how a store's new
  pages are written (`StoreRoute`: its `way`, the bounce ring or the kernels' options it takes):
  "pool" (device to device into the GPU pool its Reserve named), "inline" (gathered into a
  buffer and sent through Put: no arena mapped), "bounce" (the bounce ring: whole pages into
  slabs not registered yet), "kernels" (their slabs registered: the setup made during the
  Reserve where it fits, else the kernels' auto rule), "unpinned" (the torch reference: slabs
  that could not be registered). The arena's facts are asked in that order, since asking
  costs: a bounce ring is taken only where the slabs are not registered, and only then does
  the store wait for the registration (`ArenaFacts`).
- `arena_scatter(options, layerwise_on_gpu, prepared)`: the scatter that reads a load's pages
  from the arena: the torch reference where their slabs could not be registered, the layer-wise
  options for a load in runs of layers (`LAYERWISE_TRANSFER`), the setup prepared during the
  Lookup where it moves these layers, else the kernels' auto rule.
- `pool_scatter(max_programs)`: the scatter that reads a GPU pool in place (at most
  `max_programs` kernel programs where set).
- `LAYERWISE_TRANSFER`, `UNPINNED`: the options of those two cases.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, Protocol

import kvstore_kernels

# How a layer-wise load moves each run of layers: the auto rule (its staged path). The Triton
# kernel reading the arena issues faster (one launch per run, against a copy and a launch per
# page) but moves the hf layout's 4 KiB rows at a fraction of the link's rate: about as soon
# to the first token at 8k tokens, far later at 32k (bench/NOTES-ttft.md).
LAYERWISE_TRANSFER = kvstore_kernels.TransferOptions()
UNPINNED = kvstore_kernels.TransferOptions(engine="torch")  # moves pages from and to pageable memory

StoreWay = Literal["pool", "inline", "bounce", "kernels", "unpinned"]


class ArenaFacts(Protocol):
    """What the mapped arena tells of the slabs holding some pages (`arena.MappedArena`)."""

    def bounce_for(self, offsets: list[int], page_bytes: int, on_cuda: bool) -> Any: ...

    def transfer_options(
        self, offsets: list[int], on_cuda: bool = True, device: int | None = None
    ) -> kvstore_kernels.TransferOptions | None: ...


class StoreRoute(NamedTuple):
    way: StoreWay
    ring: Any = None  # "bounce": the `bounce.BounceRing`
    options: kvstore_kernels.TransferOptions | None = None  # "unpinned": `UNPINNED`


def store_route(
    in_pool: bool,
    arena: ArenaFacts | None,
    offsets: list[int],
    page_bytes: int,
    on_cuda: bool,
    whole_pages: bool,
    device: int | None = None,
) -> StoreRoute:
    """How a store's new pages at `offsets` are written: `in_pool`, its Reserve put them in a GPU
    pool; `arena`, the mapped arena (None: none); `whole_pages`, the store writes every layer of
    its pages (a bounce slot is copied whole); `device`, the KV cache's GPU (`on_cuda`)."""
    if in_pool:
        return StoreRoute("pool")
    if arena is None:
        return StoreRoute("inline")
    ring = arena.bounce_for(offsets, page_bytes, on_cuda) if whole_pages else None
    if ring is not None:
        return StoreRoute("bounce", ring=ring)
    return arena_route(arena, offsets, on_cuda, device)


def arena_route(
    arena: ArenaFacts, offsets: list[int], on_cuda: bool = True, device: int | None = None
) -> StoreRoute:
    """The kernels' way into the arena once the slabs at `offsets` are registered (waiting for
    them), or the torch reference where they could not be."""
    options = arena.transfer_options(offsets, on_cuda, device)
    return StoreRoute("kernels" if options is None else "unpinned", options=options)


def with_options(
    transfer: Callable[..., None], options: kvstore_kernels.TransferOptions | None
) -> Callable[..., None]:
    """`transfer` (the kernels' gather or scatter) run with `options` (None: as it is)."""
    return transfer if options is None else functools.partial(transfer, options=options)


def arena_scatter(
    options: kvstore_kernels.TransferOptions | None,
    layerwise_on_gpu: kvstore_kernels.TransferOptions | None,
    prepared: Callable[..., None] | None,
) -> Callable[..., None]:
    """The scatter of a load's pages from the arena: with `options` where the registration left
    some (`UNPINNED`), else with `layerwise_on_gpu` for a load in runs of layers into a CUDA
    cache from a registered arena, else the `prepared` setup where it moves these layers, else
    the kernels' auto rule."""
    if options is not None:
        return with_options(kvstore_kernels.scatter, options)
    if layerwise_on_gpu is not None:
        return with_options(kvstore_kernels.scatter, layerwise_on_gpu)
    return prepared or kvstore_kernels.scatter


def pool_scatter(max_programs: int | None) -> Callable[..., None]:
    """The scatter that reads a GPU pool in place: at most `max_programs` kernel programs where
    set (None: the kernels' default for a device buffer)."""
    if max_programs is None:
        return kvstore_kernels.scatter
    return with_options(kvstore_kernels.scatter, kvstore_kernels.TransferOptions(max_programs=max_programs))
