"""The vLLM connector driven by vLLM's own Scheduler, with a real kvstored and CPU KV caches.

Every forward of the stand-in model (`tests.vllm_engine`) checks that each token a request
attends to holds exactly the KV of its prefix, so a test that runs to the end has proven that
no loaded byte differed from what was stored and that no block vLLM counted as loaded was left
unwritten. The KV caches start poisoned, and are poisoned again before the request under test.
"""

from __future__ import annotations

import dataclasses
import signal
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: tests/install-vllm (the README's test command runs it)")

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvstore.shared.keys import chain_keys  # noqa: E402
from kvstore.tiers.disk_files import record_path  # noqa: E402
from kvstore_client import KVSpec, KVStoreClient  # noqa: E402
from kvstore_client.vllm import ConnectorConfig  # noqa: E402
from kvstore_client.vllm import prompts as vllm_prompts  # noqa: E402
from kvstore_client.vllm import scheduler as vllm_scheduler  # noqa: E402
from tests.harness import Daemon, wait_flushed  # noqa: E402
from tests.vllm_engine import SAMPLED, Engine, Model, vllm_config  # noqa: E402

CHUNK = 32
MODEL = Model()
SPEC = KVSpec(  # what a client of the test model's pages connects with (rank 0 of 1)
    model="test-llama", num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", layout="vllm"
)
PAGE_BYTES = MODEL.num_layers * 2 * CHUNK * MODEL.num_kv_heads * MODEL.head_dim * 2  # 6 KiB


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7_919 + i * 31) % 30_000 + 10 for i in range(length)]


@pytest.fixture
def kvstored(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory(chunk_tokens=CHUNK)


@pytest.fixture
def make_engine(tmp_path: Path) -> Iterator[Callable[..., Engine]]:
    engines: list[Engine] = []

    def make(
        daemon: Daemon | str, *, tp_size: int = 1, extra: dict[str, Any] | None = None, **options: Any
    ) -> Engine:
        address = daemon if isinstance(daemon, str) else daemon.address
        layout = options.pop("layout", KVCacheLayout.LBNHC)
        model_dir = MODEL.write_config(tmp_path / f"model-tp{tp_size}", tp_size)
        settings = {"address": address, "model": "test-llama", **(extra or {})}
        engine = Engine(vllm_config(model_dir, settings, tp_size=tp_size, **options), MODEL, layout=layout)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def serve(engine: Engine, request_id: str, tokens: list[int], max_tokens: int = 1, **fields: Any) -> int:
    """Runs one request alone on poisoned caches; the prompt tokens the model computed for it."""
    engine.poison()
    engine.computed_prompt_tokens = 0
    engine.add(request_id, tokens, max_tokens, **fields)
    engine.run()
    return engine.computed_prompt_tokens


def stored_keys(engine: Engine) -> list[Any]:
    return [key for event in engine.events if isinstance(event, BlockStored) for key in event.block_hashes]


# -- hits --------------------------------------------------------------------


@pytest.mark.parametrize("load_mode", ["async", "layerwise"])
@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLHNC])
def test_a_shared_prefix_is_loaded_into_other_blocks_with_the_same_bytes(
    kvstored: Daemon, make_engine: Callable[..., Engine], load_mode: str, layout: KVCacheLayout
) -> None:
    engine = make_engine(kvstored, extra={"load_mode": load_mode}, layout=layout)
    metas: list[Any] = []
    build = engine.connector.build_connector_meta

    def recording(output: Any) -> Any:
        metas.append(build(output))
        return metas[-1]

    engine.connector.build_connector_meta = recording
    a = prompt(1, 200)
    engine.add("A", a, max_tokens=20)  # A decodes on, holding its blocks, while B loads
    for _ in range(3):
        engine.step()
    a_blocks = {block for meta in metas for save in meta.saves for block in save.block_ids}
    assert engine.computed_prompt_tokens == 200 and len(a_blocks) == 12
    b = a[:150] + prompt(2, 100)  # shares 4 whole chunks (128 tokens) with A
    engine.add("B", b, 1)  # its blocks start as the poison every unused block holds
    engine.run()
    assert engine.computed_prompt_tokens == 200 + 250 - 128
    (load,) = [load for meta in metas for load in meta.loads]
    assert (load.req_id, load.first, load.stop, load.skip) == ("B", 0, 4, 0)
    assert not a_blocks & set(load.block_ids)  # other blocks than A's
    assert engine.tokens == {"A": [SAMPLED] * 20, "B": [SAMPLED]}


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_lookup_past_its_first_window_finds_the_whole_prefix(
    kvstored: Daemon, make_engine: Callable[..., Engine], monkeypatch: Any, tp_size: int
) -> None:
    monkeypatch.setattr(vllm_scheduler, "PROBE_TOKENS", 2 * CHUNK)  # a first window of 2 chunks
    engine = make_engine(kvstored, tp_size=tp_size)
    a = prompt(24, 250)
    assert serve(engine, "A", a) == 250
    assert serve(engine, "B", a[:200] + prompt(25, 10)) == 210 - 192  # 6 chunks: 2, then 4 more
    assert serve(engine, "C", a[:40] + prompt(26, 30)) == 70 - 32  # the first window ends it


def test_a_whole_prompt_hit_leaves_one_token_to_compute(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(kvstored)
    a = prompt(3, 192)  # 6 whole chunks
    assert serve(engine, "A", a) == 192
    assert serve(engine, "A-again", a, max_tokens=3) == 1
    assert engine.tokens["A-again"] == [SAMPLED] * 3


# -- what a chunk's KV depends on beside its tokens -----------------------------


def test_lora_and_cache_salt_requests_share_chunks_only_with_their_own_kind(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(kvstored)
    a = prompt(30, 160)  # 5 whole chunks
    adapter = LoRARequest("adapter-x", 1, "/adapters/x")
    assert serve(engine, "plain", a) == 160
    assert serve(engine, "salted", a, cache_salt="tenant-a") == 160  # not the plain request's KV
    assert serve(engine, "other-tenant", a, cache_salt="tenant-b") == 160
    assert serve(engine, "lora", a, lora_request=adapter) == 160
    assert serve(engine, "lora-moved", a, lora_request=LoRARequest("adapter-x", 1, "/adapters/x2")) == 160
    # each kind hits its own chunks, whole (one token left to compute), with the bytes it stored
    assert serve(engine, "salted-again", a, cache_salt="tenant-a") == 1
    assert serve(engine, "lora-again", a, lora_request=LoRARequest("adapter-x", 7, "/adapters/x")) == 1
    assert serve(engine, "plain-again", a) == 1
    keys = stored_keys(engine)
    assert len(keys) == 5 * 5 == len(set(keys))  # five kinds, five chunks each, no key shared


def test_media_key_the_chunks_they_cover_and_every_chunk_after(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(kvstored)
    a = prompt(31, 160)
    assert serve(engine, "plain", a) == 160

    def image(identifier: str, offset: int) -> MultiModalFeatureSpec:
        return MultiModalFeatureSpec(
            data=None, modality="image", identifier=identifier, mm_position=PlaceholderRange(offset, 20)
        )

    def keys(request_id: str, *features: MultiModalFeatureSpec) -> list[bytes]:
        request = engine.request(request_id, a, mm_features=list(features))
        extras = vllm_prompts.chunk_extras(request, 5, CHUNK)
        return chain_keys(b"n" * 16, struct.pack("<160i", *a), CHUNK, extras)

    plain = chain_keys(b"n" * 16, struct.pack("<160i", *a), CHUNK)
    cat, dog, cat_later = (
        keys("cat", image("cat", 70)),
        keys("dog", image("dog", 70)),
        keys("c2", image("cat", 75)),
    )
    assert cat[:2] == dog[:2] == cat_later[:2] == plain[:2]  # before the image: the plain keys
    assert len({cat[i] for i in range(2, 5)} | {dog[i] for i in range(2, 5)} | set(plain[2:])) == 9
    assert len(set(cat[2:]) | set(cat_later[2:])) == 6  # the same image elsewhere is other KV
    assert keys("cat-again", image("cat", 70)) == cat
    request = engine.request("with-image", a, mm_features=[image("cat", 70)])
    assert engine.connector.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, True)
    engine.connector.request_finished(request, [])


def test_a_prompt_that_shares_a_prefix_takes_its_keys_from_the_memo(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(kvstored)
    a = prompt(32, 320)  # 10 whole chunks: A's saves put all ten keys in the memo
    assert serve(engine, "A", a) == 320
    b = a[:200] + prompt(33, 100)  # 6 whole chunks (192 tokens) in common
    request = engine.request("B", b)
    assert engine.connector.get_num_new_matched_tokens(request, 0) == (192, True)
    scheduler = engine.connector._scheduler
    state = scheduler._requests["B"]
    with KVStoreClient.connect(kvstored.address, SPEC) as client:
        assert state.keys[client.namespace] == client.keys(b)  # the memo's keys are the tokens' keys
    assert state.packed_from == 192 and len(state.packed) == (288 - 192) * 4  # none of A's tokens packed
    engine.connector.request_finished(request, [])
    memo = vllm_prompts.KeyMemo(2, capacity=4)
    keys = [bytes([i]) * 16 for i in range(6)]
    memo.add(keys, [bytes([100 + i]) * 32 for i in range(12)], 0)
    assert list(memo.keys.values()) == keys[2:]  # at most `capacity`, the oldest dropped


def test_a_partial_chunk_held_by_vllms_prefix_cache_is_never_written(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    """vLLM's own cache holds 48 tokens (1.5 chunks); kvstore holds 6 chunks: chunk 1's first
    block is vLLM's and must not be written, its second block and chunks 2..5 are loaded."""
    writer = make_engine(kvstored)
    a = prompt(4, 200)
    assert serve(writer, "A", a) == 200
    engine = make_engine(kvstored, prefix_caching=True)
    assert serve(engine, "X", a[:48] + prompt(5, 20)) == 68 - 32  # chunk 0 came from kvstore
    engine.computed_prompt_tokens = 0
    engine.add("B", a + prompt(6, 10), 1)  # no poison: vLLM's cached blocks must stay as they are
    engine.run()
    assert engine.computed_prompt_tokens == 210 - 192


def test_vllms_own_prefix_cache_and_kvstore_together_compute_less(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(kvstored, prefix_caching=True)
    a = prompt(7, 256)
    assert serve(engine, "A", a) == 256
    engine.scheduler.reset_prefix_cache()  # vLLM forgets, kvstore does not
    assert serve(engine, "B", a + prompt(8, 40)) == 296 - 256


# -- failures ----------------------------------------------------------------


def test_a_chunk_that_cannot_be_read_back_is_recomputed_from_there(
    tmp_path: Path, daemon_factory: Callable[..., Daemon], make_engine: Callable[..., Engine]
) -> None:
    disk = tmp_path / "disk"
    daemon = daemon_factory(
        chunk_tokens=CHUNK,
        tiers__cpu__bytes=f"{40 * PAGE_BYTES // 1024}KiB",
        tiers__cpu__slab_bytes=f"{40 * PAGE_BYTES // 1024}KiB",
        tiers__disk__enabled=True,
        tiers__disk__path=str(disk),
        tiers__disk__bytes="64MiB",
    )
    engine = make_engine(daemon)
    a = prompt(9, 256)  # 8 chunks
    assert serve(engine, "A", a) == 256
    for i in range(8):  # 64 more pages: A's go to disk
        serve(engine, f"filler-{i}", prompt(100 + i, 256))
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        wait_flushed(client)
        record = record_path(disk, client.namespace, client.keys(a)[5])
        data = bytearray(record.read_bytes())
        data[-50] ^= 0xFF
        record.write_bytes(bytes(data))
    removed_before = sum(isinstance(event, BlockRemoved) for event in engine.events)
    assert serve(engine, "B", a + prompt(10, 20)) == 276 - 5 * CHUNK  # chunks 0..4 load, then recompute
    assert sum(isinstance(event, BlockRemoved) for event in engine.events) == removed_before + 1


def test_pages_gone_between_lookup_and_load_are_recomputed(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(kvstored)
    a = prompt(11, 160)
    assert serve(engine, "A", a) == 160
    original = engine.workers[0].start_load_kv
    cleared: list[int] = []

    def clear_then_load(context: Any) -> None:  # after the scheduler's lookup, before the load
        client = engine.workers[0]._worker.groups[0].conn.get()
        if not cleared and client is not None:
            cleared.append(client.clear())
        original(context)

    engine.workers[0].start_load_kv = clear_then_load
    assert serve(engine, "B", a + prompt(12, 10)) == 170
    assert cleared == [5]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_daemon_is_a_miss_and_a_restarted_one_serves_again(
    tmp_path: Path,
    daemon_factory: Callable[..., Daemon],
    make_engine: Callable[..., Engine],
    caplog: Any,
    sig: signal.Signals,
) -> None:
    daemon = daemon_factory("first", chunk_tokens=CHUNK)
    engine = make_engine(daemon)
    a = prompt(13, 128)
    assert serve(engine, "A", a) == 128
    assert daemon.stop(sig) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    started = time.monotonic()
    assert serve(engine, "B", a + prompt(14, 10)) == 138  # nothing raised, everything computed
    assert time.monotonic() - started < 5
    assert serve(engine, "C", prompt(15, 96)) == 96  # its save is dropped
    again = daemon_factory("first", chunk_tokens=CHUNK)  # the same socket, an empty daemon
    assert again.address == daemon.address
    time.sleep(0.3)
    assert serve(engine, "D", prompt(16, 96)) == 96
    assert serve(engine, "E", prompt(16, 96) + [5]) == 1  # D's chunks, saved after the restart
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "not serving" in r.getMessage()]
    assert 1 <= len(warnings) <= 3  # one per client (scheduler, worker) for the outage


def test_a_daemon_that_is_down_at_start_up_costs_nothing(
    tmp_path: Path, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(f"unix://{tmp_path}/nothing-here.sock")
    assert serve(engine, "A", prompt(17, 100)) == 100
    assert serve(engine, "B", prompt(17, 100)) == 100


def test_bad_extra_config_names_the_key() -> None:
    with pytest.raises(ValueError, match="load_mode"):
        ConnectorConfig.from_extra({"load_mode": "eager"})
    with pytest.raises(ValueError, match="unknown key.*adress"):
        ConnectorConfig.from_extra({"adress": "unix:///x"})
    with pytest.raises(ValueError, match="lookup_timeout_s"):
        ConnectorConfig.from_extra({"lookup_timeout_s": -1})
    with pytest.raises(ValueError, match="save_to: expected one of auto, arena, gpu, lend, got 'hbm'"):
        ConnectorConfig.from_extra({"save_to": "hbm"})
    for readers in (0, 17, "2", True):
        with pytest.raises(
            ValueError, match=r"lend_readers: expected the decode instance's TP size, 1\.\.16"
        ):
            ConnectorConfig.from_extra({"save_to": "lend", "lend_readers": readers})
    with pytest.raises(ValueError, match="lend_readers: only with save_to 'lend'"):
        ConnectorConfig.from_extra({"lend_readers": 2})
    assert ConnectorConfig.from_extra({"save_to": "lend", "lend_readers": 8}).lend_readers == 8
    roles = {"kv_producer": (False, True), "kv_consumer": (True, False), "kv_both": (True, True)}
    for save_to, wanted in (("auto", ["kv_producer"]), ("gpu", list(roles)), ("arena", []), ("lend", [])):
        config = ConnectorConfig.from_extra({"save_to": save_to})
        chosen = [
            role for role, (loads, saves) in roles.items() if config.saves_to_gpu(loads=loads, saves=saves)
        ]
        assert chosen == wanted


# -- roles, tensor parallelism, saves in flight, events ---------------------------


def test_two_tp_ranks_each_store_and_load_their_own_heads(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(kvstored, tp_size=2)
    a = prompt(18, 200)
    assert serve(engine, "A", a) == 200
    assert serve(engine, "B", a[:100] + prompt(19, 50)) == 150 - 96
    # Rank 1's pages alone gone: the scheduler's lookup agrees with what every rank can load.
    with KVStoreClient.connect(kvstored.address, dataclasses.replace(SPEC, tp_rank=1, tp_size=2)) as rank1:
        assert rank1.lookup(a) == 192
        assert rank1.clear() == 7  # A's 6 chunks and B's own fourth
    assert serve(engine, "C", a + [1]) == 201


def test_a_producer_saves_and_a_consumer_loads_through_one_daemon(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    prefill = make_engine(kvstored, kv_role="kv_producer")
    decode = make_engine(kvstored, kv_role="kv_consumer")
    assert [w._worker.save_to_gpu for w in (*prefill.workers, *decode.workers)] == [True, False]
    a = prompt(20, 160)
    assert serve(prefill, "A", a) == 160  # asked for the GPU tier: a CPU engine's saves go to the arena
    assert serve(prefill, "A-again", a) == 160  # a producer loads nothing
    assert serve(decode, "A", a + [3], max_tokens=4) == 1
    assert serve(decode, "B", prompt(21, 64)) == 64
    assert serve(prefill, "B", prompt(21, 64) + [1]) == 65  # the consumer saved nothing
    assert stored_keys(decode) == []


def test_a_lending_producer_keeps_a_requests_blocks_until_its_lend_is_done(
    kvstored: Daemon, make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`save_to: lend`. The lend itself needs a CUDA cache (test_lends_cuda.py moves the bytes);
    here the client lends as the daemon would answer, to see vLLM hold the request's blocks
    until `lends_done` names the lend, with the real scheduler."""
    engine = make_engine(kvstored, kv_role="kv_producer", extra={"save_to": "lend"})
    worker = engine.workers[0]._worker
    assert worker.lends and not worker.save_to_gpu
    lent: list[int] = []
    asked: list[list[int]] = []

    def lend(
        self: KVStoreClient, token_ids: Any, kv_caches: Any, block_ids: Any, **options: Any
    ) -> tuple[int, int]:
        assert token_ids is None and len(block_ids) == len(options["keys"]) * self.spec.blocks_per_chunk
        lent.append(len(options["keys"]))
        return 7, len(options["keys"]) * CHUNK

    def lends_done(self: KVStoreClient, ids: list[int], withdraw: bool = False) -> list[int]:
        asked.append(list(ids))
        # The request is finished, and its blocks are still the request's: vLLM has not freed them.
        assert "A" in engine.scheduler.requests
        assert engine.scheduler.kv_cache_manager.get_block_ids("A")[0]
        return list(ids) if len(asked) >= 3 else []

    monkeypatch.setattr(KVStoreClient, "lend", lend)
    monkeypatch.setattr(KVStoreClient, "lends_done", lends_done)
    engine.add("A", prompt(23, 128), 1)
    engine.run()
    assert lent == [128 // CHUNK] and asked == [[7], [7], [7]]
    assert "A" not in engine.scheduler.requests  # freed once the lend was done
    assert stored_keys(engine) == []  # nothing copied anywhere


def test_a_preempted_requests_lends_are_revoked_before_its_blocks_are_reused(
    kvstored: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM frees a preempted request's blocks at once (no delayed free): before the next forward
    may write them, the connector has revoked every lend of that request, so no decode instance
    counts a copy of them. An engine of 24 blocks of 16 tokens, two requests that outgrow it."""
    settings = {"address": kvstored.address, "model": "test-llama", "save_to": "lend"}
    config = vllm_config(MODEL.write_config(tmp_path / "small", 1), settings, kv_role="kv_producer")
    engine = Engine(config, MODEL, num_blocks=24)
    try:
        lends: dict[int, str] = {}
        revoked: list[tuple[list[int], set[str]]] = []

        lending = engine.workers[0]._worker._lending
        original_lend = lending.lend
        saving: list[str] = []

        def lend_of(client: Any, side: Any, spec: Any, keys: Any, readers: int = 1) -> bool:
            saving.append(spec.req_id)  # whose save the client's lend below is
            return original_lend(client, side, spec, keys, readers)

        def lend(self: KVStoreClient, token_ids: Any, kv_caches: Any, block_ids: Any, **options: Any):  # type: ignore[no-untyped-def]
            lend_id = len(lends) + 1
            lends[lend_id] = saving[-1]
            return lend_id, len(options["keys"]) * CHUNK

        monkeypatch.setattr(lending, "lend", lend_of)

        def lends_done(
            self: KVStoreClient, ids: list[int], *, withdraw: bool = False, revoke: bool = False
        ) -> list[int]:
            if revoke:
                # the request's blocks are free in vLLM but this step's forward has not run yet
                revoked.append((list(ids), {lends[i] for i in ids}))
            return list(ids)

        monkeypatch.setattr(KVStoreClient, "lend", lend)
        monkeypatch.setattr(KVStoreClient, "lends_done", lends_done)
        preempted: list[str] = []
        original = engine.scheduler._preempt_request

        def preempt(request: Any, *args: Any, **kwargs: Any) -> None:
            preempted.append(request.request_id)
            original(request, *args, **kwargs)

        monkeypatch.setattr(engine.scheduler, "_preempt_request", preempt)
        engine.add("A", prompt(26, 100), 150)  # 7 blocks each to start, 16 each by the end
        engine.add("B", prompt(27, 100), 150)
        engine.run()
        assert preempted, "the engine never ran out of blocks"
        assert revoked and {req for _, reqs in revoked for req in reqs} <= set(preempted)
        # every lend a preempted request made before its preemption was revoked
        assert {i for ids, _ in revoked for i in ids} >= {
            i for i, req in lends.items() if req in preempted and i < min(ids[0] for ids, _ in revoked)
        }
        assert engine.finished.keys() == {"A", "B"}
    finally:
        engine.close()


def test_a_cache_that_cannot_be_lent_is_stored_instead(
    kvstored: Daemon, make_engine: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    """On the CPU a lend is refused (no CUDA cache to export): said once, and the saves are stored."""
    engine = make_engine(kvstored, kv_role="kv_producer", extra={"save_to": "lend"})
    assert serve(engine, "A", prompt(24, 128)) == 128
    assert serve(engine, "B", prompt(25, 128)) == 128
    assert "A" not in engine.scheduler.requests and "B" not in engine.scheduler.requests
    assert len(stored_keys(engine)) == 2 * 128 // CHUNK
    assert sum("cannot be lent" in record.getMessage() for record in caplog.records) == 1


def test_a_finished_request_keeps_its_blocks_until_its_save_is_committed(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(kvstored)
    worker = engine.workers[0]._worker
    commits: list[str] = []
    original = worker._commit

    def commit(req_id: str) -> None:
        if worker._saving.get(req_id):
            # The request is finished and its blocks are still the request's: vLLM has not freed them.
            assert req_id in engine.scheduler.requests
            assert engine.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            commits.append(req_id)
        original(req_id)

    worker._commit = commit
    worker.commit_done = lambda: None  # gathers still running at every step's end, as a slow GPU's
    engine.add("A", prompt(22, 128), 1)
    engine.run()
    assert commits == ["A"]
    assert "A" not in engine.scheduler.requests  # freed once the save was reported
    assert serve(engine, "B", prompt(22, 128) + [1]) == 1


@pytest.mark.parametrize("when", ["loading", "prefilling"])
def test_a_request_aborted_mid_load_or_mid_prefill_gives_every_block_back(
    kvstored: Daemon, make_engine: Callable[..., Engine], when: str
) -> None:
    from vllm.v1.request import RequestStatus

    engine = make_engine(kvstored, max_num_batched_tokens=64)
    a = prompt(26, 192)
    assert serve(engine, "A", a) == 192
    engine.add("B", a + prompt(27, 200) if when == "loading" else prompt(27, 300), 1)
    engine.step()  # B's load (or its first 64 prompt tokens and their save) is under way
    engine.scheduler.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    engine.run()
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == engine.kv_cache_config.num_blocks - 1  # block 0 is vLLM's null block
    worker = engine.workers[0]._worker
    assert not worker._finished and not worker._loading and not worker._saving
    scheduler = engine.connector._scheduler
    assert not scheduler._requests and not scheduler._prompts  # nothing kept of a request that is gone
    assert serve(engine, "C", a + [9]) == 1  # the daemon still serves A's chunks whole


def test_kv_events_name_each_stored_chunk_and_each_found_gone(
    kvstored: Daemon, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(kvstored)
    a = prompt(23, 100)
    serve(engine, "A", a)
    stored = [event for event in engine.events if isinstance(event, BlockStored)]
    with KVStoreClient.connect(kvstored.address, SPEC) as client:
        keys = client.keys(a)
    assert [event.block_hashes for event in stored] == [[key] for key in keys]
    assert [event.parent_block_hash for event in stored] == [None, *keys[:-1]]
    assert [event.token_ids for event in stored] == [a[i * CHUNK : (i + 1) * CHUNK] for i in range(3)]
    assert {event.medium for event in stored} == {"CPU"} and {event.block_size for event in stored} == {CHUNK}
    serve(engine, "A-again", a)
    assert len([event for event in engine.events if isinstance(event, BlockStored)]) == 3  # nothing new
