"""A Lookup's stored prefix in every shape: the store finds the keys in one C call and looks at
each page only where one is missing, uncommitted or tiered (`Namespace.unplain` says which); the
answer, a Lookup's and a Query's (`Store.query`), is the page-at-a-time rule's.

Every leased hit is acquired and its bytes compared with what was stored.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstore.shared.domain import Tier
from kvstore.shared.errors import ResourceExhausted
from kvstore.shared.keys import chunk_keys
from kvstore.shared.spec import PageSpec
from kvstore.store.index import COMMITTED
from kvstore.store.policy import make_policy
from kvstore.store.store import Store
from kvstore.store.store_settings import StoreSettings
from kvstore.tiers.cpu import Arena, CpuTier

SPEC = PageSpec(model="test", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=16)
PAGE = SPEC.page_bytes
CHAIN = 12


def make_store(tmp_path: Path, pages: int = 64, clock: Callable[[], float] | None = None) -> Store:
    arena = Arena(tmp_path / "arena", pages * PAGE, prefault=False)
    settings = StoreSettings(lease_ttl_s=10.0, max_lease_ttl_s=60.0)
    extra = {"clock": clock} if clock is not None else {}
    return Store(CpuTier(arena, pages * PAGE), make_policy("lfuda"), settings, **extra)


def assert_unplain_holds(store: Store) -> None:
    """Each namespace's `unplain` holds the key of every page in its index that a Lookup must look
    at one by one (not committed, or with a `Tiering`), and no other key: a page that left the
    index took its key with it."""
    for ns in store.namespaces.values():
        must = {key for key, e in ns.entries.items() if not e.state & COMMITTED or e.tiering is not None}
        assert ns.unplain == must, (len(ns.unplain - must), len(must - ns.unplain))


def page_bytes(key: bytes) -> bytes:
    return (key * (PAGE // len(key)))[:PAGE]


def expected_hits(store: Store, ns: bytes, keys: list[bytes]) -> int:
    """The page-at-a-time rule: the leading keys whose page is committed or being read in."""
    entries = store.namespaces[ns].entries
    hits = 0
    for key in keys:
        entry = entries.get(key)
        if entry is None or not (entry.state & COMMITTED or entry.loaded is not None):
            break
        hits += 1
    return hits


def check_lookup(store: Store, ns: bytes, keys: list[bytes]) -> None:
    want = expected_hits(store, ns, keys)
    before = dict(store.counters)
    assert_unplain_holds(store)
    query = store.lookup(ns, keys, touch=False)
    assert (query.hit_chunks, query.tiers, query.lease_id) == (want, bytes([Tier.CPU]) * want, 0)
    assert store.query(ns, keys) == (want, bytes([Tier.CPU]) * want)
    assert store.counters["lookups"] == before.get("lookups", 0) + 2
    assert store.counters["hit_chunks"] == before.get("hit_chunks", 0) + 2 * want
    assert store.counters["missed_chunks"] == before.get("missed_chunks", 0) + 2 * (len(keys) - want)
    leased = store.lookup(ns, keys, lease=True)
    assert leased.hit_chunks == want and bool(leased.lease_id) == (want > 0)
    if leased.lease_id:
        acquired = store.acquire_now(ns, leased.lease_id)
        assert acquired is not None
        read = [bytes(store.cpu.read(offset, PAGE)) for offset in acquired.offsets]
        assert read == [page_bytes(key) for key in keys[:want]]
        assert store.release(ns, leased.lease_id) == want


def test_every_shape_of_a_lookup_hits_the_same_prefix(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    ns = store.connect(SPEC).id
    keys = chunk_keys(ns, list(range(CHAIN * 16)), 16)
    reserved = store.reserve(ns, keys)
    for key, offset in zip(keys, reserved.offsets, strict=True):
        store.cpu.write(offset, page_bytes(key))
    store.commit(ns, reserved.lease_id)
    missing = [bytes([0xFF]) * 16, bytes([0xFE]) * 16]
    shapes = [keys, keys[:1], keys[5:6], [], missing[:1], keys[:4] + keys[:4], keys[3:] + keys[:3]]
    shapes += [keys[:cut] + missing[:1] + keys[cut:] for cut in range(CHAIN + 1)]  # a miss at each place
    shapes += [keys[:cut] + missing + keys for cut in (0, 1, 6)]  # two misses, the stored keys after
    for shape in shapes:
        check_lookup(store, ns, shape)

    # Pages being written (reserved, uncommitted) end the prefix where they stand.
    pending = chunk_keys(ns, list(range(1000, 1000 + 3 * 16)), 16)
    lease = store.reserve(ns, pending).lease_id
    for cut in range(CHAIN + 1):
        check_lookup(store, ns, keys[:cut] + pending + keys[cut:])
        check_lookup(store, ns, keys[:cut] + pending[1:2])
    store.abort(ns, lease)

    rng = random.Random(31)
    pool = keys + missing + pending
    for _ in range(200):
        check_lookup(store, ns, [rng.choice(pool) for _ in range(rng.randrange(0, 20))])


@pytest.mark.parametrize("seed", range(4))
def test_the_pages_a_lookup_must_look_at_are_known_through_every_change(tmp_path: Path, seed: int) -> None:
    """Random stores (committed whole, in parts, aborted, left to expire), leased loads, clears
    and evictions in an arena that fills: after each, every Lookup's and Query's answer is the
    page-at-a-time rule's, and `unplain` names exactly the pages that are not plain."""
    rng = random.Random(seed)
    now = [1000.0]
    store = make_store(tmp_path, pages=48, clock=lambda: now[0])
    ns = store.connect(SPEC).id
    chains = [chunk_keys(ns, list(range(first * 1000, first * 1000 + 8 * 16)), 16) for first in range(10)]
    open_leases: list[tuple[int, int]] = []  # (lease, pages not yet committed)
    for _ in range(300):
        op = rng.randrange(8)
        chain = rng.choice(chains)[: rng.randrange(1, 9)]
        if op <= 2:  # a store, written in place
            try:
                reserved = store.reserve(ns, chain)
            except ResourceExhausted:
                continue
            for key, offset in zip(chain, reserved.offsets, strict=True):
                if offset >= 0:
                    store.cpu.write(offset, page_bytes(key))
            if reserved.lease_id:
                open_leases.append((reserved.lease_id, sum(o >= 0 for o in reserved.offsets)))
        elif op == 3 and open_leases:  # a commit of a part, or of the rest
            lease, left = open_leases.pop(rng.randrange(len(open_leases)))
            part = rng.randrange(1, left + 1)
            store.commit(ns, lease, part if part < left else 0)
            if part < left:
                open_leases.append((lease, left - part))
        elif op == 4 and open_leases:  # an abort, or a writer that goes silent
            lease, _ = open_leases.pop(rng.randrange(len(open_leases)))
            if rng.random() < 0.5:
                store.abort(ns, lease)
            else:
                now[0] += 11.0
                store.expire()
                open_leases = [(lid, left) for lid, left in open_leases if store.leases.get(lid) is not None]
        elif op == 5 and rng.random() < 0.1:
            store.clear(ns)
        else:
            check_lookup(store, ns, chain + rng.choice(chains)[:2])
        assert_unplain_holds(store)
        check_lookup(store, ns, chain)
