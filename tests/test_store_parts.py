"""A store's path through the client against the real daemon: the gather set up while the Reserve is
in flight, and the first pages committed while the last ones are still being written (the
daemon's Commit of a lease in parts). Every store is loaded back by another client and compared
byte for byte."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvstore_kernels
from kvstore.proto import kvstore_pb2 as pb
from kvstore_client import KVStoreClient, stores
from tests.harness import Daemon
from tests.test_client import BLOCK, assert_blocks_equal, empty_cache, make_spec, random_cache, tokens_of


def sent_commits(client: KVStoreClient, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The Commits this client sends without waiting (the early ones)."""
    sent: list[Any] = []
    local = client._conn.local
    assert local is not None
    real_send = local.send

    def send(method: str, request: Any) -> None:
        if method == "Commit":
            sent.append(pb.LeaseRequest.FromString(request.SerializeToString()))
        real_send(method, request)

    monkeypatch.setattr(local, "send", send)
    return sent


def load_back(daemon: Daemon, spec: Any, tokens: list[int], source: list[torch.Tensor], blocks: Any) -> int:
    """Loads `tokens` with a second client into a poisoned cache; asserts the bytes; returns tokens."""
    with KVStoreClient.connect(daemon.address, spec) as other:
        target = empty_cache(spec, 300)
        target_blocks = torch.randperm(300, generator=torch.Generator().manual_seed(9))[: len(blocks)]
        loaded = other.load(tokens, target, target_blocks)
        count = loaded // BLOCK
        assert_blocks_equal(target, target_blocks[:count], source, blocks[:count])
        return loaded


def test_the_daemon_announces_commits_in_parts(daemon: Daemon) -> None:
    with KVStoreClient.connect(daemon.address, make_spec()) as client:
        assert client.commits_in_parts is True


def commit_in_parts(
    monkeypatch: pytest.MonkeyPatch, client: KVStoreClient, part: int, tail: int, most: int = 1000
) -> None:
    monkeypatch.setattr(stores, "EARLY_COMMIT_PART_BYTES", part * client.page_bytes)
    monkeypatch.setattr(stores, "EARLY_COMMIT_TAIL_BYTES", tail * client.page_bytes)
    monkeypatch.setattr(stores, "EARLY_COMMIT_MAX_PARTS", most)


@pytest.mark.parametrize(
    ("part", "tail", "most", "early"),
    [
        (5, 3, 1000, [5]),
        (2, 1, 1000, [2, 2, 2]),
        (1, 1, 1000, [1] * 7),
        (3, 2, 1000, [3, 3]),
        (8, 1, 1000, []),
        (1, 1, 3, [2, 2, 3]),
        (2, 1, 3, [2, 2, 2]),
        (1, 2, 2, [3, 3]),
    ],
    ids=["5+3", "2+2+2+2", "1x8", "3+3+2", "one-commit", "at-most-3+1", "3-of-3", "at-most-2+2"],
)
def test_a_store_commits_its_pages_in_parts_as_they_are_written(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch, part: int, tail: int, most: int, early: list[int]
) -> None:
    """Eight new pages in parts of `part` pages, the last at least `tail`, at most `most` parts
    before the last (else those pages cut evenly, the last part `tail`): each part but the last
    is committed by a Commit sent without waiting, the last by the final one; the store counts
    all eight and another client loads them all."""
    spec = make_spec()
    tokens = tokens_of(8 * 256, seed=11)
    blocks = torch.randperm(400, generator=torch.Generator().manual_seed(12))[: len(tokens) // BLOCK]
    source = random_cache(spec, 400, seed=13)
    with KVStoreClient.connect(daemon.address, spec) as client:
        commit_in_parts(monkeypatch, client, part, tail, most)
        sent = sent_commits(client, monkeypatch)
        assert client.store(tokens, source, blocks) == 8
        assert [request.commit_count for request in sent] == early
        assert client.store(tokens, source, blocks) == 0
    assert load_back(daemon, spec, tokens, source, blocks) == 8 * 256


def test_early_commit_with_pages_already_stored(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first 3 pages are stored already: the Reserve skips them, the 5 new ones go in two
    Commits (3 early, 2 last), and the chain is whole."""
    spec = make_spec()
    tokens = tokens_of(8 * 256, seed=21)
    blocks = torch.randperm(400, generator=torch.Generator().manual_seed(22))[: len(tokens) // BLOCK]
    source = random_cache(spec, 400, seed=23)
    with KVStoreClient.connect(daemon.address, spec) as client:
        assert client.store(tokens[: 3 * 256], source, blocks[: 3 * 16]) == 3
        commit_in_parts(monkeypatch, client, 3, 2)
        sent = sent_commits(client, monkeypatch)
        assert client.store(tokens, source, blocks) == 5
        assert [request.commit_count for request in sent] == [3]
        assert client.lookup(tokens) == 8 * 256
    assert load_back(daemon, spec, tokens, source, blocks) == 8 * 256


def test_a_store_in_flight_commits_its_written_parts_when_asked(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`store_async` of 8 pages in parts of 2: nothing is committed until the handle is asked;
    `progress()` sends the early Commits of the parts written already (from a CPU cache, all of
    them), so the first 6 pages are stored before `wait()`, which commits the last 2; asked again,
    it sends nothing more. Another client loads all 8 back."""
    spec = make_spec()
    tokens = tokens_of(8 * 256, seed=41)
    blocks = torch.randperm(400, generator=torch.Generator().manual_seed(42))[: len(tokens) // BLOCK]
    source = random_cache(spec, 400, seed=43)
    with KVStoreClient.connect(daemon.address, spec) as client:
        commit_in_parts(monkeypatch, client, 2, 2)
        sent = sent_commits(client, monkeypatch)
        handle = client.store_async(tokens, source, blocks)
        assert sent == [] and client.lookup(tokens) == 0
        handle.progress()
        assert [request.commit_count for request in sent] == [2, 2, 2]
        assert client.lookup(tokens) == 6 * 256  # read after the early Commits on the same channel
        handle.progress()
        assert len(sent) == 3
        assert handle.wait() == 8
        assert len(sent) == 3 and client.lookup(tokens) == 8 * 256
        handle.progress()  # a store waited for: nothing left to send
        assert len(sent) == 3
    assert load_back(daemon, spec, tokens, source, blocks) == 8 * 256


def test_no_early_commit_where_the_daemon_does_not_commit_in_parts(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon that does not announce commits in parts would take the early Commit for the
    whole lease, pages still being written included: the client then commits once, at the end."""
    spec = make_spec()
    tokens = tokens_of(4 * 256, seed=31)
    blocks = torch.randperm(400, generator=torch.Generator().manual_seed(32))[: len(tokens) // BLOCK]
    source = random_cache(spec, 400, seed=33)
    with KVStoreClient.connect(daemon.address, spec) as client:
        client.commits_in_parts = False
        commit_in_parts(monkeypatch, client, 1, 1)
        sent = sent_commits(client, monkeypatch)
        assert client.store(tokens, source, blocks) == 4
        assert sent == []
    assert load_back(daemon, spec, tokens, source, blocks) == 4 * 256


def test_a_store_prepared_ahead_falls_back_where_it_cannot_be(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gather is prepared while the Reserve is in flight; where that fails (here: every
    prepare), the gather after the reply checks and moves everything itself."""
    spec = make_spec()
    tokens = tokens_of(4 * 256, seed=41)
    blocks = torch.randperm(400, generator=torch.Generator().manual_seed(42))[: len(tokens) // BLOCK]
    source = random_cache(spec, 400, seed=43)
    prepared: list[int] = []
    real_prepare = kvstore_kernels.prepare

    def failing(*args: Any, **kwargs: Any) -> Any:
        prepared.append(1)
        raise ValueError("not here")

    monkeypatch.setattr(kvstore_kernels, "prepare", failing)
    with KVStoreClient.connect(daemon.address, spec) as client:
        assert client.store(tokens, source, blocks) == 4
        assert prepared  # it was tried, while the Reserve was in flight
    monkeypatch.setattr(kvstore_kernels, "prepare", real_prepare)
    assert load_back(daemon, spec, tokens, source, blocks) == 4 * 256


def test_a_prepared_store_and_load_of_a_table_shorter_than_the_prompt(daemon: Daemon) -> None:
    """The block table holds 3 whole chunks of a 5-chunk prompt's keys: preparing every chunk
    fails ahead, and the store (and the load) after the reply refuses the call by name, storing
    (and loading) nothing; the daemon holds no lease of either afterwards."""
    spec = make_spec()
    tokens = tokens_of(5 * 256, seed=51)
    blocks = torch.randperm(400, generator=torch.Generator().manual_seed(52))[: 5 * 16]
    source = random_cache(spec, 400, seed=53)
    with KVStoreClient.connect(daemon.address, spec) as client:
        with pytest.raises(ValueError, match="block_ids: the block table has 48 entries"):
            client.store(tokens, source, blocks[: 3 * 16])
        assert client.lookup(tokens) == 0
        assert client.store(tokens, source, blocks) == 5
        target = empty_cache(spec, 300)
        short = torch.randperm(300, generator=torch.Generator().manual_seed(54))[: 3 * 16]
        with pytest.raises(ValueError, match="block_ids: the block table has 48 entries; chunk 4 needs 80"):
            client.load(tokens, target, short)
        assert all(bool((layer == -7.0).all()) for layer in target)
        assert client.stats()["counters"]["active_leases"] == 0
    assert load_back(daemon, spec, tokens, source, blocks) == 5 * 256


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_load_prepares_its_scatter_unless_layerwise(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch, layerwise: bool
) -> None:
    """A load prepares the scatter of every chunk while its Lookup is in flight and moves the
    pages through it; a layer-wise load (runs of layers, each its own scatter) prepares none and
    checks its block table only. Both load the stored bytes."""
    spec = make_spec()
    tokens = tokens_of(4 * 256, seed=61)
    blocks = torch.randperm(400, generator=torch.Generator().manual_seed(62))[: len(tokens) // BLOCK]
    source = random_cache(spec, 400, seed=63)
    prepared: list[bool] = []
    real_prepare = kvstore_kernels.prepare

    def counting(*args: Any, **kwargs: Any) -> Any:
        prepared.append(kwargs["to_page"])
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(kvstore_kernels, "prepare", counting)
    with KVStoreClient.connect(daemon.address, spec) as client:
        assert client.store(tokens, source, blocks) == 4
        assert prepared == [True]
        target = empty_cache(spec, 300)
        target_blocks = torch.randperm(300, generator=torch.Generator().manual_seed(64))[: len(blocks)]
        handle = client.load_async(tokens, target, target_blocks, layerwise=layerwise)
        assert handle.wait() == 4 * 256
        assert prepared == ([True] if layerwise else [True, False])
        assert_blocks_equal(target, target_blocks, source, blocks)
