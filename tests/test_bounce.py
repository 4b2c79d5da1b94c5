"""Stores into arena slabs not registered yet go through the pinned bounce ring at once, instead of
waiting for the registration: against a real kvstored (CPU caches here; the ring is the same on
CUDA), every byte loaded back; and the ring itself: batches of one slot, slots reused only once
their bytes are out, stores from several threads at once, a failed gather that gives its slots
back."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from kvstore_client.bounce import BounceRing
from tests.harness import Daemon
from tests.test_client import assert_blocks_equal, empty_cache, make_spec, random_cache, tokens_of
from tests.test_registrar import gated_client, until, until_waiting


@pytest.fixture
def small_slabs(daemon_factory: Any) -> Daemon:
    return daemon_factory(tiers__cpu={"bytes": "16MiB", "slab_bytes": "1MiB"})


def test_a_store_into_slabs_not_registered_goes_through_the_ring_without_waiting(small_slabs: Daemon) -> None:
    spec = make_spec()
    source = random_cache(spec, 256, seed=41)
    tokens = tokens_of(16 * 256, seed=42)  # 16 pages of 256 KiB (16 blocks each): slabs 0-3
    blocks = torch.randperm(256, generator=torch.Generator().manual_seed(43))
    client, host = gated_client(small_slabs)
    with client:
        client._mapped.bounce = True  # CPU caches: the ring applies to CUDA ones by default
        client._mapped.start_registrar(host)  # no registration completes until allowed
        assert client.store(tokens, source, blocks) == 16  # returns with no slab registered
        arena = client.stats()["client"]["arena"]
        waits = (arena["transfers_bounced"], arena["transfers_waited"], arena["transfers_unpinned"])
        assert waits == (1, 0, 0)
        assert arena["slabs_registered"] == 0
        host.allow(16)
        registrar = client._mapped.registrar
        assert registrar is not None and registrar.ready(range(16), 30.0)
        target = empty_cache(spec, 256)
        target_blocks = torch.randperm(256, generator=torch.Generator().manual_seed(44))
        assert client.load(tokens, target, target_blocks) == 16 * 256
        assert_blocks_equal(target, target_blocks, source, blocks)

        # Every slab registered: the next store takes the kernels' way, and the ring is freed
        # by the registration thread once the transfers pause.
        more, more_blocks = tokens_of(8 * 256, seed=45), torch.arange(128)
        assert client.store(more, source, more_blocks) == 8
        assert client.stats()["client"]["arena"]["transfers_bounced"] == 1
        shared = client._mapped._shared
        assert shared is not None
        until(lambda: shared._ring is None, "the ring was not freed after the pause")
        again = empty_cache(spec, 256)
        assert client.load(more, again, torch.arange(128, 256)) == 8 * 256
        assert_blocks_equal(again, torch.arange(128, 256), source, more_blocks)


def test_a_store_of_some_layers_still_waits_for_its_slabs(small_slabs: Daemon) -> None:
    """A store that writes some layers' spans of its pages never goes through the ring: the slot's
    other bytes would land on spans another call wrote."""
    spec = make_spec()
    source = random_cache(spec, 64, seed=51)
    tokens = tokens_of(4 * 256, seed=52)
    client, host = gated_client(small_slabs)
    with client:
        client._mapped.bounce = True
        client._mapped.start_registrar(host)
        done: list[int] = []
        thread = threading.Thread(
            target=lambda: done.append(client.store(tokens, source, torch.arange(64), layers=range(0, 4)))
        )
        thread.start()
        until_waiting(client._mapped.registrar)
        host.allow(16)
        thread.join(30)
        assert done == [4]
        arena = client.stats()["client"]["arena"]
        assert (arena["transfers_bounced"], arena["transfers_waited"]) == (0, 1)
        target = empty_cache(spec, 64)
        assert client.load(tokens, target, torch.arange(64)) == 4 * 256
        assert_blocks_equal(target, torch.arange(64), source, torch.arange(64))


PAGE = 4096


def fake_gather(pages: torch.Tensor, fail_on: int | None = None, log: list[list[int]] | None = None) -> Any:
    """A gather over CPU "pages": chunk c becomes `pages[c]` at each offset; raises for a batch
    holding chunk `fail_on`."""

    def gather(
        spec: Any,
        kv: Any,
        blocks: Any,
        chunks: Sequence[int],
        buffer: torch.Tensor,
        offsets: list[int],
        layers: Any,
    ) -> None:
        if fail_on is not None and fail_on in chunks:
            raise RuntimeError("the gather failed")
        if log is not None:
            log.append(list(chunks))
        for chunk, offset in zip(chunks, offsets, strict=True):
            buffer[offset : offset + PAGE] = pages[chunk]

    return gather


def test_the_ring_moves_whole_batches_and_reuses_a_slot_only_once_it_is_copied_out() -> None:
    pages = torch.randint(0, 256, (40, PAGE), dtype=torch.uint8, generator=torch.Generator().manual_seed(61))
    arena = torch.zeros(64 * PAGE, dtype=torch.uint8)
    ring = BounceRing(slot_bytes=3 * PAGE, num_slots=2, copiers=3)
    batches: list[list[int]] = []
    # Three stores at once from three threads, to disjoint slots of the arena.
    plans = [
        (list(range(t * 13, t * 13 + 13)), [(63 - (t * 13 + j)) * PAGE for j in range(13)]) for t in range(3)
    ]
    errors: list[BaseException] = []

    def store(chunks: list[int], offsets: list[int]) -> None:
        try:
            gather = fake_gather(pages, log=batches)
            ring.gather(gather, None, None, None, chunks, arena, offsets, None, PAGE).synchronize()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=store, args=plan) for plan in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert sorted(len(batch) for batch in batches) == [1, 1, 1] + [3] * 12  # 13 pages: 4 of 3 and 1
    for chunks, offsets in plans:
        for chunk, offset in zip(chunks, offsets, strict=True):
            assert torch.equal(arena[offset : offset + PAGE], pages[chunk]), f"page {chunk}"
    untouched = set(range(64)) - {offset // PAGE for _, offsets in plans for offset in offsets}
    assert all(not arena[p * PAGE : (p + 1) * PAGE].any() for p in untouched)
    assert (ring.num_stores, ring.num_pages) == (3, 39)
    ring.close()


def test_a_failed_gather_gives_its_slots_back_and_the_ring_goes_on() -> None:
    pages = torch.randint(0, 256, (12, PAGE), dtype=torch.uint8, generator=torch.Generator().manual_seed(71))
    arena = torch.zeros(16 * PAGE, dtype=torch.uint8)
    ring = BounceRing(slot_bytes=2 * PAGE, num_slots=2, copiers=2)
    with pytest.raises(RuntimeError, match="the gather failed"):
        gather = fake_gather(pages, fail_on=4)
        ring.gather(gather, None, None, None, list(range(6)), arena, [p * PAGE for p in range(6)], None, PAGE)
    until(lambda: ring.idle, "the batches before the failure were not copied out")
    done = threading.Event()

    def store() -> None:  # needs both slots: hangs if the failure kept one
        ring.gather(
            fake_gather(pages),
            None,
            None,
            None,
            list(range(6, 12)),
            arena,
            [p * PAGE for p in range(10, 16)],
            None,
            PAGE,
        ).synchronize()
        done.set()

    threading.Thread(target=store, daemon=True).start()
    assert done.wait(30), "a slot was not given back"
    for j, chunk in enumerate(range(6, 12)):
        assert torch.equal(arena[(10 + j) * PAGE : (11 + j) * PAGE], pages[chunk])
    assert ring.fits(2 * PAGE) and not ring.fits(2 * PAGE + 1)
    ring.close()


class GatedCudaRegistrar:
    """CUDA's registration, each slab only once the test allows it (`device`: the ring is pinned
    on it, as with the client's own registrar)."""

    def __init__(self, device: int) -> None:
        from kvstore_client.registrar import CudaRegistrar

        self._cuda = CudaRegistrar(device)
        self.device = device
        self._permits = threading.Semaphore(0)

    def allow(self, count: int) -> None:
        for _ in range(count):
            self._permits.release()

    def register(self, address: int, size: int) -> None:
        self._permits.acquire(timeout=60)
        self._cuda.register(address, size)

    def unregister(self, address: int) -> None:
        self._cuda.unregister(address)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_cuda_stores_before_any_registration_go_through_the_pinned_ring(
    daemon_factory: Any,
) -> None:
    """600 pages of a CUDA cache (more than the ring holds at once, so slots are reused) stored
    while no slab is registered, from two threads, then loaded back once the arena is: every byte."""
    from kvstore_client import KVSpec, KVStoreClient

    daemon = daemon_factory(tiers__cpu={"bytes": "512MiB", "slab_bytes": "16MiB"})
    spec = KVSpec(
        model="bounce", num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=16
    )
    shape = (2, 300 * 16 * 2, 16, 2, 64)
    source = [torch.randn(shape, device="cuda").bfloat16() for _ in range(4)]
    tokens = [torch.randint(0, 50_000, (300 * 256,)).tolist() for _ in range(2)]
    blocks = [torch.arange(0, 4800), torch.arange(4800, 9600)]
    with KVStoreClient.connect(daemon.address, spec, pin_arena=False) as client:
        host = GatedCudaRegistrar(torch.cuda.current_device())
        client._mapped.start_registrar(host)
        stored: list[int] = []
        threads = [
            threading.Thread(target=lambda i=i: stored.append(client.store(tokens[i], source, blocks[i])))
            for i in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert stored == [300, 300]
        arena = client.stats()["client"]["arena"]
        assert (arena["transfers_bounced"], arena["transfers_waited"], arena["slabs_registered"]) == (2, 0, 0)
        host.allow(32)
        registrar = client._mapped.registrar
        assert registrar is not None and registrar.ready(range(32), 60.0)
        for i in range(2):
            target = [torch.full(shape, -5.0, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
            target_blocks = torch.randperm(9600)[:4800]
            assert client.load(tokens[i], target, target_blocks) == 300 * 256
            for layer in range(4):
                got = target[layer][:, target_blocks.cuda()].view(torch.uint8)
                assert torch.equal(got, source[layer][:, blocks[i].cuda()].view(torch.uint8)), (i, layer)


def test_offsets_outside_the_arena_or_overlapping_are_refused_before_any_byte_moves() -> None:
    pages = torch.randint(0, 256, (4, PAGE), dtype=torch.uint8, generator=torch.Generator().manual_seed(81))
    arena = torch.zeros(8 * PAGE, dtype=torch.uint8)
    ring = BounceRing(slot_bytes=2 * PAGE, num_slots=2, copiers=2)
    with pytest.raises(ValueError, match="runs past the end"):
        ring.gather(fake_gather(pages), None, None, None, [0, 1], arena, [0, 7 * PAGE + 1], None, PAGE)
    with pytest.raises(ValueError, match="overlap"):
        ring.gather(fake_gather(pages), None, None, None, [0, 1], arena, [PAGE, PAGE + 100], None, PAGE)
    assert not arena.any()
    ring.close()


def test_a_failed_copy_is_raised_only_once_every_batch_of_the_store_has_ended() -> None:
    """The lease is let go after a failure: no copy of the store may still land after that."""
    pages = torch.randint(0, 256, (4, PAGE), dtype=torch.uint8, generator=torch.Generator().manual_seed(91))
    arena = torch.zeros(8 * PAGE, dtype=torch.uint8)
    ring = BounceRing(slot_bytes=PAGE, num_slots=4, copiers=2)
    copy_out, landed = ring._copy_out, []

    def failing_first(gathered: Any, slot: int, destinations: list[int], page_bytes: int) -> None:
        if destinations[0] == arena.data_ptr():
            ring._free.put(slot)
            raise OSError("the copy failed")
        time.sleep(0.2)
        copy_out(gathered, slot, destinations, page_bytes)
        landed.append(destinations[0])

    ring._copy_out = failing_first  # type: ignore[method-assign]
    completion = ring.gather(
        fake_gather(pages), None, None, None, [0, 1, 2], arena, [0, PAGE, 2 * PAGE], None, PAGE
    )
    assert completion is not None
    with pytest.raises(OSError, match="the copy failed"):
        completion.synchronize()
    assert len(landed) == 2  # the two later batches ended before the failure was raised
    ring.close()


def test_a_ring_closed_while_a_store_is_inside_waits_for_it_then_takes_no_more() -> None:
    pages = torch.randint(0, 256, (2, PAGE), dtype=torch.uint8, generator=torch.Generator().manual_seed(101))
    arena = torch.zeros(4 * PAGE, dtype=torch.uint8)
    ring = BounceRing(slot_bytes=PAGE, num_slots=2, copiers=2)
    inside, go = threading.Event(), threading.Event()
    gather = fake_gather(pages)

    def slow_gather(*args: Any) -> None:
        inside.set()
        go.wait(30)
        gather(*args)

    results: list[Any] = []
    store = threading.Thread(
        target=lambda: results.append(
            ring.gather(slow_gather, None, None, None, [0, 1], arena, [0, 2 * PAGE], None, PAGE)
        )
    )
    store.start()
    assert inside.wait(30)
    closing = threading.Thread(target=ring.close)
    closing.start()
    until(lambda: ring.closed, "close() did not begin")
    assert closing.is_alive()  # it waits for the store inside
    go.set()
    store.join(30)
    closing.join(30)
    assert not closing.is_alive()
    assert results[0] is not None
    assert torch.equal(arena[:PAGE], pages[0]) and torch.equal(arena[2 * PAGE : 3 * PAGE], pages[1])
    assert (
        ring.gather(gather, None, None, None, [0], arena, [PAGE], None, PAGE) is None
    )  # closed: nothing done
    assert not arena[PAGE : 2 * PAGE].any()
