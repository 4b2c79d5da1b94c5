"""Pushed hand-overs on GPUs (skipped without CUDA): a receiver sets blocks of its cache aside
(`KVStoreClient.expect`), a sender process pushes its prompt's KV into them (`deliver`), on one GPU
and from one GPU to another over peer access. Every delivery is compared byte for byte with the
sender's cache, into a poisoned cache whose other blocks must stay poisoned; a receipt of another
prompt moves only the shared prefix; a sender killed with its copy queued delivers nothing and
frees the blocks only once it is gone; the daemon is not needed. The protocol alone is
`test_inbox.py`."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvstore_client import KVStoreClient
from tests.harness import Daemon
from tests.test_lends_cuda import BLOCKS, LENDER_TABLE, READER_TABLE, SPEC, TOKENS, devices_pairs, seeded

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPT = list(range(TOKENS))


def _sender(address: str, device: int, commands: Any, out: Any) -> None:
    """Delivers receipts from blocks LENDER_TABLE of a seeded cache on GPU `device`, as told:
    ("deliver", receipt, tokens, stall): `stall` queues a long sleep on the stream first, and the
    delivery is not waited for; "die"; anything else ends it."""
    try:
        torch.cuda.set_device(device)
        with KVStoreClient.connect(address, SPEC, name="sender") as client:
            cache = client.register_kv_caches(seeded(torch.device("cuda", device), seed=11))
            out.put(("ready",))
            while True:
                command = commands.get(timeout=120)
                if command[0] == "deliver":
                    _, receipt, tokens, stall = command
                    if stall:
                        torch.cuda._sleep(1 << 33)  # seconds of GPU time ahead of the copy
                    delivery = client.deliver(receipt, tokens, cache, LENDER_TABLE)
                    out.put(("sent", delivery.tokens if stall else delivery.wait()))
                elif command[0] == "die":
                    os.kill(os.getpid(), signal.SIGKILL)
                else:
                    break
        out.put(("closed",))
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put(("error", traceback.format_exc()))


class Sender:
    def __init__(self, address: str, device: int) -> None:
        context = mp.get_context("spawn")
        self.commands, self.out = context.Queue(), context.Queue()
        self.process = context.Process(target=_sender, args=(address, device, self.commands, self.out))
        self.process.start()
        assert self.get() == ("ready",)

    def get(self) -> Any:
        message = self.out.get(timeout=120)
        assert message[0] != "error", message[1]
        return message

    def deliver(self, receipt: bytes, tokens: list[int] = PROMPT, stall: bool = False) -> int:
        self.commands.put(("deliver", receipt, tokens, stall))
        message = self.get()
        assert message[0] == "sent", message
        return int(message[1])

    def kill(self) -> None:
        self.commands.put(("die",))
        self.process.join(60)
        assert self.process.exitcode == -signal.SIGKILL

    def close(self) -> None:
        if self.process.is_alive():
            self.commands.put(("stop",))
            self.process.join(60)


@pytest.fixture
def senders() -> Iterator[Callable[..., Sender]]:
    started: list[Sender] = []

    def start(address: str, device: int) -> Sender:
        started.append(Sender(address, device))
        return started[-1]

    yield start
    for sender in started:
        sender.close()


def landed(target: list[torch.Tensor], chunks: int) -> bool:
    """The first `chunks` chunks of the prompt are the sender's bytes, every other block poison."""
    sent = seeded(torch.device("cpu"), seed=11)
    moved = chunks * SPEC.blocks_per_chunk
    ours, theirs = READER_TABLE[:moved], LENDER_TABLE[:moved]
    rest = [b for b in range(BLOCKS) if b not in ours]
    return all(
        torch.equal(t[:, ours].cpu().view(torch.uint8), s[:, theirs].view(torch.uint8))
        and bool((t[:, rest].view(torch.uint8) == 0xA5).all())
        for t, s in zip(target, sent, strict=True)
    )


@pytest.mark.parametrize(("sender_gpu", "receiver_gpu"), devices_pairs())
def test_a_pushed_prompt_lands_byte_for_byte_once(
    daemon: Daemon, senders: Callable[..., Sender], sender_gpu: int, receiver_gpu: int
) -> None:
    sender = senders(daemon.address, sender_gpu)
    device = torch.device("cuda", receiver_gpu)
    with torch.cuda.device(device), KVStoreClient.connect(daemon.address, SPEC, name="receiver") as client:
        target = client.register_kv_caches(seeded(device, seed=None))
        receiving = client.expect(PROMPT, target, READER_TABLE)
        assert receiving.poll() is None
        assert sender.deliver(receiving.receipt) == TOKENS
        assert receiving.wait(timeout_s=60) == TOKENS
        torch.cuda.synchronize(device)
        assert landed(list(target), TOKENS // 256)
        assert sender.deliver(receiving.receipt) == 0  # a receipt is delivered once
        assert receiving.cancel() is False


@pytest.mark.parametrize(("sender_gpu", "receiver_gpu"), devices_pairs())
def test_a_receipt_of_another_prompt_moves_only_the_shared_prefix(
    daemon: Daemon, senders: Callable[..., Sender], sender_gpu: int, receiver_gpu: int
) -> None:
    sender = senders(daemon.address, sender_gpu)
    device = torch.device("cuda", receiver_gpu)
    with torch.cuda.device(device), KVStoreClient.connect(daemon.address, SPEC) as client:
        target = seeded(device, seed=None)
        other = PROMPT[:512] + [t + 1 for t in PROMPT[512:]]  # two chunks alike, then not
        receiving = client.expect(other, target, READER_TABLE)
        assert sender.deliver(receiving.receipt) == 512
        assert receiving.wait(timeout_s=60) == 512
        torch.cuda.synchronize(device)
        assert landed(target, 2)
        unrelated = seeded(device, seed=None)
        nothing = client.expect([t + 7 for t in PROMPT], unrelated, READER_TABLE)
        assert sender.deliver(nothing.receipt) == 0
        assert nothing.wait(timeout_s=60) == 0
        assert all(bool((layer.view(torch.uint8) == 0xA5).all()) for layer in unrelated)


@pytest.mark.parametrize(("sender_gpu", "receiver_gpu"), devices_pairs())
def test_a_sender_killed_with_its_copy_queued_delivers_nothing(
    daemon: Daemon, senders: Callable[..., Sender], sender_gpu: int, receiver_gpu: int
) -> None:
    sender = senders(daemon.address, sender_gpu)
    device = torch.device("cuda", receiver_gpu)
    with torch.cuda.device(device), KVStoreClient.connect(daemon.address, SPEC) as client:
        target = seeded(device, seed=None)
        first = client.expect(PROMPT, target, READER_TABLE)  # the sender opens this cache (once)
        assert sender.deliver(first.receipt) == TOKENS and first.wait(timeout_s=60) == TOKENS
        for layer in target:
            layer.view(torch.uint8).fill_(0xA5)
        torch.cuda.synchronize(device)
        receiving = client.expect(PROMPT, target, READER_TABLE)
        assert sender.deliver(receiving.receipt, stall=True) == TOKENS  # claimed, queued, not run
        assert receiving.wait(timeout_s=0.2) is None
        assert receiving.cancel() is False  # the sender lives: its copy may still land
        sender.kill()
        assert receiving.cancel() is True  # gone, and its copy with it
        assert receiving.poll() is None
        torch.cuda.synchronize(device)
        assert all(bool((layer.view(torch.uint8) == 0xA5).all()) for layer in target)


def test_a_hand_over_needs_no_daemon(daemon: Daemon, senders: Callable[..., Sender]) -> None:
    pairs = devices_pairs()
    sender_gpu, receiver_gpu = pairs[-1]
    sender = senders(daemon.address, sender_gpu)
    device = torch.device("cuda", receiver_gpu)
    with torch.cuda.device(device), KVStoreClient.connect(daemon.address, SPEC) as client:
        assert daemon.stop() == 0
        target = seeded(device, seed=None)
        receiving = client.expect(PROMPT, target, READER_TABLE)
        started = time.monotonic()
        assert sender.deliver(receiving.receipt) == TOKENS
        assert receiving.wait(timeout_s=60) == TOKENS
        assert time.monotonic() - started < 30  # no daemon timeout on the path
        torch.cuda.synchronize(device)
        assert landed(target, TOKENS // 256)


def test_a_receipt_refused_by_name(daemon: Daemon, senders: Callable[..., Sender]) -> None:
    device = torch.device("cuda", 0)
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        cache = seeded(device, seed=11)
        with pytest.raises(ValueError, match="not a kvstore receipt"):
            client.deliver(b"KVXX" + bytes(100), PROMPT, cache, LENDER_TABLE)
        with pytest.raises(ValueError, match="no whole chunk"):
            client.expect(PROMPT[:100], cache, READER_TABLE)
        target = seeded(device, seed=None)
        receiving = client.expect(PROMPT, target, READER_TABLE)
        with pytest.raises(ValueError, match="cannot be opened here"):  # its own export
            client.deliver(receiving.receipt, PROMPT, cache, LENDER_TABLE)
        assert receiving.cancel() is True  # nothing was claimed
        assert senders(daemon.address, 0).deliver(receiving.receipt) == 0  # cancelled: nothing sent
        torch.cuda.synchronize(device)
        assert all(bool((layer.view(torch.uint8) == 0xA5).all()) for layer in target)
