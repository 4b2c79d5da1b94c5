"""The daemon's garbage collection off the calls' path (`kvstore.server.heap`): a turn collects
what is not frozen and freezes what survives, CPython's own full collections stay off while it
is tended, a cycle frozen alive is collected by the next full turn, and a real kvstored tends
its heap while every stored byte loads back."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvstore.server.heap import NO_FULL_COLLECTIONS, Heap
from kvstore_client import KVSpec, KVStoreClient
from tests.harness import Daemon

SPEC = KVSpec(
    model="heap-test", num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, block_size=16
)


class Node:
    """An object in a reference cycle (its `other` is its partner)."""

    other: Any = None


def cycle() -> tuple[Node, weakref.ref[Node]]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a, weakref.ref(b)


@pytest.fixture
def collector() -> Iterator[None]:
    """The test process's collector as it was, whatever the test froze or set."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_a_turn_collects_what_died_and_freezes_what_lives(collector: None) -> None:
    now = [0.0]
    heap = Heap(freeze_s=10.0, full_s=100.0, clock=lambda: now[0])
    young, middle, _ = gc.get_threshold()
    heap.start()
    assert gc.get_threshold() == (young, middle, NO_FULL_COLLECTIONS)
    frozen = gc.get_freeze_count()
    live = [Node() for _ in range(1000)]  # survives the turn: frozen (a dict of atoms would be untracked)
    dead, dead_ref = cycle()
    del dead
    assert dead_ref() is not None  # a cycle: its counts never reach 0
    heap.turn()
    assert dead_ref() is None  # collected
    assert gc.get_freeze_count() >= frozen + len(live)
    assert all(gc.is_tracked(page) for page in live) and live[999].other is None

    # A cycle frozen while alive, then dropped: no ordinary turn scans it, the next full one does.
    held, held_ref = cycle()
    heap.turn()
    del held
    heap.turn()
    assert held_ref() is not None and (heap.turns, heap.full_turns) == (3, 0)
    now[0] = 100.0
    heap.turn()
    assert held_ref() is None and (heap.turns, heap.full_turns) == (4, 1)
    figures = heap.figures()
    assert figures["gc_turns"] == 4 and figures["gc_full_turns"] == 1
    assert 0 < figures["gc_last_pause_ms"] <= figures["gc_max_pause_ms"]
    assert "gc_frozen_objects" not in figures  # counting them walks them all: not on a Stats call
    heap.stop()
    assert gc.get_threshold() == (young, middle, _)


def test_untended_the_collector_runs_as_cpython_does(collector: None) -> None:
    thresholds = gc.get_threshold()
    heap = Heap(freeze_s=0.0, full_s=3600.0)
    heap.start()
    assert gc.get_threshold() == thresholds and heap.figures() == {}
    heap.stop()
    assert gc.get_threshold() == thresholds


def wait_for(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_daemon_tends_its_heap_while_it_serves(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(server__gc_freeze_s=0.05, server__gc_full_s=0.3)
    cache = [torch.randn(2, 128, 16, 2, 16).half() for _ in range(2)]
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        for first in range(0, 2048, 512):  # stores across several turns
            tokens = list(range(first, first + 512))
            assert client.store(tokens, cache, torch.arange(first // 16, first // 16 + 32)) == 2

        def counters() -> dict[str, float]:
            return client.stats()["counters"]  # type: ignore[no-any-return]

        wait_for(lambda: counters().get("gc_full_turns", 0) >= 2)
        figures = counters()
        assert figures["gc_turns"] >= figures["gc_full_turns"] >= 2 and figures["gc_max_pause_ms"] > 0
        for first in range(0, 2048, 512):
            tokens = list(range(first, first + 512))
            target = [torch.full_like(t, float("nan")) for t in cache]
            blocks = torch.arange(first // 16, first // 16 + 32)
            assert client.load(tokens, target, blocks) == 512
            pairs = zip(target, cache, strict=True)
            assert all(torch.equal(got[:, blocks], want[:, blocks]) for got, want in pairs)
    assert "full garbage collection" in daemon.log()
    untended = daemon_factory("untended", server__gc_freeze_s=0)
    with KVStoreClient.connect(untended.address, SPEC) as client:
        assert not any(name.startswith("gc_") for name in client.stats()["counters"])
