"""The Mooncake conversation trace through vLLM's real scheduler, with and without kvstore.

Each trace block (one hash id, 512 tokens) becomes 512 token ids derived from its id, so two
requests that share an id share that block's tokens, as the trace says. Requests run one after
another, each to its end (one output token), through `tests.vllm_engine.Engine`: vLLM 0.33's
Scheduler, the KVStoreConnector loaded by vLLM's factory, a worker on real CPU KV tensors that
stores and loads real pages through a real kvstored (chunk_tokens 512: one page per trace
block), and a stand-in model that computes nothing. Four runs:

- vLLM's prefix caching off, with kvstore: the share of prompt tokens kvstore serves, against
  what `kvctl replay` (`kvstore.replay`, the same policy) predicts for the same capacity in pages.
- vLLM's prefix caching off, without kvstore: every prompt token is computed.
- vLLM's prefix caching on (its GPU cache of `--gpu-blocks` blocks), without and with kvstore:
  the prompt tokens vLLM computes.

The connector's scheduler-side cost: the time inside its scheduler methods per step, and per
request looked up (get_num_new_matched_tokens: keys, one Lookup per TP rank), median and p99,
in the engine's run and again for every prompt back to back once the run is over (the same
lookups without the worker's stores and loads between them, on a daemon that holds the pages).
It runs where vLLM's scheduler runs, on the host CPU, and reports of each lookup the part spent
waiting for the daemon's answers. The times are the machine's it ran on (`meta` in the JSON):
`bench/carry-vllm` builds what a device call carries to run it on the GPU machine's host
(`bench/NOTES-vllm.md` has the command).

    python -m bench.vllm_scheduler [--requests 2000] [--cpu-pages 8192] [--gpu-blocks 16384]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import Latency, print_table, running_daemon, write_results
from kvstore.config import EvictionConfig
from kvstore.replay import replay
from kvstore.trace import Trace, load_trace
from kvstore_client.client import KVStoreClient

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
BLOCK_TOKENS = 512  # the trace's block
VLLM_BLOCK = 16
SCHEDULER_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "take_events",
)


def block_tokens(block_id: int) -> list[int]:
    """The 512 token ids of trace block `block_id` (any fixed function of the id will do)."""
    base = block_id * 2_654_435_761
    return ((base + np.arange(BLOCK_TOKENS, dtype=np.int64) * 40_503) % 30_000 + 10).tolist()


def prompts_of(trace: Trace) -> list[list[int]]:
    cache: dict[int, list[int]] = {}
    return [
        [token for block in request for token in cache.setdefault(block, block_tokens(block))]
        for request in trace.requests
    ]


class Timer:
    """Wraps the scheduler connector's methods: time per call and per step, and of each lookup
    the part spent waiting for the daemon's answers (`KVStoreClient.lookup_chunks`)."""

    def __init__(self, connector: Any) -> None:
        self.lookups: list[float] = []
        self.round_trips: list[float] = []  # per lookup: the time inside lookup_chunks
        self.step_s = 0.0
        self.steps: list[float] = []
        self._waited = 0.0
        for name in SCHEDULER_METHODS:
            setattr(connector, name, self._timed(name, getattr(connector, name)))
        lookup_chunks = KVStoreClient.lookup_chunks

        def timed_lookup(client: KVStoreClient, keys: Any) -> int:
            started = time.perf_counter()
            try:
                return lookup_chunks(client, keys)
            finally:
                self._waited += time.perf_counter() - started

        self._restore = lambda: setattr(KVStoreClient, "lookup_chunks", lookup_chunks)
        KVStoreClient.lookup_chunks = timed_lookup  # type: ignore[method-assign]

    def close(self) -> None:
        self._restore()

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                self.step_s += elapsed
                if name == "get_num_new_matched_tokens":
                    self.lookups.append(elapsed)
                    self.round_trips.append(self._waited)
                self._waited = 0.0

        return timed

    def end_step(self) -> None:
        self.steps.append(self.step_s)
        self.step_s = 0.0


def run(
    prompts: list[list[int]],
    *,
    address: str | None,
    prefix_caching: bool,
    gpu_blocks: int,
    model_dir: Path,
) -> dict[str, Any]:
    from tests.vllm_engine import Engine, Model, vllm_config

    model = Model(num_layers=1, num_kv_heads=1, head_dim=8)
    longest = max(map(len, prompts))
    extra = {"address": address, "model": "trace", "lookup_timeout_s": 5.0} if address else None
    config = vllm_config(
        model.write_config(model_dir, 1),
        extra,
        prefix_caching=prefix_caching,
        max_num_batched_tokens=8192,
        max_model_len=longest + 16,
    )
    num_blocks = max(gpu_blocks, longest // VLLM_BLOCK + 256)  # the longest prompt always fits
    engine = Engine(config, model, num_blocks=num_blocks, check=False)
    timer = Timer(engine.connector) if engine.connector is not None else None
    external: list[int] = []
    if engine.connector is not None:
        allocate = engine.connector.update_state_after_alloc

        def counted(request: Any, blocks: Any, num_external_tokens: int) -> None:
            external.append(num_external_tokens)
            allocate(request, blocks, num_external_tokens)

        engine.connector.update_state_after_alloc = counted
    step_s: list[float] = []
    again: list[float] = []
    started = time.perf_counter()
    try:
        for index, tokens in enumerate(prompts):
            engine.add(f"r{index}", tokens, 1)
            while engine.scheduler.has_requests():
                begun = time.perf_counter()
                engine.step()
                step_s.append(time.perf_counter() - begun)
                if timer is not None:
                    timer.end_step()
        elapsed = time.perf_counter() - started
        looked_up = len(timer.lookups) if timer is not None else 0
        if timer is not None:
            timer.close()
        if engine.connector is not None:  # every prompt looked up again, back to back
            for index, tokens in enumerate(prompts):
                request = engine.request(f"again-{index}", tokens)
                begun = time.perf_counter()
                engine.connector.get_num_new_matched_tokens(request, 0)
                again.append(time.perf_counter() - begun)
                engine.connector.request_finished(request, [])
    finally:
        engine.close()
    prompt_tokens = sum(map(len, prompts))
    result: dict[str, Any] = {
        "kvstore": address is not None,
        "prefix_caching": prefix_caching,
        "prompt_tokens": prompt_tokens,
        "computed_tokens": engine.computed_prompt_tokens,
        "external_tokens": sum(external),
        "served_share": sum(external) / prompt_tokens,
        "steps": engine.steps,
        "vllm_blocks": num_blocks,
        "step_p50_us": statistics.median(step_s) * 1e6,
        "elapsed_s": round(elapsed, 2),
    }
    if timer is not None:
        result["lookup"] = Latency.of(timer.lookups[:looked_up])._asdict()
        result["lookup_round_trips"] = Latency.of(timer.round_trips[:looked_up])._asdict()
        own = [total - waited for total, waited in zip(timer.lookups, timer.round_trips, strict=True)]
        result["lookup_own_work"] = Latency.of(own[:looked_up])._asdict()
        result["lookup_back_to_back"] = Latency.of(again)._asdict()
        result["connector_per_step"] = Latency.of(timer.steps)._asdict()
    return result


def daemon_config(cpu_pages: int, page_bytes: int, policy: str) -> dict[str, Any]:
    size = cpu_pages * page_bytes
    return {
        "chunk_tokens": BLOCK_TOKENS,
        "log_level": "warning",
        "eviction": {"policy": policy},
        "tiers": {"cpu": {"bytes": size, "slab_bytes": size, "prefault": False}},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--requests", type=int, default=2000, help="the first N requests of the trace")
    parser.add_argument("--cpu-pages", type=int, default=8192, help="kvstore's CPU tier (512-token pages)")
    parser.add_argument("--gpu-blocks", type=int, default=16384, help="vLLM's own cache (16-token blocks)")
    parser.add_argument("--policy", default=EvictionConfig().policy)
    args = parser.parse_args()

    full = load_trace(args.trace)
    trace = Trace(full.path, full.requests[: args.requests])
    prompts = prompts_of(trace)
    predicted = replay(trace, args.cpu_pages, args.policy)
    page_bytes = 1 * 2 * BLOCK_TOKENS * 1 * 8 * 2  # the stand-in model: 1 layer, 1 KV head, dim 8, fp16
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvstore-vllm-bench-") as scratch:
        model_dir = Path(scratch) / "model"
        for name, with_kvstore, prefix_caching in (
            ("kvstore", True, False),
            ("none", False, False),
            ("vllm_prefix_cache", False, True),
            ("vllm_prefix_cache+kvstore", True, True),
        ):
            common = {"prefix_caching": prefix_caching, "gpu_blocks": args.gpu_blocks, "model_dir": model_dir}
            if with_kvstore:
                with running_daemon(daemon_config(args.cpu_pages, page_bytes, args.policy)) as daemon:
                    runs[name] = run(prompts, address=daemon.address, **common)
            else:
                runs[name] = run(prompts, address=None, **common)
            print(f"{name}: {runs[name]['elapsed_s']} s", flush=True)

    share, expected = runs["kvstore"]["served_share"], predicted.hit_ratio
    own = runs["vllm_prefix_cache"]["computed_tokens"]
    both = runs["vllm_prefix_cache+kvstore"]["computed_tokens"]
    lookup = runs["kvstore"]["lookup"]
    print_table(
        [
            "run",
            "prompt tokens computed",
            "served by kvstore",
            "lookup p50/p99 µs",
            "of which daemon p50",
            "own work p50",
            "back to back",
        ],
        [
            [
                name,
                f"{r['computed_tokens']:,}",
                *(
                    [
                        f"{r['served_share']:.2%}",
                        f"{r['lookup']['p50_us']:.0f} / {r['lookup']['p99_us']:.0f}",
                        f"{r['lookup_round_trips']['p50_us']:.0f}",
                        f"{r['lookup_own_work']['p50_us']:.0f}",
                        "{p50_us:.0f} / {p99_us:.0f}".format(**r["lookup_back_to_back"]),
                    ]
                    if r["kvstore"]
                    else ["-"] * 5
                ),
            ]
            for name, r in runs.items()
        ],
    )
    targets = {
        "served_share_vs_replay_pp": round((share - expected) * 100, 3),
        "served_share_within_1pp": abs(share - expected) <= 0.01,
        "prefix_cache_tokens_saved": own - both,
        "prefix_cache_fewer_with_kvstore": both < own,
        "lookup_p50_us": round(lookup["p50_us"], 1),
        "lookup_p50_within_300us": lookup["p50_us"] <= 300,
        "lookup_back_to_back_p50_us": round(runs["kvstore"]["lookup_back_to_back"]["p50_us"], 1),
        "lookup_round_trips_p50_us": round(runs["kvstore"]["lookup_round_trips"]["p50_us"], 1),
        "lookup_own_work_p50_us": round(runs["kvstore"]["lookup_own_work"]["p50_us"], 1),
    }
    print(
        f"\nkvctl replay predicts {expected:.2%} for {args.cpu_pages} pages; kvstore served {share:.2%} "
        f"({targets['served_share_vs_replay_pp']:+.2f} pp). With vLLM's prefix cache on, kvstore saves "
        f"{own - both:,} of {own:,} computed prompt tokens ({(own - both) / max(own, 1):.1%})."
    )
    write_results(
        "vllm_scheduler",
        {
            "trace": str(args.trace),
            "requests": len(prompts),
            "cpu_pages": args.cpu_pages,
            "gpu_blocks": args.gpu_blocks,
            "policy": args.policy,
            "replay_hit_ratio": expected,
            "runs": runs,
            "targets": targets,
        },
    )


if __name__ == "__main__":
    main()
