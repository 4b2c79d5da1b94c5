"""One fresh worker of `bench/connect.py`: connect, then (`--load-first`) a load of a prompt another
worker stored, a store and a load of its own prompt, then (`--steady`) the same for another prompt
once every slab is registered; prints one JSON line.

    python bench/connect_worker.py ADDRESS --tokens 8192 --seed 0 [--load-first S] [--steady]
        [--second-connect]
    python bench/connect_worker.py ADDRESS --fill PROMPTS [--pause S] [--tokens 8192]

`--fill N`: from connect on (or after `--pause` seconds, an engine loading its weights), stores N
prompts back to back (enough to fill the arena), each timed with its wait for slabs; then, once
every slab is registered, loads each of them into a poisoned cache and compares every byte, and
times stores of further prompts (the steady rate); then connects a second client in the process
(`second_*`: whether it shares the mapping and registration); last, `arena_mapping`: the pages
of its mapping of the arena by kind (smaps: huge ones PMD-mapped or hugetlbfs), as pinned.

CUDA is initialised before the clock starts, as an engine's worker is, and the transfer kernels
are compiled (Triton, on a pinned buffer of the worker's own, timed as `kernels_s`), as an
engine's first forward would have them compiled: the first store after connect shows what the
arena costs. The KV cache has the 8B geometry (32 layers, 8 KV heads, head dim 128, bf16,
16-token blocks), on the GPU where there is one (on the CPU otherwise: a smoke run). Every load
goes into a poisoned cache and is compared byte for byte with what was stored.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.connect_pages import mapping_pages  # noqa: E402
from kvstore_client import KVSpec, KVStoreClient  # noqa: E402
from kvstore_client.bounce import SLOT_BYTES  # noqa: E402

BLOCK = 16
SPEC = KVSpec(
    model="connect-bench",
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
    block_size=BLOCK,
    layout="flash_attn",
)
REGISTER_TIMEOUT_S = 300.0


def device() -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.init()
        torch.empty(1, device="cuda")  # the CUDA context, before the clock
        return torch.device("cuda")
    return torch.device("cpu")


def cache(num_blocks: int, on: torch.device, seed: int | None) -> list[torch.Tensor]:
    shape = (2, num_blocks, BLOCK, SPEC.num_kv_heads, SPEC.head_dim)
    if seed is None:  # poisoned
        return [torch.full(shape, -7.0, dtype=torch.bfloat16, device=on) for _ in range(SPEC.num_layers)]
    gen = torch.Generator(device=on).manual_seed(seed)
    return [
        torch.randn(shape, generator=gen, device=on, dtype=torch.bfloat16) for _ in range(SPEC.num_layers)
    ]


def warm_kernels(on: torch.device, num_tokens: int) -> float:
    """Seconds to compile and run the gather and scatter kernels once, for a prompt of `num_tokens`
    (the bench's daemon has 256-token chunks), on a pinned buffer of this process's own; 0 without
    a GPU."""
    if on.type != "cuda":
        return 0.0
    import kvstore_kernels

    spec = SPEC.with_chunk_tokens(256)
    chunks = num_tokens // 256
    blocks = chunks * 256 // BLOCK
    source, target = cache(blocks, on, 1), cache(blocks, on, None)
    page = spec.page.page_bytes
    buffer = torch.empty(chunks * page, dtype=torch.uint8, pin_memory=True)
    ids, offsets = torch.randperm(blocks), [i * page for i in range(chunks)]
    started = time.perf_counter()
    kvstore_kernels.gather(spec, source, ids, list(range(chunks)), buffer, offsets)
    kvstore_kernels.scatter(spec, target, ids, list(range(chunks)), buffer, offsets)
    # The bounce ring's batches (a slot's worth of pages, and one page), as an engine's first
    # stores into a warming arena compile them: the fill then times the ring, not Triton.
    per_slot = max(1, SLOT_BYTES // page)
    for batch in {min(per_slot, chunks), 1}:
        kvstore_kernels.gather(spec, source, ids, list(range(batch)), buffer, offsets[:batch])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    if not all(torch.equal(t, s) for t, s in zip(target, source, strict=True)):
        raise AssertionError("the kernels' warm-up moved wrong bytes")
    return seconds


def synchronize(on: torch.device) -> None:
    if on.type == "cuda":
        torch.cuda.synchronize()


class Prompt:
    """A prompt's tokens and its KV in a cache of its own blocks (deterministic in `seed`)."""

    def __init__(self, num_tokens: int, seed: int, on: torch.device) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, 128_000, (num_tokens,), generator=gen).tolist()
        num_blocks = num_tokens // BLOCK
        self.source = cache(num_blocks, on, seed)
        self.blocks = torch.randperm(num_blocks, generator=gen)
        self.on = on


def timed(client: KVStoreClient, on: torch.device, move: Any) -> dict[str, Any]:
    """Runs `move()` (a store or a load, returning its chunks) to completion: its time, rate,
    wait for slabs to be registered and transfers that took the unpinned path."""
    synchronize(on)
    before = client._mapped.stats()
    started = time.perf_counter()
    chunks = move()
    synchronize(on)
    seconds = time.perf_counter() - started
    after = client._mapped.stats()
    moved = chunks * client.page_bytes
    return {
        "chunks": chunks,
        "s": seconds,
        "gbps": moved / seconds / 1e9 if seconds and moved else 0.0,
        "waited_s": after.get("wait_s", 0.0) - before.get("wait_s", 0.0),
        "unpinned": after.get("transfers_unpinned", 0) - before.get("transfers_unpinned", 0),
        "bounced": after.get("transfers_bounced", 0) - before.get("transfers_bounced", 0),
    }


def store(client: KVStoreClient, prompt: Prompt) -> dict[str, Any]:
    return timed(client, prompt.on, lambda: client.store(prompt.tokens, prompt.source, prompt.blocks))


def load(client: KVStoreClient, prompt: Prompt) -> dict[str, Any]:
    """Loads the prompt into a poisoned cache. `chunks`: those loaded (fewer where other workers'
    stores evicted the rest); `bytes_exact`: each loaded block equals what was stored, and each
    block past them is still poisoned."""
    target = cache(len(prompt.blocks), prompt.on, None)
    result = timed(
        client,
        prompt.on,
        lambda: client.load(prompt.tokens, target, prompt.blocks) // client.spec.chunk_tokens,
    )
    hit = result["chunks"] * client.spec.chunk_tokens // BLOCK
    loaded, rest = prompt.blocks[:hit], prompt.blocks[hit:]
    result["bytes_exact"] = all(
        torch.equal(t[:, loaded].view(torch.uint8), s[:, loaded].view(torch.uint8))
        and bool((t[:, rest] == -7.0).all())
        for t, s in zip(target, prompt.source, strict=True)
    )
    return result


def registered_all(client: KVStoreClient, since: float) -> tuple[float | None, dict[str, Any]]:
    """Seconds from `since` until no slab is pending (None: not within the timeout), and the stats."""
    deadline = time.perf_counter() + REGISTER_TIMEOUT_S
    while True:
        stats = client._mapped.stats()
        if not stats.get("slabs_pending", 0):
            return time.perf_counter() - since, stats
        if time.perf_counter() > deadline:
            return None, stats
        time.sleep(0.01)


class PromptSet:
    """`count` prompts of distinct tokens whose KV cycles through `sources` caches (GPU memory for
    a whole arena's prompts would not fit): prompt i holds cache i % sources."""

    def __init__(self, num_tokens: int, sources: int, seed: int, on: torch.device) -> None:
        self.prompts = [Prompt(num_tokens, seed + i, on) for i in range(sources)]
        self.num_tokens, self.seed, self.on = num_tokens, seed, on

    def tokens(self, i: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return torch.randint(0, 128_000, (self.num_tokens,), generator=gen).tolist()

    def store(self, client: KVStoreClient, i: int) -> dict[str, Any]:
        prompt = self.prompts[i % len(self.prompts)]
        tokens = self.tokens(i)
        return timed(client, self.on, lambda: client.store(tokens, prompt.source, prompt.blocks))

    def load(self, client: KVStoreClient, i: int) -> dict[str, Any]:
        prompt = self.prompts[i % len(self.prompts)]
        view = Prompt.__new__(Prompt)
        view.tokens, view.source, view.blocks, view.on = self.tokens(i), prompt.source, prompt.blocks, self.on
        return load(client, view)


def fill(
    client: KVStoreClient, on: torch.device, args: argparse.Namespace, started: float, prompts: PromptSet
) -> dict[str, Any]:
    """The fill (its prompts made before connect), the byte check, the steady rate and a second
    client in the process. `gap_s`: from connect to the first store."""
    if args.pause:
        time.sleep(max(0.0, args.pause - (time.perf_counter() - started)))
    result: dict[str, Any] = {"pause_s": args.pause, "at_start": client._mapped.stats()}
    fill_started = time.perf_counter()
    result["gap_s"] = fill_started - started
    stores = [prompts.store(client, i) for i in range(args.fill)]
    result["fill_s"] = time.perf_counter() - fill_started
    result["stores"] = stores
    all_s, stats = registered_all(client, started)
    result.update(register_all_s=all_s, at_end=stats)
    loads = [prompts.load(client, i) for i in range(args.fill)]
    result["loads"] = [{k: v for k, v in one.items() if k != "waited_s"} for one in loads]
    result["bytes_exact"] = all(one["bytes_exact"] for one in loads)
    result["loaded_chunks"] = sum(one["chunks"] for one in loads)
    steady = [prompts.store(client, args.fill + i) for i in range(5)]
    result["steady_stores"] = steady
    check = prompts.load(client, args.fill + 4)
    result["bytes_exact"] = result["bytes_exact"] and check["bytes_exact"] and check["chunks"] > 0
    second = KVStoreClient.connect(args.address, SPEC)
    try:
        shares = second.arena is not None and client.arena is not None
        result["second_shares_mapping"] = shares and second.arena.data_ptr() == client.arena.data_ptr()
        result["second_registrar_shared"] = second._mapped.registrar is client._mapped.registrar
        again = second.load(
            prompts.tokens(args.fill + 4),
            cache(len(prompts.prompts[0].blocks), on, None),
            prompts.prompts[(args.fill + 4) % 4].blocks,
        )
        result["second_loaded_tokens"] = again
        result["second_stats"] = second._mapped.stats()
    finally:
        second.close()
    if client.arena is not None:  # last: reading smaps walks the whole mapping's page tables
        result["arena_mapping"] = mapping_pages(client.arena.data_ptr())
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0, help="this worker's prompt")
    parser.add_argument("--load-first", type=int, default=None, help="first load the prompt of this seed")
    parser.add_argument(
        "--steady", action="store_true", help="then a store and load with every slab registered"
    )
    parser.add_argument("--second-connect", action="store_true", help="then connect a second client here")
    parser.add_argument("--fill", type=int, default=0, help="store this many prompts back to back")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between connect and the fill")
    parser.add_argument(
        "--no-bounce", action="store_true", help="stores wait for their slabs' registration (no bounce ring)"
    )
    args = parser.parse_args()
    on = device()
    kernels_s = warm_kernels(on, args.tokens)
    prompts = PromptSet(args.tokens, 4, 7000 + args.seed, on) if args.fill else None
    synchronize(on)
    started = time.perf_counter()
    client = KVStoreClient.connect(args.address, SPEC)
    connect_s = time.perf_counter() - started
    if args.no_bounce:
        client._mapped.bounce = False
    at_connect = client._mapped.stats()
    result: dict[str, Any] = {
        "connect_s": connect_s,
        "kernels_s": kernels_s,
        "pinning": client._registered,
        "slabs": at_connect.get("slabs", 0),
        "slabs_registered_at_connect": at_connect.get("slabs_registered", 0),
    }
    if prompts is not None:
        result.update(fill(client, on, args, started, prompts))
        client.close()
        print(json.dumps(result))
        return
    if args.load_first is not None:  # a prompt another worker stored: the first transfer is a load
        result["first_load"] = load(client, Prompt(args.tokens, args.load_first, on))
    own = Prompt(args.tokens, args.seed, on)
    result["store"] = store(client, own)
    result["load"] = load(client, own)
    all_s, stats = registered_all(client, started)
    result.update(register_all_s=all_s, slabs_registered=stats.get("slabs_registered", 0))
    result["slabs_failed"] = stats.get("slabs_failed", 0)
    if args.steady:
        steady = Prompt(args.tokens, args.seed + 1000, on)
        result["steady_store"] = store(client, steady)
        result["steady_load"] = load(client, steady)
    if args.second_connect:
        started = time.perf_counter()
        second = KVStoreClient.connect(args.address, SPEC)
        result["second_connect_s"] = time.perf_counter() - started
        all_s, stats = registered_all(second, started)
        result["second_register_all_s"] = all_s
        result["second_slabs_failed"] = stats.get("slabs_failed", 0)
        second.close()
    client.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
