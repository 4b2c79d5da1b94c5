"""Issue #30, items 10-12, as attacks on a real kvstored: the event stream across a restart, what
a tenant's member can learn of another tenant's activity from it, and names that would write
escape sequences onto an admin's terminal.

- A consumer that resumes with a `since` from before a restart is told to resync (the epoch).
- A member of tenant beta follows a stream of its own: its sequence numbers are dense 1..n for
  its own pages while alpha stores, and Stats shows it no daemon-wide count.
- A Connect naming a model, salt or weights id with a control character is INVALID_ARGUMENT
  naming the field, from any uid; kvctl prints no raw control byte, even from a daemon (an older
  one) that still lists such names.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.shared.errors import KVStoreError
from kvstore.shared.keys import chunk_keys
from kvstore.shared.spec import KVSpec, PageSpec
from kvstore.shared.wire import page_spec_message
from tests import test_tenants
from tests.harness import Daemon
from tests.test_cli import kvctl
from tests.test_events import Follower
from tests.test_protocol import SPEC, connect, random_pages, store
from tests.test_tenants import BETA_UID, Raw, as_user, assert_alpha_intact, store_alpha

STORED, RESYNC = pb.KVEvent.STORED, pb.KVEvent.RESYNC
Code = grpc.StatusCode

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="runs clients as other uids: needs root (CI is)")
run_dir = test_tenants.run_dir  # the tenant tests' fixtures: a daemon with tenants alpha and beta
tenant_daemon = test_tenants.tenant_daemon

# What a terminal acts on: C0 controls but the newline, DEL, C1 controls, bidi controls.
RAW_CONTROL = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)
HOSTILE_MODEL = "evil\x1b[2J\x1b[H\rroot"  # clears root's screen and rewrites the line


def chain_of(ns: bytes, count: int, first_token: int, chunk_tokens: int = 16) -> list[bytes]:
    tokens = np.arange(first_token, first_token + count * chunk_tokens)
    return chunk_keys(ns, tokens, chunk_tokens)


def events_of(
    address: str, count: int, metadata: tuple[tuple[str, str], ...] = (), **request: Any
) -> list[pb.KVEvent]:
    """The first `count` events of a stream, as the caller `metadata` names sees them."""
    seen: list[pb.KVEvent] = []
    with grpc.insecure_channel(address) as channel:
        stream = pb_grpc.KVStoreStub(channel).Events(
            pb.EventsRequest(**request), metadata=metadata, timeout=20
        )
        for batch in stream:
            seen += batch.events
            if len(seen) >= count:
                stream.cancel()
                break
    return seen


# --- 10: an epoch per daemon start ---------------------------------------------------------------


def test_a_consumer_resuming_from_before_a_restart_is_told_to_resync(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = daemon_factory("restarted")
    conn = connect(daemon.stub())
    follower = Follower(daemon, since=0)
    store(conn, chain_of(conn.ns, 4, 0), random_pages(4, conn.page_bytes, seed=1))
    before = follower.until(4)
    follower.close()
    old_epoch = before[-1].epoch
    assert old_epoch and {e.epoch for e in before} == {old_epoch}
    assert daemon.stub().Stats(pb.StatsRequest()).event_epoch == old_epoch
    assert daemon.stop() == 0, daemon.log()

    daemon = daemon_factory("restarted")  # the same socket: a new start, its numbering from 1 again
    conn = connect(daemon.stub())
    stored = chain_of(conn.ns, 6, 1000)
    store(conn, stored, random_pages(6, conn.page_bytes, seed=2))
    new_epoch = daemon.stub().Stats(pb.StatsRequest()).event_epoch
    assert new_epoch and new_epoch != old_epoch

    resumed = Follower(daemon, since=4, epoch=old_epoch)  # the consumer's last event: 4 of the old start
    events = resumed.until(6)
    resumed.close()
    assert (events[0].kind, events[0].sequence, events[0].epoch) == (RESYNC, 0, new_epoch)
    assert "another epoch" in events[0].reason
    assert [(e.sequence, e.key) for e in events[1:]] == list(enumerate(stored, start=1))  # none missed
    assert {e.epoch for e in events} == {new_epoch}

    old_client = events_of(daemon.address, 3, since=4)  # a since without an epoch: cannot be trusted
    assert old_client[0].kind == RESYNC and "no epoch" in old_client[0].reason
    assert [e.sequence for e in old_client[1:3]] == [1, 2]

    same_start = Follower(daemon, since=6, epoch=new_epoch)  # this start's: resumes, no resync
    more = chain_of(conn.ns, 1, 5000)
    store(conn, more, random_pages(1, conn.page_bytes, seed=3))
    events = same_start.until(7)
    same_start.close()
    assert [(e.kind, e.sequence, e.key) for e in events] == [(STORED, 7, more[0])]

    listed = kvctl(daemon, "events", "--json", "--since", "4", "--epoch", str(old_epoch), "--count", "2")
    assert listed.returncode == 0, listed.stderr
    lines = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(e["kind"], e["sequence"], e["epoch"]) for e in lines] == [
        ("resync", 0, new_epoch),
        ("stored", 1, new_epoch),
    ]


# --- 11: a member sees its own stream's numbers only ---------------------------------------------


@needs_root
def test_a_member_cannot_count_another_tenants_events(tenant_daemon: Callable[..., Daemon]) -> None:
    daemon = tenant_daemon()

    def beta_stores(first_token: int) -> tuple[str, bytes, float]:
        raw = Raw(daemon)
        reply = raw.connect()
        keys = chunk_keys(raw.ns, np.arange(first_token, first_token + 512), 256)
        assert raw.store(keys, random_pages(2, reply.page_bytes, seed=first_token)) == 2
        return reply.credential, raw.ns, raw.call("Stats", pb.StatsRequest()).counters["event_sequence"]

    credential, beta_ns, _ = as_user(BETA_UID, lambda: beta_stores(0))  # beta's events 1, 2
    client, tokens, source = store_alpha(daemon)  # alpha's four pages between beta's
    _, _, counted = as_user(BETA_UID, lambda: beta_stores(10_000))  # beta's 3, 4
    admin = daemon.admin()
    assert admin.call("Stats", pb.StatsRequest()).counters["event_sequence"] == 8  # an admin: every event

    as_beta = (("authorization", f"Bearer {credential}"),)  # beta's own credential, on gRPC
    events = events_of(daemon.address, 4, as_beta, since=0)
    assert [e.sequence for e in events] == [1, 2, 3, 4]  # dense: no gap where alpha stored
    assert {(e.tenant, e.namespace, e.kind) for e in events} == {("beta", beta_ns, STORED)}
    assert counted == 4  # Stats on the local channel: beta's own figure
    with grpc.insecure_channel(daemon.address) as channel:
        stats = pb_grpc.KVStoreStub(channel).Stats(pb.StatsRequest(), metadata=as_beta, timeout=10)
    assert stats.counters["event_sequence"] == 4 and stats.event_epoch == events[0].epoch
    resumed = events_of(daemon.address, 2, as_beta, since=2, epoch=events[0].epoch)
    assert [e.sequence for e in resumed] == [3, 4]  # its own numbers resume its own stream
    admin.close()
    assert_alpha_intact(client, tokens, source)
    client.close()


# --- 12: names with control characters -----------------------------------------------------------


BAD_NAMES: list[tuple[dict[str, Any], str]] = [
    ({"model": "m\x1b[2J"}, "model: control character U+001B at index 1"),
    ({"model": "m\rroot"}, "model: control character U+000D at index 1"),
    ({"model": "m\x7f"}, "model: control character U+007F"),
    ({"model": "m\x9b2J"}, "model: control character U+009B"),  # C1: CSI in one character
    ({"model": "m\u202egnp.exe"}, "model: control character U+202E"),  # a bidi override
    ({"salt": "s\x1b]0;owned\x07"}, "salt: control character U+001B"),
    (
        {"weights": [pb.LayerWeights(stop=2, id="w\x1b[31m")]},
        "weights: the id of the range ending at 2: control character U+001B",
    ),
]


def test_connect_refuses_control_characters_in_names(daemon: Daemon) -> None:
    stub, admin = daemon.stub(), daemon.admin()
    for changes, message in BAD_NAMES:
        with pytest.raises(grpc.RpcError) as refused:
            stub.Connect(pb.ConnectRequest(spec=pb.PageSpec(**{**SPEC, **changes})))
        error: Any = refused.value
        assert (error.code(), message in error.details()) == (Code.INVALID_ARGUMENT, True), error.details()
        with pytest.raises(KVStoreError, match=re.escape(message)):  # the local channel: the same check
            admin.call("Connect", pb.ConnectRequest(spec=pb.PageSpec(**{**SPEC, **changes})))
    assert not stub.Stats(pb.StatsRequest()).namespaces  # none registered
    # The client checks the same way before it sends anything.
    with pytest.raises(ValueError, match=re.escape("model: control character U+001B")):
        KVSpec(model="m\x1b[2J", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16")
    with pytest.raises(ValueError, match=re.escape("salt: control character U+000D")):
        PageSpec(**{**SPEC, "salt": "\r"})
    fine = connect(stub, model="Qwen/Qwen2.5-7B-Instruct · ü", salt="tenant a")  # printable text is fine
    assert [n.model for n in stub.Stats(pb.StatsRequest()).namespaces] == ["Qwen/Qwen2.5-7B-Instruct · ü"]
    assert fine.ns
    admin.close()


@needs_root
def test_another_uids_hostile_model_name_never_reaches_roots_terminal(
    tenant_daemon: Callable[..., Daemon], run_dir: Path
) -> None:
    token_file = run_dir / "admin.token"  # kvctl events is gRPC: root shows itself by the admins' token
    token_file.write_text("admin-token-0123\n")
    token_file.chmod(0o600)
    daemon = tenant_daemon(server__auth_token="admin-token-0123")
    client, tokens, source = store_alpha(daemon)
    hostile = replace_model(test_tenants.SPEC, HOSTILE_MODEL)

    def beta() -> tuple[Any, int]:
        raw = Raw(daemon)
        try:
            raw.call("Connect", pb.ConnectRequest(spec=hostile))
            refusal: Any = "served"
        except KVStoreError as exc:
            refusal = (type(exc).__name__, str(exc))
        raw.connect()  # then a fine name, and pages under it
        keys = chunk_keys(raw.ns, np.arange(512), 256)
        return refusal, raw.store(keys, random_pages(2, test_tenants.SPEC.page_bytes, seed=4))

    refusal, stored = as_user(BETA_UID, beta)
    assert refusal[0] == "InvalidArgument" and "model: control character U+001B at index 4" in refusal[1]
    assert stored == 2
    as_admin = ("--token-file", str(token_file))
    for args in (
        ("ls",),
        ("stats",),
        (*as_admin, "events", "--count", "6"),
        (*as_admin, "events", "--json", "--count", "6"),
    ):
        shown = kvctl(daemon, *args)
        assert shown.returncode == 0, shown.stderr
        assert not RAW_CONTROL.search(shown.stdout), (args, shown.stdout)
    assert HOSTILE_MODEL not in kvctl(daemon, "ls").stdout
    assert_alpha_intact(client, tokens, source)
    client.close()


def replace_model(spec: PageSpec, model: str) -> pb.PageSpec:
    message = page_spec_message(spec)
    message.model = model  # past PageSpec's own check: what a hostile process sends
    return message


# --- kvctl against a daemon that still lists such names (one older than the check) ---------------


class OlderDaemon(pb_grpc.KVStoreServicer):
    """Stats and Events of a daemon that took control characters in names."""

    def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        return pb.StatsResponse(
            version="0.0.9",
            tiers=[
                pb.TierStats(
                    name="remote",
                    bytes_capacity=1,
                    nodes=[pb.RemoteNode(address="10.0.0.9:6379\x1b[8m", role="master\r", up=True)],
                )
            ],
            namespaces=[
                pb.NamespaceStats(
                    namespace=bytes(16),
                    model=HOSTILE_MODEL,
                    tenant="t\u202eab",
                    pages=1,
                    contents="KV of layers 0-1, weights w\x1b]0;owned\x07",
                )
            ],
            counters={"lookups\x1b[2J": 1.0},
        )

    def Events(self, request: pb.EventsRequest, context: Any) -> Iterator[pb.EventBatch]:
        yield pb.EventBatch(
            events=[
                pb.KVEvent(
                    sequence=1,
                    kind=STORED,
                    tier=pb.TIER_CPU,
                    namespace=bytes(16),
                    model=HOSTILE_MODEL,
                    tenant="t\x9b2J",
                    key=bytes(16),
                    reason="committed\r\x1b[K",
                )
            ]
        )


@pytest.fixture
def older_daemon(tmp_path: Path) -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_KVStoreServicer_to_server(OlderDaemon(), server)
    address = f"unix://{tmp_path / 'older.sock'}"
    server.add_insecure_port(address)
    server.start()
    try:
        yield address
    finally:
        stopped: threading.Event = server.stop(None)
        stopped.wait(10)


def test_kvctl_escapes_what_a_daemon_lists(older_daemon: str) -> None:
    tables: list[tuple[str, ...]] = [("ls",), ("stats",), ("events",), ("top", "--once", "--interval", "0")]
    for args in tables:
        shown = kvctl(None, *args, address=older_daemon)
        assert shown.returncode == 0, (args, shown.stderr)
        assert not RAW_CONTROL.search(shown.stdout), (args, shown.stdout)
        assert "evil\\x1b[2J\\x1b[H\\rroot" in shown.stdout, (args, shown.stdout)
    for args in [("ls", "--json"), ("stats", "--json"), ("events", "--json")]:
        shown = kvctl(None, *args, address=older_daemon)
        assert shown.returncode == 0, (args, shown.stderr)
        assert not RAW_CONTROL.search(shown.stdout) and "\\u001b[2J" in shown.stdout, (args, shown.stdout)
        assert HOSTILE_MODEL in shown.stdout.encode().decode("unicode_escape")  # the name, intact
    stats = kvctl(None, "stats", address=older_daemon).stdout
    assert "10.0.0.9:6379\\x1b[8m" in stats and "t\\u202eab" in stats and "lookups\\x1b[2J" in stats
