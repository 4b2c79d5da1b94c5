"""Input checks shared by every backend, and the validated plan they execute.

`plan_transfer` checks a gather or scatter call completely before any byte moves and
returns a `Transfer`: the engine layers to move with their page positions, where their
canonical views lie (see `layouts`; the views themselves are made on demand), the block
ids of every page and the page offsets. Every problem is a `ValueError` that names the
argument, the layer or the index at fault, and what was expected. What the checks learn
about the cache tensors is remembered per tensor fingerprint (`cache_facts`); chunks,
offsets, the buffer and the block table are checked on every call, with numpy (the checks of
the arguments: `validate_args`; of the block table: `validate_blocks`).

A block table on the host (list, numpy array, CPU tensor) is checked entry by entry. A
block table on a CUDA device is not read back (that would wait for the stream): its
entries are looked up on the device, the kernel skips (moves nothing for) a block id
outside the cache, and scatter cannot refuse a block id that appears twice.

`check_blocks(spec, kv_caches, block_ids, chunks, ...)` checks a host block table ahead of
the calls that use it: the blocks of chunks `0..chunks-1` against the cache, as a scatter of
them all would. A call given the `CheckedBlocks` it returns, for chunks among those, takes
their blocks without checking them again (a load checks its table while its Lookup is in
flight, then scatters the chunks the reply names); for other chunks, another cache or another
direction, the call checks the table it holds as it checks any table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kvstore.shared.spec import KVSpec, PageSpec

from .cache_facts import CacheFacts, RegisteredCaches, ViewFacts, cache_facts
from .layouts import KVCaches, kv_views
from .validate_args import check_buffer, check_layers, int_array
from .validate_blocks import block_table, check_unique, table_array


class Transfer(NamedTuple):
    """A checked transfer, ready for a backend."""

    page: PageSpec
    layers: tuple[int, ...]  # engine layers moved: the stored ones among `layers`
    positions: tuple[int, ...]  # their stored-layer index within a page
    view_facts: tuple[tuple[ViewFacts, ...], ...]  # per moved layer: where its K, V (or latent) views lie
    blocks: np.ndarray | torch.Tensor  # int64 [num_pages, blocks_per_chunk]; a tensor: on the device
    offsets: tuple[int, ...]  # byte offset of each page in the buffer
    buffer: torch.Tensor
    device: torch.device  # where the KV cache lives
    num_blocks: int  # blocks in the smallest moved cache tensor: valid ids are 0..num_blocks-1
    spec: KVSpec
    kv_caches: KVCaches
    batch_index: int

    @property
    def blocks_on_device(self) -> bool:
        """Whether the block ids are a device tensor, unchecked on the host."""
        return isinstance(self.blocks, torch.Tensor)

    @property
    def views(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per moved layer: its K, V (or latent) views (`layouts.kv_views`), made on each access."""
        return tuple(kv_views(self.spec, self.kv_caches, layer, self.batch_index) for layer in self.layers)


class CheckedBlocks(NamedTuple):
    """A host block table whose first `chunks` chunks' blocks passed the checks of a transfer on a
    cache of `num_blocks` blocks (`unique`: and of a scatter, each block once)."""

    table: Any  # the block table as given: what a call for other chunks checks
    blocks: np.ndarray  # int64 [chunks, blocks_per_chunk]
    num_blocks: int
    unique: bool

    @property
    def chunks(self) -> int:
        return len(self.blocks)


def check_blocks(
    spec: KVSpec,
    kv_caches: KVCaches,
    block_ids: Any,
    chunks: int,
    layers: range | None = None,
    batch_index: int = 0,
    *,
    writes_cache: bool,
) -> Any:
    """`block_ids` as `CheckedBlocks` for chunks `0..chunks-1` (fewer where the table holds fewer
    whole chunks), or `block_ids` itself where there is nothing to check ahead (a device table,
    the hf layout) or the check fails (the call that uses it then names the fault)."""
    if spec.layout == "hf" or isinstance(block_ids, CheckedBlocks):
        return block_ids
    if isinstance(block_ids, torch.Tensor) and block_ids.device.type != "cpu":
        return block_ids
    try:
        page = spec.page
        moved, facts = _moved_facts(spec, kv_caches, layers, batch_index)
        table = table_array(block_ids)
        assert isinstance(table, np.ndarray)  # a CPU table
        per_chunk = page.page_tokens // spec.block_size
        count = min(chunks, table.size // per_chunk)
        blocks = block_table(
            spec, page, table, np.arange(count), facts.num_blocks, facts.smallest_layer, facts.device
        )
        assert isinstance(blocks, np.ndarray)
        if writes_cache:
            check_unique(blocks)
    except ValueError:
        return block_ids
    return CheckedBlocks(block_ids, blocks, facts.num_blocks, writes_cache)


def plan_transfer(
    spec: KVSpec,
    kv_caches: KVCaches,
    block_ids: Any,
    chunks: Sequence[int],
    buffer: torch.Tensor,
    offsets: Sequence[int] | None,
    layers: range | None,
    batch_index: int,
    *,
    writes_cache: bool,
) -> Transfer:
    """Check a gather (`writes_cache=False`) or scatter call; return what to move. With `offsets`
    None, a plan of every chunk whose offsets are not known yet: `plan_pages` takes pages of it."""
    page = spec.page
    position = page.stored_position
    moved, facts = _moved_facts(spec, kv_caches, layers, batch_index)
    chunk_array = int_array("chunks", chunks)
    # None: not known yet (`kvstore_kernels.prepare`); `plan_pages` checks them when they are.
    offset_array = np.empty(0, dtype=np.int64) if offsets is None else int_array("offsets", offsets)
    if offsets is not None and chunk_array.size != offset_array.size:
        raise ValueError(
            f"chunks and offsets: {chunk_array.size} chunks but {offset_array.size} offsets; "
            "give one page offset per chunk"
        )
    check_buffer(buffer, facts.device, offset_array, page.page_bytes, overlap_ok=writes_cache)
    blocks = _blocks_of(spec, facts, block_ids, chunk_array, writes_cache)
    return Transfer(
        page=page,
        layers=tuple(moved),
        positions=tuple(position[layer] for layer in moved),
        view_facts=facts.views,
        blocks=blocks,
        offsets=tuple(offset_array.tolist()),
        buffer=buffer,
        device=facts.device,
        num_blocks=facts.num_blocks,
        spec=spec,
        kv_caches=kv_caches,
        batch_index=batch_index,
    )


def facts_of(spec: KVSpec, kv_caches: KVCaches, layers: range | None, batch_index: int) -> CacheFacts:
    """The checked facts of the cache tensors a transfer of `layers` moves (as `plan_transfer`
    takes them): remembered, so cheap for tensors seen before and for `RegisteredCaches`."""
    return _moved_facts(spec, kv_caches, layers, batch_index)[1]


def replan(
    plan: Transfer, facts: CacheFacts, block_ids: Any, chunks: Sequence[int], *, writes_cache: bool
) -> Transfer:
    """`plan` (of the same cache, layers and buffer, offsets not known yet) for `chunks` of
    `block_ids`: the checks `plan_transfer` makes of a call's chunks and block table, the rest
    taken from `plan` (`facts`: the cache facts it was made with)."""
    chunk_array = int_array("chunks", chunks)
    blocks = _blocks_of(plan.spec, facts, block_ids, chunk_array, writes_cache)
    return plan._replace(blocks=blocks, offsets=())


def _blocks_of(
    spec: KVSpec, facts: CacheFacts, block_ids: Any, chunk_array: np.ndarray, writes_cache: bool
) -> np.ndarray | torch.Tensor:
    """The checked block ids of `chunk_array`'s chunks, [chunks, blocks per chunk]."""
    blocks: np.ndarray | torch.Tensor | None = _checked_already(
        block_ids, chunk_array, facts.num_blocks, writes_cache
    )
    if blocks is None:
        if isinstance(block_ids, CheckedBlocks):
            block_ids = block_ids.table
        blocks = block_table(
            spec, spec.page, block_ids, chunk_array, facts.num_blocks, facts.smallest_layer, facts.device
        )
        if writes_cache:
            check_unique(blocks)
        if facts.write_error is not None:
            raise ValueError(facts.write_error)
    return blocks


def plan_pages(
    plan: Transfer, pages: Sequence[int], offsets: Sequence[int], *, writes_cache: bool
) -> Transfer:
    """The plan of pages `pages` of `plan` (indices into its chunks) at `offsets` in its buffer,
    checked as `plan_transfer` checks a call's chunks and offsets."""
    page_array = int_array("pages", pages)
    offset_array = int_array("offsets", offsets)
    if page_array.size != offset_array.size:
        raise ValueError(
            f"pages and offsets: {page_array.size} pages but {offset_array.size} offsets; "
            "give one page offset per page"
        )
    count = len(plan.blocks)
    if page_array.size and int(page_array.max()) >= count:
        index = int(np.flatnonzero(page_array >= count)[0])
        raise ValueError(f"pages[{index}]: {int(page_array[index])} is not one of the plan's {count} chunks")
    if writes_cache and np.unique(page_array).size != page_array.size:
        raise ValueError("pages: a page appears twice; scatter would write its blocks twice")
    check_buffer(plan.buffer, plan.device, offset_array, plan.page.page_bytes, overlap_ok=writes_cache)
    blocks: np.ndarray | torch.Tensor = plan.blocks
    if isinstance(blocks, torch.Tensor):
        blocks = blocks[torch.as_tensor(page_array, device=blocks.device)]
    else:
        blocks = blocks[page_array]
    return plan._replace(blocks=blocks, offsets=tuple(offset_array.tolist()))


def _checked_already(
    block_ids: Any, chunks: np.ndarray, num_blocks: int, writes_cache: bool
) -> np.ndarray | None:
    """The blocks of `chunks` from `CheckedBlocks` that cover them for this call, else None.

    A subset of blocks that are each in range (and distinct) is too; chunks given twice would
    repeat blocks, so a scatter takes them from it only in increasing order."""
    if not isinstance(block_ids, CheckedBlocks) or block_ids.num_blocks != num_blocks:
        return None
    if writes_cache and not block_ids.unique:
        return None
    if chunks.size and int(chunks.max()) >= block_ids.chunks:
        return None
    if writes_cache and chunks.size > 1 and not bool((chunks[1:] > chunks[:-1]).all()):
        return None  # not in increasing order: possibly a chunk twice; the full check decides
    return block_ids.blocks[chunks]


def host_blocks(plan: Transfer, *, writes_cache: bool) -> np.ndarray:
    """The plan's block ids on the host, checked: a device table is read back (the stream waits)."""
    if isinstance(plan.blocks, np.ndarray):
        return plan.blocks
    blocks = plan.blocks.cpu().numpy()
    bad = np.argwhere((blocks < 0) | (blocks >= plan.num_blocks))
    if bad.size:
        row, column = (int(i) for i in bad[0])
        raise ValueError(
            f"block_ids: block {int(blocks[row, column])} (page {row}, block {column} of its chunk) "
            f"is outside 0..{plan.num_blocks - 1}"
        )
    if writes_cache:
        check_unique(blocks)
    return blocks


def _moved_facts(
    spec: KVSpec, kv_caches: KVCaches, layers: range | None, batch_index: int
) -> tuple[tuple[int, ...], CacheFacts]:
    """The engine layers a call moves (the stored ones among `layers`) and the facts of the cache
    tensors (only the moved layers are read or written; with none, all are checked anyway). Kept
    on `RegisteredCaches` per spec, layers and batch index: a call then neither lists the layers
    nor looks the facts up."""
    kept: dict[Any, Any] | None = None
    if type(kv_caches) is RegisteredCaches and (layers is None or type(layers) is range):
        kept = kv_caches.__dict__.setdefault("_moved", {})
        found = kept.get((id(spec), layers, batch_index))
        if found is not None and found[0] is spec:
            return found[1], found[2]
    page = spec.page
    position = page.stored_position
    moved = tuple(layer for layer in check_layers(spec, layers) if layer in position)
    facts = cache_facts(spec, kv_caches, moved, moved or page.stored_layers, batch_index)
    if kept is not None:
        if len(kept) >= _MAX_KEPT:
            kept.clear()
        kept[(id(spec), layers, batch_index)] = (spec, moved, facts)
    return moved, facts


_MAX_KEPT = 32  # layer subsets kept per registered cache
