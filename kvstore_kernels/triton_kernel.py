"""The Triton kernel that moves pages: `copy_pages`, one persistent launch for every layer of
every page (`triton_copy` makes its arguments and launches it).

Its unit of work is a segment (see `geometry`): one (page, layer, k|v, block) span. At most
`max_programs` programs stride over steps of `SEGMENTS` segments, moving each in tiles of up to
`TILE` words: host reads need many bytes in flight per program, and few programs leave the SMs
to the model.

Addresses travel as int64 tables (layer base pointers, page addresses), so the cache's layers
and a pinned host buffer need no single base tensor; the kernel casts them with
`.to(tl.pointer_type(...))`. Data moves as integer words of 1-8 bytes, the widest that every
address and stride allows, so no dtype (fp8, bf16) needs special casing. A cache whose views
are not contiguous within a block is honoured through its strides. A block id outside
`0..num_blocks-1` (possible only with a device block table) moves nothing (a staged gather
writes zeros for it in its staging slot instead, so no stale slot bytes reach a page).

`TRITON_INTERPRET=1` set before this module is imported runs the kernel in Triton's CPU
interpreter (`is_interpreted`): the tests' CPU path.
"""

from __future__ import annotations

import triton
import triton.language as tl

WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


# Per-launch values of the staged path: not specialised, so one compiled kernel serves every piece.
@triton.jit(do_not_specialize=["first_segment", "num_segments", "stage_base", "stage_stride"])
def copy_pages(
    tables,  # int64: page addresses, then the parts that start at the *_at offsets
    blocks,  # int64 [pages, blocks_per_chunk]: a part of `tables`, or a device tensor
    layer_addrs_at,
    layer_strides_at,  # per (layer, k|v): block stride in bytes; token, head, dim strides in elements
    layer_page_offsets_at,
    first_segment,  # this launch moves segments first_segment..num_segments-1
    num_segments,
    stage_base,  # STAGED: this launch's first page starts here (a staging slot, less its offset)
    stage_stride,  # STAGED: bytes from one page of this launch to the next in the slot
    num_layer_kv,  # runtime, not constexpr: a new layer range must not recompile
    blocks_per_chunk,
    num_blocks,
    SEGMENT_WORDS: tl.constexpr,
    TILE: tl.constexpr,
    SEGMENTS: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WORDS_PER_ELEMENT: tl.constexpr,
    WORD: tl.constexpr,
    WORD_BYTES: tl.constexpr,
    ALIGN: tl.constexpr,
    TO_PAGE: tl.constexpr,
    STAGED: tl.constexpr,
    LOAD_CACHE: tl.constexpr,
    STORE_CACHE: tl.constexpr,
    EVICTION: tl.constexpr,
):
    layer_addrs = tables + layer_addrs_at
    layer_strides = tables + layer_strides_at
    layer_page_offsets = tables + layer_page_offsets_at
    num_steps = tl.cdiv(num_segments - first_segment, SEGMENTS)
    # A while loop, not range(program_id, ...): the interpreter cannot index with a traced scalar.
    step = tl.program_id(0)
    while step < num_steps:
        segment = first_segment + step * SEGMENTS + tl.arange(0, SEGMENTS)
        in_range = segment < num_segments
        block_in_chunk = segment % blocks_per_chunk
        layer_kv = (segment // blocks_per_chunk) % num_layer_kv
        page = segment // (blocks_per_chunk * num_layer_kv)
        block = tl.load(blocks + page * blocks_per_chunk + block_in_chunk, mask=in_range, other=0)
        live = in_range & (block >= 0) & (block < num_blocks)
        # A staged gather writes zeros for a block outside the cache: a slot's stale bytes are another page's.
        writes = (in_range if TO_PAGE else live) if STAGED else live
        cache_addr = tl.load(layer_addrs + layer_kv, mask=live, other=0) + block * tl.load(
            layer_strides + layer_kv * 4, mask=live, other=0
        )
        if STAGED:  # the launch's pages one after the other in its slot
            first_page = first_segment // (blocks_per_chunk * num_layer_kv)
            page_base = stage_base.to(tl.int64) + (page - first_page).to(tl.int64) * stage_stride
        else:
            page_base = tl.load(tables + page, mask=live, other=0)
        page_addr = (
            page_base
            + tl.load(layer_page_offsets + layer_kv, mask=writes, other=0)
            + block_in_chunk.to(tl.int64) * (SEGMENT_WORDS * WORD_BYTES)
        )
        # Loaded addresses carry no alignment facts; the host checked ALIGN, so say it (vector loads).
        cache_ptr = tl.multiple_of(cache_addr, ALIGN).to(tl.pointer_type(WORD))[:, None]
        page_ptr = tl.multiple_of(page_addr, ALIGN).to(tl.pointer_type(WORD))[:, None]
        if not CONTIGUOUS:  # strides in elements: token, head, dim
            token_stride = tl.load(layer_strides + layer_kv * 4 + 1, mask=live, other=0)[:, None]
            head_stride = tl.load(layer_strides + layer_kv * 4 + 2, mask=live, other=0)[:, None]
            dim_stride = tl.load(layer_strides + layer_kv * 4 + 3, mask=live, other=0)[:, None]
        for start in range(0, SEGMENT_WORDS, TILE):
            words = (start + tl.arange(0, TILE))[None, :]
            mask = live[:, None] & (words < SEGMENT_WORDS) if SEGMENT_WORDS % TILE else live[:, None]
            page_mask = writes[:, None] & (words < SEGMENT_WORDS) if SEGMENT_WORDS % TILE else writes[:, None]
            if CONTIGUOUS:
                cache_words = words.to(tl.int64)
            else:
                element = words // WORDS_PER_ELEMENT
                token = element // (HEADS * HEAD_DIM)
                head = (element // HEAD_DIM) % HEADS
                dim = element % HEAD_DIM
                cache_elements = token * token_stride + head * head_stride + dim * dim_stride
                cache_words = cache_elements * WORDS_PER_ELEMENT + words % WORDS_PER_ELEMENT
            if TO_PAGE:
                data = tl.load(
                    cache_ptr + cache_words,
                    mask=mask,
                    other=0,
                    cache_modifier=LOAD_CACHE,
                    eviction_policy=EVICTION,
                )
                tl.store(
                    page_ptr + words,
                    data,
                    mask=page_mask,
                    cache_modifier=STORE_CACHE,
                    eviction_policy=EVICTION,
                )
            else:
                data = tl.load(
                    page_ptr + words, mask=mask, cache_modifier=LOAD_CACHE, eviction_policy=EVICTION
                )
                tl.store(
                    cache_ptr + cache_words,
                    data,
                    mask=mask,
                    cache_modifier=STORE_CACHE,
                    eviction_policy=EVICTION,
                )
        step += tl.num_programs(0)


def is_interpreted() -> bool:
    """Whether the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(copy_pages, triton.runtime.JITFunction)
