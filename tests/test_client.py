"""The client against the real daemon: store and load KV byte for byte, through shared memory and bytes."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest
import torch

from kvstore.shared.errors import Unauthenticated
from kvstore_client import KVSpec, KVStoreClient, ResourceExhausted
from tests.harness import Daemon, python_env

BLOCK = 16
CHUNK = 256


def make_spec(dtype: torch.dtype = torch.float16, model: str = "llama-test", layers: int = 4) -> KVSpec:
    return KVSpec(
        model=model,
        num_layers=layers,
        num_kv_heads=2,
        head_dim=32,
        dtype=dtype,
        block_size=BLOCK,
        layout="flash_attn",
    )


def random_cache(spec: KVSpec, num_blocks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [
        torch.randn(shape, generator=gen).to(torch.float32).to(getattr(torch, spec.dtype))
        for _ in range(spec.num_layers)
    ]


def empty_cache(spec: KVSpec, num_blocks: int) -> list[torch.Tensor]:
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.full(shape, -7.0, dtype=getattr(torch, spec.dtype)) for _ in range(spec.num_layers)]


def tokens_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_blocks_equal(
    dst: list[torch.Tensor], dst_blocks: torch.Tensor, src: list[torch.Tensor], src_blocks: torch.Tensor
) -> None:
    for layer, (d, s) in enumerate(zip(dst, src, strict=True)):
        got, want = d[:, dst_blocks].view(torch.uint8), s[:, src_blocks].view(torch.uint8)
        assert torch.equal(got, want), f"layer {layer} differs"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shared_memory", [True, False])
def test_store_then_load_2k_tokens(daemon: Daemon, dtype: torch.dtype, shared_memory: bool) -> None:
    spec = make_spec(dtype)
    tokens = tokens_of(2048 + 100, seed=1)  # 8 whole chunks and a partial tail that is not stored
    blocks = torch.randperm(400, generator=torch.Generator().manual_seed(2))[: len(tokens) // BLOCK + 1]
    source = random_cache(spec, 400, seed=3)
    with KVStoreClient.connect(daemon.address, spec, shared_memory=shared_memory) as client:
        assert client.shared_memory is shared_memory
        assert client.lookup(tokens) == 0
        assert client.store(tokens, source, blocks) == 8
        assert client.store(tokens, source, blocks) == 0  # already stored
        assert client.lookup(tokens) == 2048
        target = empty_cache(spec, 300)
        target_blocks = torch.randperm(300, generator=torch.Generator().manual_seed(4))[:128]
        assert client.load(tokens, target, target_blocks) == 2048
        assert_blocks_equal(target, target_blocks, source, blocks[:128])
        untouched = torch.ones(300, dtype=torch.bool)
        untouched[target_blocks] = False
        assert all(bool((t[:, untouched] == -7.0).all()) for t in target)
        stats = client.stats()
        assert stats["tiers"]["cpu"]["pages"] == 8
        assert stats["counters"]["stored_chunks"] == 8
        assert stats["counters"]["active_leases"] == 0


@pytest.mark.parametrize("shared_memory", [True, False])
def test_registered_kv_caches_store_and_load_the_same_bytes(daemon: Daemon, shared_memory: bool) -> None:
    spec = make_spec(torch.bfloat16)
    tokens = tokens_of(1024, seed=11)
    blocks = torch.randperm(200, generator=torch.Generator().manual_seed(12))[:64]
    source = random_cache(spec, 200, seed=13)
    with KVStoreClient.connect(daemon.address, spec, shared_memory=shared_memory) as client:
        assert client.store(tokens, client.register_kv_caches(source), blocks) == 4
        target = empty_cache(spec, 100)
        registered = client.register_kv_caches(target)
        target_blocks = torch.randperm(100, generator=torch.Generator().manual_seed(14))[:64]
        for _ in range(2):
            assert client.load(tokens, registered, target_blocks) == 1024
            assert_blocks_equal(target, target_blocks, source, blocks)
        first_layers = client.load(tokens, registered, target_blocks.flip(0), layers=range(0, 2))
        assert first_layers == 1024
        assert_blocks_equal(target[:2], target_blocks.flip(0), source[:2], blocks)
        with pytest.raises(ValueError, match=r"kv_caches\[3\]: shape"):
            client.register_kv_caches([*target[:3], target[3][:, :, :8]])


@pytest.mark.parametrize("shared_memory", [True, False])
def test_a_load_refuses_a_bad_block_table_and_releases_its_pages(daemon: Daemon, shared_memory: bool) -> None:
    """A block table that cannot take the hit is refused naming the entry (the table is checked while
    the Lookup is in flight, and in full when that check failed); the lease is released and the
    cache untouched. A table shorter than the prompt loads the chunks it covers only when it
    covers every chunk that hit."""
    spec = make_spec()
    tokens = tokens_of(1024, seed=21)  # 4 chunks, 64 blocks
    source = random_cache(spec, 64, seed=22)
    with KVStoreClient.connect(daemon.address, spec, shared_memory=shared_memory) as client:
        assert client.store(tokens, source, torch.arange(64)) == 4
        target = empty_cache(spec, 64)
        outside = torch.arange(64)
        outside[40] = 64  # chunk 2's block
        twice = torch.arange(64)
        twice[50] = 3  # chunk 3's block repeats chunk 0's
        for table, message in (
            (outside, r"block_ids\[40\]: block 64 \(chunk 2\) is outside 0..63"),
            (twice, "block 3 appears twice"),
            (torch.arange(32), "the block table has 32 entries; chunk 3 needs 64"),
        ):
            with pytest.raises(ValueError, match=message):
                client.load(tokens, target, table)
            assert all(bool((t == -7.0).all()) for t in target)
            assert client.stats()["counters"]["active_leases"] == 0
        assert client.load(tokens[:512], target, torch.arange(32)) == 512
        assert_blocks_equal(target, torch.arange(32), source, torch.arange(32))


def test_shared_memory_and_bytes_clients_share_pages(daemon: Daemon) -> None:
    spec = make_spec(torch.bfloat16)
    tokens = tokens_of(1024, seed=5)
    blocks = torch.arange(64)
    source = random_cache(spec, 64, seed=6)
    with (
        KVStoreClient.connect(daemon.address, spec, shared_memory=True) as writer,
        KVStoreClient.connect(daemon.address, spec, shared_memory=False) as reader,
    ):
        writer.store(tokens, source, blocks)
        target = empty_cache(spec, 64)
        assert reader.load(tokens, target, blocks) == 1024
        assert_blocks_equal(target, blocks, source, blocks)


def test_lookup_is_the_exact_prefix(daemon: Daemon) -> None:
    spec = make_spec()
    tokens = tokens_of(4 * CHUNK, seed=7)
    cache = random_cache(spec, 64, seed=8)
    with KVStoreClient.connect(daemon.address, spec) as client:
        client.store(tokens, cache, torch.arange(64))
        mid_chunk = list(tokens)
        mid_chunk[2 * CHUNK + 100] += 1  # diverges inside chunk 2
        assert client.lookup(mid_chunk) == 2 * CHUNK
        at_boundary = list(tokens)
        at_boundary[3 * CHUNK] += 1  # diverges at the first token of chunk 3
        assert client.lookup(at_boundary) == 3 * CHUNK
        first_token = list(tokens)
        first_token[0] += 1
        assert client.lookup(first_token) == 0
        assert client.lookup(tokens[: 3 * CHUNK - 1]) == 2 * CHUNK
        assert client.lookup(tokens + tokens_of(CHUNK, seed=9)) == 4 * CHUNK
        target = empty_cache(spec, 64)
        assert client.load(mid_chunk, target, torch.arange(64)) == 2 * CHUNK
        assert_blocks_equal(target, torch.arange(32), cache, torch.arange(32))
        assert bool((target[0][:, 32:] == -7.0).all())


def test_keys_alone_name_the_chunks_of_a_store_and_a_load(daemon: Daemon) -> None:
    spec = make_spec()
    tokens = tokens_of(3 * CHUNK, seed=11)
    cache = random_cache(spec, 48, seed=12)
    with KVStoreClient.connect(daemon.address, spec) as client:
        keys = client.keys(tokens)
        assert client.store_async(None, cache, torch.arange(48), keys=keys).wait() == 3
        assert client.lookup(tokens) == 3 * CHUNK  # the same pages as the tokens name
        target = empty_cache(spec, 48)
        assert client.load_async(None, target, torch.arange(32), keys=keys[:2]).wait() == 2 * CHUNK
        assert_blocks_equal(target, torch.arange(32), cache, torch.arange(32))
        assert bool((target[0][:, 32:] == -7.0).all())
        with pytest.raises(ValueError, match="token_ids: None needs keys, one per chunk"):
            client.store_async(None, cache, torch.arange(48))


def test_models_do_not_share_pages(daemon: Daemon) -> None:
    tokens = tokens_of(512, seed=10)
    with (
        KVStoreClient.connect(daemon.address, make_spec(model="a")) as a,
        KVStoreClient.connect(daemon.address, make_spec(model="b")) as b,
    ):
        a.store(tokens, random_cache(a.spec, 32, seed=11), torch.arange(32))
        assert a.lookup(tokens) == 512 and b.lookup(tokens) == 0
        assert b.load(tokens, empty_cache(b.spec, 32), torch.arange(32)) == 0


CHILD = textwrap.dedent("""
    import sys, torch
    from kvstore_client import KVSpec, KVStoreClient
    spec = KVSpec(model="llama-test", num_layers=4, num_kv_heads=2, head_dim=32, dtype=torch.float16,
                  block_size=16, layout="flash_attn")
    tokens = torch.randint(0, 128000, (1024,), generator=torch.Generator().manual_seed(12)).tolist()
    with KVStoreClient.connect(sys.argv[1], spec) as client:
        if sys.argv[2] == "load":
            cache = [torch.zeros(2, 64, 16, 2, 32, dtype=torch.float16) for _ in range(4)]
            print(client.load(tokens, cache, torch.arange(64)))
            torch.save(cache, sys.argv[3])
        else:
            from kvstore.proto import kvstore_pb2 as pb
            from kvstore.shared.keys import pack_keys
            client._rpc("Reserve", pb.ReserveRequest(namespace=client.namespace,
                                                     keys=pack_keys(client.keys(tokens))))
            print("reserved", flush=True)
            import time; time.sleep(600)
""")


def test_second_process_sees_what_the_first_stored(daemon: Daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = make_spec()
    tokens = torch.randint(0, 128000, (1024,), generator=torch.Generator().manual_seed(12)).tolist()
    cache = random_cache(spec, 64, seed=13)
    with KVStoreClient.connect(daemon.address, spec) as client:
        assert client.store(tokens, cache, torch.arange(64)) == 4
    out = tmp_path / "loaded.pt"
    result = subprocess.run(
        [sys.executable, "-c", CHILD, daemon.address, "load", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=python_env(),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1024"
    assert_blocks_equal(torch.load(out), torch.arange(64), cache, torch.arange(64))


def test_killed_client_leaks_no_slot(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(leases__ttl_s=1.0)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, daemon.address, "reserve"],
        stdout=subprocess.PIPE,
        text=True,
        env=python_env(),
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "reserved"
    spec = make_spec()
    with KVStoreClient.connect(daemon.address, spec) as client:
        stats = client.stats()
        assert stats["counters"]["active_store_leases"] == 1
        assert stats["tiers"]["cpu"]["bytes_used"] == 4 * client.page_bytes
        assert (
            client.lookup(
                torch.randint(0, 128000, (1024,), generator=torch.Generator().manual_seed(12)).tolist()
            )
            == 0
        )
        child.send_signal(signal.SIGKILL)
        child.wait()
        deadline = time.monotonic() + 10
        while client.stats()["counters"]["active_store_leases"] and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = client.stats()
        assert stats["counters"]["active_store_leases"] == 0
        assert stats["counters"]["expired_leases"] == 1
        assert stats["tiers"]["cpu"]["bytes_used"] == 0


def test_full_arena_evicts_and_stays_correct(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(tiers__cpu__bytes="8MiB", tiers__cpu__slab_bytes="1MiB")
    spec = make_spec()  # 256 KiB pages: 32 fit
    prompts = [tokens_of(1024, seed=100 + i) for i in range(12)]  # 48 pages in all
    caches = [random_cache(spec, 64, seed=200 + i) for i in range(12)]
    with KVStoreClient.connect(daemon.address, spec) as client:
        assert client.page_bytes == 256 * 1024
        for tokens, cache in zip(prompts, caches, strict=True):
            assert client.store(tokens, cache, torch.arange(64)) == 4
        stats = client.stats()
        assert stats["tiers"]["cpu"]["pages"] == 32 and stats["counters"]["evicted_chunks"] == 16
        for tokens, cache in zip(prompts, caches, strict=True):
            target = empty_cache(spec, 64)
            loaded = client.load(tokens, target, torch.arange(64))
            blocks = torch.arange(loaded // BLOCK)
            assert_blocks_equal(target, blocks, cache, blocks)
        assert client.lookup(prompts[-1]) == 1024  # the newest prompt is whole


def test_arena_full_of_leased_pages_is_resource_exhausted(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(tiers__cpu__bytes="2MiB", tiers__cpu__slab_bytes="1MiB")
    spec = make_spec()  # 256 KiB pages: 8 fit
    with KVStoreClient.connect(daemon.address, spec) as client:
        held = tokens_of(2048, seed=300)
        client.store(held, random_cache(spec, 128, seed=301), torch.arange(128))
        from kvstore.proto import kvstore_pb2 as pb
        from kvstore.shared.keys import pack_keys

        client._rpc(
            "Lookup",
            pb.LookupRequest(namespace=client.namespace, keys=pack_keys(client.keys(held)), lease=True),
        )
        with pytest.raises(ResourceExhausted, match="pinned by a lease"):
            client.store(tokens_of(256, seed=302), random_cache(spec, 16, seed=303), torch.arange(16))
        assert client.lookup(held) == 2048


def test_a_tcp_client_takes_its_token_from_the_environment(
    daemon_factory: Callable[..., Daemon],
    tmp_path,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    """$KVSTORE_TOKEN or $KVSTORE_TOKEN_FILE when `connect` is given no token: stores and loads over
    TCP, every byte right; a wrong one is refused at connect with the daemon's reason."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    daemon_factory(server__tcp=f"127.0.0.1:{port}", server__auth_token="tcp-token")
    spec = make_spec()
    tokens = tokens_of(512, seed=11)
    source = random_cache(spec, 64, seed=12)
    blocks = torch.arange(32)
    (tmp_path / "token").write_text("tcp-token\n")
    monkeypatch.setenv("KVSTORE_TOKEN_FILE", str(tmp_path / "token"))
    with KVStoreClient.connect(f"127.0.0.1:{port}", spec) as client:
        assert client.store(tokens, source, blocks) == 2
    monkeypatch.delenv("KVSTORE_TOKEN_FILE")
    monkeypatch.setenv("KVSTORE_TOKEN", "tcp-token")
    with KVStoreClient.connect(f"127.0.0.1:{port}", spec) as client:
        target = empty_cache(spec, 64)
        assert client.load(tokens, target, blocks) == 512
        assert_blocks_equal(target, blocks, source, blocks)
    monkeypatch.setenv("KVSTORE_TOKEN", "wrong")
    with pytest.raises(Unauthenticated, match="Bearer <token>"):
        KVStoreClient.connect(f"127.0.0.1:{port}", spec)
