"""The arena the daemon pins through CUDA (`tiers.cpu.pinned`), against the real daemon.

On a host without a GPU (CI): the daemon refuses the setting at start, naming it; `ArenaSlabs`
on a shared-memory arena, or over gRPC, is refused with a message that says why. With a GPU:
workers map the slabs' descriptors and store and load through them, in this process and in
another, across a restart of the daemon; every byte compared.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest
import torch

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.channel import LocalChannel
from kvstore.shared.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from kvstore.tiers.pinned import may_map
from kvstore_client import KVSpec, KVStoreClient
from tests.harness import REPO_ROOT, python_env, start_daemon

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (none here)")

PAGE = pb.PageSpec(model="m", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", chunk_tokens=16)
SPEC = KVSpec(
    model="pinned-test", num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=16
)


def test_who_may_map_a_pinned_arena_follows_the_file_mode_as_for_a_shared_memory_file() -> None:
    me, group, stranger = os.geteuid(), os.getegid(), 4242
    assert may_map(0o600, me, group, ()) and may_map(0o600, 0, 0, ())  # its user, and root
    assert not may_map(0o600, stranger, stranger, ())
    assert not may_map(0o600, stranger, group, ())  # the group is kept out by 0600
    assert may_map(0o660, stranger, group, ()) and may_map(0o660, stranger, stranger, (group,))
    assert not may_map(0o640, stranger, group, ())  # read alone is not enough: workers write pages
    assert not may_map(0o660, stranger, stranger, ()) and may_map(0o666, stranger, stranger, ())


@pytest.mark.skipif(CUDA, reason="this host has a GPU: the pinned arena starts")
def test_a_host_without_a_gpu_refuses_the_pinned_arena_at_start_by_name(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as error:
        start_daemon(tmp_path, tiers__cpu__pinned=True)
    text = str(error.value)
    assert "tiers.cpu.pinned" in text and "set tiers.cpu.pinned: false" in text
    assert "Traceback" not in text


def test_arena_slabs_of_a_shared_memory_arena_is_refused(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path)
    try:
        channel = daemon.admin()
        try:
            reply = channel.call("Connect", pb.ConnectRequest(spec=PAGE))
            assert not reply.arena.shm_path.startswith("cuda:")
            request = pb.ArenaSlabsRequest(epoch=reply.epoch, first=0, count=1)
            with pytest.raises(FailedPrecondition, match="shared memory .*tiers.cpu.pinned is off"):
                channel.call_with_fds("ArenaSlabs", request)
            # The channel stays in step after the refusal.
            assert channel.call("Connect", pb.ConnectRequest(spec=PAGE)).epoch
        finally:
            channel.close()
        with pytest.raises(grpc.RpcError) as error:
            daemon.stub().ArenaSlabs(pb.ArenaSlabsRequest(first=0, count=1), timeout=10)
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "local channel only" in str(error.value.details())
    finally:
        daemon.stop()


def cache(num_blocks: int, fill: float | None = None) -> list[torch.Tensor]:
    shape = (2, num_blocks, 16, 2, 64)
    return [
        torch.randn(shape, device="cuda").bfloat16()
        if fill is None
        else torch.full(shape, fill, device="cuda", dtype=torch.bfloat16)
        for _ in range(SPEC.num_layers)
    ]


def blocks_of(kv: list[torch.Tensor], blocks: torch.Tensor) -> torch.Tensor:
    return torch.stack([t[:, blocks.cuda()].view(torch.uint8) for t in kv]).cpu()


def store_and_load(client: KVStoreClient, tokens: list[int], blocks: int) -> None:
    source, source_blocks = cache(blocks * 2), torch.randperm(blocks * 2)[:blocks]
    assert client.store(tokens, source, source_blocks) == len(tokens) // 256
    target, target_blocks = cache(blocks * 2, fill=-7.0), torch.randperm(blocks * 2)[:blocks]
    assert client.load(tokens, target, target_blocks) == len(tokens)
    assert torch.equal(blocks_of(target, target_blocks), blocks_of(source, source_blocks))


@needs_cuda
@pytest.mark.gpu
def test_workers_map_the_pinned_arena_and_move_exact_bytes_across_a_restart(tmp_path: Path) -> None:
    options = {"tiers__cpu__pinned": True, "tiers__cpu__bytes": "1GiB", "tiers__cpu__slab_bytes": "256MiB"}
    daemon = start_daemon(tmp_path, **options)
    try:
        with KVStoreClient.connect(daemon.address, SPEC) as client:
            assert client.shared_memory
            tokens = torch.randint(0, 50_000, (4096,)).tolist()
            store_and_load(client, tokens, 256)
            # Its first slab mapped (a transfer waits for it), the kernels see pinned memory. (Never
            # print the arena: its slabs are the GPU's until a transfer opens them to the CPU.)
            assert client.arena is not None
            pinned = client.arena.is_pinned()
            assert pinned
            # A KV cache in host memory: the CPU moves the pages, through slabs opened to it.
            host = [torch.randn(2, 128, 16, 2, 64).bfloat16() for _ in range(4)]
            host_tokens = torch.randint(0, 50_000, (1024,)).tolist()
            assert client.store(host_tokens, host, torch.arange(64, 128)) == 4
            back = [torch.full((2, 64, 16, 2, 64), -5.0, dtype=torch.bfloat16) for _ in range(4)]
            assert client.load(host_tokens, back, torch.arange(64)) == 1024
            assert all(torch.equal(b, h[:, 64:128]) for b, h in zip(back, host, strict=True))
            stats = client.stats()
            arena = stats["client"]["arena"]
            assert arena["slabs_failed"] == 0 and arena["transfers_unpinned"] == 0
            counters = stats["counters"]
            assert counters["arena_huge_pages"] == 3  # "pinned"
            # Another process maps the same slabs and reads the pages this one stored.
            child = textwrap.dedent(
                f"""
                import torch
                from kvstore_client import KVSpec, KVStoreClient
                spec = KVSpec(model="pinned-test", num_layers=4, num_kv_heads=2, head_dim=64,
                              dtype=torch.bfloat16, block_size=16)
                kv = [torch.full((2, 512, 16, 2, 64), -1.0, device="cuda", dtype=torch.bfloat16)
                      for _ in range(4)]
                with KVStoreClient.connect({daemon.address!r}, spec) as client:
                    assert client.load({tokens!r}, kv, torch.arange(256)) == 4096
                torch.save([t[:, :256].cpu() for t in kv], {str(tmp_path / "child.pt")!r})
                """
            )
            subprocess.run(
                [sys.executable, "-c", child], env=python_env(), cwd=REPO_ROOT, check=True, timeout=300
            )
            loaded = torch.load(tmp_path / "child.pt")
            target = cache(512, fill=-2.0)
            assert client.load(tokens, target, torch.arange(256)) == 4096
            assert all(torch.equal(a, t[:, :256].cpu()) for a, t in zip(loaded, target, strict=True))
            # The daemon restarts: its arena (and epoch) is new; the client maps it and goes on.
            daemon.stop()
            daemon = start_daemon(tmp_path, **options)
            assert client.load(tokens, cache(512), torch.arange(256)) == 0  # a miss, never old bytes
            store_and_load(client, torch.randint(0, 50_000, (2048,)).tolist(), 128)
    finally:
        daemon.stop()


@needs_cuda
@pytest.mark.gpu
def test_a_client_that_maps_no_slab_still_asks_over_the_local_channel(tmp_path: Path) -> None:
    """An engine's scheduler connects with `pin_arena=False`: it maps none of the pinned arena
    (no slab granted to a GPU for a process that moves no bytes), yet its Lookups go over the
    daemon's local channel as a worker's do, and bytes it sends inline load back exact."""
    options = {"tiers__cpu__pinned": True, "tiers__cpu__bytes": "1GiB", "tiers__cpu__slab_bytes": "256MiB"}
    daemon = start_daemon(tmp_path, **options)
    try:
        with (
            KVStoreClient.connect(daemon.address, SPEC) as worker,
            KVStoreClient.connect(daemon.address, SPEC, pin_arena=False, name="scheduler") as scheduler,
        ):
            assert scheduler.arena is None and not scheduler.shared_memory
            assert scheduler._conn.local is not None  # the same host: control calls stay local
            tokens = torch.randint(0, 50_000, (2048,)).tolist()
            assert scheduler.lookup(tokens) == 0
            store_and_load(worker, tokens, 128)
            assert scheduler.lookup(tokens) == 2048
            assert scheduler.lookup(tokens + [1] * 256) == 2048
            # Its own bytes go inline and are the bytes a worker then loads.
            host = [torch.randn(2, 32, 16, 2, 64).bfloat16() for _ in range(SPEC.num_layers)]
            inline = torch.randint(0, 50_000, (512,)).tolist()
            assert scheduler.store(inline, host, torch.arange(32)) == 2
            target = cache(64, fill=-3.0)
            assert worker.load(inline, target, torch.arange(32, 64)) == 512
            assert all(
                torch.equal(t[:, 32:64].cpu().view(torch.uint8), h.view(torch.uint8))
                for t, h in zip(target, host, strict=True)
            )
    finally:
        daemon.stop()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_kv_cache_on_another_gpu_of_the_worker_moves_exact_bytes(tmp_path: Path) -> None:
    """The worker maps the slabs for the GPU current at connect (0); a KV cache on GPU 1 of the
    same process gets its slabs opened to GPU 1 as its transfers reach them."""
    options = {"tiers__cpu__pinned": True, "tiers__cpu__bytes": "1GiB", "tiers__cpu__slab_bytes": "256MiB"}
    daemon = start_daemon(tmp_path, **options)
    try:
        torch.cuda.set_device(0)
        with KVStoreClient.connect(daemon.address, SPEC) as client:
            importer = client._mapped._shared.imported.importer
            assert importer.device == 0
            tokens = torch.randint(0, 50_000, (4096,)).tolist()
            with torch.cuda.device(1):
                source = [t.to("cuda:1") for t in cache(512)]
                assert client.store(tokens, source, torch.arange(256, 512)) == 16
                back = [torch.full_like(t, -3.0) for t in source]
                assert client.load(tokens, back, torch.arange(256)) == 4096
            assert all(torch.equal(b[:, :256], s[:, 256:]) for b, s in zip(back, source, strict=True))
            target = cache(256, fill=-7.0)  # GPU 0, the mapping's own: its bytes too
            assert client.load(tokens, target, torch.arange(256)) == 4096
            assert all(torch.equal(t.cpu(), s[:, 256:].cpu()) for t, s in zip(target, source, strict=True))
            assert importer._granted.get(1) and 0 not in importer._granted
    finally:
        daemon.stop()


def test_slabs_are_mapped_for_the_workers_gpu_alone_and_opened_to_others_once() -> None:
    """The driver's calls a slab costs (a recording stand-in for libcuda, which CI lacks): one
    access grant for the importer's GPU when mapped; another GPU, or the CPU, granted once per
    slab, only where asked; a slab mapped after another GPU needed some is mapped with it."""
    import contextlib

    from kvstore_client.imported import SlabImporter

    class Driver:
        device_count = 8

        def __init__(self) -> None:
            self.access: list[tuple[int, tuple[int, ...], bool]] = []

        @contextlib.contextmanager
        def on_device(self, device: int):  # type: ignore[no-untyped-def]
            yield

        def import_fd(self, fd: int) -> int:
            return fd

        def map(self, address: int, size: int, handle: int) -> None:
            pass

        def set_access(self, address: int, size: int, devices, host: bool) -> None:  # type: ignore[no-untyped-def]
            self.access.append((address, tuple(devices), host))

    driver, slab = Driver(), 1 << 20
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(3)]
    importer = SlabImporter(driver, lambda first, count: [], 3, 0, slab, 4, {})  # type: ignore[arg-type]
    importer.seed(0, fds)
    for index in range(3):
        importer.register(index * slab, slab)
    assert driver.access == [(0, (3,), False), (slab, (3,), False), (2 * slab, (3,), False)]
    driver.access.clear()
    importer.grant([0, 1], 3)  # its own GPU has them
    importer.grant([0, 1], 5)
    importer.grant([1, 2], 5)  # slab 1 is 5's already
    importer.grant([2], None)  # the CPU
    importer.grant([2], None)
    five = [(index * slab, (5,), False) for index in range(3)]
    assert driver.access == [*five, (2 * slab, (), True)]
    driver.access.clear()
    importer.seed(3, [os.open(os.devnull, os.O_RDONLY)])
    importer.register(3 * slab, slab)  # mapped after GPU 5 needed some: with GPU 5 too, not the CPU
    importer.grant([3], 5)
    assert driver.access == [(3 * slab, (3,), False), (3 * slab, (5,), False)]
    importer.close()


@needs_cuda
@pytest.mark.gpu
def test_arena_slabs_hands_each_pinned_slab_once_asked_and_refuses_bad_counts(tmp_path: Path) -> None:
    daemon = start_daemon(
        tmp_path, tiers__cpu__pinned=True, tiers__cpu__bytes="512MiB", tiers__cpu__slab_bytes="64MiB"
    )
    try:
        channel = daemon.admin()
        try:
            reply = channel.call("Connect", pb.ConnectRequest(spec=PAGE))
            assert reply.arena.shm_path.startswith("cuda:") and reply.arena.slab_bytes == 64 << 20
            slabs, fds = channel.call_with_fds(
                "ArenaSlabs", pb.ArenaSlabsRequest(epoch=reply.epoch, first=2, count=64)
            )
            try:
                assert slabs.first == 2 and slabs.num_slabs == 8 and len(fds) == slabs.count <= 6
            finally:
                for fd in fds:
                    os.close(fd)
            with pytest.raises(InvalidArgument, match="count must be 1..64"):
                channel.call_with_fds(
                    "ArenaSlabs", pb.ArenaSlabsRequest(epoch=reply.epoch, first=0, count=65)
                )
            with pytest.raises(InvalidArgument, match="slabs 0..7"):
                channel.call_with_fds("ArenaSlabs", pb.ArenaSlabsRequest(epoch=reply.epoch, first=8, count=1))
        finally:
            channel.close()
    finally:
        daemon.stop()


@needs_cuda
@pytest.mark.gpu
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_another_uid_gets_no_slab_unless_the_file_mode_lets_it() -> None:
    import shutil
    import tempfile

    from tests.test_tenants import as_user

    nobody = 65534
    base = Path(tempfile.mkdtemp(prefix="kvstore-pinned-", dir="/tmp"))
    base.chmod(0o755)  # the socket reachable by another uid
    try:
        for mode, allowed in ((0o600, False), (0o666, True)):
            daemon = start_daemon(
                base,
                f"mode-{mode:o}",
                tiers__cpu__pinned=True,
                tiers__cpu__bytes="256MiB",
                tiers__cpu__slab_bytes="64MiB",
                tiers__cpu__file_mode=f"0{mode:o}",
                server__socket_mode="0666",
            )
            try:
                (base / f"mode-{mode:o}").chmod(0o755)
                path = str(daemon.local_path)

                def ask(path: str = path) -> int:
                    channel = LocalChannel(path, 10.0)
                    try:
                        epoch = channel.call("Connect", pb.ConnectRequest(spec=PAGE)).epoch
                        request = pb.ArenaSlabsRequest(epoch=epoch, first=0, count=4)
                        _, fds = channel.call_with_fds("ArenaSlabs", request)
                        for fd in fds:
                            os.close(fd)
                        return len(fds)
                    finally:
                        channel.close()

                outcome = as_user(nobody, ask)
                if allowed:
                    assert outcome == 4
                else:
                    kind, name, message = outcome
                    assert (kind, name) == ("error", PermissionDenied.__name__)
                    assert "uid 65534 may not map the arena (tiers.cpu.file_mode 0o600" in message
            finally:
                daemon.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_fetchers_try_each_client_of_the_mapping_in_turn() -> None:
    from kvstore.shared.errors import Unavailable
    from kvstore_client.imported import Fetchers

    calls: list[str] = []

    def closed(first: int, count: int) -> list[int]:
        calls.append("closed")
        raise Unavailable("this client's local channel is closed")

    def live(first: int, count: int) -> list[int]:
        calls.append(f"live {first} {count}")
        return [first + i for i in range(count)]

    fetchers = Fetchers()
    with pytest.raises(Unavailable, match="no client of this process"):
        fetchers(0, 2)
    fetchers.add(closed)
    with pytest.raises(Unavailable, match="closed"):
        fetchers(0, 2)
    fetchers.add(live)
    assert fetchers(3, 2) == [3, 4] and calls[-2:] == ["closed", "live 3 2"]
    fetchers.remove(closed)
    assert fetchers(5, 1) == [5] and calls[-1] == "live 5 1"


def test_descriptors_the_kernel_drops_are_a_clear_error_and_none_leaks(tmp_path: Path) -> None:
    """A reply that carries more descriptors than the receiver takes (as for a process out of
    descriptors: MSG_CTRUNC) is ResourceExhausted, saying why; those received are closed."""
    import array
    import socket
    import threading

    from kvstore.shared.errors import ResourceExhausted
    from kvstore.shared.wire import HEADER, frame

    path = tmp_path / "s.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    sent = [os.open(os.devnull, os.O_RDONLY) for _ in range(100)]

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            length, _ = HEADER.unpack(conn.recv(HEADER.size))
            conn.recv(length)
            reply = frame(0, pb.ArenaSlabsResponse(first=0, count=100).SerializeToString())
            conn.sendmsg([reply], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", sent))])
            conn.recv(1)  # until the client closes

    thread = threading.Thread(target=answer)
    thread.start()
    before = len(os.listdir("/proc/self/fd"))
    channel = LocalChannel(str(path), 10.0)
    try:
        with pytest.raises(ResourceExhausted, match="out of file descriptors .*RLIMIT_NOFILE"):
            channel.call_with_fds("ArenaSlabs", pb.ArenaSlabsRequest(epoch=1, first=0, count=64))
        # The channel's socket and the test server's end of it: none of the 100 descriptors.
        assert len(os.listdir("/proc/self/fd")) == before + 2
    finally:
        channel.close()
        thread.join(10)
        server.close()
        for fd in sent:
            os.close(fd)
