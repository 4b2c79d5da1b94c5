"""Tenants: a real kvstored with two tenants, and clients running as other uids.

Tenant "alpha" is this process's uid (root on CI), with the real `KVStoreClient`; tenant "beta"
and an outsider are other uids: forked children that drop to them (`as_user`) and speak the
protocol themselves, as a hostile local process would. Every attack the security review tried
is refused with a clear status, and alpha's pages load back byte-identical afterwards.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import random
import secrets
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.shared.channel import LocalChannel
from kvstore.shared.errors import KVStoreError, PermissionDenied
from kvstore.shared.keys import chunk_keys, pack_keys
from kvstore.shared.spec import PageSpec
from kvstore.shared.wire import QueryRequest, page_spec_message
from kvstore_client import KVStoreClient
from tests.harness import Daemon, start_daemon
from tests.test_cli import kvctl
from tests.test_client import assert_blocks_equal, empty_cache, make_spec, random_cache, tokens_of

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs clients as other uids: needs root (CI is)")

BETA_UID, OUTSIDER_UID = 40001, 40002
SPEC = make_spec().with_chunk_tokens(256).page  # the pages alpha's client stores: 128 KiB
TENANT_BYTES = 16 << 20  # 128 pages of SPEC


def tenants_config(tokens_file: Path | None = None, **beta: Any) -> list[dict[str, Any]]:
    return [
        {"name": "alpha", "uids": [os.geteuid()], "cpu_bytes": "16MiB"},
        {
            "name": "beta",
            "uids": [BETA_UID],
            "cpu_bytes": "16MiB",
            **({"tokens_file": str(tokens_file)} if tokens_file else {}),
            **beta,
        },
    ]


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A directory other uids can reach (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="kvstore-tenants-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tenant_daemon(run_dir: Path) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def factory(**overrides: Any) -> Daemon:
        overrides.setdefault("tenants", tenants_config())
        daemon = start_daemon(
            run_dir,
            "kvstored",
            server__socket_mode="0666",
            tiers__cpu__slab_bytes="4MiB",
            **overrides,
        )
        started.append(daemon)
        return daemon

    yield factory
    for daemon in started:
        assert daemon.stop() == 0, daemon.log()
        assert not list(Path("/dev/shm").glob(daemon.arena_path.name + "*"))


def as_user(uid: int, work: Callable[[], Any], gid: int | None = None) -> Any:
    """`work()` in a forked child running as `uid` (gid `gid`, or the same, no supplementary groups); its
    result, or the KVStoreError it raised, comes back through a pipe. The child can import
    nothing new (this interpreter's files are root's): `work` uses what is loaded."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no gRPC here, only sockets, mmap and protobuf
        code = 0
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid if gid is None else gid)
            os.setuid(uid)
            try:
                outcome: tuple[str, Any] = ("ok", work())
            except KVStoreError as exc:
                outcome = ("error", (type(exc).__name__, str(exc)))
            except OSError as exc:
                outcome = ("oserror", (exc.errno, str(exc)))
            except Exception:
                outcome = ("crash", (traceback.format_exc(),))
            data = pickle.dumps(outcome)
            with os.fdopen(write_end, "wb") as f:
                f.write(data)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, "the child failed before it could answer"
    kind, value = pickle.loads(data)
    assert kind != "crash", value[0]
    if kind == "ok":
        return value
    return (kind, *value)


class Raw:
    """The protocol, spoken by hand on the local channel: what a hostile process would do."""

    def __init__(self, daemon: Daemon) -> None:
        self.channel = LocalChannel(str(daemon.local_path), 10.0)
        self.ns = b""
        self.epoch = 0
        self.fd: int | None = None  # its tenant's arena, handed with the Connect reply

    def call(self, method: str, request: Any) -> Any:
        return self.channel.call(method, request)

    def connect(self, spec: PageSpec = SPEC) -> pb.ConnectResponse:
        reply = self.call("Connect", pb.ConnectRequest(spec=page_spec_message(spec), client_name="raw"))
        self.ns, self.epoch = reply.namespace, reply.epoch
        if self.fd is not None:
            os.close(self.fd)
        self.fd = self.channel.take_fd()
        return reply

    def store(self, keys: list[bytes], pages: list[bytes]) -> int:
        """Reserve, write the pages into the arena in place, Commit."""
        reply = self.call(
            "Reserve", pb.ReserveRequest(namespace=self.ns, keys=pack_keys(keys), epoch=self.epoch)
        )
        assert self.fd is not None
        with mmap.mmap(self.fd, 0) as arena:
            for offset, page in zip(reply.offsets, pages, strict=True):
                if offset >= 0:
                    arena[offset : offset + len(page)] = page
        request = pb.LeaseRequest(namespace=self.ns, lease_id=reply.lease_id, epoch=self.epoch)
        return int(self.call("Commit", request).committed)


def refused(outcome: Any, kind: str, text: str) -> None:
    assert isinstance(outcome, tuple) and outcome[0] == "error", outcome
    assert outcome[1] == kind and text in outcome[2], outcome


def store_alpha(daemon: Daemon, seed: int = 1) -> tuple[KVStoreClient, list[int], list[torch.Tensor]]:
    spec = make_spec()
    tokens = tokens_of(1024, seed=seed)
    source = random_cache(spec, 64, seed=seed + 1)
    client = KVStoreClient.connect(daemon.address, spec)
    assert client.store(tokens, source, torch.arange(64)) == 4
    return client, tokens, source


def assert_alpha_intact(client: KVStoreClient, tokens: list[int], source: list[torch.Tensor]) -> None:
    target = empty_cache(client.spec, 64)
    for layer in target:
        layer.fill_(float("nan"))  # poisoned: a page not written stays visible
    assert client.load(tokens, target, torch.arange(64)) == 1024
    assert_blocks_equal(target, torch.arange(64), source, torch.arange(64))


def test_tenants_share_no_namespace_and_see_only_their_own(tenant_daemon: Callable[..., Daemon]) -> None:
    daemon = tenant_daemon()
    client, tokens, source = store_alpha(daemon)
    assert client.spec.page.namespace("alpha") == client.namespace != client.spec.page.namespace()
    alpha_keys = client.keys(tokens)

    def beta() -> Any:
        raw = Raw(daemon)
        connected = raw.connect()
        stats = raw.call("Stats", pb.StatsRequest())
        lookup = raw.call("Lookup", pb.LookupRequest(namespace=raw.ns, keys=pack_keys(alpha_keys)))
        own_keys = chunk_keys(raw.ns, np.array(tokens), 256)
        return (
            connected.tenant,
            connected.namespace,
            [(n.tenant, n.namespace) for n in stats.namespaces],
            stats.tiers[0].bytes_capacity,
            lookup.hit_chunks,
            own_keys == alpha_keys,
        )

    tenant, ns, namespaces, capacity, hits, same_keys = as_user(BETA_UID, beta)
    assert tenant == "beta" and ns == SPEC.namespace("beta") != client.namespace
    assert namespaces == [("beta", ns)] and capacity == TENANT_BYTES  # alpha's are not listed
    assert hits == 0 and not same_keys  # the same prompt and spec: other keys, no hit
    stats = client.stats()  # root is an admin: every tenant
    assert {n["tenant"] for n in stats["namespaces"]} == {"alpha", "beta"}
    assert stats["tiers"]["cpu"]["bytes_capacity"] == 2 * TENANT_BYTES
    listed = kvctl(daemon, "ls")  # kvctl, as root on the local channel: every tenant's, by tenant
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line.split()[1] for line in listed.stdout.splitlines()[2:]}
    assert rows == {client.namespace.hex(): "alpha", ns.hex(): "beta"}
    assert_alpha_intact(client, tokens, source)
    client.close()


def test_every_attack_of_another_tenant_is_refused(tenant_daemon: Callable[..., Daemon]) -> None:
    daemon = tenant_daemon()
    client, tokens, source = store_alpha(daemon)
    alpha_ns, alpha_keys = client.namespace, client.keys(tokens)
    later_tokens = tokens_of(1024, seed=8)
    admin = daemon.admin()  # root: an admin, in tenant alpha
    loading = admin.call(
        "Lookup", pb.LookupRequest(namespace=alpha_ns, keys=pack_keys(alpha_keys), lease=True)
    )
    assert loading.hit_chunks == 4 and loading.lease_id
    assert client.shared_memory  # alpha's arena: handed to it on the local channel, mapped
    assert not list(Path("/dev/shm").glob(daemon.arena_path.name + "*"))  # no tenant's arena has a path
    attacks: dict[str, Callable[[Raw], Any]] = {
        "lookup": lambda r: r.call(
            "Lookup", pb.LookupRequest(namespace=alpha_ns, keys=pack_keys(alpha_keys))
        ),
        "query": lambda r: r.call("Query", QueryRequest(alpha_ns, pack_keys(alpha_keys))),
        "reserve": lambda r: r.call(
            "Reserve", pb.ReserveRequest(namespace=alpha_ns, keys=pack_keys(alpha_keys), epoch=r.epoch)
        ),
        "release": lambda r: r.call(
            "Release", pb.LeaseRequest(namespace=alpha_ns, lease_id=loading.lease_id)
        ),
        "acquire": lambda r: r.call(
            "Acquire", pb.LeaseRequest(namespace=alpha_ns, lease_id=loading.lease_id)
        ),
        "release in its own namespace": lambda r: r.call(
            "Release", pb.LeaseRequest(namespace=r.ns, lease_id=loading.lease_id)
        ),
        "pin": lambda r: r.call(
            "Pin", pb.PinRequest(namespace=alpha_ns, keys=pack_keys(alpha_keys), ttl_ms=1)
        ),
        "clear one": lambda r: r.call("Clear", pb.ClearRequest(namespace=alpha_ns)),
        "clear all": lambda r: r.call("Clear", pb.ClearRequest()),
        "truncate its own arena": lambda r: os.ftruncate(r.fd or -1, 0),  # would fault the daemon's mapping
        "grow its own arena": lambda r: os.ftruncate(r.fd or -1, TENANT_BYTES * 2),
        "open the daemon's descriptors": lambda r: os.listdir(f"/proc/{daemon.pid}/fd"),
    }

    def beta() -> dict[str, Any]:
        raw = Raw(daemon)
        raw.connect()
        outcomes: dict[str, Any] = {}
        for name, attack in attacks.items():
            try:
                attack(raw)
                outcomes[name] = "served"
            except KVStoreError as exc:
                outcomes[name] = (type(exc).__name__, str(exc))
            except OSError as exc:
                outcomes[name] = ("OSError", exc.strerror)
        # The same prompt under its own namespace, with garbage: stored, and harmless to alpha.
        own = chunk_keys(raw.ns, np.array(tokens), 256)
        outcomes["garbage stored"] = raw.store(own, [b"\xff" * SPEC.page_bytes] * 4)
        # A prompt alpha has not stored yet, stored first with garbage: alpha must not hit it.
        ahead = chunk_keys(raw.ns, np.array(later_tokens), 256)
        outcomes["garbage ahead"] = raw.store(ahead, [b"\xee" * SPEC.page_bytes] * 4)
        return outcomes

    outcomes = as_user(BETA_UID, beta)
    not_found = "is not registered with this daemon for tenant 'beta'"
    for name in ("lookup", "query", "reserve", "release", "acquire", "pin", "clear one"):
        assert outcomes[name][0] == "NotFound" and not_found in outcomes[name][1], (name, outcomes[name])
    assert outcomes["release in its own namespace"][0] in ("NotFound", "FailedPrecondition")
    assert outcomes["clear all"][0] == "PermissionDenied"
    assert "Clear of every namespace is for admins" in outcomes["clear all"][1]
    assert outcomes["truncate its own arena"] == ("OSError", "Operation not permitted")  # sealed
    assert outcomes["grow its own arena"] == ("OSError", "Operation not permitted")
    assert outcomes["open the daemon's descriptors"] == ("OSError", "Permission denied")
    assert outcomes["garbage stored"] == 4 and outcomes["garbage ahead"] == 4
    assert admin.call("Release", pb.LeaseRequest(namespace=alpha_ns, lease_id=loading.lease_id)).pages == 4
    assert_alpha_intact(client, tokens, source)
    assert client.lookup(later_tokens) == 0  # beta's garbage for the prompt is no hit of alpha's
    later_source = random_cache(client.spec, 64, seed=9)
    assert client.store(later_tokens, later_source, torch.arange(64)) == 4
    assert_alpha_intact(client, later_tokens, later_source)
    client.close()


def test_a_process_in_no_tenant_and_an_anonymous_grpc_caller_are_refused(
    tenant_daemon: Callable[..., Daemon],
) -> None:
    daemon = tenant_daemon()
    client, tokens, source = store_alpha(daemon)

    def outsider() -> Any:
        return Raw(daemon).connect()

    refused(
        as_user(OUTSIDER_UID, outsider),
        "PermissionDenied",
        f"uid {OUTSIDER_UID} (gid {OUTSIDER_UID}) is in no tenant",
    )
    stub = daemon.stub()
    request = pb.ConnectRequest(spec=page_spec_message(SPEC))
    with pytest.raises(grpc.RpcError) as anonymous:
        stub.Connect(request)
    assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "known by a bearer token" in (anonymous.value.details() or "")
    forged = f"kvc1:alpha:a:{secrets.token_hex(32)}"
    with pytest.raises(grpc.RpcError) as bad:
        stub.Connect(request, metadata=(("authorization", f"Bearer {forged}"),))
    assert bad.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert_alpha_intact(client, tokens, source)
    client.close()


def test_grpc_calls_carry_the_credential_issued_on_the_local_channel(
    tenant_daemon: Callable[..., Daemon],
) -> None:
    daemon = tenant_daemon()
    spec = make_spec()
    tokens = tokens_of(1024, seed=5)
    source = random_cache(spec, 64, seed=6)
    with KVStoreClient.connect(daemon.address, spec, shared_memory=False) as inline:
        assert not inline.shared_memory and inline._local is None  # page bytes and calls over gRPC
        assert inline.namespace == inline.spec.page.namespace("alpha")
        assert inline.store(tokens, source, torch.arange(64)) == 4
    with KVStoreClient.connect(daemon.address, spec) as mapped:
        target = empty_cache(spec, 64)
        target[0].fill_(float("nan"))
        assert mapped.load(tokens, target, torch.arange(64)) == 1024
        assert_blocks_equal(target, torch.arange(64), source, torch.arange(64))


def test_a_tenant_at_its_quota_evicts_its_own_pages_never_anothers(
    tenant_daemon: Callable[..., Daemon],
) -> None:
    daemon = tenant_daemon()
    client, tokens, source = store_alpha(daemon)  # 4 of alpha's 128 pages

    def beta() -> Any:
        raw = Raw(daemon)
        raw.connect()
        rng = random.Random(7)  # (numpy.random is not loaded: nothing is imported as another uid)
        stored = 0
        for _ in range(80):  # 320 pages into an arena of 128
            keys = chunk_keys(raw.ns, [rng.randrange(50_000) for _ in range(1024)], 256)
            stored += raw.store(keys, [rng.randbytes(SPEC.page_bytes) for _ in keys])
        stats = raw.call("Stats", pb.StatsRequest())
        return stored, stats.counters["evicted_chunks"], stats.tiers[0].pages

    stored, evicted, held = as_user(BETA_UID, beta)
    assert stored == 320 and evicted == 320 - held and held <= TENANT_BYTES // SPEC.page_bytes
    assert client.lookup(tokens) == 1024
    assert_alpha_intact(client, tokens, source)
    client.close()


def test_a_tenant_cannot_exceed_its_namespaces_or_cut_an_admins_pin(
    tenant_daemon: Callable[..., Daemon],
) -> None:
    daemon = tenant_daemon(tenants=tenants_config(max_namespaces=2))
    admin = daemon.admin()

    def beta_fills() -> Any:
        raw = Raw(daemon)
        outcomes: list[Any] = []
        for i in range(3):
            try:
                raw.connect(replace(SPEC, model=f"model-{i}"))
                keys = chunk_keys(raw.ns, np.arange(256), 256)
                outcomes.append(raw.store(keys, [b"\x01" * SPEC.page_bytes]))
            except KVStoreError as exc:
                outcomes.append((type(exc).__name__, str(exc)))
        return outcomes

    outcomes = as_user(BETA_UID, beta_fills)
    assert outcomes[:2] == [1, 1] and outcomes[2][0] == "ResourceExhausted"
    assert "tenant 'beta' already has 2 namespaces" in outcomes[2][1] and "max_namespaces" in outcomes[2][1]
    client, tokens, source = store_alpha(daemon)  # another tenant still connects a new model
    beta_ns = replace(SPEC, model="model-0").namespace("beta")
    keys = pack_keys(chunk_keys(beta_ns, np.arange(256), 256))
    pinned = admin.call("Pin", pb.PinRequest(namespace=beta_ns, keys=keys, ttl_ms=3_600_000))
    assert pinned.pinned_chunks == 1

    def beta_cuts_the_pin() -> Any:
        raw = Raw(daemon)
        raw.connect(replace(SPEC, model="model-0"))
        raw.call("Pin", pb.PinRequest(namespace=beta_ns, keys=keys, ttl_ms=1))
        time.sleep(0.3)  # the reaper runs every 50 ms: a 1 ms pin would be over
        return raw.call("Stats", pb.StatsRequest()).counters["pinned_pages"]

    assert as_user(BETA_UID, beta_cuts_the_pin) == 1  # the admin's hour stands
    admin.call("Pin", pb.PinRequest(namespace=beta_ns, keys=keys, ttl_ms=1))  # an admin may
    time.sleep(0.3)
    assert daemon_counter(admin, "pinned_pages") == 0
    assert_alpha_intact(client, tokens, source)
    client.close()


def daemon_counter(admin: LocalChannel, name: str) -> float:
    return float(admin.call("Stats", pb.StatsRequest()).counters[name])


def test_a_tcp_client_is_its_tenant_by_its_token(tenant_daemon: Callable[..., Daemon], run_dir: Path) -> None:
    token = secrets.token_hex(16)
    tokens_file = run_dir / "beta.tokens"
    tokens_file.write_text(f"# beta's TCP clients\n{token}\n")
    tokens_file.chmod(0o600)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    daemon = tenant_daemon(
        tenants=tenants_config(tokens_file),
        server__tcp=f"127.0.0.1:{port}",
        server__auth_token="admin-token-0123",
    )
    alpha, alpha_tokens, alpha_source = store_alpha(daemon)
    spec = make_spec()
    tokens = tokens_of(1024, seed=21)
    source = random_cache(spec, 64, seed=22)
    with KVStoreClient.connect(f"127.0.0.1:{port}", spec, token=token) as beta:
        assert beta.namespace == beta.spec.page.namespace("beta")
        assert beta.lookup(alpha_tokens) == 0
        assert beta.store(tokens, source, torch.arange(64)) == 4
        target = empty_cache(spec, 64)
        target[1].fill_(float("nan"))
        assert beta.load(tokens, target, torch.arange(64)) == 1024
        assert_blocks_equal(target, torch.arange(64), source, torch.arange(64))
        with pytest.raises(PermissionDenied, match="Clear of every namespace is for admins"):
            beta._conn.rpc("Clear", pb.ClearRequest())
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    admin_stub = pb_grpc.KVStoreStub(channel)
    with pytest.raises(grpc.RpcError) as no_tenant:  # the admins' token names no tenant
        admin_stub.Connect(
            pb.ConnectRequest(spec=page_spec_message(SPEC)),
            metadata=(("authorization", "Bearer admin-token-0123"),),
        )
    assert no_tenant.value.code() == grpc.StatusCode.PERMISSION_DENIED
    stats = admin_stub.Stats(pb.StatsRequest(), metadata=(("authorization", "Bearer admin-token-0123"),))
    assert {n.tenant for n in stats.namespaces} == {"alpha", "beta"}

    def events(token: str, count: int) -> list[pb.KVEvent]:  # the first `count` a token may see
        seen: list[pb.KVEvent] = []
        stream = admin_stub.Events(
            pb.EventsRequest(since=0), metadata=(("authorization", f"Bearer {token}"),)
        )
        for batch in stream:
            seen += batch.events
            if len(seen) >= count:
                stream.cancel()
                break
        return seen

    mine = events(token, 4)  # beta's token: beta's four pages, none of alpha's
    assert [(e.tenant, e.kind) for e in mine] == [("beta", pb.KVEvent.STORED)] * 4
    assert {e.tenant for e in events("admin-token-0123", 8)} == {"alpha", "beta"}
    channel.close()
    assert_alpha_intact(alpha, alpha_tokens, alpha_source)
    alpha.close()


def test_who_a_caller_is_from_its_credentials_and_tokens() -> None:
    from kvstore.config.root import TenantConfig
    from kvstore.server.tenants import Tenancy
    from kvstore.shared.errors import Unauthenticated
    from kvstore.shared.peers import Peer

    tenancy = Tenancy(
        [TenantConfig("a", uids=(1001,)), TenantConfig("b", gids=(2000,))],
        admin_token="admin-token-0123",
        tenant_tokens={"b": frozenset({"b" * 32})},
    )
    assert tenancy.of_peer(Peer(uid=1001, gid=1001)).tenant == "a"
    assert tenancy.of_peer(Peer(uid=1002, gid=5, groups=(2000,))).tenant == "b"  # by a supplementary group
    torn = tenancy.of_peer(Peer(uid=1001, gid=1001, groups=(2000,)))  # uid in a, group in b: in neither
    assert torn.tenant is None and "matches tenants 'a' and 'b'" in torn.who
    assert tenancy.of_peer(Peer(uid=3_000_000_000, gid=3_000_000_000)).tenant is None  # ids past 2^31
    member = tenancy.of_peer(Peer(uid=1001, gid=1001))
    credential = tenancy.credential(member)
    assert tenancy.of_token(credential, unix=True).tenant == "a"
    with pytest.raises(Unauthenticated):  # a credential is for the daemon's unix socket only
        tenancy.of_token(credential, unix=False)
    root = tenancy.of_peer(Peer(uid=0, gid=0, groups=()))
    assert root.admin and not tenancy.of_token(tenancy.credential(root) or "x", unix=True).admin
    assert tenancy.of_token("b" * 32, unix=False).tenant == "b"
    assert tenancy.of_token("admin-token-0123", unix=False).admin
    assert tenancy.of_token("unknown-token-012345", unix=True).tenant is None  # on unix: no token
    with pytest.raises(Unauthenticated, match="not one this daemon knows"):
        tenancy.of_token("unknown-token-012345", unix=False)
    with pytest.raises(Unauthenticated, match="printable ASCII"):
        tenancy.of_token("caf\u00e9", unix=False)
    assert Tenancy().credential(Tenancy().of_peer(Peer(uid=1001, gid=1001))) == ""  # none without tenants


def test_processes_in_no_tenant_cannot_crowd_out_the_members(tenant_daemon: Callable[..., Daemon]) -> None:
    daemon = tenant_daemon(server__max_local_connections=8, server__max_local_connections_per_uid=4)
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # an outsider holding every connection it can get
        code = 1
        try:
            os.setgroups([])
            os.setgid(OUTSIDER_UID)
            os.setuid(OUTSIDER_UID)
            held = []
            for _ in range(40):
                sock = socket.socket(socket.AF_UNIX)
                sock.connect(str(daemon.local_path))
                held.append(sock)
            os.write(ready_w, b"1")
            os.read(done_r, 1)
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)  # the child's ends: a child that died reads as the end of its pipe, not a wait
    os.close(done_r)
    try:
        assert os.read(ready_r, 1) == b"1", "the outsider's child failed before it held its connections"
        time.sleep(0.2)
        client, tokens, source = store_alpha(daemon)  # a member still connects, on the local channel
        assert client._local is not None and client.shared_memory
        assert_alpha_intact(client, tokens, source)
        counters = daemon.admin().call("Stats", pb.StatsRequest()).counters
        assert counters["refused_outsider_connections"] == 40 - 16  # 16 outsiders kept, told why
        client.close()
    finally:
        with contextlib.suppress(BrokenPipeError):
            os.write(done_w, b"1")
        os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(done_w)
