"""The Mooncake conversation trace through vLLM's real scheduler, with and without kvstore.

Each trace block (one hash id, 512 tokens) becomes 512 token ids derived from its id, so two
requests that share an id share that block's tokens, as the trace says. Requests run one after
another, each to its end (one output token), through `tests.vllm_engine.Engine`: vLLM 0.33's
Scheduler with its hybrid allocator on, the KVStoreConnector loaded by vLLM's factory, a worker
on real CPU KV tensors that stores and loads real pages through a real kvstored (chunk_tokens
512: one page per trace block and KV-cache group), and a stand-in model that computes nothing.

The model's layers follow a pattern (`--patterns`, each run in turn on the same requests):
`full`, every layer full attention (one group, one namespace), `gpt-oss`, sliding-window
layers (window 128) alternating with full attention (two groups: the window's group loads only
the chunks of the window before the resume point), or `qwen3-next`, three Mamba layers to one
full (`--layers 4`): vLLM keeps their state only with its prefix caching in align mode, where a
prefill ends (the last block boundary before the prompt's last token), so that pattern runs
only the two runs with vLLM's prefix caching on, with vLLM's blocks of 512 tokens (a state per
trace block, kvstore's chunk), and a hit needs the state at its end. Every pattern stores every layer of every
chunk, so its bytes per token are the same and kvstore's CPU tier is the same size in bytes:
`--cpu-pages` chunks of every layer (for gpt-oss, twice as many pages of half the size).

Four runs per pattern:

- vLLM's prefix caching off, with kvstore: the share of prompt tokens kvstore serves, against
  what `kvctl replay` (`kvstore.ctl.replay`, the same policy) predicts for the same capacity in
  chunks; and the bytes its loads move per served request, from the LoadSpecs of each step's
  metadata (a chunk moves one whole page of its group), against loading every layer of every
  chunk the request loads.
- vLLM's prefix caching off, without kvstore: every prompt token is computed.
- vLLM's prefix caching on (its GPU cache of `--gpu-blocks` blocks), without and with kvstore:
  the prompt tokens vLLM computes.

The connector's scheduler-side cost: the time inside its scheduler methods per step, and per
request looked up (get_num_new_matched_tokens: keys, one Lookup per TP rank and group), median
and p99, in the engine's run and again for every prompt back to back once the run is over (the
same lookups without the worker's stores and loads between them, on a daemon that holds the
pages). It runs where vLLM's scheduler runs, on the host CPU, and reports of each lookup the part
spent waiting for the daemon's answers. The times are the machine's it ran on (`meta` in the
JSON): `bench/carry-vllm` builds what a device call carries to run it on the GPU machine's host
(`bench/NOTES-vllm.md` has the command).

    python -m bench.vllm_scheduler [--requests 2000] [--patterns full gpt-oss] [--layers 2]
        [--cpu-pages 8192] [--gpu-blocks 16384] [--results NAME]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.common import Latency, print_table, running_daemon, write_results
from kvstore.config.root import EvictionConfig
from kvstore.ctl.replay import replay
from kvstore.ctl.trace import Trace, load_trace
from kvstore_client.client import KVStoreClient

if TYPE_CHECKING:
    from tests.vllm_engine import Model

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
BLOCK_TOKENS = 512  # the trace's block
VLLM_BLOCK = 16
SCHEDULER_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",  # what vLLM calls on a connector that supports its hybrid allocator
    "take_events",
)
# the layer kinds each pattern repeats over the model's layers (the CLI's choices)
PATTERNS: dict[str, tuple[str, ...]] = {
    "full": ("full",),
    "gpt-oss": ("sliding", "full"),
    "qwen3-next": ("mamba", "mamba", "mamba", "full"),
}
# patterns with Mamba state: vLLM keeps it only with prefix caching in align mode, and the
# connector's chunks are the Mamba block size, here the trace's block
STATEFUL = {"qwen3-next"}
WINDOW = 128  # gpt-oss's sliding window, in tokens
KV_HEADS, HEAD_DIM, VALUE_BYTES = 1, 8, 2  # the stand-in model's KV: one head of dim 8, fp16
RUNS = (  # name, with kvstore, vLLM's prefix caching
    ("kvstore", True, False),
    ("none", False, False),
    ("vllm_prefix_cache", False, True),
    ("vllm_prefix_cache+kvstore", True, True),
)


def block_tokens(block_id: int) -> list[int]:
    """The 512 token ids of trace block `block_id` (any fixed function of the id will do)."""
    base = block_id * 2_654_435_761
    return ((base + np.arange(BLOCK_TOKENS, dtype=np.int64) * 40_503) % 30_000 + 10).tolist()


def model_of(pattern: str, layers: int) -> Model:
    """The stand-in model of `layers` layers in `pattern`, or a ValueError where they do not fit."""
    from tests.vllm_engine import Model

    kinds = PATTERNS[pattern]
    if layers <= 0 or layers % len(kinds):
        raise ValueError(
            f"--layers {layers}: the {pattern} pattern needs a positive multiple of {len(kinds)}"
        )
    return Model(
        num_layers=layers,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        kinds=kinds * (layers // len(kinds)),
        window=WINDOW,
    )


def chunk_bytes(layers: int) -> int:
    """One chunk's K and V of every layer: the same for every pattern (every layer is stored)."""
    return layers * 2 * BLOCK_TOKENS * KV_HEADS * HEAD_DIM * VALUE_BYTES


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
        self._originals = {name: getattr(KVStoreClient, name) for name in ("lookup_chunks", "lookup_each")}
        for name, original in self._originals.items():
            setattr(KVStoreClient, name, self._waiting(original))

    def _waiting(self, lookup: Callable[..., Any]) -> Callable[..., Any]:
        def timed_lookup(client: KVStoreClient, keys: Any) -> Any:
            started = time.perf_counter()
            try:
                return lookup(client, keys)
            finally:
                self._waited += time.perf_counter() - started

        return timed_lookup

    def close(self) -> None:
        for name, original in self._originals.items():
            setattr(KVStoreClient, name, original)

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


class LoadCounter:
    """The loads each step's metadata gives the workers (its `LoadSpec`s): chunks per KV-cache
    group and the bytes they move. Every chunk of a load moves one whole page of its group (a
    chunk vLLM holds in part goes through a scratch chunk); loading every layer instead would
    move, for each loaded request, a page of every group for each chunk any group loads."""

    def __init__(self, connector: Any, kv_cache_config: Any) -> None:
        from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

        groups = list(kv_cache_config.kv_cache_groups)
        self.kinds = [
            "sliding"
            if isinstance(g.kv_cache_spec, SlidingWindowSpec)
            else "mamba"
            if isinstance(g.kv_cache_spec, MambaSpec)
            else "full"
            for g in groups
        ]
        self.layers = [len(g.layer_names) for g in groups]
        self.page_bytes = [  # a Mamba group's page: its layers' states, one per chunk
            len(g.layer_names)
            * (g.kv_cache_spec.real_page_size_bytes if kind == "mamba" else g.kv_cache_spec.page_size_bytes)
            * (1 if kind == "mamba" else BLOCK_TOKENS // g.kv_cache_spec.block_size)
            for g, kind in zip(groups, self.kinds, strict=True)
        ]
        self.chunks = [0] * len(groups)
        self.every_layer_chunks = 0
        self.requests: set[str] = set()
        build = connector.build_connector_meta

        def counted(scheduler_output: Any) -> Any:
            meta = build(scheduler_output)
            self.add(meta.loads)
            return meta

        connector.build_connector_meta = counted

    def add(self, loads: Sequence[Any]) -> None:
        spans: dict[str, tuple[int, int]] = {}  # per request: the chunks any of its groups loads
        for spec in loads:
            self.chunks[spec.group] += spec.stop - spec.first
            first, stop = spans.get(spec.req_id, (spec.first, spec.stop))
            spans[spec.req_id] = (min(first, spec.first), max(stop, spec.stop))
        self.every_layer_chunks += sum(stop - first for first, stop in spans.values())
        self.requests.update(spans)

    def summary(self) -> dict[str, Any]:
        moved = sum(chunks * size for chunks, size in zip(self.chunks, self.page_bytes, strict=True))
        every = self.every_layer_chunks * sum(self.page_bytes)
        served = max(len(self.requests), 1)
        return {
            "groups": [
                {"kind": kind, "layers": layers, "chunks": chunks, "page_bytes": size}
                for kind, layers, chunks, size in zip(
                    self.kinds, self.layers, self.chunks, self.page_bytes, strict=True
                )
            ],
            "served_requests": len(self.requests),
            "bytes": moved,
            "bytes_per_served_request": moved / served,
            "every_layer_bytes": every,
            "every_layer_bytes_per_served_request": every / served,
            "share_of_every_layer": moved / every if every else 0.0,
        }


def run(
    prompts: list[list[int]],
    *,
    address: str | None,
    model: Model,
    prefix_caching: bool,
    gpu_blocks: int,
    model_dir: Path,
) -> dict[str, Any]:
    from tests.vllm_engine import Engine, vllm_config

    longest = max(map(len, prompts))
    extra = {"address": address, "model": "trace", "lookup_timeout_s": 5.0} if address else None
    stateful = "mamba" in model.kinds
    block = BLOCK_TOKENS if stateful else VLLM_BLOCK  # a stateful model: a state per trace block
    config = vllm_config(
        model.write_config(model_dir, 1),
        extra,
        prefix_caching=prefix_caching,
        block_size=block,
        mamba_cache_mode="align" if stateful else "none",
        max_num_batched_tokens=8192,
        max_model_len=longest + block,
    )
    # the same tokens' worth of vLLM's cache whatever its block; the longest prompt always fits
    num_blocks = max(gpu_blocks * VLLM_BLOCK // block, longest // block + 256 * VLLM_BLOCK // block)
    engine = Engine(config, model, num_blocks=num_blocks, check=False)
    timer = Timer(engine.connector) if engine.connector is not None else None
    loads = LoadCounter(engine.connector, engine.kv_cache_config) if engine.connector is not None else None
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
        "vllm_pool_blocks": engine.kv_cache_config.num_blocks,  # a hybrid pool: blocks of every group
        "step_p50_us": statistics.median(step_s) * 1e6,
        "elapsed_s": round(elapsed, 2),
    }
    if loads is not None:
        result["loads"] = loads.summary()
    if timer is not None:
        result["lookup"] = Latency.of(timer.lookups[:looked_up])._asdict()
        result["lookup_round_trips"] = Latency.of(timer.round_trips[:looked_up])._asdict()
        own = [total - waited for total, waited in zip(timer.lookups, timer.round_trips, strict=True)]
        result["lookup_own_work"] = Latency.of(own[:looked_up])._asdict()
        result["lookup_back_to_back"] = Latency.of(again)._asdict()
        result["connector_per_step"] = Latency.of(timer.steps)._asdict()
    return result


def daemon_config(
    cpu_chunks: int, bytes_per_chunk: int, policy: str, stateful: bool = False
) -> dict[str, Any]:
    size = cpu_chunks * bytes_per_chunk
    # one page size per slab: a stateful model's state pages need slabs of their own
    slab = min(size, 1 << 20) if stateful else size
    return {
        "chunk_tokens": BLOCK_TOKENS,
        "log_level": "warning",
        "eviction": {"policy": policy},
        "tiers": {"cpu": {"bytes": -(-size // slab) * slab, "slab_bytes": slab, "prefault": False}},
    }


def measure(
    prompts: list[list[int]], pattern: str, model: Model, args: argparse.Namespace, model_dir: Path
) -> dict[str, dict[str, Any]]:
    """The four runs of one pattern, each kvstore run on a fresh daemon."""
    runs: dict[str, dict[str, Any]] = {}
    for name, with_kvstore, prefix_caching in RUNS:
        if pattern in STATEFUL and not prefix_caching:
            continue  # vLLM keeps Mamba state only with its prefix caching on
        common = {"model": model, "prefix_caching": prefix_caching, "gpu_blocks": args.gpu_blocks}
        if with_kvstore:
            config = daemon_config(
                args.cpu_pages, chunk_bytes(model.num_layers), args.policy, pattern in STATEFUL
            )
            with running_daemon(config) as daemon:
                runs[name] = run(prompts, address=daemon.address, model_dir=model_dir, **common)
        else:
            runs[name] = run(prompts, address=None, model_dir=model_dir, **common)
        print(f"{pattern}, {name}: {runs[name]['elapsed_s']} s", flush=True)
    return runs


def targets_of(runs: dict[str, dict[str, Any]], expected: float) -> dict[str, Any]:
    own = runs["vllm_prefix_cache"]["computed_tokens"]
    both = runs["vllm_prefix_cache+kvstore"]["computed_tokens"]
    alone = "kvstore" in runs  # a stateful pattern runs with vLLM's prefix caching only
    kvstore = runs["kvstore" if alone else "vllm_prefix_cache+kvstore"]
    share = kvstore["served_share"]
    return {
        "served_share_vs_replay_pp": round((share - expected) * 100, 3) if alone else None,
        "served_share_within_1pp": abs(share - expected) <= 0.01 if alone else None,
        "prefix_cache_tokens_saved": own - both,
        "prefix_cache_fewer_with_kvstore": both < own,
        "lookup_p50_us": round(kvstore["lookup"]["p50_us"], 1),
        "lookup_p50_within_300us": kvstore["lookup"]["p50_us"] <= 300,
        "lookup_back_to_back_p50_us": round(kvstore["lookup_back_to_back"]["p50_us"], 1),
        "lookup_round_trips_p50_us": round(kvstore["lookup_round_trips"]["p50_us"], 1),
        "lookup_own_work_p50_us": round(kvstore["lookup_own_work"]["p50_us"], 1),
        "load_bytes_share_of_every_layer": round(kvstore["loads"]["share_of_every_layer"], 4),
    }


def report(patterns: dict[str, dict[str, dict[str, Any]]], targets: dict[str, dict[str, Any]]) -> None:
    rows = [(pattern, name, r) for pattern, runs in patterns.items() for name, r in runs.items()]
    print_table(
        [
            "pattern",
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
                pattern,
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
            for pattern, name, r in rows
        ],
    )
    print()
    print_table(
        [
            "pattern",
            "run",
            "served requests",
            "chunks loaded per group",
            "MB per served request",
            "every layer MB",
            "share",
        ],
        [
            [
                pattern,
                name,
                r["loads"]["served_requests"],
                " + ".join(f"{g['chunks']:,} {g['kind']}" for g in r["loads"]["groups"]),
                f"{r['loads']['bytes_per_served_request'] / 1e6:.2f}",
                f"{r['loads']['every_layer_bytes_per_served_request'] / 1e6:.2f}",
                f"{r['loads']['share_of_every_layer']:.1%}",
            ]
            for pattern, name, r in rows
            if r["kvstore"]
        ],
    )
    for pattern, runs in patterns.items():
        own = runs["vllm_prefix_cache"]["computed_tokens"]
        saved = targets[pattern]["prefix_cache_tokens_saved"]
        alone = (
            f"kvstore served {runs['kvstore']['served_share']:.2%} "
            f"({targets[pattern]['served_share_vs_replay_pp']:+.2f} pp against kvctl replay). "
            if "kvstore" in runs
            else "(vLLM's prefix caching on in both runs: its align mode keeps the Mamba states.) "
        )
        print(
            f"\n{pattern}: {alone}With vLLM's prefix cache on, kvstore saves {saved:,} of {own:,} "
            f"computed prompt tokens ({saved / max(own, 1):.1%})."
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--requests", type=int, default=2000, help="the first N requests of the trace")
    parser.add_argument("--patterns", nargs="+", choices=list(PATTERNS), default=["full"])
    parser.add_argument(
        "--layers",
        type=int,
        default=2,
        help="the stand-in model's layers: a multiple of the pattern's (the shares do not depend on it)",
    )
    parser.add_argument(
        "--cpu-pages", type=int, default=8192, help="kvstore's CPU tier, in 512-token chunks of every layer"
    )
    parser.add_argument("--gpu-blocks", type=int, default=16384, help="vLLM's own cache (16-token blocks)")
    parser.add_argument("--policy", default=EvictionConfig().policy)
    parser.add_argument(
        "--results", help="bench/results/<name>.json (default: vllm_scheduler, or vllm_scheduler-patterns)"
    )
    args = parser.parse_args()
    try:
        models = {pattern: model_of(pattern, args.layers) for pattern in args.patterns}
    except ValueError as error:
        parser.error(str(error))

    full = load_trace(args.trace)
    trace = Trace(full.path, full.requests[: args.requests])
    prompts = prompts_of(trace)
    expected = replay(trace, args.cpu_pages, args.policy).hit_ratio
    patterns: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvstore-vllm-bench-") as scratch:
        for pattern, model in models.items():
            patterns[pattern] = measure(prompts, pattern, model, args, Path(scratch) / pattern)
    targets = {pattern: targets_of(runs, expected) for pattern, runs in patterns.items()}
    report(patterns, targets)
    print(f"\nkvctl replay predicts {expected:.2%} for {args.cpu_pages} chunks.")
    write_results(
        args.results or ("vllm_scheduler" if args.patterns == ["full"] else "vllm_scheduler-patterns"),
        {
            "trace": str(args.trace),
            "requests": len(prompts),
            "layers": args.layers,
            "window": WINDOW,
            "cpu_pages": args.cpu_pages,
            "cpu_tier_bytes": args.cpu_pages * chunk_bytes(args.layers),
            "gpu_blocks": args.gpu_blocks,
            "policy": args.policy,
            "replay_hit_ratio": expected,
            "patterns": {pattern: list(models[pattern].kinds) for pattern in patterns},
            "runs": patterns,
            "targets": targets,
        },
    )


if __name__ == "__main__":
    main()
