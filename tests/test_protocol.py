"""The gRPC protocol against a real kvstored: every validation's status code and message, and
byte-exact stores and loads over the inline data plane (Put/Get).

Each scenario talks raw gRPC through the generated stubs, so what is checked is exactly what
any client in any language sees on the wire.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.shared.keys import chunk_keys
from kvstore.shared.spec import PageSpec
from kvstore.shared.wire import page_spec_message, page_spec_of

Code = grpc.StatusCode

# A page of 2 layers x (K, V) x 16 tokens x 2 heads x 16 dims x 2 bytes = 4096 bytes: one arena slot.
SPEC: dict[str, Any] = {
    "model": "test",
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 16,
    "dtype": "float16",
    "chunk_tokens": 16,
}
PAGE_BYTES = PageSpec(**SPEC).page_bytes
# An arena of 4 slabs x 4 slots: 16 pages of SPEC.
SMALL_ARENA = {"tiers__cpu__bytes": "64KiB", "tiers__cpu__slab_bytes": "16KiB"}
SMALL_ARENA_PAGES = 16
MAX_TTL_MS = 600_000  # leases.max_ttl_s default


class Conn(NamedTuple):
    """One Connect's answer: what every later call needs."""

    stub: pb_grpc.KVStoreStub
    ns: bytes
    page_bytes: int
    chunk_tokens: int
    max_message_bytes: int
    epoch: int


# --- helpers ----------------------------------------------------------------------------------


def connect(stub: pb_grpc.KVStoreStub, **changes: Any) -> Conn:
    reply = stub.Connect(pb.ConnectRequest(spec=pb.PageSpec(**{**SPEC, **changes}), client_name="test"))
    return Conn(
        stub, reply.namespace, reply.page_bytes, reply.chunk_tokens, reply.max_message_bytes, reply.epoch
    )


def chain(conn: Conn, num_chunks: int, first_token: int = 0) -> list[bytes]:
    """Keys of `num_chunks` full chunks of consecutive tokens from `first_token`."""
    tokens = np.arange(first_token, first_token + num_chunks * conn.chunk_tokens)
    return chunk_keys(conn.ns, tokens, conn.chunk_tokens)


def random_pages(num_pages: int, page_bytes: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(page_bytes) for _ in range(num_pages)]


def header(conn: Conn, lease_id: int) -> pb.PutRequest:
    return pb.PutRequest(header=pb.PutHeader(namespace=conn.ns, lease_id=lease_id))


def put(conn: Conn, lease_id: int, data: bytes, piece_bytes: int = 1 << 20) -> int:
    """Writes `data` under a store lease in messages of `piece_bytes`; returns bytes_written."""
    pieces = (pb.PutRequest(data=data[i : i + piece_bytes]) for i in range(0, len(data), piece_bytes))
    return conn.stub.Put(iter([header(conn, lease_id), *pieces])).bytes_written


def put_nothing(conn: Conn, lease_id: int) -> int:
    """A Put of no bytes: enough to have the daemon check the header."""
    return put(conn, lease_id, b"")


def reserve(conn: Conn, keys: list[bytes], ttl_ms: int = 0) -> pb.ReserveResponse:
    return conn.stub.Reserve(pb.ReserveRequest(namespace=conn.ns, keys=b"".join(keys), lease_ttl_ms=ttl_ms))


def store(
    conn: Conn, keys: list[bytes], pages: list[bytes], piece_bytes: int = 1 << 20
) -> pb.ReserveResponse:
    """Reserve + Put (the pages of the keys not stored yet) + Commit; returns the reservation."""
    reply = reserve(conn, keys)
    new = b"".join(page for page, offset in zip(pages, reply.offsets, strict=True) if offset >= 0)
    if reply.lease_id:
        assert put(conn, reply.lease_id, new, piece_bytes) == len(new)
        assert commit(conn, reply.lease_id) == len(new) // conn.page_bytes
    return reply


def commit(conn: Conn, lease_id: int) -> int:
    return conn.stub.Commit(pb.LeaseRequest(namespace=conn.ns, lease_id=lease_id)).committed


def lookup(conn: Conn, keys: list[bytes], lease: bool = False) -> pb.LookupResponse:
    return conn.stub.Lookup(pb.LookupRequest(namespace=conn.ns, keys=b"".join(keys), lease=lease))


def get_messages(conn: Conn, lease_id: int) -> list[bytes]:
    return [reply.data for reply in conn.stub.Get(pb.LeaseRequest(namespace=conn.ns, lease_id=lease_id))]


def get(conn: Conn, lease_id: int) -> bytes:
    return b"".join(get_messages(conn, lease_id))


def acquire(conn: Conn, lease_id: int) -> pb.AcquireResponse:
    return conn.stub.Acquire(pb.LeaseRequest(namespace=conn.ns, lease_id=lease_id, epoch=conn.epoch))


def release(conn: Conn, lease_id: int) -> int:
    return conn.stub.Release(pb.LeaseRequest(namespace=conn.ns, lease_id=lease_id)).pages


def abort(conn: Conn, lease_id: int) -> int:
    return conn.stub.Abort(pb.LeaseRequest(namespace=conn.ns, lease_id=lease_id)).pages


def load(conn: Conn, keys: list[bytes]) -> bytes:
    """The bytes of the stored prefix of `keys`, through Lookup(lease) + Get + Release."""
    hit = lookup(conn, keys, lease=True)
    if not hit.hit_chunks:
        return b""
    data = get(conn, hit.lease_id)
    assert release(conn, hit.lease_id) == hit.hit_chunks
    return data


def hit_chunks(conn: Conn, keys: list[bytes]) -> int:
    return lookup(conn, keys).hit_chunks


def stats(stub: pb_grpc.KVStoreStub) -> pb.StatsResponse:
    return stub.Stats(pb.StatsRequest())


def bytes_used(stub: pb_grpc.KVStoreStub) -> int:
    return stats(stub).tiers[0].bytes_used


def counter(stub: pb_grpc.KVStoreStub, name: str) -> float:
    return stats(stub).counters.get(name, 0.0)


def rejects(
    code: grpc.StatusCode, fragment: str, call: Callable[..., object], *args: Any, **kwargs: Any
) -> None:
    """`call(*args, **kwargs)` fails with `code`, and its message contains `fragment`."""
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    error: Any = info.value
    assert (error.code(), fragment in error.details()) == (code, True), error.details()


# --- validation -------------------------------------------------------------------------------


def test_connect_rejects_bad_specs_and_registers_none_of_them(daemon_factory: Callable[..., Any]) -> None:
    daemon = daemon_factory(tiers__cpu__slab_bytes="64KiB", tiers__cpu__bytes="1MiB")
    stub = daemon.stub()
    bad_specs: list[tuple[dict[str, Any], str]] = [
        ({"model": ""}, "model: expected a non-empty model id"),
        ({"num_layers": 0}, "num_layers: expected a positive integer, got 0"),
        ({"num_kv_heads": 0}, "num_kv_heads: expected a positive integer, got 0"),
        ({"head_dim": 0}, "head_dim: expected a positive integer, got 0"),
        ({"dtype": "float64"}, "dtype: unsupported 'float64'"),
        ({"dtype": ""}, "dtype: unsupported ''"),
        ({"tp_rank": 2, "tp_size": 2}, "tp_rank: expected 0 <= tp_rank < tp_size=2, got 2"),
        ({"tp_rank": 1}, "tp_rank: expected 0 <= tp_rank < tp_size=1, got 1"),  # tp_size 0 means 1
        ({"kv_sharing": {5: 0}}, "kv_sharing: layer 5 -> 0 is outside 0..1"),
        ({"kv_sharing": {0: 7}}, "kv_sharing: layer 0 -> 7 is outside 0..1"),
        ({"kv_sharing": {1: 1}}, "kv_sharing: layer 1 must reuse a layer that stores its own KV"),
        ({"latent": True}, "num_kv_heads: MLA pages hold one latent vector per token"),
        # 2 x 2 x 512 tokens x 2 x 16 x 2 bytes = 128 KiB pages, in 64 KiB slabs.
        (
            {"chunk_tokens": 512},
            "a page of this spec is 131072 bytes, larger than a CPU-tier slab (65536 bytes)",
        ),
    ]
    for changes, fragment in bad_specs:
        rejects(Code.INVALID_ARGUMENT, fragment, connect, stub, **changes)
    assert len(stats(stub).namespaces) == 0

    conn = connect(stub)
    assert (conn.ns, conn.page_bytes, conn.chunk_tokens) == (PageSpec(**SPEC).namespace(), 4096, 16)
    assert connect(stub).ns == conn.ns  # Connect is idempotent
    # chunk_tokens 0 takes the daemon's 256: a 64 KiB page, exactly one slab.
    default_chunk = connect(stub, chunk_tokens=0)
    assert (default_chunk.chunk_tokens, default_chunk.page_bytes) == (256, 65536)
    reply = stub.Connect(pb.ConnectRequest(spec=pb.PageSpec(**SPEC)))
    assert (reply.arena.shm_path, reply.arena.size) == (str(daemon.arena_path), 1 << 20)
    assert (reply.lease_ttl_ms, reply.max_message_bytes) == (30_000, 1088 << 10)
    assert {ns.namespace for ns in stats(stub).namespaces} == {conn.ns, default_chunk.ns}


def test_malformed_keys_namespaces_and_ttls_are_rejected_without_side_effects(daemon: Any) -> None:
    stub = daemon.stub()
    conn = connect(stub)
    keys = chain(conn, 2)

    odd_keys = b"".join(keys) + b"x"
    fragment = "keys: expected a concatenation of 16-byte keys, got 33 bytes (1 bytes left over)"
    rejects(Code.INVALID_ARGUMENT, fragment, lookup, conn, [odd_keys])
    rejects(Code.INVALID_ARGUMENT, fragment, reserve, conn, [odd_keys])

    for ns in (b"", conn.ns[:15], conn.ns + b"\0"):
        fragment = f"namespace: expected 16 bytes, got {len(ns)}"
        misnamed = conn._replace(ns=ns)
        for call, arg in ((lookup, keys), (reserve, keys), (commit, 1), (get, 1), (put_nothing, 1)):
            rejects(Code.INVALID_ARGUMENT, fragment, call, misnamed, arg)
    rejects(
        Code.INVALID_ARGUMENT,
        "namespace: expected 16 bytes, got 3",
        stub.Clear,
        pb.ClearRequest(namespace=b"abc"),
    )

    stranger = conn._replace(ns=bytes(16))
    fragment = f"namespace {bytes(16).hex()} is not registered with this daemon"
    for call, arg in ((lookup, keys), (reserve, keys), (commit, 1), (get, 1), (put_nothing, 1)):
        rejects(Code.NOT_FOUND, fragment, call, stranger, arg)
    rejects(Code.NOT_FOUND, fragment, stub.Clear, pb.ClearRequest(namespace=stranger.ns))
    rejects(Code.NOT_FOUND, "call Connect with its page spec first", lookup, stranger, keys)

    rejects(
        Code.INVALID_ARGUMENT,
        "keys[2] repeats an earlier key of the same request",
        reserve,
        conn,
        [keys[0], keys[1], keys[0]],
    )
    rejects(Code.INVALID_ARGUMENT, "keys[1] repeats an earlier key", reserve, conn, [keys[0], keys[0]])

    fragment = f"lease_ttl_ms: {MAX_TTL_MS + 1} ms is outside 1..{MAX_TTL_MS} (leases.max_ttl_s)"
    rejects(Code.INVALID_ARGUMENT, fragment, reserve, conn, keys, MAX_TTL_MS + 1)
    rejects(
        Code.INVALID_ARGUMENT,
        fragment,
        stub.Lookup,
        pb.LookupRequest(namespace=conn.ns, keys=b"".join(keys), lease=True, lease_ttl_ms=MAX_TTL_MS + 1),
    )

    # Nothing above reserved a slot or created a lease.
    assert bytes_used(stub) == 0
    assert counter(stub, "active_leases") == 0
    # The longest TTL itself is allowed, and the keys are still free.
    longest = reserve(conn, keys, ttl_ms=MAX_TTL_MS)
    assert longest.lease_id != 0 and min(longest.offsets) >= 0
    assert abort(conn, longest.lease_id) == 2
    assert bytes_used(stub) == 0


def test_lease_ids_are_checked_for_existence_namespace_and_kind(daemon: Any) -> None:
    stub = daemon.stub()
    conn_a, conn_b = connect(stub), connect(stub, model="other")
    stored_keys, stored_pages = chain(conn_a, 2), random_pages(2, PAGE_BYTES, seed=1)
    store(conn_a, stored_keys, stored_pages)
    load_lease = lookup(conn_a, stored_keys, lease=True).lease_id
    new_keys, new_pages = chain(conn_a, 3, first_token=10_000), random_pages(3, PAGE_BYTES, seed=2)
    store_lease = reserve(conn_a, new_keys).lease_id
    assert 0 not in (load_lease, store_lease)

    unknown = 12345
    store_calls = (commit, abort, put_nothing)
    load_calls = (acquire, release, get)
    for call in (*store_calls, *load_calls):
        rejects(
            Code.NOT_FOUND,
            f"lease {unknown} not found in namespace {conn_a.ns.hex()[:12]}",
            call,
            conn_a,
            unknown,
        )
        rejects(Code.NOT_FOUND, "lease 0 not found", call, conn_a, 0)
        # Both leases belong to namespace A: under B they do not exist.
        for lease in (load_lease, store_lease):
            rejects(
                Code.NOT_FOUND,
                f"lease {lease} not found in namespace {conn_b.ns.hex()[:12]}",
                call,
                conn_b,
                lease,
            )
    for call in store_calls:
        rejects(
            Code.FAILED_PRECONDITION,
            f"lease {load_lease} is a load lease: use Acquire/Release/Get",
            call,
            conn_a,
            load_lease,
        )
    for call in load_calls:
        rejects(
            Code.FAILED_PRECONDITION,
            f"lease {store_lease} is a store lease: use Commit/Abort/Put",
            call,
            conn_a,
            store_lease,
        )

    # None of the refused calls touched either lease.
    assert get(conn_a, load_lease) == b"".join(stored_pages)
    assert release(conn_a, load_lease) == 2
    rejects(Code.NOT_FOUND, f"lease {load_lease} not found", release, conn_a, load_lease)
    assert put(conn_a, store_lease, b"".join(new_pages)) == 3 * PAGE_BYTES
    assert commit(conn_a, store_lease) == 3
    rejects(Code.NOT_FOUND, f"lease {store_lease} not found", commit, conn_a, store_lease)
    rejects(Code.NOT_FOUND, f"lease {store_lease} not found", abort, conn_a, store_lease)
    assert load(conn_a, new_keys) == b"".join(new_pages)
    assert counter(stub, "active_leases") == 0


def test_malformed_put_streams_are_rejected_and_the_lease_can_still_be_aborted(daemon: Any) -> None:
    stub = daemon.stub()
    conn = connect(stub)
    keys, pages = chain(conn, 2), random_pages(2, PAGE_BYTES, seed=3)
    two_pages = b"".join(pages)

    bad_streams: list[tuple[Callable[[int], Iterable[pb.PutRequest]], str]] = [
        (lambda lease: [pb.PutRequest(data=two_pages)], "the first message must be a PutHeader"),
        (lambda lease: [], "the first message must be a PutHeader"),
        (
            lambda lease: [header(conn, lease), pb.PutRequest(data=pages[0]), header(conn, lease)],
            "only the first message may be a PutHeader; the rest carry data",
        ),
        (
            lambda lease: [header(conn, lease), *[pb.PutRequest(data=page) for page in [*pages, pages[0]]]],
            "more than the 8192 bytes of the lease's 2 pages of 4096 bytes",
        ),
        (
            lambda lease: [header(conn, lease), pb.PutRequest(data=two_pages + b"\0")],
            "more than the 8192 bytes",
        ),
        (
            lambda lease: [header(conn, lease), pb.PutRequest(data=two_pages[:-1])],
            "received 8191 bytes; the lease's 2 pages of 4096 bytes need exactly 8192",
        ),
        (lambda lease: [header(conn, lease)], "received 0 bytes"),
    ]
    for stream, fragment in bad_streams:
        lease = reserve(conn, keys).lease_id
        rejects(Code.INVALID_ARGUMENT, fragment, stub.Put, iter(stream(lease)))
        assert abort(conn, lease) == 2
        assert bytes_used(stub) == 0
        assert counter(stub, "active_store_leases") == 0
        assert hit_chunks(conn, keys) == 0

    # The slots are free again: a well-formed Put of the same keys stores them.
    store(conn, keys, pages)
    assert load(conn, keys) == two_pages


def test_a_failed_put_cannot_be_committed_and_puts_are_exclusive(daemon: Any) -> None:
    stub = daemon.stub()
    conn = connect(stub)
    keys, pages = chain(conn, 2), random_pages(2, PAGE_BYTES, seed=11)
    lease = reserve(conn, keys).lease_id
    rejects(
        Code.INVALID_ARGUMENT,
        "received 100 bytes",
        stub.Put,
        iter([header(conn, lease), pb.PutRequest(data=pages[0][:100])]),
    )
    # Committing would publish whatever the slots held before: refused until aborted.
    rejects(Code.FAILED_PRECONDITION, "Put failed part-way", commit, conn, lease)
    assert hit_chunks(conn, keys) == 0
    assert abort(conn, lease) == 2

    lease = reserve(conn, keys).lease_id
    release_first = __import__("threading").Event()

    def slow_stream() -> Iterator[pb.PutRequest]:
        yield header(conn, lease)
        release_first.wait(10)
        yield pb.PutRequest(data=b"".join(pages))

    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(stub.Put, slow_stream())
        deadline = time.monotonic() + 10
        while counter(stub, "active_puts") != 1:  # wait until the first Put holds the lease
            assert time.monotonic() < deadline
            time.sleep(0.01)
        second = iter([header(conn, lease)])
        rejects(Code.FAILED_PRECONDITION, "another Put is already writing", stub.Put, second)
        rejects(Code.FAILED_PRECONDITION, "a Put is still writing", commit, conn, lease)
        release_first.set()
        assert first.result(timeout=30).bytes_written == 2 * PAGE_BYTES
    assert commit(conn, lease) == 2
    assert load(conn, keys) == b"".join(pages)


def test_an_arena_full_of_pinned_or_reserved_pages_is_exhausted(daemon_factory: Callable[..., Any]) -> None:
    daemon = daemon_factory(**SMALL_ARENA)
    stub = daemon.stub()
    conn = connect(stub)
    keys, pages = chain(conn, SMALL_ARENA_PAGES), random_pages(SMALL_ARENA_PAGES, PAGE_BYTES, seed=4)
    store(conn, keys, pages)
    assert bytes_used(stub) == stats(stub).tiers[0].bytes_capacity == SMALL_ARENA_PAGES * PAGE_BYTES

    pin = lookup(conn, keys, lease=True)
    assert pin.hit_chunks == SMALL_ARENA_PAGES
    extra = chain(conn, 1, first_token=10_000)
    fragment = "cannot reserve 1 page(s) of 4096 bytes in the CPU tier (65536 bytes, 65536 in use)"
    rejects(Code.RESOURCE_EXHAUSTED, fragment, reserve, conn, extra)
    rejects(Code.RESOURCE_EXHAUSTED, "pinned by a lease or being written", reserve, conn, extra)
    # All or nothing: the refusal evicted nothing and reserved nothing.
    assert counter(stub, "evicted_chunks") == 0
    assert counter(stub, "active_store_leases") == 0
    assert get(conn, pin.lease_id) == b"".join(pages)

    # Unpinned, the least recent page (the chain's tail) makes room.
    assert release(conn, pin.lease_id) == SMALL_ARENA_PAGES
    extra_lease = reserve(conn, extra).lease_id
    assert counter(stub, "evicted_chunks") == 1
    assert load(conn, keys) == b"".join(pages[:-1])

    # Pages being written cannot be evicted either.
    assert abort(conn, extra_lease) == 1
    assert stub.Clear(pb.ClearRequest(namespace=conn.ns)).pages == SMALL_ARENA_PAGES - 1
    assert bytes_used(stub) == 0
    writing = reserve(conn, keys).lease_id
    rejects(Code.RESOURCE_EXHAUSTED, "pinned by a lease or being written", reserve, conn, extra)
    assert abort(conn, writing) == SMALL_ARENA_PAGES
    assert bytes_used(stub) == 0


def test_a_full_arena_of_committed_pages_evicts_chain_tails(daemon_factory: Callable[..., Any]) -> None:
    daemon = daemon_factory(**SMALL_ARENA)
    stub = daemon.stub()
    conn = connect(stub)
    keys_a, pages_a = chain(conn, SMALL_ARENA_PAGES), random_pages(SMALL_ARENA_PAGES, PAGE_BYTES, seed=5)
    slots_a = store(conn, keys_a, pages_a).offsets

    keys_b, pages_b = chain(conn, 4, first_token=10_000), random_pages(4, PAGE_BYTES, seed=6)
    slots_b = store(conn, keys_b, pages_b).offsets

    assert counter(stub, "evicted_chunks") == 4
    assert sorted(slots_b) == sorted(slots_a[-4:])  # B took exactly the slots of A's last 4 chunks
    assert hit_chunks(conn, keys_a) == SMALL_ARENA_PAGES - 4
    assert load(conn, keys_a) == b"".join(pages_a[:-4])
    assert load(conn, keys_b) == b"".join(pages_b)
    namespace = stats(stub).namespaces[0]
    assert (namespace.pages, namespace.stored_bytes) == (SMALL_ARENA_PAGES, SMALL_ARENA_PAGES * PAGE_BYTES)


# --- byte-exact stores and loads ----------------------------------------------------------------


def test_eight_pages_stored_with_put_load_back_byte_exact(daemon: Any) -> None:
    stub = daemon.stub()
    conn = connect(stub)
    keys, pages = chain(conn, 8), random_pages(8, PAGE_BYTES, seed=7)
    # Pieces of 3000 bytes: most messages straddle two pages.
    reserved = store(conn, keys, pages, piece_bytes=3000)
    assert len(set(reserved.offsets)) == 8 and min(reserved.offsets) >= 0

    hit = lookup(conn, keys, lease=True)
    assert (hit.hit_chunks, list(hit.tiers)) == (8, [pb.TIER_CPU] * 8)
    acquired = acquire(conn, hit.lease_id)
    assert (acquired.ready_chunks, list(acquired.offsets), acquired.page_bytes) == (
        8,
        list(reserved.offsets),
        PAGE_BYTES,
    )
    assert get_messages(conn, hit.lease_id) == pages
    # The inline plane wrote the shared arena at the offsets the daemon handed out.
    with open(daemon.arena_path, "rb") as arena:
        for offset, page in zip(acquired.offsets, pages, strict=True):
            arena.seek(offset)
            assert arena.read(PAGE_BYTES) == page
    assert release(conn, hit.lease_id) == 8

    namespace = stats(stub).namespaces[0]
    assert (namespace.namespace, namespace.pages, namespace.stored_bytes) == (conn.ns, 8, 8 * PAGE_BYTES)
    assert bytes_used(stub) == 8 * PAGE_BYTES
    assert hit_chunks(conn, chain(conn, 9)) == 8  # a longer chain hits its stored prefix


def test_pages_larger_than_the_message_limit_stream_both_ways(daemon_factory: Callable[..., Any]) -> None:
    daemon = daemon_factory()  # 64 MiB arena of 16 MiB slabs
    stub = daemon.stub()
    # 2 x 2 x 3000 tokens x 2 x 128 x 2 bytes = 6,144,000 bytes: 5.5 messages per page.
    conn = connect(stub, head_dim=128, chunk_tokens=3000)
    assert conn.page_bytes == 6_144_000 > conn.max_message_bytes == 1088 << 10
    keys, pages = chain(conn, 3), random_pages(3, conn.page_bytes, seed=8)

    lease = reserve(conn, keys).lease_id
    rejects(
        Code.RESOURCE_EXHAUSTED,
        "Received message larger than max",
        put,
        conn,
        lease,
        b"".join(pages),
        conn.page_bytes,
    )
    assert abort(conn, lease) == 3
    # The largest pieces the daemon accepts, then odd ones that straddle pages.
    for piece_bytes in (conn.max_message_bytes - 1024, 1_000_017):
        stub.Clear(pb.ClearRequest(namespace=conn.ns))
        store(conn, keys, pages, piece_bytes=piece_bytes)
        hit = lookup(conn, keys, lease=True)
        messages = get_messages(conn, hit.lease_id)
        assert release(conn, hit.lease_id) == 3
        assert b"".join(messages) == b"".join(pages)
        assert len(messages) == 18 and max(map(len, messages)) <= conn.max_message_bytes


def test_reserve_of_a_stored_prefix_slots_only_the_new_chunks(daemon: Any) -> None:
    stub = daemon.stub()
    conn = connect(stub)
    keys, pages = chain(conn, 6), random_pages(6, PAGE_BYTES, seed=9)
    old_slots = store(conn, keys[:3], pages[:3]).offsets

    reply = reserve(conn, keys)
    assert reply.lease_id != 0
    assert list(reply.offsets[:3]) == [-1, -1, -1]
    assert min(reply.offsets[3:]) >= 0 and len(set(reply.offsets[3:]) | set(old_slots)) == 6
    # Put carries only the reserved chunks' pages.
    assert put(conn, reply.lease_id, b"".join(pages[3:])) == 3 * PAGE_BYTES
    assert commit(conn, reply.lease_id) == 3

    assert load(conn, keys) == b"".join(pages)
    everything_stored = reserve(conn, keys)
    assert (everything_stored.lease_id, list(everything_stored.offsets)) == (0, [-1] * 6)
    assert counter(stub, "skipped_chunks") == 3 + 6
    assert bytes_used(stub) == 6 * PAGE_BYTES


# --- visibility and lease lifetimes ------------------------------------------------------------


def test_uncommitted_pages_are_invisible_and_an_expired_store_lease_frees_them(daemon: Any) -> None:
    stub = daemon.stub()
    conn = connect(stub)
    keys, pages = chain(conn, 4), random_pages(4, PAGE_BYTES, seed=10)

    writing = reserve(conn, keys).lease_id
    assert put(conn, writing, b"".join(pages)) == 4 * PAGE_BYTES
    assert (lookup(conn, keys).hit_chunks, lookup(conn, keys, lease=True).lease_id) == (0, 0)
    being_stored = reserve(conn, keys)
    assert (being_stored.lease_id, list(being_stored.offsets)) == (0, [-1] * 4)
    assert abort(conn, writing) == 4

    # Nothing is sent under the short lease: the test does not race its 200 ms.
    lease = reserve(conn, keys, ttl_ms=200).lease_id
    assert bytes_used(stub) == 4 * PAGE_BYTES
    deadline = time.monotonic() + 5.0
    while counter(stub, "active_store_leases") and time.monotonic() < deadline:
        time.sleep(0.05)
    rejects(Code.NOT_FOUND, f"lease {lease} not found", commit, conn, lease)
    rejects(Code.NOT_FOUND, f"lease {lease} not found", put, conn, lease, b"".join(pages))
    assert bytes_used(stub) == 0
    assert counter(stub, "expired_leases") >= 1
    assert hit_chunks(conn, keys) == 0

    again = store(conn, keys, pages)
    assert again.lease_id not in (0, lease) and min(again.offsets) >= 0
    assert load(conn, keys) == b"".join(pages)


def test_a_load_lease_pins_its_pages_against_eviction(daemon_factory: Callable[..., Any]) -> None:
    daemon = daemon_factory(**SMALL_ARENA)
    stub = daemon.stub()
    conn = connect(stub)
    half = SMALL_ARENA_PAGES // 2
    keys_a, pages_a = chain(conn, half), random_pages(half, PAGE_BYTES, seed=11)
    store(conn, keys_a, pages_a)
    pin = lookup(conn, keys_a, lease=True)
    assert pin.hit_chunks == half
    # B is stored after A was last used: without the pin, A would be evicted first.
    keys_b, pages_b = chain(conn, half, first_token=10_000), random_pages(half, PAGE_BYTES, seed=12)
    slots_b = store(conn, keys_b, pages_b).offsets
    assert bytes_used(stub) == SMALL_ARENA_PAGES * PAGE_BYTES

    keys_c, pages_c = chain(conn, half + 1, first_token=20_000), random_pages(half, PAGE_BYTES, seed=13)
    rejects(Code.RESOURCE_EXHAUSTED, f"cannot reserve {half + 1} page(s)", reserve, conn, keys_c)
    assert counter(stub, "evicted_chunks") == 0 and hit_chunks(conn, keys_b) == half
    keys_c = keys_c[:half]
    slots_c = store(conn, keys_c, pages_c).offsets

    assert counter(stub, "evicted_chunks") == half
    assert sorted(slots_c) == sorted(slots_b)
    assert hit_chunks(conn, keys_b) == 0
    assert get(conn, pin.lease_id) == b"".join(pages_a)
    assert release(conn, pin.lease_id) == half
    assert load(conn, keys_a) == b"".join(pages_a)
    assert load(conn, keys_c) == b"".join(pages_c)


def test_clear_drops_one_namespace_and_spares_pages_a_lease_is_reading(daemon: Any) -> None:
    stub = daemon.stub()
    conn_a, conn_b = connect(stub), connect(stub, salt="b")
    keys_a, pages_a = chain(conn_a, 3), random_pages(3, PAGE_BYTES, seed=14)
    keys_b, pages_b = chain(conn_b, 5), random_pages(5, PAGE_BYTES, seed=15)
    store(conn_a, keys_a, pages_a)
    store(conn_b, keys_b, pages_b)

    assert stub.Clear(pb.ClearRequest(namespace=conn_a.ns)).pages == 3
    assert hit_chunks(conn_a, keys_a) == 0
    assert load(conn_b, keys_b) == b"".join(pages_b)
    assert bytes_used(stub) == 5 * PAGE_BYTES

    reading = lookup(conn_b, keys_b, lease=True).lease_id
    assert stub.Clear(pb.ClearRequest(namespace=conn_b.ns)).pages == 5
    assert hit_chunks(conn_b, keys_b) == 0
    # The same keys stored again get other slots: the leased ones still hold the old bytes.
    store(conn_b, keys_b, random_pages(5, PAGE_BYTES, seed=16))
    assert bytes_used(stub) == 10 * PAGE_BYTES
    assert get(conn_b, reading) == b"".join(pages_b)
    assert release(conn_b, reading) == 5
    assert bytes_used(stub) == 5 * PAGE_BYTES

    with pytest.raises(grpc.RpcError) as refused:  # every namespace: for admins, known on the local channel
        stub.Clear(pb.ClearRequest())
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "Clear of every namespace is for admins" in (refused.value.details() or "")
    assert daemon.admin().call("Clear", pb.ClearRequest()).pages == 5  # empty namespace: every namespace
    assert bytes_used(stub) == 0
    assert [(ns.pages, ns.stored_bytes) for ns in stats(stub).namespaces] == [(0, 0), (0, 0)]


# --- standard services ---------------------------------------------------------------------------


def test_health_and_reflection_describe_the_service(daemon: Any) -> None:
    with grpc.insecure_channel(daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvstore.v1.KVStore"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        # grpcio's health servicer answers an unknown service with a bare NOT_FOUND.
        rejects(Code.NOT_FOUND, "", health.Check, health_pb2.HealthCheckRequest(service="nope"))

        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests: Iterator[reflection_pb2.ServerReflectionRequest] = iter(
            [
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvstore.v1.KVStore"),
            ]
        )
        listed, described = reflection.ServerReflectionInfo(requests)
    services = {service.name for service in listed.list_services_response.service}
    assert services == {
        "kvstore.v1.KVStore",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in described.file_descriptor_response.file_descriptor_proto
    ]
    methods = {method.name for file in files for service in file.service for method in service.method}
    assert methods == {m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods}


def test_a_page_spec_crosses_the_wire_field_for_field() -> None:
    assert {f.name for f in dataclasses.fields(PageSpec)} == set(pb.PageSpec.DESCRIPTOR.fields_by_name)
    page = PageSpec(
        model="m", num_layers=4, num_kv_heads=1, head_dim=64, dtype="bfloat16", chunk_tokens=128,
        latent=True, kv_sharing=((3, 1),), tp_rank=1, tp_size=2, salt="tenant",
    )  # fmt: skip
    assert page_spec_of(page_spec_message(page), 256) == page
    asked = page_spec_message(page, chunk_tokens=0, tp_size=0, tp_rank=0)  # unset: the defaults
    assert page_spec_of(asked, 256) == dataclasses.replace(page, chunk_tokens=256, tp_size=1, tp_rank=0)
