"""Never a hit with wrong bytes: daemon restarts under load, stalled writers, shutdown and start-up.

Each scenario runs real daemons and real client processes, and every load goes into a poisoned
cache whose bytes are compared with what was stored:

- restarts (SIGTERM and SIGKILL, with and without the local channel) while workers store and
  load: no exception out of a public call, no wrong byte, each client object served again
  within 3 s of each restart without a new `connect`;
- a worker that made a call while the daemon was down, and another that connected to the new
  daemon first: the first maps the new arena before it moves a byte (arena epochs);
- gRPC channels that failed to connect while the daemon was down and will not try again for a
  minute: both workers are served as soon as the new daemon is, the one that made no call while
  it was down on its first call;
- a writer stopped (SIGSTOP) past its lease's TTL: its slot stays fenced, so its late write
  lands nowhere that another page lives, and its Commit stores nothing;
- a slow but live writer keeps its lease by renewing it;
- a store in flight when SIGTERM comes commits; a SIGTERM at any moment of start-up leaves
  nothing behind.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.shared.keys import chunk_keys, pack_keys
from kvstore_client import KVStoreClient
from kvstore_client.connection import RECONNECT_INTERVAL_S, open_channel
from tests.harness import STARTUP_TIMEOUT_S, Daemon, python_env, start_daemon, write_config
from tests.integrity_worker import BLOCKS, POISON, SPEC, cache_for, prompt, wrong_blocks

SERVE_AGAIN_S = 3.0
RESTARTS = 5
WORKERS = 3
# A small arena (128 pages for 40 prompts x 4 chunks): pages are evicted and their slots reused
# all the time, which is where a stale writer or reader would show.
SMALL = {"tiers__cpu__bytes": "1MiB", "tiers__cpu__slab_bytes": "256KiB"}


def counters(daemon: Daemon) -> dict[str, float]:
    return dict(daemon.stub().Stats(pb.StatsRequest()).counters)


def load_checked(client: KVStoreClient, i: int) -> int:
    """Loads prompt i into a poisoned cache; asserts the bytes; returns the tokens loaded."""
    target = [torch.full_like(t, POISON) for t in cache_for(i)]
    loaded = client.load(prompt(i), target, torch.arange(BLOCKS))
    assert wrong_blocks(target, cache_for(i), loaded) == []
    return loaded


class Workers:
    """Client processes running tests/integrity_worker.py against one address."""

    def __init__(self, tmp_path: Path, address: str, count: int, *extra: str) -> None:
        self.stop_file = tmp_path / "stop"
        self.reports = [tmp_path / f"worker-{n}.json" for n in range(count)]
        self.processes = [
            subprocess.Popen(
                [
                    sys.executable, "-m", "tests.integrity_worker",
                    address, str(self.stop_file), str(report), "--seed", str(n), *extra,
                ],
                env=python_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for n, report in enumerate(self.reports)
        ]  # fmt: skip
        for process in self.processes:
            line = process.stdout.readline() if process.stdout else b""
            assert line.strip() == b"connected", process.stderr.read() if process.stderr else ""

    def served_after(self, since: float) -> bool:
        """Whether every worker has had a call served at `since` or later."""
        for report in self.reports:
            served = report.with_name(report.name + ".served")
            lines = served.read_text().split() if served.exists() else []
            if not any(float(t) >= since for t in lines):
                return False
        return True

    def wait_served(self, since: float, timeout_s: float) -> None:
        """Until every worker has had a call served at `since` or later, or `timeout_s` passed
        (the caller's assertions on the reports say which worker was not served)."""
        deadline = time.monotonic() + timeout_s
        while not self.served_after(since) and time.monotonic() < deadline:
            time.sleep(0.05)

    def finish(self) -> list[dict]:
        self.stop_file.touch()
        results = []
        for process, report in zip(self.processes, self.reports, strict=True):
            _, err = process.communicate(timeout=60)
            assert process.returncode == 0, err.decode(errors="replace")[-4000:]
            results.append(json.loads(report.read_text()))
        return results

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Starts the daemon of one config again and again on the same socket; stops the last."""
    current: list[Daemon] = []

    def start(**overrides: object) -> Daemon:
        daemon = start_daemon(tmp_path, "restart", **overrides)
        current[:] = [daemon]
        return daemon

    yield start
    for daemon in current:
        if daemon.process.poll() is None:
            assert daemon.stop() == 0, daemon.log()


@pytest.mark.parametrize(
    ("local_channel", "parts"),
    [(True, False), (False, False), (True, True)],
    ids=["local-channel", "grpc-only", "local-channel-commits-in-parts"],
)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_workers_see_no_error_and_no_wrong_byte_through_five_restarts(
    tmp_path: Path, restartable: Callable[..., Daemon], sig: int, local_channel: bool, parts: bool
) -> None:
    """`parts`: every store commits page by page as each is written (a restart lands between
    a store's Commits too)."""
    config = {**SMALL, "server__local_channel": local_channel}
    daemon = restartable(**config)
    workers = Workers(tmp_path, daemon.address, WORKERS, *(["--commit-parts"] if parts else []))
    serving_since: list[float] = []
    try:
        workers.wait_served(time.time(), STARTUP_TIMEOUT_S)  # every worker is storing or loading
        for _ in range(RESTARTS):
            daemon.stop(sig)
            time.sleep(0.3)  # calls made while it is down
            daemon = restartable(**config)
            serving_since.append(time.time())
            # The next restart comes as soon as every worker is served again, with calls in flight.
            workers.wait_served(serving_since[-1], SERVE_AGAIN_S + 0.5)
        reports = workers.finish()
    finally:
        workers.kill()
    for n, report in enumerate(reports):
        assert report["exceptions"] == [], f"worker {n}: {report['exceptions'][:2]}"
        assert report["wrong"] == [], f"worker {n}: {report['wrong'][:3]}"
        assert report["loads"] > 20 and report["hit_tokens"] > 0 and report["stored"] > 0
        for k, since in enumerate(serving_since):
            served = [t for t in report["served"] if since <= t <= since + SERVE_AGAIN_S]
            assert served, f"worker {n} not served within {SERVE_AGAIN_S} s of restart {k + 1}"


def restarted_under_workers(
    tmp_path: Path, restartable: Callable[..., Daemon], sig: int, config: dict[str, object], *extra: str
) -> list[dict]:
    """The daemon of `config` stopped with `sig` and started again three times under WORKERS
    workers (`extra`: their options); each saw no exception and no wrong byte. Their reports."""
    daemon = restartable(**config)
    workers = Workers(tmp_path, daemon.address, WORKERS, *extra)
    try:
        workers.wait_served(time.time(), STARTUP_TIMEOUT_S)
        for _ in range(3):
            daemon.stop(sig)
            time.sleep(0.3)  # calls made while it is down
            daemon = restartable(**config)
            workers.wait_served(time.time(), SERVE_AGAIN_S + 0.5)
        reports = workers.finish()
    finally:
        workers.kill()
    for n, report in enumerate(reports):
        assert report["exceptions"] == [], f"worker {n}: {report['exceptions'][:2]}"
        assert report["wrong"] == [], f"worker {n}: {report['wrong'][:3]}"
        assert report["loads"] > 20 and report["hit_tokens"] > 0 and report["stored"] > 0
    return reports


PINNED = {"tiers__cpu__pinned": True, "tiers__cpu__bytes": "8MiB", "tiers__cpu__slab_bytes": "2MiB"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a pinned arena needs a CUDA device (none here)")
@pytest.mark.parametrize("caches", ["gpu", "cpu"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_workers_on_a_pinned_arena_see_no_error_and_no_wrong_byte_through_restarts(
    tmp_path: Path, restartable: Callable[..., Daemon], sig: int, caches: str
) -> None:
    """The arena pinned by the daemon (`tiers.cpu.pinned`): each restart makes a new one, whose
    slabs the workers map again; the old one stays mapped in a worker until then. KV caches on
    the GPU, or in host memory (their slabs opened to the CPU)."""
    restarted_under_workers(tmp_path, restartable, sig, PINNED, *(["--gpu"] if caches == "gpu" else []))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_stores_through_the_bounce_ring_see_no_error_and_no_wrong_byte_through_restarts(
    tmp_path: Path, restartable: Callable[..., Daemon], sig: int
) -> None:
    """Every store of every worker goes through the bounce ring (their arenas' slabs never
    register): the daemon restarted under them, a new arena each time, and nothing they load
    is wrong."""
    reports = restarted_under_workers(tmp_path, restartable, sig, SMALL, "--bounce")
    assert all(report["bounced"] > 0 for report in reports)  # the last arena's stores went through the ring


@pytest.mark.parametrize("calls_while_down", [True, False], ids=["calls-while-down", "idle-while-down"])
@pytest.mark.parametrize("local_channel", [True, False], ids=["local-channel", "grpc-only"])
def test_a_worker_left_on_the_old_arena_maps_the_new_one_before_moving_a_byte(
    restartable: Callable[..., Daemon],
    local_channel: bool,
    calls_while_down: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = {"server__local_channel": local_channel}
    daemon = restartable(**config)
    a = KVStoreClient.connect(daemon.address, SPEC)
    b = KVStoreClient.connect(daemon.address, SPEC)
    try:
        assert a.store(prompt(0), cache_for(0), torch.arange(BLOCKS)) == BLOCKS
        old_epoch = a.epoch
        daemon.stop(signal.SIGKILL)
        with caplog.at_level(logging.INFO, logger="kvstore_client"):
            for _ in range(200 if calls_while_down else 0):  # misses, and one warning
                assert a.lookup(prompt(0)) == 0
                assert load_checked(a, 0) == 0
            if calls_while_down:  # nothing answered: A let go of the dead arena at once
                assert a.arena is None and a.epoch == 0
            daemon = restartable(**config)
            # B reaches the new daemon first and registers the namespace again: over gRPC, A's
            # calls now find its namespace; only the epoch tells that its mapping is stale.
            assert b.store(prompt(1), cache_for(1), torch.arange(BLOCKS)) == BLOCKS
            deadline = time.monotonic() + SERVE_AGAIN_S
            while a.store(prompt(2), cache_for(2), torch.arange(BLOCKS)) == 0:
                assert time.monotonic() < deadline, "A did not serve again in time"
                time.sleep(0.05)
        assert a.epoch != old_epoch and a.epoch == b.epoch
        assert (a._local is not None, b._local is not None) == (local_channel, local_channel)
        assert load_checked(a, 1) == BLOCKS * 16  # B's page, through A's new mapping
        assert load_checked(b, 2) == BLOCKS * 16  # A's page reached the new arena
        assert load_checked(a, 0) == 0  # the old daemon's page is gone, not read from the old arena
        # One warning and one info line per client object: B met the restart too (its local
        # channel closed, or its epoch was refused).
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        infos = [r for r in caplog.records if r.levelno == logging.INFO and "serves again" in r.getMessage()]
        assert len(warnings) == 2 and all("not serving" in r.getMessage() for r in warnings)
        assert len(infos) == 2
    finally:
        a.close()
        b.close()


# gRPC's own next attempt to connect, for channels made while it is in force: later than the test.
ADVERSARIAL_BACKOFF_MS = 60_000


@pytest.mark.parametrize("local_channel", [True, False], ids=["local-channel", "grpc-only"])
def test_workers_whose_channels_failed_while_the_daemon_was_down_are_served_as_soon_as_it_serves(
    restartable: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch, local_channel: bool
) -> None:
    # The race, forced: a channel's attempt to connect fails while the daemon is down, and the
    # daemon serves again before the channel's own next attempt (here a minute away, on a fast
    # machine up to the 250 ms backoff), which fails every call on it meanwhile.
    monkeypatch.setattr("kvstore_client.connection._RECONNECT_BACKOFF_MS", ADVERSARIAL_BACKOFF_MS)
    config = {"server__local_channel": local_channel}
    daemon = restartable(**config)
    a = KVStoreClient.connect(daemon.address, SPEC)
    b = KVStoreClient.connect(daemon.address, SPEC)
    witness = open_channel(daemon.address, None)
    try:
        assert a.store(prompt(0), cache_for(0), torch.arange(BLOCKS)) == BLOCKS
        daemon.stop(signal.SIGKILL)
        assert a.lookup(prompt(0)) == 0  # A's channel fails to connect; B makes no call
        with pytest.raises(grpc.RpcError):
            pb_grpc.KVStoreStub(witness).Stats(pb.StatsRequest(), timeout=10)
        daemon = restartable(**config)
        with pytest.raises(grpc.RpcError) as failed:  # serving, but not to a channel that backs off
            pb_grpc.KVStoreStub(witness).Stats(pb.StatsRequest(), timeout=10)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        # B never met the outage: its first call is served.
        assert b.store(prompt(1), cache_for(1), torch.arange(BLOCKS)) == BLOCKS
        # A connects again by itself at most every RECONNECT_INTERVAL_S, on a channel of its own.
        deadline = time.monotonic() + RECONNECT_INTERVAL_S + SERVE_AGAIN_S
        while a.store(prompt(2), cache_for(2), torch.arange(BLOCKS)) == 0:
            assert time.monotonic() < deadline, "A did not serve again in time"
        assert a.epoch == b.epoch != 0
        assert load_checked(a, 1) == BLOCKS * 16
        assert load_checked(b, 2) == BLOCKS * 16
        assert load_checked(a, 0) == 0
    finally:
        witness.close()
        a.close()
        b.close()


def test_calls_from_another_arena_epoch_are_refused_and_do_nothing(
    restartable: Callable[..., Daemon],
) -> None:
    daemon = restartable()
    stub = daemon.stub()
    spec = pb.PageSpec(
        model="epochs", num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", chunk_tokens=16
    )
    old = stub.Connect(pb.ConnectRequest(spec=spec))
    keys = pack_keys(chunk_keys(old.namespace, list(range(64)), 16))
    daemon.stop(signal.SIGKILL)
    daemon = restartable()
    stub = daemon.stub()
    new = stub.Connect(pb.ConnectRequest(spec=spec))
    assert new.epoch != old.epoch and new.epoch != 0
    assert (new.arena.device, new.arena.inode) != (0, 0)
    ns = new.namespace
    calls = [
        ("Reserve", stub.Reserve, pb.ReserveRequest(namespace=ns, keys=keys, epoch=old.epoch)),
        (
            "Lookup",
            stub.Lookup,
            pb.LookupRequest(namespace=ns, keys=keys, lease=True, acquire=True, epoch=old.epoch),
        ),
        ("Commit", stub.Commit, pb.LeaseRequest(namespace=ns, lease_id=1, epoch=old.epoch)),
        ("Acquire", stub.Acquire, pb.LeaseRequest(namespace=ns, lease_id=1, epoch=old.epoch)),
        ("Renew", stub.Renew, pb.RenewRequest(namespace=ns, lease_ids=[1], epoch=old.epoch)),
    ]
    for name, call, request in calls:
        with pytest.raises(grpc.RpcError) as info:
            call(request)
        assert info.value.code() == grpc.StatusCode.ABORTED, name  # type: ignore[attr-defined]
        assert f"arena epoch {old.epoch:#x}" in info.value.details(), name  # type: ignore[attr-defined]
    stats = stub.Stats(pb.StatsRequest())
    assert stats.tiers[0].bytes_used == 0 and stats.counters["active_leases"] == 0
    reply = stub.Reserve(pb.ReserveRequest(namespace=ns, keys=keys, epoch=new.epoch))
    assert reply.lease_id and len(reply.offsets) == 4  # the current epoch is served
    # A call naming no epoch (an inline client's, or one older than epochs) is not checked.
    assert stub.Lookup(pb.LookupRequest(namespace=ns, keys=keys, lease=True, acquire=True)).hit_chunks == 0


def test_a_client_maps_only_the_daemons_own_arena_file(
    restartable: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = restartable()
    with KVStoreClient.connect(daemon.address, SPEC, shared_memory=True) as client:
        arena = pb.Arena(shm_path=str(daemon.arena_path), size=1 << 20, device=1, inode=2)
        with pytest.raises(ConnectionError, match="is not the daemon's arena"):
            client._mapped.map(arena, (1, 2))
        assert client.arena is None
        other_host = pb.Arena(shm_path=str(daemon.arena_path), size=1 << 20, boot_id="another-host")
        with pytest.raises(ConnectionError, match="runs on another host"):
            client._mapped.map(other_host, (0, 0))
    # Without shared_memory=True such a daemon's pages go inline, and still load byte for byte.
    monkeypatch.setattr("kvstore_client.arena.boot_id", lambda: "another-host")
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        assert client.arena is None and client.epoch == 0
        assert client.store(prompt(0), cache_for(0), torch.arange(BLOCKS)) == BLOCKS
        assert load_checked(client, 0) == BLOCKS * 16


# --- stalled and slow writers -----------------------------------------------------------------

STALLED_WRITER = """
import json, sys, torch
import kvstore_kernels
from kvstore_client import KVStoreClient
from tests.integrity_worker import SPEC, BLOCKS, prompt

gather, run = kvstore_kernels.gather, kvstore_kernels.Prepared.run

def stall():  # between Reserve and the write: wait for the test
    print("reserved", flush=True)
    sys.stdin.readline()

def stalled(*args, **kwargs):
    stall()
    return gather(*args, **kwargs)

def stalled_run(self, *args, **kwargs):  # the gather prepared while the Reserve was in flight
    stall()
    return run(self, *args, **kwargs)

kvstore_kernels.gather, kvstore_kernels.Prepared.run = stalled, stalled_run
client = KVStoreClient.connect(sys.argv[1], SPEC)
mine = [torch.full((2, BLOCKS, 16, 2, 32), 0.5).half() for _ in range(2)]  # a pattern of A's own
try:
    stored = client.store(prompt(int(sys.argv[2]))[:16], mine, torch.arange(1))
    print(json.dumps({"stored": stored, "exception": None}), flush=True)
except BaseException as exc:
    print(json.dumps({"stored": None, "exception": repr(exc)}), flush=True)
client.close()
"""


def start_writer(address: str, i: int) -> subprocess.Popen[bytes]:
    writer = subprocess.Popen(
        [sys.executable, "-c", STALLED_WRITER, address, str(i)],
        env=python_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert writer.stdout is not None and writer.stdout.readline().strip() == b"reserved"
    return writer


def finish_writer(writer: subprocess.Popen[bytes]) -> dict[str, object]:
    out, err = writer.communicate(b"go\n", timeout=60)
    assert writer.returncode == 0, err.decode(errors="replace")
    result: dict[str, object] = json.loads(out.decode().strip().splitlines()[-1])
    return result


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# Two slots: one for the stalled writer, one holding an older page that a new store may evict.
TWO_SLOTS = {"tiers__cpu__bytes": "16KiB", "tiers__cpu__slab_bytes": "16KiB", "leases__ttl_s": 0.5}


@pytest.mark.parametrize("local_channel", [True, False], ids=["local-channel", "grpc-only"])
def test_a_writer_stopped_past_its_ttl_never_overwrites_another_page(
    daemon_factory: Callable[..., Daemon], local_channel: bool
) -> None:
    daemon = daemon_factory(**TWO_SLOTS, server__local_channel=local_channel)
    with KVStoreClient.connect(daemon.address, SPEC) as b:
        one = torch.arange(1)
        assert b.store(prompt(7)[:16], cache_for(7), one) == 1  # the older page, in the other slot
        writer = start_writer(daemon.address, 3)  # A reserved the free slot and stalls
        try:
            writer.send_signal(signal.SIGSTOP)
            wait_for(lambda: counters(daemon).get("expired_leases", 0) == 1)
            quarantined = counters(daemon).get("quarantined_pages", 0)
            # B stores its page: the fenced slot is not handed out, the older page is evicted.
            assert b.store(prompt(8)[:16], cache_for(8), one) == 1
            writer.send_signal(signal.SIGCONT)
            result = finish_writer(writer)  # A writes its bytes into its old slot and commits
        finally:
            writer.kill()
        assert result == {"stored": 0, "exception": None}  # its Commit stored nothing
        target = [torch.full_like(t, POISON) for t in cache_for(8)]
        assert b.load(prompt(8)[:16], target, one) == 16
        assert wrong_blocks(target, cache_for(8), 16) == []  # B's bytes, not A's
        assert b.lookup(prompt(3)[:16]) == 0  # A's page never became visible
        assert quarantined == 1
        stats = counters(daemon)
        assert stats["fenced_leases"] == 1
        assert stats["quarantined_pages"] == 0  # A's Commit ended the fence: it had stopped writing
        assert stats["evicted_chunks"] == 1


@pytest.mark.parametrize("local_channel", [True, False], ids=["local-channel", "grpc-only"])
def test_a_fence_ends_when_its_writer_dies(
    daemon_factory: Callable[..., Daemon], local_channel: bool
) -> None:
    daemon = daemon_factory(**TWO_SLOTS, server__local_channel=local_channel)
    writer = start_writer(daemon.address, 3)
    try:
        writer.send_signal(signal.SIGSTOP)
        wait_for(lambda: counters(daemon).get("quarantined_pages", 0) == 1)
        time.sleep(1.5)
        assert counters(daemon)["quarantined_pages"] == 1  # still held while the writer lives
        writer.kill()
        writer.wait()
        wait_for(lambda: counters(daemon)["quarantined_pages"] == 0, timeout_s=5.0)
    finally:
        writer.kill()
    assert counters(daemon)["quarantines_ended"] == 1
    with KVStoreClient.connect(daemon.address, SPEC) as b:  # both slots usable again
        assert b.store(prompt(1)[:32], cache_for(1), torch.arange(2)) == 2
        assert load_checked(b, 1) == 32


def test_a_slow_but_live_writer_renews_its_lease_and_stores(daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(**TWO_SLOTS)
    writer = start_writer(daemon.address, 3)
    try:
        time.sleep(1.5)  # three TTLs between its Reserve and its write: the renewal thread keeps it
        result = finish_writer(writer)
    finally:
        writer.kill()
    assert result == {"stored": 1, "exception": None}
    stats = counters(daemon)
    assert stats.get("fenced_leases", 0) == 0 and stats["renewed_leases"] >= 2
    with KVStoreClient.connect(daemon.address, SPEC) as b:
        target = [torch.full_like(t, POISON) for t in cache_for(3)]
        assert b.load(prompt(3)[:16], target, torch.arange(1)) == 16
        assert all(torch.equal(t[:, 0], torch.full_like(t[:, 0], 0.5)) for t in target)  # A's bytes
        assert all(torch.equal(t[:, 1:], torch.full_like(t[:, 1:], POISON)) for t in target)


# --- shutdown and start-up --------------------------------------------------------------------


@pytest.mark.parametrize("local_channel", [True, False], ids=["local-channel", "grpc-only"])
def test_a_store_in_flight_at_sigterm_commits_and_new_work_is_a_miss(
    daemon_factory: Callable[..., Daemon], local_channel: bool
) -> None:
    daemon = daemon_factory(server__local_channel=local_channel)
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        handle = client.store_async(prompt(0), cache_for(0), torch.arange(BLOCKS))  # reserved, written
        daemon.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the daemon is draining: it waits for the lease
        assert client.lookup(prompt(0)) == 0  # new work is refused: a miss, no exception
        assert handle.wait() == BLOCKS  # the store in flight commits
        assert daemon.process.wait(10) == 0
        assert load_checked(client, 0) == 0  # the daemon is gone: a miss
    assert "leases still held" not in daemon.log()


@pytest.mark.parametrize("delay_s", [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.3, 1.7])
def test_sigterm_at_any_moment_of_start_up_leaves_nothing_behind(tmp_path: Path, delay_s: float) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    socket_path = run_dir / "kvstored.sock"
    config = write_config(
        run_dir / "kvstored.yaml",
        socket_path,
        tiers__cpu__bytes="256MiB",
        tiers__disk__enabled=True,
        tiers__disk__path=str(tmp_path / "disk"),
        tiers__disk__bytes="64MiB",
    )
    daemon = Daemon(
        subprocess.Popen(
            [sys.executable, "-m", "kvstore.server.daemon", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        ),
        config,
        socket_path,
        run_dir / "unused.log",
    )
    time.sleep(delay_s)
    daemon.process.send_signal(signal.SIGTERM)
    out, _ = daemon.process.communicate(timeout=30)
    # Exit 0, or killed by the signal before Python could take it (nothing was made yet).
    assert daemon.process.returncode in (0, -signal.SIGTERM), out.decode(errors="replace")
    left = sorted(p.name for p in run_dir.iterdir() if p.name != "kvstored.yaml")
    assert left == [], out.decode(errors="replace")
    assert not daemon.arena_path.exists()
