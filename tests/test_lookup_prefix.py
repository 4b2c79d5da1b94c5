"""A Lookup's stored prefix in every shape: the store finds the keys in one C call and looks at
each page only where one is missing, uncommitted or tiered; the answer is the page-at-a-time rule's.

Every leased hit is acquired and its bytes compared with what was stored.
"""

from __future__ import annotations

import random
from pathlib import Path

from kvstore.shared.domain import Tier
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


def make_store(tmp_path: Path) -> Store:
    arena = Arena(tmp_path / "arena", 64 * PAGE, prefault=False)
    settings = StoreSettings(lease_ttl_s=10.0, max_lease_ttl_s=60.0)
    return Store(CpuTier(arena, 64 * PAGE), make_policy("lfuda"), settings)


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
    query = store.lookup(ns, keys, touch=False)
    assert (query.hit_chunks, query.tiers, query.lease_id) == (want, bytes([Tier.CPU]) * want, 0)
    assert store.counters["lookups"] == before.get("lookups", 0) + 1
    assert store.counters["hit_chunks"] == before.get("hit_chunks", 0) + want
    assert store.counters["missed_chunks"] == before.get("missed_chunks", 0) + len(keys) - want
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
