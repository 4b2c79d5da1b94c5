"""The transfer benchmark's cases: the 8B-geometry setup, each way of moving its pages, timing.

- `Setup(layout, tokens)`: a random KV cache, two disjoint random block tables, two pinned
  buffers (anonymous shared memory registered with CUDA, like the client's arena).
- Variants, each a callable that queues one whole transfer on the current stream and
  returns its bytes: `memcpy`, `memcpy_pages`, `per_block_python`, `per_block_torch`, `per_block_cuda`,
  `staging` (torch index_select into a GPU buffer as large as the transfer), `kernel`,
  `copy_engines`, `staged` (the kernel packing into the staging ring, copy engines moving
  it), `device_pack` (its pack alone, into device memory); `Setup.call` is the public API
  with options.
- `timed(enqueue)`, `timed_pair(first, second)`: median wall time, GB/s, host issue time;
  `timed_against(enqueue, baseline)`: the two in turn, the median per-round ratio.
- `verify(setup, to_page, enqueue)`: one transfer checked against the torch reference.
"""

from __future__ import annotations

import contextlib
import mmap
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import kvstore_kernels
from kvstore.spec import KVSpec
from kvstore_kernels import cache_facts, copy_engine, cudart, reference, staged, triton_copy
from kvstore_kernels.validate import plan_transfer

CHUNK_TOKENS = 256
CAPS = (4, 8, 16, None)  # None: one program per SM
Enqueue = Callable[[], int]  # queues one transfer on the current stream, returns its bytes


def make_spec(layout: str) -> KVSpec:
    return KVSpec(
        model="llama-3.1-8b",
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        block_size=16,
        layout=layout,
        chunk_tokens=CHUNK_TOKENS,
    )


class PinnedBuffer:
    """Anonymous shared memory registered with CUDA, like the client's view of the arena."""

    def __init__(self, size: int) -> None:
        self._map = mmap.mmap(-1, size)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        status = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), size, 0)
        if int(getattr(status, "value", status)) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {status}")

    def unregister(self) -> None:
        torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())


class Setup:
    """One layout's cache, block tables, pinned buffers and baselines' tensors."""

    def __init__(self, layout: str, tokens: int, seed: int = 0) -> None:
        self.spec = spec = make_spec(layout.split("/")[0])
        self.layout = layout
        self.num_pages = tokens // CHUNK_TOKENS
        blocks_needed = self.num_pages * spec.blocks_per_chunk
        num_blocks = 2 * blocks_needed  # two disjoint tables: gather from one, scatter into the other
        shape = {
            "flash_attn": [(2, num_blocks, 16, 8, 128)] * 32,
            "flashinfer": [(num_blocks, 2, 16, 8, 128)] * 32,
            "cross_layer": (num_blocks, 32, 2, 16, 8, 128),
            # vLLM 0.33's views [blocks, heads, tokens, K|V]: LBNHC (tokens before heads in memory)
            # and BLHNC (block-outermost: one block holds every layer, vLLM's cross-layer cache).
            "vllm": [(num_blocks, 16, 8, 256)] * 32,
            "vllm/cross": (num_blocks, 32, 8, 16, 256),
        }[layout]
        gen = torch.Generator(device="cuda").manual_seed(seed)

        def rand(size: Any) -> torch.Tensor:
            return torch.randint(-32768, 32767, size, dtype=torch.int16, device="cuda", generator=gen).view(
                torch.bfloat16
            )

        self.caches: Any = rand(shape) if isinstance(shape, tuple) else [rand(s) for s in shape]
        if layout == "vllm":
            self.caches = [cache.transpose(1, 2) for cache in self.caches]
        elif layout == "vllm/cross":
            blocks_outermost: Any = self.caches
            self.caches = [blocks_outermost[:, layer] for layer in range(32)]
        order = np.random.default_rng(seed).permutation(num_blocks)
        self.table, self.table2 = order[:blocks_needed].tolist(), order[blocks_needed:].tolist()
        self.page_bytes = spec.page.page_bytes
        self.bytes = self.num_pages * self.page_bytes
        self.chunks = list(range(self.num_pages))
        self.offsets = (
            np.random.default_rng(seed + 1).permutation(self.num_pages) * self.page_bytes
        ).tolist()
        self.pinned = PinnedBuffer(self.bytes)
        self.pinned2 = PinnedBuffer(self.bytes)
        self.buffer, self.buffer2 = self.pinned.tensor, self.pinned2.tensor
        noise = torch.randint(0, 256, (self.bytes,), dtype=torch.uint8, device="cuda", generator=gen)
        self.buffer.copy_(noise)
        self.buffer2.copy_(noise)
        self.flat = noise  # the memcpy baseline's GPU side
        self.flat2 = torch.empty_like(noise)
        torch.cuda.synchronize()

    def release(self) -> None:
        """Unpin the buffers (the memory goes when the last view of it does)."""
        torch.cuda.synchronize()
        self.pinned.unregister()
        self.pinned2.unregister()

    def plan(self, *, to_page: bool, buffer: torch.Tensor | None = None, second: bool = False) -> Any:
        table = self.table2 if second else self.table
        buf = buffer if buffer is not None else (self.buffer2 if second else self.buffer)
        return plan_transfer(
            self.spec, self.caches, table, self.chunks, buf, self.offsets, None, 0, writes_cache=not to_page
        )

    def call(
        self,
        to_page: bool,
        options: kvstore_kernels.TransferOptions | None,
        second: bool = False,
        cold: bool = False,
    ) -> Enqueue:
        """The public call. `cold`: as the first call on these cache tensors (what the checks learnt
        about them is forgotten first, `cache_facts.forget`)."""
        table = self.table2 if second else self.table
        buffer = self.buffer2 if second else self.buffer
        function = kvstore_kernels.gather if to_page else kvstore_kernels.scatter

        def enqueue() -> int:
            if cold:
                cache_facts.forget()
            function(self.spec, self.caches, table, self.chunks, buffer, self.offsets, options=options)
            return self.bytes

        return enqueue

    def per_layer(self, to_page: bool) -> Enqueue:
        """One public call per layer, back to back: what a save (or load) issued layer by layer
        from inside the forward costs, against one call for every layer ("auto")."""
        function = kvstore_kernels.gather if to_page else kvstore_kernels.scatter
        layers = [range(layer, layer + 1) for layer in range(self.spec.num_layers)]

        def enqueue() -> int:
            for layer in layers:
                function(self.spec, self.caches, self.table, self.chunks, self.buffer, self.offsets, layer)
            return self.bytes

        return enqueue


# -- variants: each returns an Enqueue ------------------------------------------------------------


def memcpy(setup: Setup, to_page: bool, second: bool = False) -> Enqueue:
    host = setup.buffer2 if second else setup.buffer
    device = setup.flat2 if second else setup.flat

    def enqueue() -> int:
        (host.copy_(device, non_blocking=True) if to_page else device.copy_(host, non_blocking=True))
        return setup.bytes

    return enqueue


def memcpy_pages(setup: Setup, to_page: bool, streams: int = 1, handoff: bool = False) -> Enqueue:
    """One cudaMemcpyAsync per page (a contiguous GPU buffer <-> the pages at their offsets), the
    copies alternating between `streams` side streams: what the staged path's copies cost alone.
    `handoff`: with the staged path's events around each copy (the side stream waits for one
    recorded on the caller's stream, then records one), without its packs."""
    runtime = cudart.runtime()
    sides = [torch.cuda.Stream() for _ in range(streams)]
    with torch.cuda.device(setup.flat.device):
        events = [runtime.event_create() for _ in range(2)]
    device = setup.flat.data_ptr()
    host = setup.buffer.data_ptr()
    pairs = [(device + i * setup.page_bytes, host + offset) for i, offset in enumerate(setup.offsets)]

    def enqueue() -> int:
        current = torch.cuda.current_stream()
        handles = []
        for side in sides:
            side.wait_stream(current)
            handles.append(side.cuda_stream)
        for index, (gpu, page) in enumerate(pairs):
            dst, src = (page, gpu) if to_page else (gpu, page)
            handle = handles[index % streams]
            if handoff:
                runtime.event_record(events[0], current.cuda_stream)
                runtime.stream_wait_event(handle, events[0])
            runtime.memcpy_async(dst, src, setup.page_bytes, handle)
            if handoff:
                runtime.event_record(events[1], handle)
        for side in sides:
            current.wait_stream(side)
        return setup.bytes

    return enqueue


def per_block_torch(setup: Setup, to_page: bool) -> Enqueue:
    """One torch copy_ per segment, through tensor views made once."""
    copies = copy_engine.plan_copies(setup.spec, setup.plan(to_page=to_page), to_page=to_page, shape="1d")
    segment = int(copies.sizes.min())
    as_tensor = _address_views(setup, segment)
    pairs = [
        (as_tensor(d), as_tensor(s)) for d, s in zip(copies.dsts.tolist(), copies.srcs.tolist(), strict=True)
    ]

    def enqueue() -> int:
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        return setup.bytes

    return enqueue


def per_block_python(setup: Setup, to_page: bool) -> Enqueue:
    """The plain Python loop: index the cache and the buffer for every (block, layer, k|v) copy."""
    spec, page = setup.spec, setup.spec.page
    per_chunk, segment = spec.blocks_per_chunk, spec.block_size * page.token_bytes
    span = page.chunk_tokens * page.token_bytes
    caches = setup.caches

    def block_bytes(layer: int, kv: int, block: int) -> torch.Tensor:
        if setup.layout == "cross_layer":
            return caches[block, layer, kv].view(-1).view(torch.uint8)
        if setup.layout == "flashinfer":
            return caches[layer][block, kv].view(-1).view(torch.uint8)
        return caches[layer][kv, block].view(-1).view(torch.uint8)

    def enqueue() -> int:
        for page_index, offset in enumerate(setup.offsets):
            for layer in range(spec.num_layers):
                for kv in range(2):
                    for b in range(per_chunk):
                        block = setup.table[page_index * per_chunk + b]
                        at = offset + (2 * layer + kv) * span + b * segment
                        host = setup.buffer[at : at + segment]
                        if to_page:
                            host.copy_(block_bytes(layer, kv, block), non_blocking=True)
                        else:
                            block_bytes(layer, kv, block).copy_(host, non_blocking=True)
        return setup.bytes

    return enqueue


def per_block_cuda(setup: Setup, to_page: bool) -> Enqueue:
    """One cudaMemcpyAsync per segment (what swap_blocks does in C++), from the tightest Python
    loop: the copy list made beforehand, libcudart's function called through ctypes with its
    argument types declared, statuses checked after the loop."""
    copies = copy_engine.plan_copies(setup.spec, setup.plan(to_page=to_page), to_page=to_page, shape="1d")
    runtime = cudart.runtime()
    memcpy = runtime.memcpy_async_unchecked  # no per-call status check
    rows = list(zip(copies.dsts.tolist(), copies.srcs.tolist(), copies.sizes.tolist(), strict=True))

    def enqueue() -> int:
        stream = torch.cuda.current_stream().cuda_stream
        failed = 0
        for dst, src, size in rows:
            failed |= memcpy(dst, src, size, 4, stream)  # 4: cudaMemcpyDefault
        if failed:
            raise RuntimeError("cudaMemcpyAsync failed in the per-block loop")
        return setup.bytes

    return enqueue


def staging(setup: Setup, to_page: bool) -> Enqueue:
    """torch index_select into a GPU staging buffer, then one copy (scatter: the reverse)."""
    packed = torch.empty(setup.bytes, dtype=torch.uint8, device="cuda")
    plan = setup.plan(to_page=to_page, buffer=packed)

    def enqueue() -> int:
        if to_page:
            reference.gather_plan(plan)
            setup.buffer.copy_(packed, non_blocking=True)
        else:
            packed.copy_(setup.buffer, non_blocking=True)
            reference.scatter_plan(plan)
        return setup.bytes

    return enqueue


def kernel(
    setup: Setup, to_page: bool, programs: int | None, tuning: Any = None, second: bool = False
) -> Enqueue:
    plan = setup.plan(to_page=to_page, second=second)
    tuning = tuning or triton_copy.DEFAULT_TUNING

    def enqueue() -> int:
        triton_copy.launch(setup.spec, plan, to_page=to_page, max_programs=programs, tuning=tuning)
        return setup.bytes

    return enqueue


def device_pack(setup: Setup, to_page: bool, programs: int) -> Enqueue:
    """The staged path's GPU half alone: the kernel between the cache and a device buffer (the
    pages packed or unpacked device to device), to time a pack burst."""
    plan = setup.plan(to_page=to_page, buffer=setup.flat2)

    def enqueue() -> int:
        triton_copy.launch(setup.spec, plan, to_page=to_page, max_programs=programs)
        return setup.bytes

    return enqueue


def copy_engines(setup: Setup, to_page: bool, shape: str | None = None, second: bool = False) -> Enqueue:
    plan = setup.plan(to_page=to_page, second=second)

    def enqueue() -> int:
        copy_engine.launch(setup.spec, plan, to_page=to_page, shape=shape)
        return setup.bytes

    return enqueue


def staged_path(
    setup: Setup,
    to_page: bool,
    programs: int | None = None,
    staging_bytes: int | None = None,
    overlap: bool = staged.OVERLAP,
    second: bool = False,
    copy_streams: int = staged.COPY_STREAMS,
) -> Enqueue:
    """The staged path (`kvstore_kernels.staged`) with its knobs, the plan prepared; None: the default."""
    plan = setup.plan(to_page=to_page, second=second)
    size = staging_bytes or staged.DEFAULT_STAGING_BYTES

    def enqueue() -> int:
        staged.launch(
            setup.spec,
            plan,
            to_page=to_page,
            max_programs=programs,
            staging_bytes=size,
            overlap=overlap,
            copy_streams=copy_streams,
        )
        return setup.bytes

    return enqueue


def _address_views(setup: Setup, size: int) -> Callable[[int], torch.Tensor]:
    """A `size`-byte uint8 view at an address inside the cache or a pinned buffer."""
    bases = [setup.buffer, setup.buffer2, setup.flat]
    caches = [setup.caches] if isinstance(setup.caches, torch.Tensor) else setup.caches
    bases += [c.view(-1).view(torch.uint8) for c in caches]
    spans = sorted((b.data_ptr(), b) for b in bases)
    starts = [s for s, _ in spans]

    def view(address: int) -> torch.Tensor:
        index = int(np.searchsorted(starts, address, side="right")) - 1
        start, base = spans[index]
        return base[address - start : address - start + size]

    return view


# -- timing ---------------------------------------------------------------------------------------


def timed(enqueue: Enqueue, reps: int = 5, warmup: int = 1) -> dict[str, Any]:
    """Median wall time of one whole transfer (issue + run), its GB/s, and the host issue time."""
    for _ in range(warmup):
        enqueue()
    torch.cuda.synchronize()
    walls, issues, moved = [], [], 0
    for _ in range(reps):
        start = time.perf_counter()
        moved = enqueue()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
        issues.append(issued - start)
    wall = statistics.median(walls)
    return {
        "ms": wall * 1e3,
        "gbps": moved / wall / 1e9,
        "issue_ms": statistics.median(issues) * 1e3,
        "spread": (max(walls) - min(walls)) / wall,
        "walls_ms": [round(w * 1e3, 3) for w in walls],
    }


def timed_pair(first: Enqueue, second: Enqueue, reps: int = 5) -> dict[str, Any]:
    """Both transfers at once on two streams: total bytes over the wall time."""
    return timed(both_ways(first, second), reps)


def both_ways(first: Enqueue, second: Enqueue) -> Enqueue:
    """`first` and `second` on two side streams, after the current stream's work and before its next."""
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def both() -> int:
        moved = 0
        for stream, enqueue in zip(streams, (first, second), strict=True):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                moved += enqueue()
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
        return moved

    return both


def timed_against(enqueue: Enqueue, baseline: Enqueue, reps: int = 7, warmup: int = 1) -> dict[str, Any]:
    """`baseline` and `enqueue` in turn, each timed alone (issue + run, synchronised): the median of
    the per-round ratios of their rates (baseline wall / wall). Slow stretches of the link (seen on
    the H100: one memcpy's seven walls wandering from 19.5 to 22.4 ms) then hit both alike, where
    two medians taken seconds apart can differ by 10%."""
    for _ in range(warmup):
        baseline()
        enqueue()
    torch.cuda.synchronize()
    walls: dict[str, list[float]] = {"baseline": [], "variant": []}
    for _ in range(reps):
        for key, function in (("baseline", baseline), ("variant", enqueue)):
            start = time.perf_counter()
            function()
            torch.cuda.synchronize()
            walls[key].append(time.perf_counter() - start)
    ratios = [b / v for b, v in zip(walls["baseline"], walls["variant"], strict=True)]
    return {
        "ratio": statistics.median(ratios),
        "ratios": [round(r, 4) for r in ratios],
        "ms": statistics.median(walls["variant"]) * 1e3,
        "baseline_ms": statistics.median(walls["baseline"]) * 1e3,
    }


def verify(setup: Setup, to_page: bool, enqueue: Enqueue) -> bool:
    """One transfer, checked against the torch reference (gather: the page bytes; scatter: the blocks
    read back by the reference)."""
    pages = torch.empty(setup.bytes, dtype=torch.uint8, device="cuda")
    check = setup.plan(to_page=True, buffer=pages)
    if to_page:
        setup.buffer.fill_(0xA5)
    else:  # bytes the cache does not hold yet
        setup.buffer.copy_(torch.randint(0, 256, (setup.bytes,), dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    enqueue()
    reference.gather_plan(check)
    torch.cuda.synchronize()
    return bool(torch.equal(pages, setup.buffer.to("cuda")))


# -- model geometries, moved by the public client against a real daemon ---------------------------

DEEPSEEK_V3_LAYERS, DEEPSEEK_V3_LATENT, MLA_BLOCK = 61, 576, 64  # 512 compressed KV + 64 rope
GPT_OSS_LAYERS, GPT_OSS_WINDOW = 36, 128  # gpt-oss-120b: layers 0, 2, ... slide, 1, 3, ... attend to all
SLAB_BYTES = 256 << 20


def deepseek_v3_spec(dtype: str) -> KVSpec:
    """DeepSeek-V3's MLA cache as vLLM's MLA backends hold it: one 576-wide latent per token."""
    return KVSpec(
        model="deepseek-v3",
        num_layers=DEEPSEEK_V3_LAYERS,
        num_kv_heads=1,
        head_dim=DEEPSEEK_V3_LATENT,
        dtype=dtype,
        block_size=MLA_BLOCK,
        layout="mla",
        chunk_tokens=CHUNK_TOKENS,
    )


def gpt_oss_spec(sliding: bool) -> KVSpec:
    """One of gpt-oss-120b's two KV-cache groups (its own namespace, as the vLLM connector keys it):
    the 18 sliding-window layers or the 18 full-attention ones."""
    return KVSpec(
        model="gpt-oss-120b",
        num_layers=GPT_OSS_LAYERS // 2,
        num_kv_heads=8,
        head_dim=64,
        dtype="bfloat16",
        block_size=16,
        layout="flash_attn",
        chunk_tokens=CHUNK_TOKENS,
        layer_ids=tuple(range(0 if sliding else 1, GPT_OSS_LAYERS, 2)),
    )


def window_chunks(window: int, chunk_tokens: int) -> int:
    """Chunks before a resume point that a sliding layer's next token attends to (w - 1 tokens)."""
    return -(-(window - 1) // chunk_tokens)


def daemon_config(page_bytes: int, pages: int) -> dict[str, Any]:
    """A daemon whose CPU tier holds `pages` pages of `page_bytes`, and one slab to spare."""
    per_slab = SLAB_BYTES // (-(-page_bytes // 4096) * 4096)
    slabs = -(-pages // per_slab) + 1
    return {
        "chunk_tokens": CHUNK_TOKENS,
        "tiers": {"cpu": {"bytes": slabs * SLAB_BYTES, "slab_bytes": SLAB_BYTES}},
    }


def wait_reserved(client: Any, timeout_s: float = 120.0) -> None:
    """Until the daemon has reserved its whole arena. It serves once the first slab is reserved and
    reserves the rest behind; a Reserve that needs the rest before then is refused
    (RESOURCE_EXHAUSTED, seen on the H100 host with 3 slabs of 4 still pending)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if stats["counters"]["arena_reserved_bytes"] >= stats["tiers"]["cpu"]["bytes_capacity"]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the daemon's arena is still not reserved after {timeout_s} s")
        time.sleep(0.01)


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run through the reference path


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class ModelCache:
    """A KV cache of `tokens` in `spec`'s layout, random bytes, on a random block table; `target`,
    the same shape poisoned (0xA5), to load into."""

    def __init__(self, spec: KVSpec, tokens: int, seed: int) -> None:
        self.spec = spec
        self.num_chunks = tokens // spec.page.chunk_tokens
        self.num_blocks = tokens // spec.block_size
        shape = {
            "mla": (self.num_blocks, spec.block_size, spec.head_dim),
            "flash_attn": (2, self.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim),
        }[spec.layout]
        byte_shape = (*shape[:-1], shape[-1] * spec.page.itemsize)
        dtype = getattr(torch, spec.dtype)
        gen = torch.Generator(device=device()).manual_seed(seed)
        self.source = [
            torch.randint(0, 256, byte_shape, dtype=torch.uint8, device=device(), generator=gen).view(dtype)
            for _ in range(spec.num_layers)
        ]
        self.target = [torch.full(byte_shape, 0xA5, dtype=torch.uint8, device=device()).view(dtype)
                       for _ in range(spec.num_layers)]  # fmt: skip
        self.table = np.random.default_rng(seed).permutation(self.num_blocks).tolist()

    def blocks_of(self, first_chunk: int) -> list[int]:
        """The block table of chunks `first_chunk..` (a load of those chunks alone)."""
        return self.table[first_chunk * self.spec.blocks_per_chunk :]

    def poison(self) -> None:
        for layer in self.target:
            layer.view(torch.uint8).fill_(0xA5)

    def loaded_right(self, first_chunk: int) -> bool:
        """Whether `target` holds `source`'s bytes in the blocks of chunks `first_chunk..` and the
        poison everywhere else."""
        loaded = torch.tensor(self.blocks_of(first_chunk), device=device())
        axis = 1 if self.spec.layout == "flash_attn" else 0
        for got, want in zip(self.target, self.source, strict=True):
            expected = torch.full_like(want.view(torch.uint8), 0xA5)
            expected.index_copy_(axis, loaded, want.view(torch.uint8).index_select(axis, loaded))
            if not torch.equal(got.view(torch.uint8), expected):
                return False
        return True


class HostCopy:
    """The baseline: one copy of `size` bytes between a contiguous device tensor and pinned host
    memory (anonymous shared memory registered with CUDA, as the client's arena); on CPU, a
    memory copy."""

    def __init__(self, size: int) -> None:
        self.pinned = PinnedBuffer(size) if torch.cuda.is_available() else None
        self.host = self.pinned.tensor if self.pinned else torch.empty(size, dtype=torch.uint8)
        self.device = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device())

    def run(self, size: int, to_host: bool) -> Callable[[], None]:
        host, dev = self.host[:size], self.device[:size]

        def copy() -> None:
            (host.copy_(dev, non_blocking=True) if to_host else dev.copy_(host, non_blocking=True))

        return copy

    def release(self) -> None:
        if self.pinned is not None:
            synchronize()
            self.pinned.unregister()


def walls_in_turn(
    runs: dict[str, Callable[[], Any]], reps: int, before: dict[str, Callable[[], Any]] | None = None
) -> dict[str, list[float]]:
    """Each run's wall seconds (synchronised), the runs in turn in each of `reps` rounds after one
    untimed round; `before[name]`, if given, runs untimed ahead of each `name` (a Clear)."""
    before = before or {}
    walls: dict[str, list[float]] = {name: [] for name in runs}
    for attempt in range(reps + 1):
        for name, run in runs.items():
            if name in before:
                before[name]()
            synchronize()
            start = time.perf_counter()
            run()
            synchronize()
            if attempt:
                walls[name].append(time.perf_counter() - start)
    return walls


def against(walls: list[float], baseline: list[float], moved: int) -> dict[str, Any]:
    """A row's figures: median ms and GB/s, and the median per-round ratio to the baseline's rate
    (baseline wall / wall; the two timed in turn)."""
    wall, base = statistics.median(walls), statistics.median(baseline)
    return {
        "bytes": moved,
        "ms": wall * 1e3,
        "gbps": moved / wall / 1e9,
        "memcpy_ms": base * 1e3,
        "memcpy_gbps": moved / base / 1e9,
        "x_memcpy": statistics.median(b / w for b, w in zip(baseline, walls, strict=True)),
        "walls_ms": [round(w * 1e3, 3) for w in walls],
        "memcpy_walls_ms": [round(w * 1e3, 3) for w in baseline],
    }


class StepClock:
    """Host timestamps of the steps of one public store or load (`installed()` wraps the local
    channel's calls, the transfer calls and CUDA event waits of whichever tree is imported), so
    that the client's time beyond the copy can be split: the round trips, the host work before
    the copy starts, the wait, the closing call."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        self.marks.append((name, time.perf_counter()))

    def take(self) -> list[tuple[str, float]]:
        """The marks since the last take, in ms from the first."""
        marks, self.marks = self.marks, []
        start = marks[0][1] if marks else 0.0
        return [(name, round((at - start) * 1e3, 4)) for name, at in marks]

    @contextlib.contextmanager
    def installed(self) -> Any:
        from kvstore.channel import LocalChannel

        clock, patched = self, []

        def wrap(owner: Any, name: str, before: str, after: str) -> None:
            original = getattr(owner, name)

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                label = lambda text: text.format(method=args[1] if len(args) > 1 else "")  # noqa: E731
                clock.mark(label(before))
                try:
                    return original(*args, **kwargs)
                finally:
                    clock.mark(label(after))

            patched.append((owner, name, original))
            setattr(owner, name, wrapper)

        original_call = LocalChannel.call

        def call(channel: Any, method: str, request: Any, meanwhile: Any = None) -> Any:
            def timed_meanwhile() -> Any:
                clock.mark(f"{method} meanwhile")
                try:
                    return meanwhile()
                finally:
                    clock.mark(f"{method} meanwhile done")

            clock.mark(f"{method} sent")
            try:
                return original_call(channel, method, request, timed_meanwhile if meanwhile else None)
            finally:
                clock.mark(f"{method} reply")

        patched.append((LocalChannel, "call", original_call))
        LocalChannel.call = call  # type: ignore[method-assign]
        wrap(LocalChannel, "send_frame", "{method} send", "{method} sent, not waited")
        wrap(kvstore_kernels, "gather", "gather call", "gather issued")
        wrap(kvstore_kernels, "scatter", "scatter call", "scatter issued")
        prepared = getattr(kvstore_kernels, "Prepared", None)
        if prepared is not None:
            wrap(prepared, "run", "prepared run", "prepared issued")
        wrap(torch.cuda.Event, "synchronize", "wait for the copy", "copy done")
        try:
            yield self
        finally:
            for owner, name, original in reversed(patched):
                setattr(owner, name, original)


def step_summary(rounds: list[list[tuple[str, float]]]) -> list[dict[str, Any]]:
    """Per step (the interval from one mark to the next), the median ms over the rounds whose marks
    carry the same names as the first round's."""
    if not rounds:
        return []
    names = [name for name, _ in rounds[0]]
    same = [marks for marks in rounds if [name for name, _ in marks] == names]
    return [
        {
            "from": names[i],
            "to": names[i + 1],
            "ms": round(statistics.median(m[i + 1][1] - m[i][1] for m in same), 4),
            "rounds": len(same),
        }
        for i in range(len(names) - 1)
    ]
