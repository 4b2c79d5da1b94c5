"""A real transformers model with the real daemon: restored prefixes give the logits of a full recompute."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.tiers.disk_files import record_path
from kvstore_client import KVSpec, KVStoreClient
from kvstore_client.hf import HFPrefixCache, cache_tensors
from kvstore_client.transfers import layer_groups
from tests.harness import Daemon, wait_flushed

transformers = pytest.importorskip("transformers")

CHUNK = 16
TOLERANCE = 1e-4
CUDA = torch.cuda.is_available()


def tiny_llama(seed: int = 0, layers: int = 3) -> Any:
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=1024,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def last_logits(model: Any, input_ids: torch.Tensor, cache: Any = None, hit: int = 0) -> torch.Tensor:
    device = next(model.parameters()).device
    out = model(input_ids[:, hit:].to(device), past_key_values=cache, use_cache=True)
    return out.logits[0, -1].float().cpu()


@torch.no_grad()
def save(prefix: HFPrefixCache, model: Any, input_ids: torch.Tensor) -> int:
    device = next(model.parameters()).device
    out = model(input_ids.to(device), use_cache=True)
    return prefix.save(input_ids, out.past_key_values)


@pytest.fixture
def model() -> Any:
    return tiny_llama()


@pytest.fixture
def connect(daemon_factory: Callable[..., Daemon]) -> Iterator[Callable[..., HFPrefixCache]]:
    """HFPrefixCache over a fresh client of one daemon (chunk_tokens=16), closed at the end."""
    daemon = daemon_factory(chunk_tokens=CHUNK)
    opened: list[KVStoreClient] = []

    def make(model: Any, name: str = "tiny-llama", hooked: bool = True) -> HFPrefixCache:
        client = KVStoreClient.connect(daemon.address, KVSpec.from_hf_config(model.config, model=name))
        opened.append(client)
        return HFPrefixCache(client, model if hooked else None)

    yield make
    for client in opened:
        client.close()


def test_restore_then_the_rest_equals_full_recompute(
    connect: Callable[..., HFPrefixCache], model: Any
) -> None:
    prefix = connect(model)
    a = prompt(100, seed=1)
    assert save(prefix, model, a) == 6  # whole chunks of 16: tokens 0..95
    question = torch.cat([a, prompt(20, seed=2)], dim=1)
    hit, cache = prefix.restore(question)
    assert hit == 96
    assert cache.get_seq_length() == 96
    want = last_logits(model, question)
    got = last_logits(model, question, cache, hit)
    assert (got - want).abs().max().item() <= TOLERANCE


def test_layerwise_restore_on_cpu_equals_full_recompute(
    connect: Callable[..., HFPrefixCache], model: Any
) -> None:
    prefix = connect(model)
    a = prompt(80, seed=3)
    save(prefix, model, a)
    question = torch.cat([a, prompt(7, seed=4)], dim=1)
    hit, cache = prefix.restore(question, overlap=True)
    assert hit == 80
    got = last_logits(model, question, cache, hit)
    assert (got - last_logits(model, question)).abs().max().item() <= TOLERANCE
    assert prefix.finish() == 0  # the forward released it


def test_a_prompt_diverging_mid_chunk_reuses_the_whole_chunks_before(
    connect: Callable[..., HFPrefixCache], model: Any
) -> None:
    prefix = connect(model)
    a = prompt(96, seed=5)
    save(prefix, model, a)
    b = torch.cat([a[:, :40], prompt(30, seed=6)], dim=1)  # diverges at token 40, inside chunk 2
    hit, cache = prefix.restore(b)
    assert hit == 32
    assert (last_logits(model, b, cache, hit) - last_logits(model, b)).abs().max().item() <= TOLERANCE


def test_a_fully_stored_prompt_leaves_one_token_to_compute(
    connect: Callable[..., HFPrefixCache], model: Any
) -> None:
    prefix = connect(model)
    a = prompt(64, seed=7)
    save(prefix, model, a)
    hit, cache = prefix.restore(a)
    assert hit == 63  # four whole chunks are stored; the last token is computed for its logits
    assert (last_logits(model, a, cache, hit) - last_logits(model, a)).abs().max().item() <= TOLERANCE
    hit, _ = prefix.restore(a[:, :1])
    assert hit == 0


def test_loading_a_layer_range_equals_recompute_for_those_layers(
    connect: Callable[..., HFPrefixCache], model: Any
) -> None:
    prefix = connect(model)
    a = prompt(64, seed=8)
    with torch.no_grad():
        full = model(a, use_cache=True).past_key_values
    prefix.save(a, full)
    want = cache_tensors(full, 3)
    poison = -3.0
    target = [(torch.full((1, 2, 64, 16), poison), torch.full((1, 2, 64, 16), poison)) for _ in range(3)]
    loaded = prefix.client.load(a[0].tolist(), target, None, layers=range(0, 2))
    assert loaded == 64
    for layer in range(3):
        for got, expect in zip(target[layer], want[layer] or (), strict=True):
            if layer < 2:
                assert torch.equal(got.view(torch.uint8), expect.contiguous().view(torch.uint8))
            else:
                assert bool((got == poison).all())


def test_two_models_never_see_each_others_pages(connect: Callable[..., HFPrefixCache]) -> None:
    first, second = tiny_llama(seed=0), tiny_llama(seed=1)
    prefix_a, prefix_b = connect(first, name="llama-a"), connect(second, name="llama-b")
    a = prompt(64, seed=9)
    save(prefix_a, first, a)
    assert prefix_b.restore(a)[0] == 0
    save(prefix_b, second, a)
    for prefix, model in ((prefix_a, first), (prefix_b, second)):
        hit, cache = prefix.restore(a)
        assert hit == 63
        assert (last_logits(model, a, cache, hit) - last_logits(model, a)).abs().max().item() <= TOLERANCE


def test_pages_lost_on_disk_give_the_valid_prefix_and_a_correct_forward(
    tmp_path: Path, daemon_factory: Callable[..., Daemon], model: Any
) -> None:
    # Pages of 3 layers x 2 x 16 tokens x 2 heads x 16 dims x 4 bytes = 12 KiB; the CPU tier holds 16.
    disk = tmp_path / "disk"
    daemon = daemon_factory(
        chunk_tokens=CHUNK,
        tiers__cpu__bytes="192KiB",
        tiers__cpu__slab_bytes="192KiB",
        tiers__disk__enabled=True,
        tiers__disk__path=str(disk),
        tiers__disk__bytes="16MiB",
    )
    spec = KVSpec.from_hf_config(model.config, model="tiny-llama")
    with KVStoreClient.connect(daemon.address, spec) as client:
        prefix = HFPrefixCache(client, model)
        a = prompt(160, seed=10)
        assert save(prefix, model, a) == 10
        for seed in range(11, 14):  # push prompt a out to disk
            save(prefix, model, prompt(160, seed))
        wait_flushed(client)
        keys = client.keys(a[0].tolist())
        record = record_path(disk, client.namespace, keys[4])
        data = bytearray(record.read_bytes())
        data[-10] ^= 0xFF
        record.write_bytes(bytes(data))
        question = torch.cat([a, prompt(5, seed=20)], dim=1)
        assert client.lookup(question[0].tolist()) == 160  # the daemon does not know yet
        hit, cache = prefix.restore(question)
        assert hit == 4 * CHUNK  # chunk 4 failed its checksum: the chunks before it are served
        got = last_logits(model, question, cache, hit)
        assert (got - last_logits(model, question)).abs().max().item() <= TOLERANCE


def test_a_daemon_gone_is_a_miss_not_an_error(daemon_factory: Callable[..., Daemon], model: Any) -> None:
    daemon = daemon_factory(chunk_tokens=CHUNK)
    spec = KVSpec.from_hf_config(model.config, model="tiny-llama")
    with KVStoreClient.connect(daemon.address, spec, timeout_s=5.0) as client:
        prefix = HFPrefixCache(client, model)
        a = prompt(48, seed=21)
        save(prefix, model, a)
        assert daemon.stop() == 0
        hit, cache = prefix.restore(a)
        assert hit == 0
        assert (last_logits(model, a, cache, hit) - last_logits(model, a)).abs().max().item() <= TOLERANCE
        assert save(prefix, model, a) == 0


def test_bad_input_is_a_clear_error(connect: Callable[..., HFPrefixCache], model: Any) -> None:
    prefix = connect(model, hooked=False)
    with pytest.raises(ValueError, match="batch size 2"):
        prefix.restore(torch.zeros((2, 8), dtype=torch.long))
    with pytest.raises(ValueError, match="overlap: needs HFPrefixCache"):
        prefix.restore(prompt(20, seed=1), overlap=True)
    with torch.no_grad():
        short = model(prompt(20, seed=1), use_cache=True).past_key_values
    with pytest.raises(ValueError, match="holds 20 tokens, fewer than the 40"):
        prefix.save(prompt(40, seed=1), short)
    with pytest.raises(ValueError, match="past_key_values: expected a transformers Cache"):
        prefix.save(prompt(20, seed=1), "not a cache")
    flash = KVSpec(model="x", num_layers=3, num_kv_heads=2, head_dim=16, dtype="float32")
    with pytest.raises(ValueError, match="layout='hf'"):
        HFPrefixCache(_FakeSpecClient(flash))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model: the config has no name_or_path"):
        KVSpec.from_hf_config(model.config)
    tokens = prompt(40, seed=1)[0]
    with pytest.raises(ValueError, match="keys: 1 keys for 2 whole chunks of token_ids"):
        prefix.client.lookup(tokens, keys=prefix.client.keys(tokens)[:1])


class _FakeSpecClient:
    """Only `.spec` is read before the layout is refused."""

    def __init__(self, spec: KVSpec) -> None:
        self.spec = spec


def test_layerwise_handle_without_cuda(connect: Callable[..., HFPrefixCache], model: Any) -> None:
    prefix = connect(model)
    a = prompt(32, seed=22)
    save(prefix, model, a)
    target = [(torch.zeros(1, 2, 32, 16), torch.zeros(1, 2, 32, 16)) for _ in range(3)]
    handle = prefix.client.load_async(a[0].tolist(), target, None, layerwise=True, layers=range(1, 3))
    assert handle.tokens == 32 and handle.layers == range(1, 3)
    assert all(handle.layer_done(layer) for layer in handle.layers)
    handle.wait_layer(1)  # copies on the CPU are already done
    with pytest.raises(ValueError, match="layer: 0 is not among this load's layers"):
        handle.wait_layer(0)
    assert handle.wait() == 32
    with pytest.raises(ValueError, match="layers: range\\(0, 4\\) is outside 0..3"):
        prefix.client.load_async(a[0].tolist(), target, None, layers=range(0, 4))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: layer-wise restore on the device")
def test_layerwise_restore_on_cuda_equals_full_recompute(
    connect: Callable[..., HFPrefixCache],
) -> None:
    model = tiny_llama(seed=3, layers=4).cuda()
    prefix = connect(model)
    a = prompt(200, seed=23)
    save(prefix, model, a)
    question = torch.cat([a, prompt(9, seed=24)], dim=1)
    want = last_logits(model, question)
    for overlap in (False, True):
        hit, cache = prefix.restore(question, overlap=overlap)
        assert hit == 192
        if overlap:
            assert prefix._pending is not None
            events = prefix._pending[0].layer_events
            runs = layer_groups(range(4), prefix.client.layerwise_runs)  # one event per run
            assert len(runs) > 1
            for run in runs:
                assert len({id(events[layer]) for layer in run}) == 1
            assert len({id(event) for event in events.values()}) == len(runs)
        got = last_logits(model, question, cache, hit)
        assert (got - want).abs().max().item() <= TOLERANCE
        assert prefix._pending is None


def test_the_example_runs_on_cpu_and_matches_recompute() -> None:
    import re
    import subprocess
    import sys

    from tests.harness import python_env

    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, str(root / "examples" / "hf_prefix_reuse.py"), "--prompt-tokens", "520"]
    command += ["--question-tokens", "8", "--device", "cpu"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=python_env())
    assert result.returncode == 0, result.stderr
    assert "528 tokens, 512 restored from kvstored" in result.stdout
    match = re.search(r"largest logit difference: (\S+)", result.stdout)
    assert match is not None, result.stdout
    assert float(match.group(1)) <= TOLERANCE


def test_layer_groups_double_and_cover_the_range_in_order() -> None:

    assert [len(g) for g in layer_groups(range(32), 6)] == [1, 1, 2, 4, 8, 16]
    assert [len(g) for g in layer_groups(range(32), 8)] == [1, 1, 2, 4, 8, 16]
    assert [len(g) for g in layer_groups(range(32), 3)] == [1, 1, 30]
    assert layer_groups(range(32), 1) == [range(32)]
    assert layer_groups(range(3, 10), 6) == [range(3, 4), range(4, 5), range(5, 7), range(7, 10)]
    assert layer_groups(range(5, 5), 2) == []
    for layers in (range(1), range(2, 61), range(0, 80)):
        for runs in (1, 2, 5, 9):
            groups = layer_groups(layers, runs)
            assert len(groups) <= runs
            assert [layer for group in groups for layer in group] == list(layers)
    with pytest.raises(ValueError, match="runs: expected a positive integer, got 0"):
        layer_groups(range(4), 0)
