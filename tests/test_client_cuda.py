"""The client's CUDA path against the real daemon: registered arena, Triton kernels, async handles.

Skipped without a CUDA device (CI has none); run on the GPU machine.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvstore_client import KVSpec, KVStoreClient
from tests.harness import Daemon

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)"),
]


def make_spec(layout: str) -> KVSpec:
    return KVSpec(
        model="cuda-test",
        num_layers=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        block_size=16,
        layout=layout,
    )


def cuda_cache(spec: KVSpec, num_blocks: int, fill: float | None = None) -> list[torch.Tensor] | torch.Tensor:
    if spec.layout == "cross_layer":
        shape: tuple[int, ...] = (num_blocks, spec.num_layers, 2, 16, spec.num_kv_heads, spec.head_dim)
        return (
            torch.randn(shape, device="cuda").bfloat16()
            if fill is None
            else torch.full(shape, fill, device="cuda", dtype=torch.bfloat16)
        )
    shape = (2, num_blocks, 16, spec.num_kv_heads, spec.head_dim)
    return [
        torch.randn(shape, device="cuda").bfloat16()
        if fill is None
        else torch.full(shape, fill, device="cuda", dtype=torch.bfloat16)
        for _ in range(spec.num_layers)
    ]


def blocks_of(cache: list[torch.Tensor] | torch.Tensor, blocks: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "cross_layer":
        assert isinstance(cache, torch.Tensor)
        return cache[blocks.cuda()].view(torch.uint8).cpu()
    return torch.stack([t[:, blocks.cuda()].view(torch.uint8) for t in cache]).cpu()


@pytest.mark.parametrize("layout", ["flash_attn", "cross_layer"])
def test_cuda_store_and_load_through_the_registered_arena(daemon: Daemon, layout: str) -> None:
    spec = make_spec(layout)
    tokens = torch.randint(0, 50_000, (2048,)).tolist()
    source_blocks = torch.randperm(512)[:128]
    source = cuda_cache(spec, 512)
    with KVStoreClient.connect(daemon.address, spec) as client:
        assert client.shared_memory and client._registered
        handle = client.store_async(tokens, source, source_blocks)
        assert handle.chunks == 8 and handle.wait() == 8
        target = cuda_cache(spec, 256, fill=-3.0)
        target_blocks = torch.randperm(256)[:128]
        load = client.load_async(tokens, target, target_blocks)
        assert load.tokens == 2048
        load.wait_stream(torch.cuda.current_stream())
        assert load.wait() == 2048
        assert torch.equal(blocks_of(target, target_blocks, layout), blocks_of(source, source_blocks, layout))
        untouched = torch.ones(256, dtype=torch.bool)
        untouched[target_blocks] = False
        rest = blocks_of(target, torch.nonzero(untouched).flatten(), layout)
        assert torch.equal(rest, torch.full_like(rest.view(torch.bfloat16), -3.0).view(torch.uint8))


def test_cuda_bytes_path_matches_shared_memory(daemon: Daemon) -> None:
    spec = make_spec("flash_attn")
    tokens = torch.randint(0, 50_000, (1024,)).tolist()
    source = cuda_cache(spec, 64)
    blocks = torch.arange(64)
    with (
        KVStoreClient.connect(daemon.address, spec) as writer,
        KVStoreClient.connect(daemon.address, spec, shared_memory=False) as reader,
    ):
        assert writer.store(tokens, source, blocks) == 4
        target = cuda_cache(spec, 64, fill=0.5)
        assert reader.load(tokens, target, blocks) == 1024
        assert torch.equal(blocks_of(target, blocks, "flash_attn"), blocks_of(source, blocks, "flash_attn"))


def test_the_side_stream_waits_for_the_default_stream() -> None:
    """What every transfer and hand-over is ordered by: work queued on torch's default stream (a
    forward writing the KV) runs before anything the side stream is given after `ordered_side`."""
    from kvstore_client.transfers import Streams

    device = torch.device("cuda", 0)
    streams = Streams()
    with torch.cuda.device(device):
        streams.ordered_side(device)  # a process's first call sets the runtime and the stream up
        torch.cuda.synchronize()
        torch.cuda._sleep(1 << 31)  # about a second
        side = streams.ordered_side(device)
        after = torch.cuda.Event()
        after.record(side)
        assert after.query() is False
        after.synchronize()
        assert torch.cuda.current_stream(device).query() is True


@pytest.mark.parametrize("asked", [False, True], ids=["at-wait", "as-written"])
def test_cuda_early_commits_go_out_once_their_pages_are_in_the_arena(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch, asked: bool
) -> None:
    """A store of 8 pages committed in parts of 2 (one transfer, marked at each part's end), its
    copy stream held back ~30 ms first: each early Commit goes out only once its pages' bytes are
    in the arena (read there as the Commit is sent, against the torch reference's pages), and
    another client loads all 8 back. `asked`: a `store_async` whose handle is asked to make
    `progress()` until every early Commit went out, without blocking, then waited."""
    import time

    import kvstore_kernels
    from kvstore_client import stores
    from kvstore_kernels import staged

    spec = make_spec("flash_attn")
    tokens = torch.randint(0, 50_000, (2048,)).tolist()
    blocks = torch.randperm(512)[:128]
    source = cuda_cache(spec, 512)
    with KVStoreClient.connect(daemon.address, spec) as client:
        page_bytes = client.page_bytes
        pages = torch.zeros(8 * page_bytes, dtype=torch.uint8)  # the torch reference's pages
        kvstore_kernels.gather(
            client.spec,
            [layer.cpu() for layer in source],
            blocks,
            range(8),
            pages,
            [i * page_bytes for i in range(8)],
            options=kvstore_kernels.TransferOptions(engine="torch"),
        )
        registrar = client._mapped.registrar
        deadline = time.monotonic() + 120
        while registrar is not None and not registrar.all_registered and time.monotonic() < deadline:
            time.sleep(0.01)
        monkeypatch.setattr(stores, "EARLY_COMMIT_PART_BYTES", 2 * page_bytes)
        monkeypatch.setattr(stores, "EARLY_COMMIT_TAIL_BYTES", 2 * page_bytes)
        replies: list[object] = []
        real_reserve = client._stores._reserve

        def reserve(*args: Any, **kwargs: Any) -> Any:
            replies.append(reply := real_reserve(*args, **kwargs))
            return reply

        monkeypatch.setattr(client._stores, "_reserve", reserve)
        marks: list[list[int]] = []
        real_run = kvstore_kernels.Prepared.run

        def run(self: object, pages_: object, offsets: object, marks_: list[int] = ()) -> object:  # type: ignore[assignment]
            marks.append(list(marks_))
            return real_run(self, pages_, offsets, marks_)  # type: ignore[arg-type]

        monkeypatch.setattr(kvstore_kernels.Prepared, "run", run)
        local = client._conn.local
        assert local is not None
        real_send, checked = local.send, list[int]()

        def send(method: str, request: object) -> None:
            if method == "Commit":
                offsets = list(replies[-1].offsets)  # type: ignore[attr-defined]
                arena = client.arena
                assert arena is not None
                upto = sum(checked) + request.commit_count  # type: ignore[attr-defined]
                for page in range(upto):
                    got = arena[offsets[page] : offsets[page] + page_bytes]
                    assert torch.equal(got, pages[page * page_bytes : (page + 1) * page_bytes]), page
                checked.append(request.commit_count)  # type: ignore[attr-defined]
            real_send(method, request)

        monkeypatch.setattr(local, "send", send)
        torch.cuda.synchronize()
        with torch.cuda.stream(staged._copy_stream(source[0].device, True, 0)):
            torch.cuda._sleep(60_000_000)
        if asked:
            handle = client.store_async(tokens, source, blocks)
            deadline = time.monotonic() + 120
            while len(checked) < 3 and time.monotonic() < deadline:
                handle.progress()
            assert checked == [2, 2, 2]  # each sent once its part's bytes were in the arena
            assert handle.wait() == 8
        else:
            assert client.store(tokens, source, blocks) == 8
        assert marks == [[2, 4, 6]] and checked == [2, 2, 2]
    with KVStoreClient.connect(daemon.address, spec) as other:
        target = cuda_cache(spec, 256, fill=-3.0)
        target_blocks = torch.randperm(256)[:128]
        assert other.load(tokens, target, target_blocks) == 2048
        assert torch.equal(
            blocks_of(target, target_blocks, "flash_attn"), blocks_of(source, blocks, "flash_attn")
        )
