"""A load's control calls, against a real daemon: the Lookup that also answers the Acquire
(`LookupRequest.acquire`), and the Release not waited for.

A same-host load asks for the Acquire with its Lookup: when no page of the lease must be waited
for, the reply carries the Acquire's answer and the load makes two calls (Lookup, Release)
instead of three. Pages on their way back from disk still go through Acquire, which waits for
them; a request without the flag (an older client) gets the reply it always got. Over the local
channel a load whose copy ended within its lease sends its Release without waiting for the
reply; one that may have outlived its lease waits, and reports nothing loaded if it had.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.domain import Tier
from kvstore.shared.keys import pack_keys
from kvstore_client import KVSpec, KVStoreClient
from tests.harness import Daemon

CHUNK = 16
SPEC = KVSpec(
    model="lookup-acquire",
    num_layers=2,
    num_kv_heads=2,
    head_dim=32,
    dtype=torch.float16,
    block_size=16,
    chunk_tokens=CHUNK,
)  # 8 KiB pages


def prompt(i: int, chunks: int) -> list[int]:
    return [i * 1000 + t for t in range(chunks * CHUNK)]


def cache_for(i: int, chunks: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(i)
    return [torch.randn(2, chunks, 16, 2, 32, generator=gen).half() for _ in range(2)]


def calls_of(client: KVStoreClient) -> list[str]:
    """The control calls `client` makes from now on, by method name, in order (a call sent without
    waiting for its reply is marked so)."""
    made: list[str] = []
    rpc = client._conn.rpc

    def recording(method: str, request: Any, meanwhile: Any = None, fds: Any = None) -> Any:
        made.append(method)
        return rpc(method, request, meanwhile, fds)

    client._conn.rpc = recording  # type: ignore[method-assign]
    local = client._local
    if local is not None:
        send = local.send_frame

        def sending(method: str, frame: bytes) -> None:
            made.append(f"{method} (no wait)")
            send(method, frame)

        local.send_frame = sending  # type: ignore[method-assign]
    return made


def load_and_compare(client: KVStoreClient, i: int, chunks: int) -> int:
    target = [torch.full((2, chunks, 16, 2, 32), -9.0).half() for _ in range(2)]
    loaded = client.load(prompt(i, chunks), target, torch.arange(chunks))
    for got, want in zip(target, cache_for(i, chunks), strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"prompt {i}"
    return loaded


def lookup(client: KVStoreClient, tokens: list[int], **flags: Any) -> pb.LookupResponse:
    keys = pack_keys(client.keys(tokens))
    request = pb.LookupRequest(namespace=client.namespace, keys=keys, epoch=client.epoch, **flags)
    return client._rpc("Lookup", request)


@pytest.mark.parametrize("local_channel", [True, False], ids=["local-channel", "grpc"])
def test_a_leased_lookup_answers_the_acquire_when_no_page_must_be_waited_for(
    daemon_factory: Callable[..., Daemon], local_channel: bool
) -> None:
    daemon = daemon_factory(chunk_tokens=CHUNK)
    with KVStoreClient.connect(daemon.address, SPEC, local_channel=local_channel) as client:
        assert client.store(prompt(0, 4), cache_for(0, 4), torch.arange(4)) == 4

        reply = lookup(client, prompt(0, 4), lease=True, acquire=True)
        assert reply.hit_chunks == 4 and reply.lease_id and reply.HasField("acquired")
        lease = pb.LeaseRequest(namespace=client.namespace, lease_id=reply.lease_id, epoch=client.epoch)
        assert reply.acquired == client._rpc("Acquire", lease)  # the same answer as the call it saves
        assert reply.acquired.ready_chunks == 4 and bytes(reply.acquired.tiers) == bytes([Tier.CPU]) * 4
        assert client._rpc("Release", lease).pages == 4

        made = calls_of(client)
        assert load_and_compare(client, 0, 4) == 4 * CHUNK
        # Over the local channel the Release is not waited for: the copy ended within the lease.
        assert made == ["Lookup", "Release (no wait)" if local_channel else "Release"]
        assert client.stats()["counters"]["active_leases"] == 0  # read after the Release's reply


def test_a_lookup_answers_no_acquire_unless_asked_with_a_lease_and_hits(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = daemon_factory(chunk_tokens=CHUNK)
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        assert client.store(prompt(0, 2), cache_for(0, 2), torch.arange(2)) == 2
        as_before = lookup(client, prompt(0, 2), lease=True)  # an older client's request
        assert as_before.hit_chunks == 2 and not as_before.HasField("acquired")
        lease = pb.LeaseRequest(namespace=client.namespace, lease_id=as_before.lease_id, epoch=client.epoch)
        assert client._rpc("Acquire", lease).ready_chunks == 2
        assert client._rpc("Release", lease).pages == 2

        no_lease = lookup(client, prompt(0, 2), acquire=True)
        assert no_lease.hit_chunks == 2 and no_lease.lease_id == 0 and not no_lease.HasField("acquired")
        miss = lookup(client, prompt(7, 2), lease=True, acquire=True)
        assert miss.hit_chunks == 0 and miss.lease_id == 0 and not miss.HasField("acquired")
        assert client.stats()["counters"]["active_leases"] == 0


def test_pages_coming_back_from_disk_are_acquired_by_the_call_that_waits_for_them(
    tmp_path: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    daemon = daemon_factory(
        chunk_tokens=CHUNK,
        tiers__cpu__bytes="400KiB",  # 50 pages
        tiers__cpu__slab_bytes="400KiB",
        tiers__disk__enabled=True,
        tiers__disk__path=str(tmp_path / "disk"),
        tiers__disk__bytes="64MiB",
    )
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        for i in range(10):  # 100 pages through a 50-page CPU tier: prompt 0 goes to disk
            assert client.store(prompt(i, 10), cache_for(i, 10), torch.arange(10)) == 10
        assert client.stats()["counters"]["demoted_chunks"] >= 10
        assert bytes(lookup(client, prompt(0, 10)).tiers) == bytes([Tier.DISK]) * 10

        made = calls_of(client)
        assert load_and_compare(client, 0, 10) == 10 * CHUNK
        # The Lookup started the reads, Acquire waited for them.
        assert made == ["Lookup", "Acquire", "Release (no wait)"]
        assert load_and_compare(client, 0, 10) == 10 * CHUNK  # now in the CPU tier: no Acquire
        assert made[3:] == ["Lookup", "Release (no wait)"]


def test_a_load_waits_for_its_release_once_the_lease_may_have_lapsed(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = daemon_factory(chunk_tokens=CHUNK, leases__ttl_s=0.3)
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        assert client.store(prompt(0, 2), cache_for(0, 2), torch.arange(2)) == 2
        client._renewer.stop()  # a worker too stalled to renew its leases
        made = calls_of(client)
        target = [torch.zeros(2, 2, 16, 2, 32).half() for _ in range(2)]
        handle = client.load_async(prompt(0, 2), target, torch.arange(2))
        time.sleep(0.6)  # the daemon reaps the lease before the worker is done with the pages
        assert handle.wait() == 0  # their slots may have been reused: nothing counts as loaded
        assert made == ["Lookup", "Release"]

        assert load_and_compare(client, 0, 2) == 2 * CHUNK  # done within the lease
        assert made[2:] == ["Lookup", "Release (no wait)"]
        assert client.stats()["counters"]["active_leases"] == 0


def test_a_slow_but_live_load_renews_its_lease_and_keeps_its_tokens(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = daemon_factory(chunk_tokens=CHUNK, leases__ttl_s=0.3)
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        assert client.store(prompt(0, 2), cache_for(0, 2), torch.arange(2)) == 2
        made = calls_of(client)
        target = [torch.full((2, 2, 16, 2, 32), -7.0).half() for _ in range(2)]
        handle = client.load_async(prompt(0, 2), target, torch.arange(2))
        time.sleep(0.9)  # three TTLs: the renewal thread keeps the lease
        assert handle.wait() == 2 * CHUNK
        for got, want in zip(target, cache_for(0, 2), strict=True):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert made[0] == "Lookup" and made[-1] == "Release" and "Renew" in made
        stats = client.stats()["counters"]
        assert stats["active_leases"] == 0 and stats.get("expired_leases", 0) == 0
        assert stats["renewed_leases"] >= 2


def test_an_error_in_a_reply_not_waited_for_is_logged_with_the_next_call(
    daemon_factory: Callable[..., Daemon], caplog: pytest.LogCaptureFixture
) -> None:
    daemon = daemon_factory(chunk_tokens=CHUNK)
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        assert client._local is not None
        client._local.send("Release", pb.LeaseRequest(namespace=client.namespace, lease_id=12345))
        assert client.store(prompt(0, 1), cache_for(0, 1), torch.arange(1)) == 1  # its own reply, intact
        assert load_and_compare(client, 0, 1) == CHUNK
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "Release (sent without waiting for its reply) failed" in warnings[0]
    assert "lease 12345 not found" in warnings[0]
