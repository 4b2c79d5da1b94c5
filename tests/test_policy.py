"""Eviction policies alone (order, ghosts, registry) and through the store (chains, pins, all or nothing)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.errors import InvalidArgument, ResourceExhausted
from kvstore.shared.keys import chunk_keys, pack_keys
from kvstore.store.history import FrequencyHistory
from kvstore.store.policy import POLICIES, EvictionPolicy, make_policy, policy_names
from kvstore.store.store import Store
from kvstore.store.store_settings import StoreSettings
from kvstore.tiers.cpu import Arena, CpuTier
from tests.harness import Daemon
from tests.test_store import PAGE, SPEC, load_chain, page_bytes, store_chain


class Page:
    """A page as the store hands it to a policy: one object per name (within a test), as the store
    has one entry per key, with the place a policy may keep its record of it in."""

    __slots__ = ("name", "key", "place")
    name: str
    key: bytes
    place: object
    _by_name: ClassVar[dict[str, Page]] = {}

    def __new__(cls, name: str) -> Page:
        page = cls._by_name.get(name)
        if page is None:
            page = cls._by_name[name] = super().__new__(cls)
            page.name = name
            page.key = name.encode().ljust(16, b".")
            page.place = None
        return page


@pytest.fixture(autouse=True)
def fresh_pages() -> Iterator[None]:
    """Each test's pages are its own: none carries a record of another test's policy."""
    Page._by_name.clear()
    yield
    Page._by_name.clear()


def pages(*names: str) -> list[Page]:
    return [Page(name) for name in names]


def order(policy: EvictionPolicy) -> list[str]:
    return [page.name for page in policy.candidates()]  # type: ignore[attr-defined]


# -- registry -------------------------------------------------------------------------------------


def test_registry_serves_chain_safe_policies_only() -> None:
    assert policy_names() == ["lfuda", "lru"]
    assert policy_names(serving=False) == ["lfuda", "lru", "lru-plain"]
    assert make_policy("lfuda").chain_safe and not make_policy("lru-plain", serving=False).chain_safe
    with pytest.raises(ValueError, match="unknown policy 'fifo'; choose one of \\['lfuda', 'lru'\\]"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="'lru-plain' may evict a chain's head before its tail"):
        make_policy("lru-plain")


# -- one policy at a time -------------------------------------------------------------------------


def test_lru_evicts_tails_first_and_refreshes_whole_chains() -> None:
    lru = make_policy("lru")
    lru.stored(pages("a0", "a1", "a2"))
    lru.stored(pages("b0", "b1"))
    assert order(lru) == ["a2", "a1", "a0", "b1", "b0"]
    lru.hit(pages("a0"))
    assert order(lru) == ["a2", "a1", "b1", "b0", "a0"]
    lru.stored(pages("a0", "a1", "a2", "a3"))  # the chain grows: the whole chain is the most recent
    assert order(lru) == ["b1", "b0", "a3", "a2", "a1", "a0"]
    lru.evicted(Page("b1"))
    lru.remove(Page("a3"))
    lru.remove(Page("never-stored"))
    assert order(lru) == ["b0", "a2", "a1", "a0"] and len(lru) == 4


def test_plain_lru_is_the_textbook_order_heads_first() -> None:
    plain = make_policy("lru-plain", serving=False)
    plain.stored(pages("a0", "a1", "a2"))
    plain.hit(pages("a0", "a1"))
    assert order(plain) == ["a2", "a0", "a1"]  # the head leaves before its tail: replay baseline only


def test_lfuda_evicts_the_least_read_first_and_tails_before_heads() -> None:
    lfuda = make_policy("lfuda")
    lfuda.stored(pages("a0", "a1", "a2"))
    lfuda.stored(pages("b0"))
    lfuda.hit(pages("a0", "a1"))
    lfuda.hit(pages("a0"))
    assert order(lfuda) == ["a2", "b0", "a1", "a0"]  # counts 1 1 2 3; a2 and b0 tie: the older first


def test_lfuda_ages_counts_as_evictions_raise_the_floor() -> None:
    lfuda = make_policy("lfuda")
    lfuda.stored(pages("x"))
    for _ in range(3):
        lfuda.hit(pages("x"))  # count 4: priority 4
    victims = []
    for i in range(4):  # each new page enters at the last victim's priority + 1
        lfuda.stored(pages(f"n{i}"))
        victim = next(lfuda.candidates())
        lfuda.evicted(victim)
        victims.append(victim.name)  # type: ignore[attr-defined]
    assert victims == ["n0", "n1", "n2", "x"]  # n3 entered at 4 too, after x: read often, but long ago


def test_lfuda_counts_survive_eviction_in_the_history() -> None:
    lfuda = make_policy("lfuda")
    lfuda.stored(pages("a"))
    lfuda.hit(pages("a"))
    lfuda.hit(pages("a"))  # count 3
    lfuda.evicted(Page("a"))  # the history keeps its count; the floor rises to 3
    lfuda.stored(pages("b"))  # count 1: priority 4
    lfuda.stored(pages("a"))  # count 4 again: priority 7
    lfuda.stored(pages("c"))  # priority 4
    assert order(lfuda) == ["b", "c", "a"]
    lfuda.remove(Page("a"))  # cleared or pinned: no history
    lfuda.stored(pages("a"))
    assert order(lfuda) == ["b", "c", "a"]  # priority 4, the newest


def test_lfuda_a_head_is_worth_at_least_its_tail() -> None:
    lfuda = make_policy("lfuda")
    lfuda.stored(pages("h", "t"))
    for _ in range(4):
        lfuda.hit(pages("h", "t"))  # both count 5
    lfuda.evicted(Page("t"))  # t's count goes to the history
    lfuda.remove(Page("h"))  # h's does not
    lfuda.stored(pages("n"))
    lfuda.stored(pages("h", "t"))  # t resumes 6; h, new, takes its tail's count
    assert order(lfuda) == ["n", "t", "h"]


def test_history_keeps_counts_by_key_and_grows_with_the_tier() -> None:
    history = FrequencyHistory(slot_bits=4)  # 16 slots
    keys = [i.to_bytes(16, "little") for i in range(1, 7)]
    for count, key in enumerate(keys, 1):
        history.put(key, count)
    history.fit(8)  # 2 slots a page: still 16
    assert history.slots == 16
    history.fit(20)  # grown to 64, entries kept
    assert history.slots == 64
    assert [history.pop(key) for key in keys] == [1, 2, 3, 4, 5, 6]
    assert [history.pop(key) for key in keys] == [0] * 6  # popped: gone
    history.put(keys[0], 1000)
    assert history.pop(keys[0]) == 255  # counts saturate at one byte


def test_history_forgets_the_older_of_two_keys_sharing_a_slot() -> None:
    history = FrequencyHistory(slot_bits=4)
    older, newer = (9).to_bytes(16, "little"), (17).to_bytes(16, "little")  # both land in slot 8
    history.put(older, 3)
    history.put(newer, 5)
    assert (history.pop(older), history.pop(newer)) == (0, 5)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_holds_each_page_once(name: str) -> None:
    policy = make_policy(name, serving=False)
    rng = random.Random(5)
    held: set[str] = set()
    for step in range(2000):
        chain = pages(*(f"c{rng.randrange(20)}-{i}" for i in range(rng.randrange(1, 5))))
        action = rng.random()
        if action < 0.5:
            policy.stored(chain)
            held.update(p.name for p in chain)
        elif action < 0.7 and held:
            policy.hit([p for p in chain if p.name in held][:1])
        elif held:
            victim = next(policy.candidates())
            if step % 2:
                policy.evicted(victim)
            else:
                policy.remove(victim)
            held.discard(victim.name)  # type: ignore[attr-defined]
        listed = order(policy)
        assert len(listed) == len(set(listed)) == len(policy) and set(listed) == held


# -- through the store ----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_store(tmp_path: Path, pages: int, policy: str = "lfuda", clock: Clock | None = None) -> Store:
    arena = Arena(tmp_path / "arena", pages * PAGE, prefault=False)
    return Store(
        CpuTier(arena, pages * PAGE),
        make_policy(policy),
        StoreSettings(lease_ttl_s=10.0, max_lease_ttl_s=60.0, pin_fraction=0.25, max_pin_ttl_s=100.0),
        clock=clock or Clock(),
    )


def tokens(chain: int, chunks: int) -> list[int]:
    return [chain * 10_000 + t for t in range(chunks * SPEC.chunk_tokens)]


@pytest.mark.parametrize("policy", ["lfuda", "lru"])
def test_eviction_never_strands_a_tail(tmp_path: Path, policy: str) -> None:
    store = make_store(tmp_path, 24, policy)
    rng = random.Random(7)
    stored: dict[bytes, bytes] = {}
    for _ in range(400):
        chain = rng.randrange(12)  # conversations that grow turn by turn, and are read back
        keys = chunk_keys(SPEC.namespace(), tokens(chain, rng.randrange(1, 7)), SPEC.chunk_tokens)
        if rng.random() < 0.5:
            store_chain(store, tokens(chain, len(keys)))
            stored.update((k, page_bytes(k)) for k in keys)
        else:
            loaded = load_chain(store, keys)
            assert loaded == [stored[k] for k in keys[: len(loaded)]]
        entries = list(store.namespaces[SPEC.namespace()].entries.values())
        for entry in entries:  # every page's predecessor is still held
            assert (
                entry.parent is None
                or store.namespaces[SPEC.namespace()].entries[entry.parent.key] is entry.parent
            )
    assert store.counters["evicted_chunks"] > 100 and sum(e.parent is not None for e in entries) > 10


def test_eviction_is_all_or_nothing(tmp_path: Path) -> None:
    store = make_store(tmp_path, 6)
    ns = SPEC.namespace()
    a = store_chain(store, tokens(1, 3))
    b = store_chain(store, tokens(2, 3))
    hold = store.lookup(ns, b, lease=True).lease_id  # b is leased: only a's 3 pages could go
    with pytest.raises(ResourceExhausted, match="pinned by a lease"):
        store.reserve(ns, chunk_keys(ns, tokens(3, 4), SPEC.chunk_tokens))
    assert store.counters["evicted_chunks"] == 0 and len(store.policy) == 6
    assert load_chain(store, a) == [page_bytes(k) for k in a]
    store.release(ns, hold)
    c = store_chain(store, tokens(3, 4))  # now b (read longest ago) and a's tail make room, tails first
    assert load_chain(store, c) == [page_bytes(k) for k in c]
    assert load_chain(store, b) == [] and load_chain(store, a) == [page_bytes(k) for k in a[:2]]


def test_a_pinned_chain_outlives_eviction_until_its_ttl(tmp_path: Path) -> None:
    clock = Clock()
    store = make_store(tmp_path, 16, clock=clock)
    ns = SPEC.namespace()
    prompt = store_chain(store, tokens(0, 3))
    assert store.pin(ns, prompt, ttl_s=30.0) == (3, 3, 3 * PAGE)
    for chain in range(1, 40):
        store_chain(store, tokens(chain, 2))
    assert load_chain(store, prompt) == [page_bytes(k) for k in prompt]
    clock.now += 20
    assert store.pin(ns, prompt, ttl_s=30.0).pinned_chunks == 3  # renewed: now ends at +50 s
    clock.now += 20
    store.expire()
    for chain in range(40, 80):
        store_chain(store, tokens(chain, 2))
    assert load_chain(store, prompt) == [page_bytes(k) for k in prompt]
    clock.now += 11
    store.expire()
    assert store.stats().counters["pinned_pages"] == 0 and store.counters["expired_pins"] == 3
    for chain in range(80, 100):
        store_chain(store, tokens(chain, 2))
    assert load_chain(store, prompt) == []  # back in the policy's care, and evicted


def test_pins_are_capped_and_take_the_stored_prefix(tmp_path: Path) -> None:
    store = make_store(tmp_path, 16)  # pin_fraction 0.25: 4 pages
    ns = SPEC.namespace()
    a = store_chain(store, tokens(1, 3))
    longer = chunk_keys(ns, tokens(1, 6), SPEC.chunk_tokens)
    assert store.pin(ns, longer, ttl_s=10.0).pinned_chunks == 3  # the stored prefix only
    b = store_chain(store, tokens(2, 2))
    with pytest.raises(ResourceExhausted, match="over eviction.pin_fraction"):
        store.pin(ns, b, ttl_s=10.0)
    assert store.pin(ns, b[:1], ttl_s=10.0) == (1, 4, 4 * PAGE)
    assert store.pin(ns, a, ttl_s=10.0).pinned_pages == 4  # pinning again adds nothing
    with pytest.raises(InvalidArgument, match="eviction.max_pin_ttl_s"):
        store.pin(ns, a, ttl_s=101.0)
    with pytest.raises(InvalidArgument, match="ttl_ms"):
        store.pin(ns, a, ttl_s=0.0)


def test_clear_drops_pins_and_frees_their_pages(tmp_path: Path) -> None:
    store = make_store(tmp_path, 16)
    ns = SPEC.namespace()
    a = store_chain(store, tokens(1, 3))
    store.pin(ns, a, ttl_s=10.0)
    assert store.clear() == 3
    assert store.cpu.bytes_used == 0 and store.stats().counters["pinned_bytes"] == 0
    a = store_chain(store, tokens(1, 3))
    assert load_chain(store, a) == [page_bytes(k) for k in a]


def kvctl(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.ctl.cli", "--address", daemon.address, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_kvctl_pins_a_system_prompt_in_the_daemon(daemon: Daemon, tmp_path: Path) -> None:
    stub = daemon.stub()
    spec = pb.PageSpec(
        model="pin", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=16
    )
    ns = stub.Connect(pb.ConnectRequest(spec=spec)).namespace
    prompt = list(range(64))  # four chunks
    keys = chunk_keys(ns, prompt, 16)
    lease = stub.Reserve(pb.ReserveRequest(namespace=ns, keys=pack_keys(keys))).lease_id
    stub.Commit(pb.LeaseRequest(namespace=ns, lease_id=lease))
    (tmp_path / "prompt.json").write_text(json.dumps(prompt + [7]))  # the partial chunk has no key

    pinned = kvctl(
        daemon, "pin", ns.hex(), "--tokens", str(tmp_path / "prompt.json"), "--ttl", "60", "--json"
    )
    assert pinned.returncode == 0, pinned.stderr
    assert json.loads(pinned.stdout) == {
        "pinned_chunks": 4,
        "ttl_s": 60.0,
        "pinned_pages": 4,
        "pinned_bytes": 4 * PAGE,
    }
    again = kvctl(daemon, "pin", ns.hex(), "--keys", f"{keys[0].hex()},{keys[1].hex()}", "--ttl", "30")
    assert again.returncode == 0 and again.stdout.startswith(
        "pinned 2 chunks for 30 s; the tier holds 4 pinned"
    )
    stats = json.loads(kvctl(daemon, "stats", "--json").stdout)
    assert (stats["counters"]["pinned_pages"], stats["counters"]["pinned_bytes"]) == (4, 4 * PAGE)

    too_long = kvctl(daemon, "pin", ns.hex(), "--keys", keys[0].hex(), "--ttl", "1e6")
    assert too_long.returncode == 1 and "eviction.max_pin_ttl_s" in too_long.stderr
    assert "INVALID_ARGUMENT" in too_long.stderr
    both = kvctl(daemon, "pin", ns.hex(), "--ttl", "5")
    assert both.returncode == 1 and "give the chain as --tokens FILE or as --keys" in both.stderr
    (tmp_path / "other.json").write_text(json.dumps(list(range(100, 164))))
    nothing = kvctl(daemon, "pin", ns.hex(), "--tokens", str(tmp_path / "other.json"), "--ttl", "60")
    assert nothing.returncode == 1 and nothing.stdout.startswith("pinned 0 chunks")
    assert f"no chunk of the chain is stored in namespace {ns.hex()}" in nothing.stderr
