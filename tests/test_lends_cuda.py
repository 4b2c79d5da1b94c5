"""Lent blocks on GPUs (skipped without CUDA): a lender process lends its KV-cache blocks
(`KVStoreClient.lend`) and a reader process's load copies them into its own cache device to
device, on one GPU and from one GPU to another over peer access, against a real kvstored. Every
load is compared byte for byte with the lender's cache, into a poisoned cache; a lender killed
before or during the read, and a daemon restarted, hand over nothing (0 tokens, the poison
intact or the copy disowned), never wrong bytes. The protocol alone is `test_lends.py`."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.keys import pack_keys
from kvstore_client import KVSpec, KVStoreClient
from tests.harness import Daemon

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SPEC = KVSpec(
    model="lend-cuda",
    num_layers=4,
    num_kv_heads=2,
    head_dim=64,
    dtype=torch.bfloat16,
    block_size=16,
    chunk_tokens=256,
)
TOKENS = 1024
BLOCKS = 2 * TOKENS // 16  # room for the prompt at blocks other than 0..63


def seeded(device: torch.device, seed: int | None, blocks: int = BLOCKS) -> list[torch.Tensor]:
    """A flash_attn cache of `blocks` blocks: bytes of a seeded CPU generator (alike in every
    process), or the poison 0xA5 (`seed` None)."""
    shape = (2, blocks, 16, 2, 128)  # bytes: 64 bf16 a head
    if seed is None:
        return [
            torch.full(shape, 0xA5, dtype=torch.uint8, device=device).view(torch.bfloat16) for _ in range(4)
        ]
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device).view(torch.bfloat16)
        for _ in range(4)
    ]


LENDER_TABLE = list(range(BLOCKS - 1, BLOCKS - 1 - TOKENS // 16, -1))  # descending, from the end
RUNNING_TABLE = list(range(BLOCKS - TOKENS // 16, BLOCKS))  # consecutive, as READER_TABLE
READER_TABLE = list(range(3, 3 + TOKENS // 16))


def _lender(address: str, device: int, commands: Any, out: Any, table: list[int]) -> None:
    """Lends the prompt from blocks `table` on GPU `device`, then does as told: "done" (poll
    lends_done), "lend" (again, with a ticket), "die"."""
    try:
        torch.cuda.set_device(device)
        with KVStoreClient.connect(address, SPEC, name="lender") as client:
            cache = seeded(torch.device("cuda", device), seed=11)
            lend_id, tokens = client.lend(list(range(TOKENS)), cache, table)
            out.put(("lent", lend_id, tokens))
            while True:
                command = commands.get(timeout=120)
                if command == "done":
                    out.put(("done", client.lends_done([lend_id])))
                elif command == "lend":  # again, the ticket sent while the daemon records it
                    tell = functools.partial(_tell, out)
                    lend_id, tokens = client.lend(list(range(TOKENS)), cache, table, meanwhile=tell)
                    out.put(("lent", lend_id, tokens))
                elif command == "die":
                    os.kill(os.getpid(), signal.SIGKILL)
                else:
                    break
        out.put(("closed",))
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put(("error", traceback.format_exc()))


def _tell(out: Any, ticket: bytes) -> None:
    out.put(("ticket", ticket))


class Lender:
    def __init__(self, address: str, device: int, table: list[int]) -> None:
        context = mp.get_context("spawn")
        self.commands, self.out = context.Queue(), context.Queue()
        self.process = context.Process(target=_lender, args=(address, device, self.commands, self.out, table))
        self.process.start()
        message = self.get()
        assert message[0] == "lent" and message[2] == TOKENS, message
        self.lend_id = message[1]

    def get(self) -> Any:
        message = self.out.get(timeout=120)
        assert message[0] != "error", message[1]
        return message

    def done(self) -> list[int]:
        self.commands.put("done")
        return self.get()[1]

    def lend(self) -> tuple[int, bytes]:
        """Lends the prompt again: (lend id, the ticket it handed over meanwhile)."""
        self.commands.put("lend")
        ticket = self.get()
        assert ticket[0] == "ticket", ticket
        lent = self.get()
        assert lent[0] == "lent" and lent[2] == TOKENS, lent
        self.lend_id = lent[1]
        return lent[1], ticket[1]

    def kill(self) -> None:
        self.commands.put("die")
        self.process.join(timeout=60)  # reaped: its pid names no process now
        assert self.process.exitcode == -signal.SIGKILL

    def close(self) -> None:
        if self.process.is_alive():
            self.commands.put("exit")
            self.process.join(timeout=60)


@pytest.fixture
def lenders() -> Iterator[Callable[..., Lender]]:
    started: list[Lender] = []

    def start(address: str, device: int, table: list[int] = LENDER_TABLE) -> Lender:
        started.append(Lender(address, device, table))
        return started[-1]

    yield start
    for lender in started:
        lender.close()


def devices_pairs() -> list[tuple[int, int]]:
    if not torch.cuda.is_available():
        return []
    pairs = [(0, 0)]
    if torch.cuda.device_count() > 1 and torch.cuda.can_device_access_peer(1, 0):
        pairs.append((0, 1))
    return pairs


def same_prompt(
    reader: list[torch.Tensor], lender: list[torch.Tensor], table: list[int] = LENDER_TABLE
) -> bool:
    return all(
        torch.equal(r[:, READER_TABLE].cpu().view(torch.uint8), w[:, table].cpu().view(torch.uint8))
        for r, w in zip(reader, lender, strict=True)
    )


@pytest.mark.parametrize(("lender_gpu", "reader_gpu"), devices_pairs())
def test_lent_blocks_land_byte_for_byte(
    daemon: Daemon, lenders: Callable[..., Lender], lender_gpu: int, reader_gpu: int
) -> None:
    lender = lenders(daemon.address, lender_gpu)
    device = torch.device("cuda", reader_gpu)
    with torch.cuda.device(device), KVStoreClient.connect(daemon.address, SPEC, name="reader") as reader:
        target = seeded(device, seed=None)
        assert reader.load(list(range(TOKENS)), target, READER_TABLE) == TOKENS
        assert same_prompt(target, seeded(torch.device("cpu"), seed=11))
        untouched = [b for b in range(BLOCKS) if b not in READER_TABLE]
        assert all(bool((layer[:, untouched].view(torch.uint8) == 0xA5).all()) for layer in target)
        assert reader.stats()["counters"]["lent_reads_returned"] == 1
        assert lender.done() == [lender.lend_id]
        again = seeded(device, seed=None)
        assert (
            reader.load(list(range(TOKENS)), again, READER_TABLE) == 0
        )  # read once, then the blocks are the lender's


@pytest.mark.parametrize(("lender_gpu", "reader_gpu"), devices_pairs())
def test_a_lender_killed_before_the_read_hands_over_nothing(
    daemon: Daemon, lenders: Callable[..., Lender], lender_gpu: int, reader_gpu: int
) -> None:
    lender = lenders(daemon.address, lender_gpu)
    lender.kill()
    device = torch.device("cuda", reader_gpu)
    with torch.cuda.device(device), KVStoreClient.connect(daemon.address, SPEC) as reader:
        target = seeded(device, seed=None)
        assert reader.load(list(range(TOKENS)), target, READER_TABLE) == 0
        assert all(bool((layer.view(torch.uint8) == 0xA5).all()) for layer in target)


@pytest.mark.parametrize("in_place", [True, False], ids=["read slot", "Returned"])
@pytest.mark.parametrize(("lender_gpu", "reader_gpu"), devices_pairs())
def test_a_lender_killed_during_the_read_disowns_the_copy(
    daemon: Daemon, lenders: Callable[..., Lender], lender_gpu: int, reader_gpu: int, in_place: bool
) -> None:
    """The read is taken, the lender dies and is reaped, then the copy runs from the dead
    process's memory (still mapped here): it must neither crash nor count, whether the reader
    learns it from its read slot or from Returned's answer."""
    lender = lenders(daemon.address, lender_gpu)
    device = torch.device("cuda", reader_gpu)
    with torch.cuda.device(device), KVStoreClient.connect(daemon.address, SPEC) as reader:
        keys = reader.keys(list(range(TOKENS)))
        request = pb.LookupRequest(
            namespace=reader.namespace,
            keys=pack_keys(keys),
            lease=True,
            lent_devices=reader._lends.devices(device),
            read_slots=in_place,
        )
        fds: list[int] = []
        asked = time.monotonic()
        reply = reader._conn.rpc("Lookup", request, fds=fds)
        reader._lends.take_slots(fds)
        assert reply.HasField("lent") and reply.hit_chunks == len(keys)
        assert bool(reply.lent.slot) == in_place
        target = seeded(device, seed=None)
        reader._link.lent.open(
            SPEC, reply.lent.cache, reply.lent.device_pci_bus_id, device, target
        )  # mapped here: the copy may start
        lender.kill()
        query = pb.LookupRequest(namespace=reader.namespace, keys=pack_keys(keys), lent_devices=["*"])
        deadline = time.monotonic() + 30
        while reader._conn.rpc("Lookup", query).hit_chunks:  # the daemon saw the lender go
            assert time.monotonic() < deadline
            time.sleep(0.01)
        handle = reader._lends.read(
            reply, None, target, READER_TABLE, range(4), None, reader._link.lent, asked
        )
        assert handle is not None and handle.wait() == 0
        torch.cuda.synchronize(device)
        assert reader.load(list(range(TOKENS)), seeded(device, seed=None), READER_TABLE) == 0


def test_a_restarted_daemon_knows_no_lend(
    daemon_factory: Callable[..., Daemon], lenders: Callable[..., Lender]
) -> None:
    daemon = daemon_factory("lends")
    lender = lenders(daemon.address, 0)
    assert daemon.stop() == 0
    daemon = daemon_factory("lends")
    device = torch.device("cuda", 0)
    with KVStoreClient.connect(daemon.address, SPEC) as reader:
        target = seeded(device, seed=None)
        assert reader.load(list(range(TOKENS)), target, READER_TABLE) == 0
        assert all(bool((layer.view(torch.uint8) == 0xA5).all()) for layer in target)
    deadline = time.monotonic() + 30
    while lender.done() != [lender.lend_id]:  # the lender's client connects again, then learns
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_read_past_its_ttl_on_the_readers_clock_counts_nothing(
    daemon: Daemon, lenders: Callable[..., Lender]
) -> None:
    """The slot still holds the read (the daemon ends lapsed reads lazily), but the reader's own
    clock says its TTL is over: a lender that gave up waiting may have reused the blocks."""
    lenders(daemon.address, 0)
    device = torch.device("cuda", 0)
    with torch.cuda.device(device), KVStoreClient.connect(daemon.address, SPEC) as reader:
        keys = reader.keys(list(range(TOKENS)))
        request = pb.LookupRequest(
            namespace=reader.namespace,
            keys=pack_keys(keys),
            lease=True,
            lent_devices=reader._lends.devices(device),
            read_slots=True,
        )
        fds: list[int] = []
        reply = reader._conn.rpc("Lookup", request, fds=fds)
        reader._lends.take_slots(fds)
        assert reply.lent.slot and reader._conn.local.holds(reply.lent.slot - 1, reply.lent.read_id)
        asked = time.monotonic() - reply.lent.ttl_ms / 1000  # as if asked a TTL ago
        target = seeded(device, seed=None)
        handle = reader._lends.read(
            reply, None, target, READER_TABLE, range(4), None, reader._link.lent, asked
        )
        assert handle is not None and handle.wait() == 0


@pytest.mark.parametrize(("lender_gpu", "reader_gpu"), devices_pairs())
def test_a_ticket_is_copied_before_the_daemon_answers_and_counts_only_its_lend(
    daemon: Daemon, lenders: Callable[..., Lender], lender_gpu: int, reader_gpu: int
) -> None:
    """A reader given the lender's ticket copies at once and counts the copy once the daemon's
    answer shows a read of that very lend that held: byte for byte; a ticket whose blocks are not
    the lend's, whose lend is over, or that names an earlier lend of the same blocks, counts 0."""
    lender = lenders(daemon.address, lender_gpu)
    device = torch.device("cuda", reader_gpu)
    prompt = list(range(TOKENS))
    with torch.cuda.device(device), KVStoreClient.connect(daemon.address, SPEC, name="reader") as reader:
        assert reader.load(prompt, seeded(device, seed=None), READER_TABLE) == TOKENS  # its read slots come
        _, ticket = lender.lend()
        target = seeded(device, seed=None)
        assert reader.load_async(prompt, target, READER_TABLE, lent=ticket).wait() == TOKENS
        assert same_prompt(target, seeded(torch.device("cpu"), seed=11))
        assert lender.done() == [lender.lend_id]
        assert reader.load_async(prompt, seeded(device, seed=None), READER_TABLE, lent=ticket).wait() == 0

        lend_id, ticket = lender.lend()
        forged = pb.LentRead.FromString(ticket)
        forged.blocks = (5).to_bytes(4, "little") + forged.blocks[4:]  # one block another than lent
        assert (
            reader.load_async(
                prompt, seeded(device, seed=None), READER_TABLE, lent=forged.SerializeToString()
            ).wait()
            == 0
        )
        assert lender.done() == []  # given back unused: the lend still waits for its reader
        target = seeded(device, seed=None)
        assert reader.load_async(prompt, target, READER_TABLE, lent=ticket).wait() == TOKENS
        assert same_prompt(target, seeded(torch.device("cpu"), seed=11))

        _, fresh = lender.lend()  # the same blocks lent again: the old ticket names an earlier lend
        assert reader.load_async(prompt, seeded(device, seed=None), READER_TABLE, lent=ticket).wait() == 0
        target = seeded(device, seed=None)
        assert reader.load_async(prompt, target, READER_TABLE, lent=fresh).wait() == TOKENS
        assert same_prompt(target, seeded(torch.device("cpu"), seed=11))
        with pytest.raises(ValueError, match="ticket"):
            reader.load_async(prompt, target, READER_TABLE, lent=b"\xff not a ticket")


@pytest.mark.skipif(len(devices_pairs()) < 2, reason="needs two GPUs with peer access")
def test_a_read_from_another_gpu_goes_by_the_copy_engines_where_the_blocks_run_on(
    daemon: Daemon, lenders: Callable[..., Lender], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lender's cache is another GPU's memory, though opened as tensors on the reader's GPU:
    where the block ids run on consecutively on both sides, the read is a copy between GPUs by the
    copy engines (one batch call, no kernel), keyed and from a ticket, byte for byte, the blocks
    around the prompt's untouched."""
    from kvstore_kernels import block_engines, blocks

    monkeypatch.setattr(block_engines, "MIN_PIECE_BYTES", 0)  # this small cache's pieces: 256 KiB
    ways: list[bool] = []
    engines = blocks.copy_by_engines
    monkeypatch.setattr(blocks, "copy_by_engines", lambda *args: ways.append(engines(*args)) or ways[-1])
    lender = lenders(daemon.address, 0, RUNNING_TABLE)
    device, prompt = torch.device("cuda", 1), list(range(TOKENS))
    untouched = [b for b in range(BLOCKS) if b not in READER_TABLE]
    with torch.cuda.device(device), KVStoreClient.connect(daemon.address, SPEC, name="reader") as reader:
        target = seeded(device, seed=None)
        assert reader.load(prompt, target, READER_TABLE) == TOKENS
        assert same_prompt(target, seeded(torch.device("cpu"), seed=11), RUNNING_TABLE)
        assert all(bool((layer[:, untouched].view(torch.uint8) == 0xA5).all()) for layer in target)
        _, ticket = lender.lend()
        target = seeded(device, seed=None)
        assert reader.load_async(prompt, target, READER_TABLE, lent=ticket).wait() == TOKENS
        assert same_prompt(target, seeded(torch.device("cpu"), seed=11), RUNNING_TABLE)
        assert all(bool((layer[:, untouched].view(torch.uint8) == 0xA5).all()) for layer in target)
    assert ways == [True, True]
