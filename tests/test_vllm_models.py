"""The vLLM connector on the model kinds people deploy: MLA, sliding-window and chunked-local
hybrids, Mamba / linear-attention hybrids, fp8 caches, and the layouts of different attention
backends, driven by vLLM's real Scheduler (its hybrid allocator on) over a real kvstored.

Every forward of the stand-in model (`tests.vllm_engine`) checks that each token a request
attends to holds exactly the KV (or MLA latent) of its prefix, for every layer and TP rank: a
test that runs to the end proved every loaded byte. A second engine has caches of its own, so a
hit there can only come from the daemon.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: tests/install-vllm (the README's test command runs it)")

from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvstore_client import KVStoreClient  # noqa: E402
from tests.harness import Daemon  # noqa: E402
from tests.test_vllm import CHUNK, prompt  # noqa: E402  (the same chunks and prompts)
from tests.vllm_engine import Engine, Model, vllm_config  # noqa: E402

# DeepSeek-V2-Lite's KV cache: 27 MLA layers, one latent of kv_lora_rank 512 + rope 64 per token
DEEPSEEK_V2_LITE = Model(
    num_layers=27, num_kv_heads=1, head_dim=576, kinds=("mla",) * 27, backend="TRITON_MLA"
)
# gpt-oss's pattern: sliding-window layers (window 128) alternating with full attention
GPT_OSS = Model(num_layers=4, kinds=("sliding", "full") * 2, window=128)
# Gemma 3's: five sliding-window layers to one full
GEMMA3 = Model(num_layers=6, kinds=("sliding",) * 5 + ("full",), window=64)
# Llama 4's: chunked-local attention layers beside full ones (every fourth)
LLAMA4 = Model(num_layers=4, kinds=("chunked", "chunked", "chunked", "full"), window=96)
# Qwen3-Next's: three linear-attention (Mamba-state) layers to one full
QWEN3_NEXT = Model(num_layers=8, kinds=("mamba", "mamba", "mamba", "full") * 2)
STATE_BLOCK = 16  # the Mamba block size (vLLM's block size here): a stateful model's chunk


@pytest.fixture
def kvstored(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory(chunk_tokens=CHUNK)


@pytest.fixture
def make_engine(tmp_path: Path) -> Iterator[Callable[..., Engine]]:
    engines: list[Engine] = []

    def make(
        daemon: Daemon, model: Model, *, tp_size: int = 1, name: str = "test-model", **options: Any
    ) -> Engine:
        layout = options.pop(
            "layout", KVCacheLayout.LBHNC if model.backend == "CPU_ATTN" else KVCacheLayout.LBNHC
        )
        num_blocks = options.pop("num_blocks", 160)
        kernel_block = options.pop("kernel_block", None)
        if "mamba" in model.kinds:  # vLLM keeps states at block boundaries with prefix caching on
            options = {"prefix_caching": True, "mamba_cache_mode": "align", **options}
        model_dir = _write_config(tmp_path / f"model-{len(engines)}", model, tp_size)
        settings = {"address": daemon.address, "model": name, **options.pop("extra", {})}
        config = vllm_config(
            model_dir, settings, tp_size=tp_size, cache_dtype=model.cache_dtype, max_model_len=2048, **options
        )
        engine = Engine(config, model, num_blocks=num_blocks, layout=layout, kernel_block=kernel_block)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def _write_config(directory: Path, model: Model, tp_size: int) -> Path:
    return Model(
        num_layers=model.num_layers, num_kv_heads=max(1, model.num_kv_heads), head_dim=8
    ).write_config(directory, tp_size)


def serve(engine: Engine, request_id: str, tokens: list[int]) -> int:
    """Runs one request alone on poisoned caches; the prompt tokens the model computed for it."""
    engine.poison()
    engine.computed_prompt_tokens = 0
    engine.add(request_id, tokens, 1)
    engine.run()
    return engine.computed_prompt_tokens


def namespace_pages(daemon: Daemon) -> list[int]:
    """The pages of each namespace holding any."""
    with KVStoreClient.connect(daemon.address, _any_spec()) as client:
        return sorted(entry["pages"] for entry in client.stats()["namespaces"] if entry["pages"])


def _any_spec() -> Any:
    from kvstore.shared.spec import KVSpec

    return KVSpec(model="probe", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", layout="vllm")


# -- MLA ----------------------------------------------------------------------


def test_an_mla_model_stores_once_and_another_engine_loads_it(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    a = prompt(1, 4 * CHUNK + 5)
    assert serve(make_engine(kvstored, DEEPSEEK_V2_LITE), "A", a) == len(a)
    second = make_engine(kvstored, DEEPSEEK_V2_LITE)
    assert serve(second, "B", a) == len(a) - 4 * CHUNK  # every latent of 4 chunks loaded, byte-exact


def test_mla_with_tp_2_stores_one_copy_that_both_ranks_load(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    model = Model(num_layers=3, num_kv_heads=1, head_dim=576, kinds=("mla",) * 3, backend="TRITON_MLA")
    a = prompt(2, 3 * CHUNK + 1)
    assert serve(make_engine(kvstored, model, tp_size=2), "A", a) == len(a)
    assert namespace_pages(kvstored) == [3]  # one copy, not one per rank
    second = make_engine(kvstored, model, tp_size=2)
    assert serve(second, "B", a) == 1  # both ranks loaded the same latent, checked byte for byte


def test_a_lending_mla_producer_lends_rank_0_s_latent_for_every_decode_rank(
    kvstored: Daemon, make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`save_to: lend` with `lend_readers: 2` (a decode instance of TP 2): the latent, the same on
    every rank, is lent once, by rank 0, held for two readers; a model whose ranks hold their own
    heads lends each rank's for one. The lend itself needs a CUDA cache (test_lends_cuda.py), and
    the daemon's count of readers is tested against it in test_lend_readers.py; here the client
    records what the connector asks for, with the real scheduler."""
    asked: list[tuple[int, int]] = []

    def lend(self: KVStoreClient, token_ids: Any, kv_caches: Any, block_ids: Any, **options: Any) -> Any:
        asked.append((id(self), options["readers"]))
        return len(asked), len(options["keys"]) * CHUNK

    monkeypatch.setattr(KVStoreClient, "lend", lend)
    monkeypatch.setattr(KVStoreClient, "lends_done", lambda self, ids, **_: list(ids))
    extra = {"save_to": "lend", "lend_readers": 2}
    mla = Model(num_layers=3, num_kv_heads=1, head_dim=576, kinds=("mla",) * 3, backend="TRITON_MLA")
    engine = make_engine(kvstored, mla, tp_size=2, kv_role="kv_producer", extra=extra)
    assert serve(engine, "A", prompt(3, 3 * CHUNK + 1)) == 3 * CHUNK + 1
    assert asked and {readers for _, readers in asked} == {2} and len({client for client, _ in asked}) == 1
    asked.clear()
    gqa = Model(num_layers=2, num_kv_heads=1, kinds=("full",) * 2)
    engine = make_engine(kvstored, gqa, tp_size=2, kv_role="kv_producer", extra=extra, name="gqa")
    assert serve(engine, "A", prompt(4, 3 * CHUNK + 1)) == 3 * CHUNK + 1
    assert {readers for _, readers in asked} == {1} and len({client for client, _ in asked}) == 2


# -- sliding windows ----------------------------------------------------------


@pytest.mark.parametrize("model", [GPT_OSS, GEMMA3], ids=["gpt-oss", "gemma3"])
def test_a_sliding_window_hybrid_loads_its_full_layers_and_the_window_only(
    kvstored: Daemon, make_engine: Callable[..., Engine], model: Model
) -> None:
    a = prompt(3, 12 * CHUNK + 7)
    assert serve(make_engine(kvstored, model), "A", a) == len(a)
    groups = len(make_engine(kvstored, model).kv_cache_config.kv_cache_groups)
    assert namespace_pages(kvstored) == [12] * groups  # each group stores every chunk
    second = make_engine(kvstored, model)
    loaded = _record_loads(second)
    assert serve(second, "B", a) == len(a) - 12 * CHUNK
    sides = second.workers[0]._worker.groups.values()
    kinds = {side.group.index: side.group.kind for side in sides}
    arenas = {side.conn.get().arena.data_ptr() for side in sides}  # type: ignore[union-attr]
    assert len(arenas) == 1  # the groups' clients are siblings: one mapping of the arena
    window_chunks = -(-(model.window - 1) // CHUNK) + 1  # the chunks of the window's tokens, at most
    for group, chunks in loaded.items():
        if kinds[group] == "full":
            assert chunks == 12
        else:
            assert 1 <= chunks <= window_chunks  # the window's chunks, not the prompt's 12


def _record_loads(engine: Engine) -> dict[int, int]:
    """Chunks each group's loads move on rank 0, from here on."""
    worker, chunks = engine.workers[0]._worker, {}
    original = worker._start_load

    def recording(spec: Any) -> Any:
        chunks[spec.group] = chunks.get(spec.group, 0) + spec.stop - spec.first
        return original(spec)

    worker._start_load = recording
    return chunks


def test_chunked_local_attention_loads_the_resume_point_s_attention_chunk_only(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    """Llama 4's pattern: chunked-local layers (attention chunks of 96 tokens here) beside full
    ones. A request resumed at 384 (= 4 x 96) needs none of the chunked layers' KV; one resumed at
    320 needs its attention chunk's, [288, 320): one page of 32."""
    model = LLAMA4
    a = prompt(18, 12 * CHUNK + 3)  # resumes at 384
    assert serve(make_engine(kvstored, model), "A", a) == len(a)
    second = make_engine(kvstored, model)
    loaded = _record_loads(second)
    assert serve(second, "B", a) == 3
    kinds = {g: side.group.kind for g, side in second.workers[0]._worker.groups.items()}
    assert {kinds[g]: n for g, n in loaded.items()} == {"full": 12}  # the chunked layers: nothing
    b = a[: 10 * CHUNK] + prompt(19, 40)  # resumes at 320
    third = make_engine(kvstored, model)
    loaded = _record_loads(third)
    assert serve(third, "C", b) == len(b) - 10 * CHUNK
    assert {kinds[g]: n for g, n in loaded.items()} == {"full": 10, "chunked": 1}


def test_a_prefix_ending_inside_a_window_loads_what_that_window_needs(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    a = prompt(4, 10 * CHUNK)
    assert serve(make_engine(kvstored, GPT_OSS), "A", a) == len(a)
    b = a[: 6 * CHUNK + 9] + prompt(5, 40)  # shares 6 chunks and 9 tokens of the 7th
    assert serve(make_engine(kvstored, GPT_OSS), "B", b) == len(b) - 6 * CHUNK


def test_a_chunk_evicted_under_a_window_is_recomputed_never_a_wrong_byte(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    a = prompt(6, 10 * CHUNK + 3)
    first = make_engine(kvstored, GPT_OSS)
    assert serve(first, "A", a) == len(a)
    sliding = first.workers[0]._worker.groups[0]
    assert sliding.group.kind == "sliding"
    client = sliding.conn.get()
    assert client is not None and client.clear() == 10  # the window's pages are gone
    assert serve(make_engine(kvstored, GPT_OSS), "B", a) == len(a)  # a miss: all computed


# -- Mamba / linear-attention state ------------------------------------------------


def _drop_state_saves(engine: Engine, boundaries: set[int]) -> list[int]:
    """Rank 0 saves no state at `boundaries` (tokens) from here on; returns every state boundary
    the scheduler asked it to save."""
    worker, asked = engine.workers[0]._worker, []
    original = worker.start_saves

    def dropping(meta: Any) -> None:
        kept = []
        for spec in meta.saves:
            if worker.groups[spec.group].group.kind == "mamba":
                asked.append(spec.stop * STATE_BLOCK)
                if spec.stop * STATE_BLOCK in boundaries:
                    continue
            kept.append(spec)
        meta.saves = kept
        original(meta)

    worker.start_saves = dropping
    return asked


def test_a_mamba_hybrid_stores_states_and_another_engine_resumes_from_one(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    a = prompt(12, 12 * STATE_BLOCK + 5)
    first = make_engine(kvstored, QWEN3_NEXT)
    kinds = sorted(side.group.kind for side in first.workers[0]._worker.groups.values())
    assert kinds == ["full", "mamba", "mamba", "mamba"]  # vLLM's groups: two layers each
    assert serve(first, "A", a) == len(a)
    second = make_engine(kvstored, QWEN3_NEXT)
    loaded = _record_loads(second)
    # the KV of 12 chunks and the state after them: the stand-in checked every byte and state
    assert serve(second, "B", a) == 5
    states = [group for group, side in second.workers[0]._worker.groups.items() if side.group.kind == "mamba"]
    assert states and all(loaded[group] == 1 for group in states)  # one state page, not 12


def test_a_mamba_hit_stops_at_the_last_stored_state_never_beyond(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    """Steps of 64 tokens whose states vLLM keeps (prefix_cache_retention_interval 64): states
    at 64, 128, 192. A prompt sharing 100 tokens resumes at 64 (its attention KV reaches 96, but
    no state is kept there), and without the state at 192 a prompt sharing all of them resumes
    at 128."""
    a = prompt(13, 12 * STATE_BLOCK + 5)
    first = make_engine(kvstored, QWEN3_NEXT, retention_interval=64, max_num_batched_tokens=64)
    asked = _drop_state_saves(first, {192})
    assert serve(first, "A", a) == len(a)
    assert sorted(set(asked)) == [64, 128, 192]
    b = a[:100] + prompt(14, 30)
    assert serve(make_engine(kvstored, QWEN3_NEXT), "B", b) == len(b) - 64
    assert serve(make_engine(kvstored, QWEN3_NEXT), "C", a) == len(a) - 128


def test_a_mamba_hit_extends_what_the_engine_s_own_prefix_cache_holds(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    """The engine's own cache holds a prompt's first 64 tokens and the state there; kvstore holds
    the state at 192: the request resumes at 192, loading from 64 on."""
    a = prompt(17, 12 * STATE_BLOCK + 5)
    assert serve(make_engine(kvstored, QWEN3_NEXT), "A", a) == len(a)
    engine = make_engine(kvstored, QWEN3_NEXT)
    assert serve(engine, "short", a[:69]) == 69  # nothing stored at 64 by A: all computed
    loaded = _record_loads(engine)
    engine.computed_prompt_tokens = 0
    engine.add("B", a, 1)  # no poison: vLLM's own cache keeps the first 64 tokens
    engine.run()
    assert engine.computed_prompt_tokens == 5
    full = next(g for g, side in engine.workers[0]._worker.groups.items() if side.group.kind == "full")
    assert loaded[full] == 12 - 64 // STATE_BLOCK  # the chunks after vLLM's own 64 tokens


def test_mamba_states_cleared_cost_a_recompute_never_a_wrong_state(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    a = prompt(15, 8 * STATE_BLOCK + 3)
    first = make_engine(kvstored, QWEN3_NEXT)
    assert serve(first, "A", a) == len(a)
    for side in first.workers[0]._worker.groups.values():
        if side.group.kind == "mamba":
            client = side.conn.get()
            assert client is not None and client.clear() == 1
    assert serve(make_engine(kvstored, QWEN3_NEXT), "B", a) == len(a)  # the KV alone is no hit


@pytest.mark.parametrize("shared", [False, True], ids=["sharded", "replicated"])
def test_mamba_states_with_tp_2_each_rank_loads_its_own(
    kvstored: Daemon, make_engine: Callable[..., Engine], shared: bool
) -> None:
    model = Model(num_layers=2, kinds=("mamba", "full"), state_shared=shared)
    a = prompt(16, 6 * STATE_BLOCK + 2)
    assert serve(make_engine(kvstored, model, tp_size=2), "A", a) == len(a)
    # the KV per rank; the states per rank, or once where every rank holds the whole state
    assert namespace_pages(kvstored) == ([1, 6, 6] if shared else [1, 1, 6, 6])
    assert serve(make_engine(kvstored, model, tp_size=2), "B", a) == 2


def test_mamba_state_outside_align_mode_is_refused_at_start_up(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    with pytest.raises(ValueError, match="mamba_cache_mode 'none'.*--mamba-cache-mode align"):
        make_engine(kvstored, QWEN3_NEXT, prefix_caching=False, mamba_cache_mode="none")


# -- fp8 and scales -------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_cache_round_trips_and_other_scales_never_hit(
    kvstored: Daemon, make_engine: Callable[..., Engine], cache_dtype: str
) -> None:
    model = Model(cache_dtype=cache_dtype, kv_scale=0.5)
    a = prompt(7, 5 * CHUNK + 2)
    assert serve(make_engine(kvstored, model), "A", a) == len(a)
    assert serve(make_engine(kvstored, model), "B", a) == len(a) - 5 * CHUNK
    rescaled = Model(cache_dtype=cache_dtype, kv_scale=0.25)
    assert serve(make_engine(kvstored, rescaled), "C", a) == len(a)  # other scales: no hit


# -- layouts read from the backend --------------------------------------------


@pytest.mark.parametrize(
    "writer,reader", [("CPU_ATTN", "FLASH_ATTN"), ("FLASH_ATTN", "CPU_ATTN"), ("CPU_ATTN", "CPU_ATTN")]
)
def test_pages_are_canonical_whichever_backend_wrote_them(
    kvstored: Daemon, make_engine: Callable[..., Engine], writer: str, reader: str
) -> None:
    a = prompt(8, 6 * CHUNK + 1)
    assert serve(make_engine(kvstored, Model(backend=writer)), "A", a) == len(a)
    assert serve(make_engine(kvstored, Model(backend=reader)), "B", a) == 1


def test_a_backend_with_smaller_kernel_blocks_is_served(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    a = prompt(9, 4 * CHUNK + 3)
    assert serve(make_engine(kvstored, Model(), block_size=32), "A", a) == len(a)
    engine = make_engine(kvstored, Model(), block_size=32, kernel_block=16)
    assert engine.caches[0][0].shape[2] == 16  # two kernel blocks per vLLM block
    assert serve(engine, "B", a) == len(a) - 4 * CHUNK


def test_an_attention_kind_the_connector_does_not_serve_is_refused_at_start_up(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    with pytest.raises(
        ValueError, match=r"model.layers.1.self_attn.attn are sliding-window MLA \(SlidingWindowMLASpec\)"
    ):
        make_engine(
            kvstored,
            Model(
                num_layers=2, num_kv_heads=1, head_dim=576, kinds=("mla", "sliding_mla"), backend="TRITON_MLA"
            ),
        )


def test_a_backend_whose_layout_is_unknown_is_refused_at_start_up(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    with pytest.raises(
        ValueError, match="FLASH_ATTN_DIFFKV attention backend, whose KV layout kvstore does not know"
    ):
        make_engine(kvstored, Model(backend="FLASH_ATTN_DIFFKV"))


# -- failed loads ---------------------------------------------------------------


def test_a_load_that_fails_is_not_offered_again_and_its_chunks_are_saved_again(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(kvstored, Model())
    a = prompt(10, 5 * CHUNK + 4)
    assert serve(engine, "A", a) == len(a)
    worker = engine.workers[0]._worker
    original = worker._start_load

    def clear_then_load(spec: Any) -> Any:  # after the scheduler's lookup, before the load
        client = worker.groups[0].conn.get()
        assert client is not None and client.clear() == 5
        return original(spec)

    worker._start_load = clear_then_load
    scheduler = engine.connector._scheduler
    lookups, offered = scheduler.num_new_matched_tokens, []

    def recording(*args: Any) -> int:
        offered.append(lookups(*args))
        return offered[-1]

    scheduler.num_new_matched_tokens = recording
    assert serve(engine, "B", a) == len(a)  # the load failed: recomputed, never offered again
    assert offered[0] == 5 * CHUNK and all(tokens == 0 for tokens in offered[1:])
    worker._start_load = original
    # the chunks B recomputed were stored anew: another engine loads them
    assert serve(make_engine(kvstored, Model()), "C", a) == len(a) - 5 * CHUNK


@pytest.mark.parametrize("model", [GPT_OSS, DEEPSEEK_V2_LITE, QWEN3_NEXT], ids=["gpt-oss", "mla", "mamba"])
def test_a_daemon_killed_between_lookup_and_load_costs_a_recompute_never_a_wrong_byte(
    daemon_factory: Callable[..., Daemon], make_engine: Callable[..., Engine], model: Model
) -> None:
    daemon = daemon_factory("victim", chunk_tokens=CHUNK)
    a = prompt(11, 6 * CHUNK + 5)
    assert serve(make_engine(daemon, model), "A", a) == len(a)
    engine = make_engine(daemon, model)
    worker = engine.workers[0]._worker
    original, killed = worker._start_load, []

    def kill_then_load(spec: Any) -> Any:  # after the scheduler's lookup, before any page is read
        if not killed:
            killed.append(daemon.stop(signal.SIGKILL))
        return original(spec)

    worker._start_load = kill_then_load
    assert serve(engine, "B", a) == len(a)  # every group's load failed: all of it recomputed
    assert killed == [-signal.SIGKILL]
    worker._start_load = original
    daemon_factory("victim", chunk_tokens=CHUNK)  # the same socket, an empty daemon
    assert serve(engine, "C", a) == len(a)  # nothing stored there yet: computed, and saved
    assert serve(make_engine(daemon, model), "D", a) == len(a) - 6 * CHUNK


def test_layerwise_loads_of_a_model_of_several_groups_are_refused_at_start_up(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    with pytest.raises(
        ValueError, match="load_mode 'layerwise' cannot serve a model with several KV-cache groups"
    ):
        make_engine(kvstored, GPT_OSS, extra={"load_mode": "layerwise"})
