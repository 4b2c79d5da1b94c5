"""Reuse across model versions and exact hand-over, with a real transformers Llama and the real daemon.

A progressive model's stage 2 keeps layers [0, b) of stage 1: it restores their KV and the
hidden states entering b, and runs only layers [b, L). A prompt stored with its tail is handed
over whole: the next process computes only the token it must.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.shared.spec import KVSpec, PageSpec
from kvstore.shared.wire import page_spec_message, page_spec_of
from kvstore.tiers.disk_files import record_path
from kvstore_client import KVStoreClient
from kvstore_client.hf import HFPrefixCache, cache_tensors
from tests.harness import REPO_ROOT, Daemon, python_env, wait_flushed
from tests.test_hf import tiny_llama

transformers = pytest.importorskip("transformers")
from kvstore_client.hf_stages import StagedPrefixCache, weights_ids  # noqa: E402  (needs transformers)

CHUNK = 16
LAYERS, BOUNDARY = 4, 2
TOLERANCE = 1e-4
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 1024,
}
# One small config per class the stage runner serves; Granite's multipliers all away from 1, so
# its embedding, its layers and its head each differ from Llama's.
SUPPORTED = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=16),
    "granite": lambda: transformers.GraniteConfig(
        **SMALL,
        logits_scaling=8.0,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.5,
    ),
}


def stage_one() -> Any:
    return tiny_llama(seed=0, layers=LAYERS)


def random_model(config: Any, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def digested_spec(model: Any, name: str) -> KVSpec:
    return KVSpec.from_hf_config(model.config, model=name, weights=weights_ids(model, [BOUNDARY, LAYERS]))


def next_stage(model: Any, first_changed: int, seed: int) -> Any:
    """`model` with its decoder layers from `first_changed` on re-initialised."""
    staged = copy.deepcopy(model)
    torch.manual_seed(seed)
    for layer in staged.model.layers[first_changed:]:
        for module in layer.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        for parameter in layer.parameters():  # RMSNorm weights too: every weight changes
            parameter.data.add_(torch.randn_like(parameter) * 0.05)
    return staged


def spec_of(model: Any, name: str, lower: str, upper: str) -> KVSpec:
    return KVSpec.from_hf_config(model.config, model=name, weights=[(BOUNDARY, lower), (LAYERS, upper)])


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def full(model: Any, input_ids: torch.Tensor) -> Any:
    return model(input_ids, use_cache=True, output_hidden_states=True)


def layer_calls(model: Any) -> Counter[int]:
    """Counts each decoder layer's forwards from now on."""
    calls: Counter[int] = Counter()
    for index, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda module, args, output, i=index: calls.update([i]))
    return calls


@pytest.fixture
def daemon(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory(chunk_tokens=CHUNK)


@pytest.fixture
def staged(daemon: Daemon) -> Iterator[Callable[..., StagedPrefixCache]]:
    opened: list[StagedPrefixCache] = []

    def make(model: Any, spec: KVSpec, address: str | None = None) -> StagedPrefixCache:
        stages = StagedPrefixCache.connect(address or daemon.address, spec, model, BOUNDARY)
        opened.append(stages)
        return stages

    yield make
    for stages in opened:
        stages.close()


def test_stage_two_runs_only_its_own_layers_and_gets_the_logits_of_a_full_forward(
    staged: Callable[..., StagedPrefixCache],
) -> None:
    one = stage_one()
    two = next_stage(one, BOUNDARY, seed=1)
    ids = prompt(70, seed=3)  # 4 whole chunks and a tail of 6
    first = staged(one, spec_of(one, "stage-1", "base-v1", "stage1-v1"))
    arena = first.lower.arena  # the three clients are siblings: one connection, one mapping
    assert arena is not None and first.upper.arena is arena and first.hidden.arena is arena
    assert first.upper._local is first.lower._local is first.hidden._local
    answered = first.prefill(ids)
    reference_one = full(one, ids)
    assert answered.path == "none"
    assert (answered.logits[0, -1] - reference_one.logits[0, -1]).abs().max().item() <= TOLERANCE
    assert first.save(ids, answered.past_key_values, answered.hidden_states) == 3 * 5
    held = {n["namespace"]: n.get("contents") for n in first.lower.stats()["namespaces"]}
    assert held == {
        first.lower.namespace.hex(): "KV of layers 0-1, weights base-v1",
        first.upper.namespace.hex(): "KV of layers 2-3, weights stage1-v1",
        first.hidden.namespace.hex(): "hidden states entering layer 2, weights base-v1",
    }

    second = staged(two, spec_of(two, "stage-2", "base-v1", "stage2-v1"))
    calls = layer_calls(two)
    result = second.prefill(ids)
    assert result.path == "partial" and result.restored == 70
    assert calls == Counter({2: 1, 3: 1})  # no layer before the boundary ran
    reference = full(two, ids)
    assert (result.logits[0, -1] - reference.logits[0, -1]).abs().max().item() <= TOLERANCE
    # What was restored is stage 1's bytes exactly; what was computed matches stage 2's forward.
    restored, expected = (
        cache_tensors(result.past_key_values, LAYERS),
        cache_tensors(reference_one.past_key_values, LAYERS),
    )
    for layer in range(BOUNDARY):
        for got, want in zip(restored[layer], expected[layer], strict=True):
            assert torch.equal(got, want)
    assert result.hidden_states is not None
    assert torch.equal(result.hidden_states, reference_one.hidden_states[BOUNDARY])
    computed = cache_tensors(reference.past_key_values, LAYERS)
    for layer in range(BOUNDARY, LAYERS):
        for got, want in zip(restored[layer], computed[layer], strict=True):
            assert (got - want).abs().max().item() <= TOLERANCE

    # The cache is ready for decoding: the next token's logits are a full forward's.
    step = torch.tensor([[int(result.logits[0, -1].argmax())]])
    with torch.no_grad():
        decoded = two(step, past_key_values=result.past_key_values, use_cache=True).logits[0, -1]
    assert (decoded - full(two, torch.cat([ids, step], dim=1)).logits[0, -1]).abs().max().item() <= TOLERANCE

    # Stage 2 stores its own layers; then it restores every layer and computes the last token.
    assert second.save(ids, result.past_key_values, result.hidden_states) == 5
    calls.clear()
    again = second.prefill(ids)
    assert again.path == "whole" and again.restored == 69
    assert calls == Counter(dict.fromkeys(range(LAYERS), 1))
    assert (again.logits[0, -1] - reference.logits[0, -1]).abs().max().item() <= TOLERANCE


def test_a_prompt_that_goes_past_the_stored_tokens_runs_the_rest_through_the_early_layers(
    staged: Callable[..., StagedPrefixCache],
) -> None:
    one = stage_one()
    two = next_stage(one, BOUNDARY, seed=2)
    ids = prompt(64, seed=4)
    first = staged(one, spec_of(one, "stage-1", "base-v1", "stage1-v1"))
    out = full(one, ids)
    first.save(ids, out.past_key_values, out.hidden_states)
    longer = torch.cat([ids, prompt(21, seed=5)], dim=1)
    second = staged(two, spec_of(two, "stage-2", "base-v1", "stage2-v1"))
    calls = layer_calls(two)
    result = second.prefill(longer)
    assert result.path == "partial" and result.restored == 64
    assert calls == Counter({0: 1, 1: 1, 2: 1, 3: 1})  # the 21 new tokens, then all 85 tokens
    assert (result.logits[0, -1] - full(two, longer).logits[0, -1]).abs().max().item() <= TOLERANCE


def test_a_stage_that_changed_an_earlier_layer_gets_no_hit(staged: Callable[..., StagedPrefixCache]) -> None:
    one = stage_one()
    ids = prompt(48, seed=6)
    first = staged(one, spec_of(one, "stage-1", "base-v1", "stage1-v1"))
    out = full(one, ids)
    first.save(ids, out.past_key_values, out.hidden_states)
    changed = next_stage(one, 1, seed=7)  # layer 1, before the boundary, changed: a new base id
    other = staged(changed, spec_of(changed, "stage-2", "base-v2", "stage2-v1"))
    tokens = ids[0].tolist()
    assert (other.lower.lookup(tokens), other.hidden.lookup(tokens), other.upper.lookup(tokens)) == (0, 0, 0)
    assert other.lower.namespace != first.lower.namespace and other.hidden.namespace != first.hidden.namespace
    result = other.prefill(ids)
    assert result.path == "none"
    assert (result.logits[0, -1] - full(changed, ids).logits[0, -1]).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("family", sorted(SUPPORTED))
def test_each_supported_model_class_gets_the_logits_of_its_own_full_forward(
    family: str, staged: Callable[..., StagedPrefixCache]
) -> None:
    one = random_model(SUPPORTED[family]())
    two = next_stage(one, BOUNDARY, seed=1)
    ids = prompt(64, seed=3)
    first = staged(one, digested_spec(one, f"{family}-1"))
    out = full(one, ids)
    assert first.save(ids, out.past_key_values, out.hidden_states) == 3 * 4
    second = staged(two, digested_spec(two, f"{family}-2"))
    longer = torch.cat([ids, prompt(21, seed=5)], dim=1)
    for asked in (ids, longer):  # only the head after layers [b, L); then the embedding too
        calls = layer_calls(two)
        result = second.prefill(asked)
        assert result.path == "partial" and result.restored == 64
        assert set(calls) == (set(range(LAYERS)) if asked is longer else {2, 3})
        reference = full(two, asked).logits[0, -1]
        assert (result.logits[0, -1] - reference).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (lambda: transformers.CohereConfig(**SMALL, logit_scale=0.5), "CohereForCausalLM is not one"),
        (lambda: transformers.Gemma2Config(**SMALL, head_dim=16), "Gemma2ForCausalLM is not one"),
        (
            lambda: transformers.MistralConfig(**SMALL, sliding_window=32),
            "MistralForCausalLM .* sliding_window=32",
        ),
        (
            lambda: transformers.Qwen2Config(
                **SMALL, use_sliding_window=True, sliding_window=32, max_window_layers=2
            ),
            r"Qwen2ForCausalLM with layer types \['sliding_attention'\]",
        ),
    ],
)
def test_a_model_whose_outer_steps_the_runner_cannot_reproduce_is_refused_at_connect(
    daemon: Daemon, config: Callable[[], Any], named: str
) -> None:
    model = random_model(config())
    spec = KVSpec.from_hf_config(model.config, model="refused", weights=[(BOUNDARY, "a"), (LAYERS, "b")])
    with pytest.raises(ValueError, match=named):
        StagedPrefixCache.connect(daemon.address, spec, model, BOUNDARY)
    with KVStoreClient.connect(daemon.address, spec) as plain:  # nothing was registered before the refusal
        assert [n["namespace"] for n in plain.stats()["namespaces"]] == [plain.namespace.hex()]


def test_two_models_labelled_alike_share_pages_but_their_weights_ids_do_not(
    staged: Callable[..., StagedPrefixCache],
) -> None:
    one = stage_one()
    other = copy.deepcopy(one)
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight[0, 0] += 1e-3  # one weight of layer 0
    ids = prompt(48, seed=6)
    tokens = ids[0].tolist()
    out = full(one, ids)
    labelled = staged(one, spec_of(one, "same", "base-v1", "top-v1"))
    labelled.save(ids, out.past_key_values, out.hidden_states)
    alike = staged(other, spec_of(other, "same", "base-v1", "top-v1"))
    assert alike.lower.lookup(tokens) == 48  # the labels say equal: the other model would read one's KV

    mine, theirs = weights_ids(one, [BOUNDARY, LAYERS]), weights_ids(other, [BOUNDARY, LAYERS])
    assert mine[0] != theirs[0] and mine[1] == theirs[1]  # layers [2, 4) alike, keyed after [0, 2) anyway
    first = staged(one, digested_spec(one, "same"))
    assert first.save(ids, out.past_key_values, out.hidden_states) == 3 * 3
    second = staged(other, digested_spec(other, "same"))
    assert (second.lower.lookup(tokens), second.upper.lookup(tokens), second.hidden.lookup(tokens)) == (
        0,
        0,
        0,
    )
    result = second.prefill(ids)
    assert result.path == "none"
    assert (result.logits[0, -1] - full(other, ids).logits[0, -1]).abs().max().item() <= TOLERANCE


def test_models_equal_up_to_the_boundary_share_that_range_by_weights_ids_and_nothing_after(
    staged: Callable[..., StagedPrefixCache],
) -> None:
    one = stage_one()
    two = next_stage(one, BOUNDARY, seed=13)
    mine, theirs = weights_ids(one, [BOUNDARY, LAYERS]), weights_ids(two, [BOUNDARY, LAYERS])
    assert mine[0] == theirs[0] and mine[1] != theirs[1]
    ids = prompt(48, seed=14)
    tokens = ids[0].tolist()
    first = staged(one, digested_spec(one, "stage-1"))
    out = full(one, ids)
    assert first.save(ids, out.past_key_values, out.hidden_states) == 3 * 3
    second = staged(two, digested_spec(two, "stage-2"))
    assert (second.lower.lookup(tokens), second.hidden.lookup(tokens), second.upper.lookup(tokens)) == (
        48,
        48,
        0,
    )
    assert second.lower.namespace == first.lower.namespace and second.upper.namespace != first.upper.namespace
    result = second.prefill(ids)
    assert result.path == "partial" and result.restored == 48
    assert (result.logits[0, -1] - full(two, ids).logits[0, -1]).abs().max().item() <= TOLERANCE


def test_weights_ids_cover_the_layers_and_configuration_and_are_the_same_in_another_process() -> None:
    one = stage_one()
    script = (
        "import json\nfrom tests.test_stages import stage_one\n"
        "from kvstore_client.hf_stages import weights_ids\n"
        f"print(json.dumps(weights_ids(stage_one(), [{BOUNDARY}, {LAYERS}])))"
    )
    child = subprocess.run(
        [sys.executable, "-c", script],
        env=python_env(),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert [tuple(entry) for entry in json.loads(child.stdout)] == weights_ids(one, [BOUNDARY, LAYERS])

    head_changed = copy.deepcopy(one)  # no KV depends on the final norm or the head
    with torch.no_grad():
        head_changed.lm_head.weight.mul_(2)
        head_changed.model.norm.weight.add_(1)
    assert weights_ids(head_changed, [BOUNDARY, LAYERS]) == weights_ids(one, [BOUNDARY, LAYERS])
    halved = copy.deepcopy(one).to(torch.bfloat16)  # the same model in another dtype: other bytes
    assert weights_ids(halved, [BOUNDARY])[0] != weights_ids(one, [BOUNDARY])[0]
    granite = SUPPORTED["granite"]()
    other = copy.deepcopy(granite)
    other.embedding_multiplier = 6.0  # equal weights, another embedding: other KV in every layer
    assert weights_ids(random_model(granite), [BOUNDARY]) != weights_ids(random_model(other), [BOUNDARY])
    with pytest.raises(ValueError, match=r"stops: expected increasing layers in 1..4, got \[2, 2\]"):
        weights_ids(one, [2, 2])


def test_a_corrupted_hidden_state_record_falls_back_to_a_full_forward(
    tmp_path: Path, daemon_factory: Callable[..., Daemon], staged: Callable[..., StagedPrefixCache]
) -> None:
    disk = tmp_path / "disk"
    daemon = daemon_factory(
        "with-disk",
        chunk_tokens=CHUNK,
        tiers__cpu__bytes="256KiB",
        tiers__cpu__slab_bytes="64KiB",
        tiers__disk__enabled=True,
        tiers__disk__path=str(disk),
        tiers__disk__bytes="16MiB",
    )
    one = stage_one()
    two = next_stage(one, BOUNDARY, seed=8)
    ids = prompt(64, seed=9)
    first = staged(one, spec_of(one, "stage-1", "base-v1", "stage1-v1"), daemon.address)
    out = full(one, ids)
    assert first.save(ids, out.past_key_values, out.hidden_states) == 12
    for seed in range(10, 18):  # push the prompt's pages out to disk
        other = prompt(64, seed)
        more = full(one, other)
        first.save(other, more.past_key_values, more.hidden_states)
    wait_flushed(first.hidden)
    record = record_path(disk, first.hidden.namespace, first.hidden.keys(ids[0].tolist())[0])
    data = bytearray(record.read_bytes())
    data[-10] ^= 0xFF
    record.write_bytes(bytes(data))
    second = staged(two, spec_of(two, "stage-2", "base-v1", "stage2-v1"), daemon.address)
    assert second.hidden.lookup(ids[0].tolist()) == 64  # the daemon does not know yet
    result = second.prefill(ids)
    assert result.path == "none"  # the first hidden-state chunk failed its checksum: nothing to start from
    assert (result.logits[0, -1] - full(two, ids).logits[0, -1]).abs().max().item() <= TOLERANCE


def test_a_prompt_stored_with_its_tail_is_handed_over_to_its_last_token(daemon: Daemon) -> None:
    model = stage_one()
    spec = KVSpec.from_hf_config(model.config, model="tiny-llama")
    ids = prompt(1000, seed=11)  # 62 whole chunks and a tail of 8
    tokens = ids[0].tolist()
    with (
        KVStoreClient.connect(daemon.address, spec) as prefill,
        KVStoreClient.connect(daemon.address, spec) as decode,
    ):
        out = full(model, ids)
        assert HFPrefixCache(prefill).save(ids, out.past_key_values, tail=True) == 63
        assert decode.lookup(tokens) == 992
        assert decode.lookup(tokens, tail=True) == 1000
        hit, cache = HFPrefixCache(decode).restore(ids)
        assert hit == 999  # every token but the last, which the forward computes for its logits
        for got, want in zip(
            cache_tensors(cache, LAYERS), cache_tensors(out.past_key_values, LAYERS), strict=True
        ):
            for restored, original in zip(got, want, strict=True):
                assert torch.equal(restored, original[:, :, :999])
        with torch.no_grad():
            logits = model(ids[:, 999:], past_key_values=cache, use_cache=True).logits[0, -1]
        assert (logits - out.logits[0, -1]).abs().max().item() <= TOLERANCE
        # The tail matches only itself: not a prompt that goes on differently, nor one that goes on.
        changed = tokens[:995] + [(t + 1) % 1000 for t in tokens[995:]]
        assert decode.lookup(changed, tail=True) == 992
        longer = tokens + prompt(24, seed=12)[0].tolist()
        assert decode.lookup(longer, tail=True) == 992
        hit, _ = HFPrefixCache(decode).restore(torch.tensor([changed]))
        assert hit == 992


def test_layer_ranges_share_only_what_their_weights_share() -> None:
    def page(
        weights: Any, first: int = 0, stop: int = LAYERS, model: str = "m", layers: int = LAYERS
    ) -> PageSpec:
        return (
            KVSpec(
                model=model,
                num_layers=layers,
                num_kv_heads=2,
                head_dim=16,
                dtype="float32",
                chunk_tokens=CHUNK,
                weights=weights,
            )
            .layer_range(first, stop)
            .page
        )

    base = [(BOUNDARY, "base")]
    a, b = page([*base, (LAYERS, "one")]), page([*base, (LAYERS, "two")], model="other")
    assert a.namespace() != b.namespace()
    lower_a = page([*base, (LAYERS, "one")], 0, BOUNDARY)
    lower_b = page([*base, (8, "two")], 0, BOUNDARY, model="other", layers=8)  # names and depth differ
    assert lower_a.namespace() == lower_b.namespace() and lower_a.stored_layers == (0, 1)
    assert lower_a.page_bytes == a.page_bytes // 2
    assert (
        page([*base, (LAYERS, "one")], BOUNDARY, LAYERS).namespace()
        != page([*base, (LAYERS, "two")], BOUNDARY, LAYERS).namespace()
    )
    plain = KVSpec(
        model="m", num_layers=LAYERS, num_kv_heads=2, head_dim=16, dtype="float32", chunk_tokens=CHUNK
    )
    assert plain.layer_range(0, BOUNDARY).page.namespace() != plain.page.namespace()  # a range has its own
    spec = KVSpec(
        model="m",
        num_layers=LAYERS,
        num_kv_heads=2,
        head_dim=16,
        dtype="float32",
        chunk_tokens=CHUNK,
        weights=[*base, (LAYERS, "one")],
    )
    hidden = spec.hidden_states(BOUNDARY, 64).page
    assert hidden.page_bytes == CHUNK * 64 * 4 and hidden.namespace() not in (
        lower_a.namespace(),
        a.namespace(),
    )
    for sent in (lower_a, hidden, a, plain.page):
        assert page_spec_of(page_spec_message(sent), CHUNK) == sent
    with pytest.raises(ValueError, match="layer 3: not where a range of weights ends"):
        spec.layer_range(0, 3)
    with pytest.raises(ValueError, match="weights: the last range ends at layer 2"):
        PageSpec("m", LAYERS, 2, 16, "float32", CHUNK, weights=((2, "base"),))
    with pytest.raises(ValueError, match="stops must increase"):
        KVSpec(
            model="m",
            num_layers=LAYERS,
            num_kv_heads=2,
            head_dim=16,
            dtype="float32",
            weights=[(3, "a"), (2, "b")],
        )
    with pytest.raises(ValueError, match="first_layer, stop_layer"):
        _ = plain.layer_range(3, 2).page
    with pytest.raises(ValueError, match="hidden_layer: a hidden-state page is one latent-format layer"):
        PageSpec("m", LAYERS, 2, 16, "float32", CHUNK, hidden_layer=2)


def test_a_daemon_refuses_a_spec_with_bad_ranges_with_a_message(daemon: Daemon) -> None:
    import grpc

    from kvstore.proto import kvstore_pb2 as pb
    from kvstore.proto import kvstore_pb2_grpc

    message = page_spec_message(PageSpec("m", LAYERS, 2, 16, "float32", CHUNK))
    message.weights.add(stop=1, id="base")
    message.weights.add(stop=1, id="again")
    with grpc.insecure_channel(f"unix://{daemon.socket_path}") as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Connect(pb.ConnectRequest(spec=message, client_name="t"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stops must increase" in (caught.value.details() or "")


def test_weights_ids_do_not_depend_on_where_the_weights_are_or_how_they_are_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvstore_client.hf_stages_weights as hf_stages  # where weights_ids reads _PIECE_BYTES

    one = stage_one()
    whole = weights_ids(one, [BOUNDARY, LAYERS])
    monkeypatch.setattr(hf_stages, "_PIECE_BYTES", 1000)  # every tensor in many pieces, a short last one
    assert weights_ids(one, [BOUNDARY, LAYERS]) == whole
    if torch.cuda.is_available():  # through the pinned buffers, in pieces, then at once
        on_gpu = copy.deepcopy(one).cuda()
        assert weights_ids(on_gpu, [BOUNDARY, LAYERS]) == whole
        monkeypatch.undo()
        assert weights_ids(on_gpu, [BOUNDARY, LAYERS]) == whole
