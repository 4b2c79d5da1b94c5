"""Prefill to decode on one host, today: the hand-over through the arena against a peer copy.

Issue 32's first step ("measure first"): how the host's GPUs are linked, and what handing a
prompt's KV from a producer on one GPU to a consumer on another costs through the CPU arena.

- Link: `nvidia-smi topo -m`, peer access between every pair (`torch.cuda.can_device_access_peer`),
  and the rate of one device-to-device copy of the prompt's bytes each way
  (`dst.copy_(src)` across devices: cudaMemcpyPeerAsync, over NVLink where there is one).
- Hand-over through the arena: a producer client with the KV cache on GPU `--producer` stores a
  prompt's pages (Llama-3.1-8B geometry: 128 KiB per token, flash_attn, blocks of 16), then a
  consumer client with its cache on GPU `--consumer` loads them: timed from the producer's call
  to the consumer's last byte (both synchronised), the namespace cleared before each round. Both
  clients live in one process (one arena mapping, as two workers on the host would have one
  each); two processes add the signal between them (tens of microseconds), not measured here.
- Baselines in the same run: the peer copy of the same bytes, and pinned memcpy device-to-host on
  the producer's GPU plus host-to-device on the consumer's (what the arena path moves at best).
- The copies a hand-over through a GPU-tier pool would make, by the kernels alone (no daemon):
  the producer's gather into a buffer on the consumer's GPU over peer access, then the
  consumer's local scatter; or a local gather, then the consumer's scatter over peer access.
- The hand-over through the GPU tier: the producer stores into the daemon's pool on its own GPU
  (`KVStoreClient.store_to_gpu`), the consumer loads from there over peer access; timed as the
  arena's.
- With lent blocks (`bench/handover_lent.py`): the consumer copies the producer's blocks: one copy,
  found by the prompt's keys, from the producer's ticket (the daemon answered during the copy),
  and pushed by the producer into blocks the consumer set aside (`bench/handover_push.py`).
- Every round's loaded bytes are compared with the producer's (column `ok`; `ok_device_copies`,
  `ok_pool`, `ok_lent`).

    python bench/handover.py                      # 8k and 32k tokens, GPUs 0 -> 1
    python bench/handover.py --dry-run            # CPU tensors, 512 tokens: that it runs and compares

Writes bench/results/handover.json (`--name`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvstore_kernels  # noqa: E402
from bench.common import print_table, running_daemon, write_results  # noqa: E402
from bench.handover_lent import LENT_ROWS, lent_rows  # noqa: E402
from bench.transfer_cases import daemon_config, make_spec, wait_reserved  # noqa: E402
from kvstore_client import KVStoreClient  # noqa: E402


def sync(*devices: torch.device) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def cache_on(spec: Any, tokens: int, device: torch.device, seed: int | None) -> list[torch.Tensor]:
    """A flash_attn cache of `tokens` on `device`: random bytes (seed), or the poison 0xA5 (None)."""
    shape = (2, tokens // spec.block_size, spec.block_size, spec.num_kv_heads, spec.head_dim * 2)
    if seed is None:
        return [
            torch.full(shape, 0xA5, dtype=torch.uint8, device=device).view(torch.bfloat16)
            for _ in range(spec.num_layers)
        ]
    gen = torch.Generator(device=device).manual_seed(seed)
    return [
        torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen).view(torch.bfloat16)
        for _ in range(spec.num_layers)
    ]


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(x.view(torch.uint8).cpu(), y.view(torch.uint8).cpu()) for x, y in zip(a, b, strict=True)
    )


def timed(run: Any, devices: tuple[torch.device, ...], reps: int, before: Any = None) -> list[float]:
    """Wall ms of `run` (synchronised), `reps` times after one untimed call; `before` untimed first."""
    walls = []
    for attempt in range(reps + 1):
        if before is not None:
            before()
        sync(*devices)
        start = time.perf_counter()
        run()
        sync(*devices)
        if attempt:
            walls.append((time.perf_counter() - start) * 1e3)
    return walls


def link(producer: torch.device, consumer: torch.device) -> dict[str, Any]:
    """How the GPUs are linked: nvidia-smi's matrix and peer access between every pair."""
    found: dict[str, Any] = {"devices": torch.cuda.device_count() if producer.type == "cuda" else 0}
    try:
        found["topo"] = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        found["topo"] = f"nvidia-smi topo -m: {exc}"
    count = found["devices"]
    found["peer_access"] = {
        f"{a}->{b}": torch.cuda.can_device_access_peer(a, b)
        for a in range(count)
        for b in range(count)
        if a != b
    }
    if count:
        found["names"] = [torch.cuda.get_device_name(i) for i in range(count)]
    return found


def run_tokens(tokens: int, producer: torch.device, consumer: torch.device, reps: int) -> dict[str, Any]:
    spec = make_spec("flash_attn")
    page_bytes = spec.page.page_bytes
    chunks = tokens // spec.chunk_tokens
    moved = chunks * page_bytes
    source = cache_on(spec, tokens, producer, seed=1)
    target = cache_on(spec, tokens, consumer, seed=None)
    table = list(range(tokens // spec.block_size))
    devices = (producer, consumer)
    row: dict[str, Any] = {"tokens": tokens, "bytes": moved}
    flat_p = torch.randint(0, 256, (moved,), dtype=torch.uint8, device=producer)
    flat_c = torch.empty(moved, dtype=torch.uint8, device=consumer)
    walls: dict[str, list[float]] = {}
    if producer.type == "cuda":
        walls["peer copy producer->consumer"] = timed(
            lambda: flat_c.copy_(flat_p, non_blocking=True), devices, reps
        )
        walls["peer copy consumer->producer"] = timed(
            lambda: flat_p.copy_(flat_c, non_blocking=True), devices, reps
        )
        host = torch.empty(moved, dtype=torch.uint8, pin_memory=True)  # cudaHostAlloc: every device's

        def through_host() -> None:
            host.copy_(flat_p, non_blocking=True)
            torch.cuda.synchronize(producer)
            flat_c.copy_(host, non_blocking=True)

        walls["memcpy d2h + h2d"] = timed(through_host, devices, reps)
        row["ok_device_copies"] = device_copies(spec, source, target, table, flat_p, flat_c, walls, reps)
    with (
        running_daemon(daemon_config(page_bytes, 2 * chunks)) as daemon,
        torch.cuda.device(producer) if producer.type == "cuda" else _nothing(),
        KVStoreClient.connect(daemon.address, spec) as producing,
    ):
        with torch.cuda.device(consumer) if consumer.type == "cuda" else _nothing():
            consuming = KVStoreClient.connect(daemon.address, spec)
        try:
            wait_reserved(producing)
            walls["hand-over through the arena"], row["ok"] = handed_over(
                producing, consuming, source, target, table, tokens, devices, reps
            )
        finally:
            consuming.close()
    if producer.type == "cuda":
        row["ok_pool"] = pool_handover(spec, source, target, table, chunks, tokens, devices, walls, reps)
        with running_daemon(daemon_config(page_bytes, 4)) as daemon:
            row["ok_lent"], row["lent_ms"] = lent_rows(daemon.address, spec, tokens, devices, reps, walls)
    row["ms"] = {name: statistics.median(values) for name, values in walls.items()}
    row["walls_ms"] = walls
    peer = row["ms"].get("peer copy producer->consumer")
    if peer:
        row["handover_x_peer_copy"] = peer / row["ms"]["hand-over through the arena"]
        row["x_peer_copy"] = {name: peer / ms for name, ms in row["ms"].items()}
        row["handover_x_host_copies"] = (
            row["ms"]["memcpy d2h + h2d"] / row["ms"]["hand-over through the arena"]
        )
    return row


POOL_ROW = "hand-over through the GPU tier (read over the link)"


def handed_over(
    producing: Any,
    consuming: Any,
    source: list[torch.Tensor],
    target: list[torch.Tensor],
    table: list[int],
    tokens: int,
    devices: tuple[torch.device, torch.device],
    reps: int,
) -> tuple[list[float], bool]:
    """The wall ms of `reps` hand-overs (the producer's store, then the consumer's load, each on
    its own device; the namespace cleared and the consumer's cache poisoned before each), and
    whether every round stored and loaded the whole prompt, the producer's bytes."""
    producer, consumer = devices
    source_r, target_r = producing.register_kv_caches(source), consuming.register_kv_caches(target)
    keys = producing.keys(list(range(tokens)))
    chunks = len(keys)
    results: list[tuple[int, int]] = []

    def hand_over() -> None:
        with torch.cuda.device(producer) if producer.type == "cuda" else _nothing():
            stored = producing.store(None, source_r, table, keys=keys)
        with torch.cuda.device(consumer) if consumer.type == "cuda" else _nothing():
            loaded = consuming.load(None, target_r, table, keys=keys)
        results.append((stored, loaded))

    def poison() -> None:
        producing.clear()
        for layer in target:
            layer.view(torch.uint8).fill_(0xA5)

    walls = timed(hand_over, devices, reps, before=poison)
    return walls, all(r == (chunks, tokens) for r in results) and same_bytes(target, source)


def pool_handover(
    spec: Any,
    source: list[torch.Tensor],
    target: list[torch.Tensor],
    table: list[int],
    chunks: int,
    tokens: int,
    devices: tuple[torch.device, torch.device],
    walls: dict[str, list[float]],
    reps: int,
) -> bool:
    """The hand-over through the GPU tier: a daemon with a pool on each of the two GPUs, the
    producer storing into the pool on its own GPU (`store_to_gpu`, device to device), the
    consumer loading from there over peer access. Timed as the arena's: from the producer's call
    to the consumer's last byte. Whether every round's pages were the producer's, and stayed out
    of the arena."""
    producer, consumer = devices
    page_bytes = spec.page.page_bytes
    pool_bytes = -(-(chunks * page_bytes + (64 << 20)) // (256 << 20)) * (256 << 20)
    config = daemon_config(page_bytes, 4)
    config["tiers"]["gpu"] = {
        "enabled": True,
        "devices": [producer.index, consumer.index],
        "bytes": pool_bytes,
        "slab_bytes": 256 << 20,
    }
    with running_daemon(config) as daemon:
        with torch.cuda.device(producer):
            producing = KVStoreClient.connect(daemon.address, spec)
        with torch.cuda.device(consumer):
            consuming = KVStoreClient.connect(daemon.address, spec)
        try:
            producing.store_to_gpu = True
            walls[POOL_ROW], ok = handed_over(
                producing, consuming, source, target, table, tokens, devices, reps
            )
            stats = consuming.stats()
            in_pool = stats["counters"].get("gpu_reserves_to_arena", 0) == 0
            return ok and in_pool and stats["counters"].get("gpu_copied_down_chunks", 0) == 0
        finally:
            consuming.close()
            producing.close()


DEVICE_ROWS = (
    "gather into the consumer's GPU (peer)",
    "scatter on the consumer's GPU (local)",
    "gather on the producer's GPU (local)",
    "scatter from the producer's GPU (peer)",
    "pool copies, written over the link",
    "pool copies, read over the link",
)


def device_copies(
    spec: Any,
    source: list[torch.Tensor],
    target: list[torch.Tensor],
    table: list[int],
    flat_p: torch.Tensor,
    flat_c: torch.Tensor,
    walls: dict[str, list[float]],
    reps: int,
) -> bool:
    """The copies of a hand-over through a GPU-tier pool, by `kvstore_kernels` alone (no daemon):
    the producer's gather into a buffer on the consumer's GPU (written over the link) and the
    consumer's scatter from it (local), or the producer's gather into its own GPU's buffer and the
    consumer's scatter from there (read over the link). Whether the pages written over the link
    and scattered locally are the producer's bytes."""
    producer, consumer = flat_p.device, flat_c.device
    devices = (producer, consumer)
    chunks = range(len(table) * spec.block_size // spec.chunk_tokens)
    offsets = [chunk * spec.page.page_bytes for chunk in chunks]
    source_r, target_r = kvstore_kernels.register(spec, source), kvstore_kernels.register(spec, target)

    def on(device: torch.device, run: Any) -> Any:
        def call() -> None:
            with torch.cuda.device(device):
                run()

        return call

    gather_peer = on(producer, lambda: kvstore_kernels.gather(spec, source_r, table, chunks, flat_c, offsets))
    scatter_local = on(
        consumer, lambda: kvstore_kernels.scatter(spec, target_r, table, chunks, flat_c, offsets)
    )
    gather_local = on(
        producer, lambda: kvstore_kernels.gather(spec, source_r, table, chunks, flat_p, offsets)
    )
    scatter_peer = on(
        consumer, lambda: kvstore_kernels.scatter(spec, target_r, table, chunks, flat_p, offsets)
    )

    def written_over_the_link() -> None:
        gather_peer()
        sync(producer)
        scatter_local()

    def read_over_the_link() -> None:
        gather_local()
        sync(producer)
        scatter_peer()

    walls[DEVICE_ROWS[0]] = timed(gather_peer, devices, reps)
    walls[DEVICE_ROWS[1]] = timed(scatter_local, devices, reps)
    walls[DEVICE_ROWS[2]] = timed(gather_local, devices, reps)
    walls[DEVICE_ROWS[3]] = timed(scatter_peer, devices, reps)
    walls[DEVICE_ROWS[4]] = timed(written_over_the_link, devices, reps)
    walls[DEVICE_ROWS[5]] = timed(read_over_the_link, devices, reps)
    ok = True
    for run in (written_over_the_link, read_over_the_link):
        flat_c.fill_(0x5A)
        flat_p.fill_(0x5A)
        for layer in target:
            layer.view(torch.uint8).fill_(0xA5)
        run()
        sync(*devices)
        ok = ok and same_bytes(target, source)
    for layer in target:
        layer.view(torch.uint8).fill_(0xA5)
    return ok


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", nargs="+", type=int, default=[8192, 32768])
    parser.add_argument("--producer", type=int, default=0)
    parser.add_argument("--consumer", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--name", default="handover")
    parser.add_argument("--dry-run", action="store_true", help="CPU tensors, 512 tokens, 2 rounds")
    args = parser.parse_args(argv)
    if args.dry_run:
        producer = consumer = torch.device("cpu")
        args.tokens, args.reps, args.name = [512], 2, "handover-dry-run"
    else:
        if torch.cuda.device_count() < 2:
            raise SystemExit("bench/handover.py needs two CUDA GPUs (--dry-run runs it on CPU)")
        producer, consumer = torch.device("cuda", args.producer), torch.device("cuda", args.consumer)
    found = link(producer, consumer) if producer.type == "cuda" else {"devices": 0}
    rows = [run_tokens(tokens, producer, consumer, args.reps) for tokens in args.tokens]
    path = write_results(args.name, {"config": vars(args), "link": found, "rows": rows})
    if found.get("topo"):
        print(found["topo"])
    print("peer access:", found.get("peer_access"))
    table = []
    for row in rows:
        for name, ms in row["ms"].items():
            mib, gbps = round(row["bytes"] / 2**20, 1), round(row["bytes"] / ms / 1e6, 2)
            ratio = row.get("x_peer_copy", {}).get(name)
            ok = row.get("ok_device_copies") if name in DEVICE_ROWS else row.get("ok")
            ok = row.get("ok_pool") if name == POOL_ROW else row.get("ok_lent") if name in LENT_ROWS else ok
            table.append(
                [
                    row["tokens"],
                    name,
                    mib,
                    round(ms, 3),
                    gbps,
                    "-" if ratio is None else round(ratio, 3),
                    "PASS" if ok else "FAIL",
                ]
            )
    print_table(["tokens", "path", "MiB", "ms", "GB/s", "x peer copy", "ok"], table)
    for row in rows:
        if "handover_x_peer_copy" in row:
            print(
                f"{row['tokens']} tokens: the arena hand-over at {row['handover_x_peer_copy']:.3f}x the peer "
                f"copy and {row['handover_x_host_copies']:.3f}x the two host copies"
            )
    print(path)


if __name__ == "__main__":
    main()
