"""A worker process for the integrity tests: stores and loads prompts through one client object
until told to stop, checking every loaded byte, and reports what it saw as JSON.

    python -m tests.integrity_worker ADDRESS STOP_FILE REPORT_FILE --seed N [--prompts P] [--gpu]

Every prompt's KV is a function of the prompt alone (`cache_for`), so any worker can check a
page another worker stored. A third of the calls use the prompt less its last 5 tokens, stored
and loaded with its tail page (`tail=True`). A load goes into a poisoned cache: the loaded tokens' blocks must
equal the prompt's KV and every other block must still hold the poison. Any exception out of a
public call is recorded, with its traceback, and the loop goes on.

With `--gpu` the caches are on the GPU and stores ask for the daemon's GPU tier. With `--bounce`
the arena's slabs never register (a registrar that is refused each one), so every store goes
through the client's bounce ring and every load takes the unpinned path, arena after arena.

Report: {"ops", "loads", "hit_tokens", "stored", "bounced" (stores through the bounce ring on
the last arena), "wrong": [...], "exceptions": [...],
"served": [wall-clock times of calls the daemon served, one per 50 ms at most]}. Each served
time is also appended to REPORT_FILE.served as it happens, one a line, for a test to wait on.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import traceback
from pathlib import Path

import torch

from kvstore_client import KVSpec, KVStoreClient

CHUNK = 16
CHUNKS = 4  # per prompt
BLOCKS = CHUNKS  # one 16-token block per chunk
POISON = -3.0
SPEC = KVSpec(
    model="integrity",
    num_layers=2,
    num_kv_heads=2,
    head_dim=32,
    dtype=torch.float16,
    block_size=16,
    chunk_tokens=CHUNK,
)  # 8 KiB pages


TAIL_TOKENS = CHUNKS * CHUNK - 5  # 3 whole chunks and a tail of 11 tokens


def whole_blocks(tokens: int) -> int:
    """`tokens` rounded up to whole blocks: a tail's block counts whole."""
    return -(-tokens // 16) * 16


def prompt(i: int) -> list[int]:
    return [i * 100_000 + t for t in range(CHUNKS * CHUNK)]


def cache_for(i: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1_000 + i)
    return [torch.randn(2, BLOCKS, 16, 2, 32, generator=gen).half() for _ in range(SPEC.num_layers)]


def wrong_blocks(
    target: list[torch.Tensor], want: list[torch.Tensor], loaded_tokens: int, moved_tokens: int | None = None
) -> list[str]:
    """What differs: blocks reported loaded that are not the prompt's, or blocks the load did not
    move that lost the poison. Blocks it moved but did not report valid (`moved_tokens`: the
    handle's `tokens`; a lease that lapsed, a daemon that died before the Release) may hold
    anything: the engine computes them again."""
    loaded = loaded_tokens // 16
    untouched = (loaded_tokens if moved_tokens is None else moved_tokens) // 16
    poison = torch.full_like(want[0][:, 0], POISON)
    problems = []
    for layer, (got, ref) in enumerate(zip(target, want, strict=True)):
        for block in range(BLOCKS):
            if loaded <= block < untouched:
                continue
            expected = ref[:, block] if block < loaded else poison
            if not torch.equal(got[:, block].view(torch.int16), expected.view(torch.int16)):
                problems.append(f"layer {layer} block {block} ({'loaded' if block < loaded else 'poison'})")
    return problems


class RefusingRegistrar:
    """A registrar that is refused every slab: they stay unregistered (`--bounce`)."""

    def register(self, address: int, size: int) -> None:
        raise OSError("refused: the stores go through the bounce ring")

    def unregister(self, address: int) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("stop_file", type=Path)
    parser.add_argument("report_file", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument(
        "--commit-parts", action="store_true", help="stores commit page by page as each is written"
    )
    parser.add_argument(
        "--gpu", action="store_true", help="caches on the GPU, stores into the daemon's GPU tier"
    )
    parser.add_argument("--bounce", action="store_true", help="every store through the bounce ring")
    args = parser.parse_args()
    if args.bounce:
        from kvstore_client.arena import MappedArena

        MappedArena.host_registrar = lambda self: RefusingRegistrar()  # type: ignore[method-assign]
    if args.commit_parts:  # parts of one page, the last part one page: every early Commit is taken
        from kvstore_client import stores

        stores.EARLY_COMMIT_PART_BYTES = stores.EARLY_COMMIT_TAIL_BYTES = 1
        stores.EARLY_COMMIT_MAX_PARTS = 1 << 20
    rng = random.Random(args.seed)
    caches = {i: cache_for(i) for i in range(args.prompts)}
    if args.gpu:
        caches = {i: [t.cuda() for t in cache] for i, cache in caches.items()}
    counts = {"ops": 0, "loads": 0, "hit_tokens": 0, "stored": 0}
    wrong: list[dict[str, object]] = []
    exceptions: list[str] = []
    served: list[float] = []

    served_file = open(args.report_file.with_name(args.report_file.name + ".served"), "a")  # noqa: SIM115

    def note_served() -> None:
        now = time.time()
        if not served or now - served[-1] >= 0.05:
            served.append(now)
            served_file.write(f"{now}\n")
            served_file.flush()

    client = KVStoreClient.connect(args.address, SPEC, timeout_s=5.0)
    client.store_to_gpu = args.gpu
    if args.bounce:
        client._mapped.bounce = True  # for CPU caches too
    print("connected", flush=True)
    blocks = torch.arange(BLOCKS)
    while not args.stop_file.exists():
        i = rng.randrange(args.prompts)
        counts["ops"] += 1
        tail = rng.random() < 0.3  # the prompt less its last 5 tokens, stored and loaded with its tail
        tokens = prompt(i)[: TAIL_TOKENS if tail else None]
        try:
            if rng.random() < 0.5:
                stored = client.store(tokens, caches[i], blocks, tail=tail)
                counts["stored"] += stored
                if stored:
                    note_served()
            else:
                target = [torch.full_like(t, POISON) for t in caches[i]]
                handle = client.load_async(tokens, target, blocks, tail=tail)
                loaded = handle.wait()
                counts["loads"] += 1
                counts["hit_tokens"] += loaded
                # A tail's page is its whole block, stored from the same cache: compare whole blocks.
                problems = wrong_blocks(target, caches[i], whole_blocks(loaded), whole_blocks(handle.tokens))
                if problems:
                    wrong.append({"prompt": i, "loaded": loaded, "problems": problems[:4]})
                if loaded:
                    note_served()
        except BaseException as exc:  # every exception out of a public call is a finding
            exceptions.append(f"{exc!r}\n{traceback.format_exc()}")
    counts["bounced"] = client._mapped.stats().get("transfers_bounced", 0)  # on the last arena
    client.close()
    served_file.close()
    report = {**counts, "wrong": wrong, "exceptions": exceptions, "served": served}
    args.report_file.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
