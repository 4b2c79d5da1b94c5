"""The transfer benchmark's model rows: real models' pages through the public client and a daemon.

- `mla_rows`, `llama_rows` (`client_rows`): a prompt's pages stored and loaded by the client,
  each in turn with a pinned memcpy of the same bytes; the copy alone (`gather` / `scatter`, no
  daemon); and the host timestamps of the steps of more stores and loads (`client_steps`).
- `sliding_rows`: gpt-oss-120b, a request resumed at the end of its prompt, its sliding layers'
  window loaded against every chunk of both groups.
- `run_models(args, log)`: the rows `--models` asks for.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from bench.common import running_daemon
from bench.common_timing import walls_in_turn
from bench.transfer_cases import CHUNK_TOKENS, daemon_config, make_spec, wait_reserved
from bench.transfer_model_cases import (
    GPT_OSS_WINDOW,
    HostCopy,
    ModelCache,
    against,
    deepseek_v3_spec,
    gpt_oss_spec,
    synchronize,
    window_chunks,
)
from bench.transfer_models_report import print_progress
from bench.transfer_rows import guarded
from bench.transfer_steps import StepClock, step_summary
from kvstore_client import KVStoreClient
from kvstore_kernels import gather, scatter

MLA_DTYPES = ("bfloat16", "float8_e4m3fn")


@dataclasses.dataclass(frozen=True)
class ClientWay:
    """How the client rows call the client and run the daemon. `registered`: the KV caches given
    as `client.register_kv_caches` returns them, as vLLM's and SGLang's adapters pass them (else
    the bare tensor lists, fingerprinted on every call). `poll_ms`: the daemon's
    `server.local_poll_ms`."""

    registered: bool = True
    poll_ms: float = 0.0


def mla_rows(dtype: str, tokens: int, reps: int, way: ClientWay) -> list[dict[str, Any]]:
    """DeepSeek-V3's MLA pages of a `tokens` prompt through the public client (`client_rows`)."""
    return client_rows("deepseek-v3", deepseek_v3_spec(dtype), tokens, reps, way)


def llama_rows(tokens: int, reps: int, way: ClientWay) -> list[dict[str, Any]]:
    """Llama-3.1-8B's pages (flash_attn, bf16, blocks of 16) through the public client."""
    return client_rows("llama-3.1-8b", make_spec("flash_attn"), tokens, reps, way)


def client_rows(model: str, spec: Any, tokens: int, reps: int, way: ClientWay) -> list[dict[str, Any]]:
    """A prompt's pages stored, then loaded, by the public client, each in turn with a pinned
    memcpy of the same bytes (the namespace cleared before each store); and the copy alone,
    `kvstore_kernels.gather` / `scatter` into the memcpy's pinned buffer, no daemon: what the
    client's control calls add. Then `reps` more stores and loads, each after its memcpy as in
    the timed rounds, with their steps' host timestamps (`StepClock`)."""
    cache = ModelCache(spec, tokens, seed=1)
    moved = cache.num_chunks * spec.page.page_bytes
    copy = HostCopy(moved)
    try:
        config = daemon_config(spec.page.page_bytes, cache.num_chunks)
        config["server"] = {"local_poll_ms": way.poll_ms}
        with (
            running_daemon(config) as daemon,
            KVStoreClient.connect(daemon.address, spec) as client,
        ):
            wait_reserved(client)
            runs = client_runs(client, cache, copy, tokens, way.registered)
            runs["store"]()
            runs["load"]()
            ok = cache.loaded_right(0)
            walls = walls_in_turn(runs, reps, before={"store": client.clear})
            steps = client_steps(client, runs, reps)
            loaded_again, ok_alone = checked_again(cache, runs)
            ok = ok and loaded_again
            arena = client.stats()["client"]["arena"]
    finally:
        copy.release()
    common = {
        "model": model,
        "dtype": spec.dtype,
        "tokens": tokens,
        "page_bytes": spec.page.page_bytes,
        "registered": way.registered,
        "daemon_poll_ms": way.poll_ms,
    }
    return [
        {
            **common,
            "direction": way,
            **against(walls[way], walls[f"memcpy {baseline}"], moved),
            "ok": ok_alone if way.endswith("alone") else ok,
            "arena": arena,
            **({"steps": step_summary(steps[way]), "step_rounds": steps[way]} if way in steps else {}),
        }
        for way, baseline in (
            ("store", "store"),
            ("gather alone", "store"),
            ("load", "load"),
            ("scatter alone", "load"),
        )
    ]


def client_runs(
    client: KVStoreClient, cache: ModelCache, copy: HostCopy, tokens: int, registered: bool
) -> dict[str, Callable[[], Any]]:
    """What a client row times, in turn: each way's memcpy before it, the store and load of the
    prompt's pages with the chunk keys (as an engine passes them), the copy alone."""
    spec = cache.spec
    moved = cache.num_chunks * spec.page.page_bytes
    keys = client.keys(list(range(tokens)))
    source, target = cache.source, cache.target
    if registered:
        source, target = client.register_kv_caches(source), client.register_kv_caches(target)

    def store() -> None:
        if client.store(None, source, cache.table, keys=keys) != cache.num_chunks:
            raise RuntimeError("store: the daemon took fewer pages than the prompt has")

    def load() -> None:
        if client.load(None, target, cache.table, keys=keys) != tokens:
            raise RuntimeError("load: fewer tokens than were stored")

    offsets = [chunk * spec.page.page_bytes for chunk in range(cache.num_chunks)]
    chunks = range(cache.num_chunks)
    return {
        "memcpy store": copy.run(moved, True),
        "store": store,
        "gather alone": lambda: gather(spec, cache.source, cache.table, chunks, copy.host, offsets),
        "memcpy load": copy.run(moved, False),
        "load": load,
        "scatter alone": lambda: scatter(spec, cache.target, cache.table, chunks, copy.host, offsets),
    }


def checked_again(cache: ModelCache, runs: dict[str, Callable[[], Any]]) -> tuple[bool, bool]:
    """Whether a load into the poisoned target brings back the stored bytes (the loads of the
    steps' rounds are checked too), and whether the copy alone does: pages gathered, then
    scattered back."""
    cache.poison()
    runs["load"]()
    synchronize()
    loaded = cache.loaded_right(0)
    cache.poison()
    runs["gather alone"]()
    runs["scatter alone"]()
    synchronize()
    return loaded, cache.loaded_right(0)


def client_steps(client: Any, runs: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[Any]]:
    """`reps` stores and loads, each after its memcpy (and a store after a Clear), as in the timed
    rounds, with the host timestamps of their steps."""
    clock = StepClock()
    rounds: dict[str, list[Any]] = {"store": [], "load": []}
    with clock.installed():
        for _ in range(reps):
            for way in rounds:
                runs[f"memcpy {way}"]()
                if way == "store":
                    client.clear()
                synchronize()
                clock.take()
                clock.mark("call")
                runs[way]()
                synchronize()
                clock.mark("synchronised")
                rounds[way].append(clock.take())
    return rounds


def sliding_rows(tokens: int, reps: int) -> list[dict[str, Any]]:
    """gpt-oss-120b, a request resumed at `tokens`: the full-attention group's every chunk and the
    sliding group's window, against every chunk of both; each in turn with a pinned memcpy (to the
    device) of the same bytes."""
    full, sliding = (
        ModelCache(gpt_oss_spec(False), tokens, seed=2),
        ModelCache(gpt_oss_spec(True), tokens, seed=3),
    )
    page_bytes, chunks = full.spec.page.page_bytes, full.num_chunks
    first = {"window": chunks - window_chunks(GPT_OSS_WINDOW, CHUNK_TOKENS), "every token": 0}
    moved = {name: (2 * chunks - start) * page_bytes for name, start in first.items()}
    copy = HostCopy(moved["every token"])
    try:
        with (
            running_daemon(daemon_config(page_bytes, 2 * chunks)) as daemon,
            KVStoreClient.connect(daemon.address, full.spec) as full_client,
            KVStoreClient.connect(daemon.address, sliding.spec) as sliding_client,
        ):
            wait_reserved(full_client)
            groups = [(full_client, full), (sliding_client, sliding)]
            keys = [client.keys(list(range(tokens))) for client, _ in groups]
            for (client, cache), group_keys in zip(groups, keys, strict=True):
                if client.store(None, cache.source, cache.table, keys=group_keys) != chunks:
                    raise RuntimeError("store: the daemon took fewer pages than the prompt has")
            runs, ok = {}, {}
            for name, start in first.items():
                request = resumed_request(groups, keys, tokens, start)
                full.poison()
                sliding.poison()
                request()
                ok[name] = full.loaded_right(0) and sliding.loaded_right(start)
                runs[f"memcpy {name}"], runs[name] = copy.run(moved[name], False), request
            walls = walls_in_turn(runs, reps)
    finally:
        copy.release()
    return [
        {
            "model": "gpt-oss-120b",
            "tokens": tokens,
            "load": name,
            "chunks": {"full": chunks, "sliding": chunks - start},
            **against(walls[name], walls[f"memcpy {name}"], moved[name]),
            "ok": ok[name],
        }
        for name, start in first.items()
    ]


def resumed_request(
    groups: list[tuple[KVStoreClient, ModelCache]], keys: list[list[bytes]], tokens: int, start: int
) -> Callable[[], None]:
    """The loads of a request resumed at chunk `start` of its prompt: the full group's every chunk,
    the sliding group's from `start` on, both issued, then waited for, as the connector does."""
    (full_client, full), (sliding_client, sliding) = groups

    def run() -> None:
        handles = [
            full_client.load_async(None, full.target, full.table, keys=keys[0]),
            sliding_client.load_async(None, sliding.target, sliding.blocks_of(start), keys=keys[1][start:]),
        ]
        if [handle.wait() for handle in handles] != [tokens, tokens - start * CHUNK_TOKENS]:
            raise RuntimeError("load: fewer tokens than were stored")

    return run


def run_models(args: argparse.Namespace, log: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = {"mla": [], "sliding": [], "llama": []}
    way = ClientWay(registered=args.register_caches, poll_ms=args.daemon_poll_ms)
    if "llama" in args.models:
        for tokens in args.llama_tokens:
            result["llama"] += guarded(log, f"llama {tokens}", llama_rows, tokens, args.reps, way) or []
            print_progress(result["llama"][-4:])
    for tokens in args.model_tokens:
        if "mla" in args.models:
            for dtype in MLA_DTYPES:
                result["mla"] += (
                    guarded(log, f"mla {dtype} {tokens}", mla_rows, dtype, tokens, args.reps, way) or []
                )
                print_progress(result["mla"][-4:])
        if "sliding" in args.models:
            result["sliding"] += guarded(log, f"sliding {tokens}", sliding_rows, tokens, args.reps) or []
            print_progress(result["sliding"][-2:])
    return result
