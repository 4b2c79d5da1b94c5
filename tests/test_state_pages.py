"""Recurrent-state pages (`PageSpec.state`): one fixed-size state per layer and chunk boundary,
stored and loaded through a real kvstored, and the per-key Lookup (`each`) that finds which
boundaries hold one."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
import torch

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.keys import chunk_keys
from kvstore.shared.spec import KVSpec, PageSpec
from kvstore_client import KVStoreClient
from tests.harness import Daemon, wait_flushed

STATE_BYTES = 1000  # not a multiple of anything the kernels like: every byte must still move
STATE = "test-mamba2:conv=bfloat16[3,64];ssm=float32[2,16,13]"


def state_spec(num_layers: int = 3, **fields: object) -> KVSpec:
    return KVSpec(
        model="hybrid",
        num_layers=num_layers,
        num_kv_heads=1,
        head_dim=STATE_BYTES,
        dtype="uint8",
        block_size=1,
        layout="mla",
        layer_ids=tuple(range(1, 2 * num_layers, 2)),
        state=STATE,
        **fields,  # type: ignore[arg-type]
    )


def state_caches(num_layers: int, num_blocks: int, page: int, fill: int) -> list[torch.Tensor]:
    """Per layer, a `[blocks, 1, STATE_BYTES]` view of blocks `page` bytes apart (vLLM pads a
    Mamba layer's page past its state), every byte `fill`."""
    caches = []
    for _ in range(num_layers):
        raw = torch.full((num_blocks * page,), fill, dtype=torch.uint8)
        caches.append(raw.as_strided((num_blocks, 1, STATE_BYTES), (page, STATE_BYTES, 1)))
    return caches


def test_a_state_page_is_one_state_per_layer_whatever_the_chunk() -> None:
    page = state_spec().page_for(256)
    assert page.page_tokens == 1 and page.page_bytes == 3 * STATE_BYTES
    assert page_for_chunk(512).namespace() != page.namespace()  # the chunk still keys it
    other = KVSpec(**{**state_spec().__dict__, "state": STATE + ";v2"}).page_for(256)
    assert other.namespace() != page.namespace()  # another format: never a hit
    assert "state of layers 1,3,5" in page.contents


def page_for_chunk(chunk_tokens: int) -> PageSpec:
    return state_spec().page_for(chunk_tokens)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dtype": "bfloat16"}, "raw bytes"),
        ({"num_kv_heads": 2}, "num_kv_heads=1"),
        ({"block_size": 4}, "one state per block"),
        ({"layout": "vllm", "head_dim": 500}, "one state per block"),
        ({"state": "a\x1bb"}, "control character"),
    ],
)
def test_a_malformed_state_spec_is_refused_by_name(fields: dict[str, object], message: str) -> None:
    values = {**state_spec().__dict__, **fields}
    values.pop("page", None)
    with pytest.raises(ValueError, match=message):
        KVSpec(**values)  # type: ignore[arg-type]


def test_raw_bytes_are_only_a_state() -> None:
    with pytest.raises(ValueError, match="uint8 holds a recurrent state"):
        KVSpec(model="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="uint8", layout="mla")


def test_states_round_trip_at_the_boundaries_stored(daemon: Daemon) -> None:
    """States stored at chunks 1 and 4 of a prompt: `lookup_each` finds exactly those, and each
    loads back byte for byte into other blocks of another cache."""
    spec, layers, page = state_spec(), 3, STATE_BYTES + 24
    tokens = list(range(1000, 1000 + 6 * 64))
    with KVStoreClient.connect(daemon.address, spec.with_chunk_tokens(64)) as client:
        keys = chunk_keys(client.namespace, tokens, 64)
        source = state_caches(layers, 8, page, 0)
        for layer, cache in enumerate(source):
            cache[2].copy_(torch.randint(0, 256, (1, STATE_BYTES), dtype=torch.uint8))
            cache[5].copy_(torch.randint(0, 256, (1, STATE_BYTES), dtype=torch.uint8))
            cache[3].fill_(layer)  # never stored
        assert client.store_async(None, source, [2], keys=[keys[1]]).wait() > 0
        assert client.store_async(None, source, [5], keys=[keys[4]]).wait() > 0
        assert client.lookup_each(keys) == bytes([0, 2, 0, 0, 2, 0])
        assert client.lookup_chunks(keys) == 0  # no prefix: chunk 0 holds no state

        target = state_caches(layers, 8, page, 0x7E)
        handle = client.load_async(None, target, [6], keys=[keys[4]])
        assert handle.wait() > 0
        for layer in range(layers):
            assert torch.equal(target[layer][6], source[layer][5])
            assert bool((target[layer][5] == 0x7E).all())  # no other block written
            # the padding between states is not the state's: never written
            raw = target[layer].as_strided((8 * page,), (1,))
            assert bool((raw[6 * page + STATE_BYTES : 7 * page] == 0x7E).all())
        handle = client.load_async(None, target, [1], keys=[keys[1]])
        assert handle.wait() > 0
        for layer in range(layers):
            assert torch.equal(target[layer][1], source[layer][2])


def test_each_leases_nothing_and_says_so(daemon: Daemon) -> None:
    spec = state_spec().with_chunk_tokens(64)
    with KVStoreClient.connect(daemon.address, spec) as client:
        namespace = client.namespace
    stub = daemon.stub()
    key = bytes(16)
    with pytest.raises(grpc.RpcError) as error:
        stub.Lookup(pb.LookupRequest(namespace=namespace, keys=key, each=True, lease=True))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "leases nothing" in (error.value.details() or "")


def test_each_finds_states_the_disk_tier_holds(daemon_factory: Callable[..., Daemon], tmp_path) -> None:
    """A state evicted to disk is still found by `each` (Tier DISK), and loads back exact."""
    daemon = daemon_factory(
        tiers__cpu__bytes="16KiB",  # 16 states
        tiers__cpu__slab_bytes="16KiB",
        tiers__disk__enabled=True,
        tiers__disk__path=str(tmp_path / "disk"),
        tiers__disk__bytes="64MiB",
    )
    spec = state_spec(num_layers=1).with_chunk_tokens(16)
    tokens = list(range(40 * 16))
    with KVStoreClient.connect(daemon.address, spec) as client:
        keys = chunk_keys(client.namespace, tokens, 16)
        source = state_caches(1, 40, STATE_BYTES, 0)
        source[0].copy_(torch.randint(0, 256, source[0].shape, dtype=torch.uint8))
        for index in range(40):  # far more than the CPU tier holds: the first go to disk
            assert client.store_async(None, source, [index], keys=[keys[index]]).wait() > 0
        wait_flushed(client)
        tiers = client.lookup_each(keys)
        assert all(tiers) and 3 in tiers, tiers
        target = state_caches(1, 1, STATE_BYTES, 0x7E)
        first_on_disk = tiers.index(3)
        assert client.load_async(None, target, [0], keys=[keys[first_on_disk]]).wait() > 0
        assert torch.equal(target[0][0], source[0][first_on_disk])
