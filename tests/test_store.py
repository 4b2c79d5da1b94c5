"""The store in-process: two-phase stores, leases, expiry, eviction order and its limits.

Every scenario that stores pages writes distinct bytes into their slots and reads them back.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.shared.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvstore.shared.keys import chunk_keys
from kvstore.shared.spec import PageSpec
from kvstore.store.index import AcquireResult
from kvstore.store.policy import make_policy
from kvstore.store.store import Store
from kvstore.store.store_settings import StoreSettings
from kvstore.tiers.cpu import Arena, CpuTier

SPEC = PageSpec(model="test", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=16)
PAGE = SPEC.page_bytes  # 4 KiB: one slot each


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make_store(tmp_path: Path, clock: Clock, pages: int) -> Store:
    arena = Arena(tmp_path / "arena", pages * PAGE, prefault=False)
    return Store(
        CpuTier(arena, pages * PAGE),
        make_policy("lru"),
        StoreSettings(lease_ttl_s=10.0, max_lease_ttl_s=60.0),
        clock=clock,
    )


def page_bytes(key: bytes) -> bytes:
    return (key * (PAGE // len(key)))[:PAGE]


def store_chain(store: Store, tokens: list[int]) -> list[bytes]:
    ns = store.connect(SPEC).id
    keys = chunk_keys(ns, tokens, SPEC.chunk_tokens)
    reserved = store.reserve(ns, keys)
    for key, offset in zip(keys, reserved.offsets, strict=True):
        if offset >= 0:
            store.cpu.write(offset, page_bytes(key))
    if reserved.lease_id:
        store.commit(ns, reserved.lease_id)
    return keys


def acquired(store: Store, ns: bytes, lease_id: int) -> AcquireResult:
    """Acquire of a lease whose pages are all in memory: answered at once (no disk tier here)."""
    result = store.acquire_now(ns, lease_id)
    assert isinstance(result, AcquireResult)
    return result


def load_chain(store: Store, keys: list[bytes]) -> list[bytes]:
    """Bytes of the stored prefix of `keys`, read under a lease."""
    ns = SPEC.namespace()
    hit = store.lookup(ns, keys, lease=True)
    if not hit.lease_id:
        return []
    offsets = acquired(store, ns, hit.lease_id).offsets
    data = [bytes(store.cpu.read(o, PAGE)) for o in offsets]
    store.release(ns, hit.lease_id)
    return data


def test_store_then_load_bytes(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, 16)
    keys = store_chain(store, list(range(64)))
    assert load_chain(store, keys) == [page_bytes(k) for k in keys]
    assert store.lookup(SPEC.namespace(), keys + [b"\0" * 16]).hit_chunks == 4
    stats = store.stats()
    assert stats.tiers[0].pages == 4 and stats.tiers[0].bytes_used == 4 * PAGE
    assert stats.counters["active_leases"] == 0


def test_uncommitted_pages_are_invisible_and_skipped(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, 16)
    ns = store.connect(SPEC).id
    keys = chunk_keys(ns, list(range(48)), 16)
    first = store.reserve(ns, keys[:2])
    assert store.lookup(ns, keys).hit_chunks == 0
    second = store.reserve(ns, keys)  # another writer: the first two are being written
    assert second.offsets[:2] == [-1, -1] and min(second.offsets[2:]) >= 0
    store.commit(ns, second.lease_id)
    assert store.lookup(ns, keys).hit_chunks == 0  # the chain's head is still uncommitted
    store.commit(ns, first.lease_id)
    assert store.lookup(ns, keys).hit_chunks == 3


def test_reserve_skips_stored_prefix(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, 16)
    short = store_chain(store, list(range(32)))
    ns = SPEC.namespace()
    keys = chunk_keys(ns, list(range(64)), 16)
    assert keys[:2] == short
    reserved = store.reserve(ns, keys)
    assert reserved.offsets[:2] == [-1, -1]
    assert store.commit(ns, reserved.lease_id) == 2
    assert store.reserve(ns, keys).lease_id == 0  # all present: nothing to write


def test_abort_and_expiry_free_the_slots(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, 4)
    ns = store.connect(SPEC).id
    keys = chunk_keys(ns, list(range(64)), 16)
    lease = store.reserve(ns, keys).lease_id
    assert store.abort(ns, lease) == 4 and store.cpu.bytes_used == 0
    lease = store.reserve(ns, keys, ttl_s=1.0).lease_id
    clock.now += 0.5
    assert store.expire() == 0
    clock.now += 0.6
    assert store.expire() == 1 and store.cpu.bytes_used == 0
    with pytest.raises(NotFound, match="expired"):
        store.commit(ns, lease)
    assert store.lookup(ns, keys).hit_chunks == 0
    assert min(store.reserve(ns, keys).offsets) >= 0  # the keys can be stored again


def test_load_lease_expiry_unpins(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, 4)
    keys = store_chain(store, list(range(64)))
    ns = SPEC.namespace()
    store.lookup(ns, keys, lease=True, ttl_s=1.0)
    with pytest.raises(ResourceExhausted):
        store.reserve(ns, chunk_keys(ns, list(range(100, 116)), 16))
    clock.now += 2
    assert store.expire() == 1
    assert min(store.reserve(ns, chunk_keys(ns, list(range(100, 116)), 16)).offsets) >= 0


def test_eviction_takes_tails_before_heads(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, 6)
    a = store_chain(store, list(range(64)))  # 4 pages
    b = store_chain(store, list(range(1000, 1032)))  # 2 pages: full
    load_chain(store, a[:1])  # a's head is now the most recent of all
    c = store_chain(store, list(range(2000, 2032)))  # needs 2: takes a's tail pages, the oldest
    assert store.counters["evicted_chunks"] == 2
    assert load_chain(store, a) == [page_bytes(k) for k in a[:2]]
    assert load_chain(store, b) == [page_bytes(k) for k in b]
    assert load_chain(store, c) == [page_bytes(k) for k in c]


def store_in_parts(store: Store, spec: PageSpec, tokens: list[int], part: int) -> list[bytes]:
    """Stores `tokens` as a client does, its pages committed `part` at a time (head first)."""
    ns = store.connect(spec).id
    keys = chunk_keys(ns, tokens, spec.chunk_tokens)
    reserved = store.reserve(ns, keys)
    for key, offset in zip(keys, reserved.offsets, strict=True):
        if offset >= 0:  # a new page (-1: stored already)
            store.cpu.write(offset, (key * (spec.page_bytes // len(key)))[: spec.page_bytes])
    new, committed = sum(offset >= 0 for offset in reserved.offsets), 0
    while committed < new:
        committed += store.commit(ns, reserved.lease_id, part)
    return keys


@pytest.mark.parametrize("policy", ["lfuda", "lru"])
def test_a_chain_committed_in_parts_is_evicted_tail_first_for_another_page_size(
    tmp_path: Path, clock: Clock, policy: str
) -> None:
    """Two chains of 8 small pages, each committed in four parts of 2, fill 4 slabs; one page four
    times as large needs a whole slab. The policy holds a chain's parts head first, so the
    eviction must reach the heads after their tails: it takes the oldest chain's last slab (its 4
    tail pages), and both chains' other pages and bytes stay. Every byte is read back."""
    slab = 4 * PAGE
    arena = Arena(tmp_path / "arena", 4 * slab, prefault=False)
    store = Store(CpuTier(arena, slab), make_policy(policy), StoreSettings(10.0, 60.0), clock=clock)
    a = store_in_parts(store, SPEC, list(range(128)), 2)
    b = store_in_parts(store, SPEC, list(range(1000, 1128)), 2)
    big = replace(SPEC, model="big", head_dim=64)  # 16 KiB pages: one a slab
    assert big.page_bytes == slab
    big_keys = store_in_parts(store, big, list(range(16)), 1)
    assert store.counters["evicted_chunks"] == 4
    assert load_chain(store, a) == [page_bytes(k) for k in a[:4]]
    assert load_chain(store, b) == [page_bytes(k) for k in b]
    ns = big.namespace()
    hit = store.lookup(ns, big_keys, lease=True)
    assert hit.hit_chunks == 1
    (offset,) = acquired(store, ns, hit.lease_id).offsets
    assert bytes(store.cpu.read(offset, slab)) == (big_keys[0] * (slab // len(big_keys[0])))[:slab]
    store.release(ns, hit.lease_id)


@pytest.mark.parametrize("policy", ["lfuda", "lru"])
def test_chains_committed_in_parts_leave_oldest_first_not_a_tail_each(
    tmp_path: Path, clock: Clock, policy: str
) -> None:
    """Two chains of 8 pages committed in parts of 2 fill the arena; a new chain of 4 takes the
    oldest chain's last 4 pages, as a chain stored whole would give them, not the last part of
    each chain. Every byte is read back."""
    arena = Arena(tmp_path / "arena", 16 * PAGE, prefault=False)
    store = Store(CpuTier(arena, 4 * PAGE), make_policy(policy), StoreSettings(10.0, 60.0), clock=clock)
    a = store_in_parts(store, SPEC, list(range(128)), 2)
    b = store_in_parts(store, SPEC, list(range(1000, 1128)), 2)
    c = store_in_parts(store, SPEC, list(range(2000, 2064)), 2)
    assert store.counters["evicted_chunks"] == 4
    assert load_chain(store, a) == [page_bytes(k) for k in a[:4]]
    assert load_chain(store, b) == [page_bytes(k) for k in b]
    assert load_chain(store, c) == [page_bytes(k) for k in c]


def test_a_slab_freed_for_another_page_size_strands_no_tail(tmp_path: Path, clock: Clock) -> None:
    """A chain of 6 small pages spans two slabs; the second also holds a leased chain, so only the
    first can be emptied for a page four times as large. Taking the chain's first 4 pages
    (its head) would leave its last 2 with no head, never to be hit: they leave with it, and
    their slots take the next small pages without another eviction. Every byte is read back."""
    slab = 4 * PAGE
    arena = Arena(tmp_path / "arena", 2 * slab, prefault=False)
    store = Store(CpuTier(arena, slab), make_policy("lfuda"), StoreSettings(10.0, 60.0), clock=clock)
    ns = SPEC.namespace()
    a = store_chain(store, list(range(96)))  # 6 pages: 4 in the first slab, 2 in the second
    held = store_chain(store, list(range(1000, 1032)))  # the second slab's other 2
    lease = store.lookup(ns, held, lease=True).lease_id
    big = replace(SPEC, model="big", head_dim=64)
    big_keys = store_in_parts(store, big, list(range(16)), 1)
    assert store.counters["evicted_chunks"] == 6
    assert store.lookup_each(ns, a) == bytes(6)  # the whole chain left, its tail too
    assert [bytes(store.cpu.read(o, PAGE)) for o in acquired(store, ns, lease).offsets] == [
        page_bytes(k) for k in held
    ]
    store.release(ns, lease)
    c = store_chain(store, list(range(2000, 2032)))  # 2 slots the tail freed: nothing evicted
    assert store.counters["evicted_chunks"] == 6
    assert load_chain(store, c) == [page_bytes(k) for k in c]
    assert load_chain(store, held) == [page_bytes(k) for k in held]
    hit = store.lookup(big.namespace(), big_keys, lease=True)
    (offset,) = acquired(store, big.namespace(), hit.lease_id).offsets
    assert bytes(store.cpu.read(offset, slab)) == (big_keys[0] * (slab // len(big_keys[0])))[:slab]


def test_eviction_spares_pinned_pages_and_the_request_own_prefix(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, 4)
    ns = SPEC.namespace()
    a = store_chain(store, list(range(32)))
    b = store_chain(store, list(range(500, 532)))
    hold = store.lookup(ns, b, lease=True).lease_id
    # Extending a by two chunks needs two slots; b is pinned and a's own prefix is protected.
    with pytest.raises(ResourceExhausted, match="pinned"):
        store.reserve(ns, chunk_keys(ns, list(range(64)), 16))
    assert store.counters["evicted_chunks"] == 0  # all or nothing
    store.release(ns, hold)
    lease = store.reserve(ns, chunk_keys(ns, list(range(64)), 16)).lease_id
    store.commit(ns, lease)
    assert store.lookup(ns, chunk_keys(ns, list(range(64)), 16)).hit_chunks == 4
    assert store.lookup(ns, b).hit_chunks == 0
    assert load_chain(store, a) == [page_bytes(k) for k in a]


def test_namespaces_are_isolated(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, 16)
    other = replace(SPEC, model="other")
    keys = store_chain(store, list(range(32)))
    other_ns = store.connect(other).id
    assert store.lookup(other_ns, chunk_keys(other_ns, list(range(32)), 16)).hit_chunks == 0
    assert store.lookup(other_ns, keys).hit_chunks == 0  # same raw keys, other namespace
    lease = store.lookup(SPEC.namespace(), keys, lease=True).lease_id
    with pytest.raises(NotFound, match="another namespace"):
        store.acquire_now(other_ns, lease)


def test_lease_kinds_are_enforced(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, 16)
    keys = store_chain(store, list(range(32)))
    ns = SPEC.namespace()
    load = store.lookup(ns, keys, lease=True).lease_id
    with pytest.raises(FailedPrecondition, match="load lease"):
        store.commit(ns, load)
    write = store.reserve(ns, chunk_keys(ns, list(range(48)), 16)).lease_id
    with pytest.raises(FailedPrecondition, match="store lease"):
        store.release(ns, write)


def test_clear_waits_for_pinned_pages(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, 16)
    keys = store_chain(store, list(range(64)))
    ns = SPEC.namespace()
    lease = store.lookup(ns, keys, lease=True).lease_id
    assert store.clear() == 4
    assert store.lookup(ns, keys).hit_chunks == 0
    offsets = acquired(store, ns, lease).offsets
    assert [bytes(store.cpu.read(o, PAGE)) for o in offsets] == [page_bytes(k) for k in keys]
    assert store.cpu.bytes_used == 4 * PAGE
    store.release(ns, lease)
    assert store.cpu.bytes_used == 0


def test_request_validation(tmp_path: Path, clock: Clock) -> None:
    store = make_store(tmp_path, clock, 16)
    ns = store.connect(SPEC).id
    with pytest.raises(InvalidArgument, match="namespace"):
        store.lookup(b"short", [])
    with pytest.raises(NotFound, match="Connect"):
        store.lookup(b"\1" * 16, [])
    key = chunk_keys(ns, list(range(16)), 16)[0]
    with pytest.raises(InvalidArgument, match="repeats"):
        store.reserve(ns, [key, key])
    with pytest.raises(InvalidArgument, match="max_ttl_s"):
        store.reserve(ns, [key], ttl_s=3600)
    big = replace(SPEC, chunk_tokens=4096)
    with pytest.raises(InvalidArgument, match="slab_bytes"):
        store.connect(big)


def test_namespace_table_is_bounded(tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstore.store.store_state

    monkeypatch.setattr(kvstore.store.store_state, "MAX_NAMESPACES", 3)
    store = make_store(tmp_path, clock, 16)
    keys = store_chain(store, list(range(16)))  # SPEC's namespace holds a page
    specs = [replace(SPEC, salt=f"tenant-{i}") for i in range(5)]
    store.connect(specs[0])
    store.connect(specs[1])
    store.connect(specs[2])  # at the cap: the two empty namespaces are forgotten
    assert set(store.namespaces) == {SPEC.namespace(), specs[2].namespace()}
    for spec in specs[2:4]:
        store.connect(spec)
        store.reserve(spec.namespace(), chunk_keys(spec.namespace(), list(range(16)), 16))
    with pytest.raises(ResourceExhausted, match="3 namespaces"):
        store.connect(specs[4])  # all three hold pages or leases
    assert load_chain(store, keys) == [page_bytes(keys[0])]


def test_a_query_is_not_a_use(tmp_path: Path, clock: Clock) -> None:
    """Only lookups that count as uses (the leased lookup of a load) refresh a page for eviction."""
    store = make_store(tmp_path, clock, 4)
    ns = SPEC.namespace()
    a = store_chain(store, list(range(32)))
    b = store_chain(store, list(range(500, 532)))  # full: a is older than b
    assert store.lookup(ns, a, touch=False).hit_chunks == 2
    store_chain(store, list(range(900, 932)))  # evicts a: the query did not refresh it
    assert store.lookup(ns, a).hit_chunks == 0 and store.lookup(ns, b).hit_chunks == 2


def test_a_reserve_past_the_slabs_reserved_so_far_says_the_arena_is_warming_up(
    tmp_path: Path, clock: Clock
) -> None:
    arena = Arena(tmp_path / "arena", 16 * PAGE, prefault=False)
    cpu = CpuTier(arena, 4 * PAGE, reserved_slabs=1)  # 4 slabs of 4 pages, one reserved so far
    store = Store(cpu, make_policy("lru"), StoreSettings(lease_ttl_s=10.0, max_lease_ttl_s=60.0), clock=clock)
    ns = store.connect(SPEC).id
    keys = chunk_keys(ns, list(range(16 * 8)), 16)  # 8 pages: more than the reserved slab holds
    with pytest.raises(ResourceExhausted, match=r"still being reserved \(16384 of 65536 bytes so far"):
        store.reserve(ns, keys)
    cpu.slots.add_reserved(1)  # once another slab is reserved, the same store fits
    reserved = store.reserve(ns, keys)
    for key, offset in zip(keys, reserved.offsets, strict=True):
        store.cpu.write(offset, page_bytes(key))
    assert store.commit(ns, reserved.lease_id) == 8
    assert load_chain(store, keys) == [page_bytes(key) for key in keys]


def test_a_page_keeps_its_flags_and_counts_apart(tmp_path: Path, clock: Clock) -> None:
    """A page's committed and removed flags, children and pins share one int (issue #31: 6 slots,
    80 bytes a page): each reads back what was set, past the counts CPython shares too."""
    store = make_store(tmp_path, clock, 16)
    ns = store.connect(SPEC)
    entry = ns.new_entry(b"k" * 16, 0)
    assert entry.namespace is ns and sys.getsizeof(entry) <= 80
    for committed, removed, children, pins in itertools.product(
        (False, True), (False, True), (0, 1, 63, 64, 5000), (0, 1, 7, 300)
    ):
        entry.pins, entry.committed, entry.children, entry.removed = pins, committed, children, removed
        assert (entry.committed, entry.removed, entry.children, entry.pins) == (
            committed,
            removed,
            children,
            pins,
        )
        entry.children += 1
        entry.pins -= 1 if pins else 0
        assert (entry.committed, entry.removed, entry.children) == (committed, removed, children + 1)
        assert entry.pins == max(pins - 1, 0)
    with pytest.raises(ValueError, match="negative"):
        entry.pins = -1


def test_a_head_with_70_continuations_stays_while_leased_and_while_any_is_stored(
    tmp_path: Path, clock: Clock
) -> None:
    """A system prompt's page followed by 70 continuations: its count of children is past what a
    page's state keeps small; the guard and its lease still hold it, and its bytes load as stored."""
    store = make_store(tmp_path, clock, 80)
    ns = SPEC.namespace()
    head = store_chain(store, list(range(16)))
    chains = [
        store_chain(store, list(range(16)) + list(range(1000 * i, 1000 * i + 16))) for i in range(1, 71)
    ]
    entries = store.namespaces[ns].entries
    assert entries[head[0]].children == 70 and all(chain[0] == head[0] for chain in chains)
    lease = store.lookup(ns, chains[-1], lease=True).lease_id
    assert entries[head[0]].pins == 1
    others = [store_chain(store, list(range(10**6 + 16 * i, 10**6 + 16 * i + 16))) for i in range(78)]
    assert entries[head[0]].children == sum(chain[1] in entries for chain in chains) == 1  # the leased one
    offsets = acquired(store, ns, lease).offsets
    assert [bytes(store.cpu.read(o, PAGE)) for o in offsets] == [page_bytes(k) for k in chains[-1]]
    store.release(ns, lease)
    assert entries[head[0]].pins == 0
    store_chain(store, list(range(2 * 10**6, 2 * 10**6 + 32)))  # evicts the last continuation, then the head
    assert head[0] not in entries and chains[-1][1] not in entries
    assert load_chain(store, others[-1]) == [page_bytes(others[-1][0])]


def test_the_index_keeps_its_least_table_while_pages_come_and_go(tmp_path: Path, clock: Clock) -> None:
    """A dict never reuses the slot of a deleted key: an index that evicts as much as it stores
    would sit at twice the table it needs. The namespace rebuilds it instead (issue #31)."""
    store = make_store(tmp_path, clock, 512)
    ns = SPEC.namespace()
    chains = [store_chain(store, list(range(64 * i, 64 * i + 64))) for i in range(20 * 512 // 4)]
    entries = store.namespaces[ns].entries
    assert len(entries) == 512 and store.counters["evicted_chunks"] == 20 * 512 - 512
    assert sys.getsizeof(entries) == sys.getsizeof(dict(entries))  # as small as a dict of its keys
    churned: dict[bytes, None] = {}
    for i in range(20 * 512):  # the same churn in a plain dict: twice the table
        churned[i.to_bytes(16, "little")] = None
        if i >= 512:
            del churned[(i - 512).to_bytes(16, "little")]
    assert sys.getsizeof(churned) > 1.5 * sys.getsizeof(entries)
    for chain in chains[-128:]:  # every page stored last loads its own bytes
        assert load_chain(store, chain) == [page_bytes(key) for key in chain]


@pytest.mark.parametrize("seed", range(4))
def test_random_stores_of_two_page_sizes_evict_whole_tails_and_keep_every_byte(
    tmp_path: Path, clock: Clock, seed: int
) -> None:
    """Chains of two page sizes (one four times the other) stored in random parts into an arena of
    8 slabs, extending stored prefixes at times, some held by leases for a while: after every
    store, no page in the index has a parent that left it (no tail stranded), and every chain
    reads back its own bytes up to where it is stored. A Reserve may be refused only while
    leases hold pages."""
    import random

    rng = random.Random(seed)
    slab = 4 * PAGE
    arena = Arena(tmp_path / "arena", 8 * slab, prefault=False)
    store = Store(CpuTier(arena, slab), make_policy("lfuda"), StoreSettings(10.0, 60.0), clock=clock)
    specs = [SPEC, replace(SPEC, model="big", head_dim=64)]
    chains: list[tuple[PageSpec, list[int]]] = []
    leases: list[tuple[bytes, int]] = []
    for step in range(150):
        if chains and rng.random() < 0.3:  # extend a stored prefix of one of them
            spec, tokens = rng.choice(chains)
            kept = 16 * rng.randrange(1, len(tokens) // 16 + 1)
            tokens = tokens[:kept] + [step * 100 + 7] * 16 * rng.randrange(1, 4)
        else:
            spec, tokens = rng.choice(specs), [step * 1000 + t for t in range(16 * rng.randrange(1, 7))]
        try:
            store_in_parts(store, spec, tokens, rng.randrange(1, 4))
            chains.append((spec, tokens))
        except ResourceExhausted:
            assert leases, f"step {step}: refused with no lease held"
        if rng.random() < 0.3 and chains:  # hold a chain for a while
            spec, tokens = rng.choice(chains)
            ns = spec.namespace()
            hit = store.lookup(ns, chunk_keys(ns, tokens, 16), lease=True)
            if hit.lease_id:
                leases.append((ns, hit.lease_id))
        while leases and rng.random() < 0.4:
            store.release(*leases.pop(0))
        for spec in specs:
            held = store.state.namespaces.get(spec.namespace())
            for entry in list(held.entries.values()) if held is not None else []:
                assert entry.parent is None or not entry.parent.removed, f"step {step}: a stranded tail"
        for spec, tokens in chains:
            ns = spec.namespace()
            keys = chunk_keys(ns, tokens, 16)
            hit = store.lookup(ns, keys, lease=True)
            if hit.lease_id:
                offsets = acquired(store, ns, hit.lease_id).offsets
                size = spec.page_bytes
                got = [bytes(store.cpu.read(o, size)) for o in offsets]
                assert got == [(k * (size // len(k)))[:size] for k in keys[: hit.hit_chunks]], f"step {step}"
                store.release(ns, hit.lease_id)
