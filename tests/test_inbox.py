"""The protocol of pushed hand-overs on the CPU (`kvstore_client.inbox`, `deliveries.Receipt`,
`Receiving`): claims, cancels and deliveries between real processes sharing one inbox, a sender
that dies with its claim, receipts that are not, or are no longer, the slot's. The copies
themselves run on GPUs: tests/test_deliveries_cuda.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from typing import Any

import pytest

from kvstore.shared.keys import KEY_BYTES
from kvstore_client import inbox as inboxes
from kvstore_client.deliveries import Receipt, Receiving
from tests.harness import Daemon

CONTEXT = mp.get_context("spawn")
KEYS = [bytes([i]) * KEY_BYTES for i in range(3)]


def _sender(address: Any, slot: int, nonce: int, receipt: bytes, done: int | None, pipe: Any) -> None:
    """Claims `slot` of the inbox at `address` for `receipt`; writes `done` into it from the host
    (where not None); reports whether the claim held, then does as told: "again" (claim the same
    receipt again), "forged" (open the same inbox by a forged id), "finish" (end the claim),
    "claim" (a new receipt: (slot, nonce, receipt)), "exit"."""
    boxes = inboxes.Inboxes()
    try:
        opened = boxes.claim(address, slot, nonce, receipt)
    except (OSError, ValueError) as exc:
        pipe.send(repr(exc))
        return
    if opened is not None and done is not None:
        opened.words[slot, inboxes.DONE] = done
    pipe.send(opened is not None)
    while (command := pipe.recv()) != "exit":
        if command == "again":
            pipe.send(boxes.claim(address, slot, nonce, receipt) is not None)
        elif command == "forged":
            pid, fd, inode, _ = address
            try:
                boxes.claim((pid, fd, inode, bytes(16)), slot, nonce, receipt)
            except ValueError as exc:
                pipe.send(repr(exc))
        elif command == "finish":
            assert opened is not None
            inboxes.Inboxes.finished(opened, slot)
            pipe.send(True)
        else:
            slot, nonce, receipt = command
            pipe.send(boxes.claim(address, slot, nonce, receipt) is not None)


class Sender:
    """A sender process that claims a slot and stays alive until stopped."""

    def __init__(self, address: Any, slot: int, nonce: int, receipt: bytes, done: int | None = None) -> None:
        self.pipe, theirs = CONTEXT.Pipe()
        args = (address, slot, nonce, receipt, done, theirs)
        self.process = CONTEXT.Process(target=_sender, args=args)
        self.process.start()
        self.claimed = self.answer()

    def answer(self) -> Any:
        assert self.pipe.poll(60), "the sender did not answer"
        return self.pipe.recv()

    def ask(self, command: Any) -> Any:
        self.pipe.send(command)
        return self.answer()

    def stop(self, kill: bool = False) -> None:
        if kill:
            os.kill(self.process.pid, signal.SIGKILL)
        elif self.process.is_alive():
            self.pipe.send("exit")
        self.process.join(60)
        assert self.process.exitcode is not None


def claiming(pending: Receiving, done: int | None = None, **changes: Any) -> Sender:
    """A sender claiming `pending`'s receipt (with `changes` to what it names)."""
    got = Receipt(pending.receipt)
    address = changes.get("address", got.inbox)
    return Sender(
        address, changes.get("slot", got.slot), changes.get("nonce", got.nonce), pending.receipt, done
    )


def receiving(box: inboxes.Inbox, chunks: int = 3, nonce: int = 0x1234_5678_9ABC | 1) -> Receiving:
    def make(slot: int) -> bytes:
        return Receipt.make(
            nonce, box.address(), slot, KEYS[:chunks], list(range(chunks * 2)), "0000:01:00.0", b"{}"
        )

    slot, receipt = box.post(nonce, make)
    return Receiving(box, slot, nonce, chunks, [n * 256 for n in range(chunks + 1)], receipt)


def test_a_receipt_reads_back_exactly_and_bytes_that_are_not_one_are_refused() -> None:
    box = inboxes.Inbox()
    got = Receipt(receiving(box).receipt)
    assert (got.nonce, got.slot, got.chunks, got.per_chunk) == (0x1234_5678_9ABC | 1, got.slot, 3, 2)
    assert got.inbox == box.address() and got.keys == b"".join(KEYS) and got.blocks.tolist() == list(range(6))
    assert (got.bus, got.descriptor) == ("0000:01:00.0", b"{}")
    good = receiving(box).receipt
    for bad, match in (
        (good[:20], "too short"),
        (b"XXXX" + good[4:], "not a kvstore receipt"),
        (good + b"x", "do not add up"),
        (good[:-1], "do not add up"),
    ):
        with pytest.raises(ValueError, match=match):
            Receipt(bad)


def test_a_slot_is_claimed_once_and_its_delivery_counts_only_its_chunks() -> None:
    box = inboxes.Inbox()
    pending = receiving(box)
    got = Receipt(pending.receipt)
    assert pending.poll() is None and pending.wait(timeout_s=0.01) is None
    first = claiming(pending, done=got.nonce + 2)
    second = claiming(pending)  # the same receipt again, from another process
    wrong = claiming(pending, nonce=got.nonce + 2)  # another nonce
    try:
        assert (first.claimed, second.claimed, wrong.claimed) == (True, False, False)
        assert pending.wait(timeout_s=30) == 512  # two chunks of 256 tokens
        assert pending.cancel() is False  # landed: nothing to give up
    finally:
        for sender in (first, second, wrong):
            sender.stop()


def test_a_receipt_altered_on_its_way_is_not_claimed() -> None:
    box = inboxes.Inbox()
    pending = receiving(box)
    got = Receipt(pending.receipt)
    at = pending.receipt.index(KEYS[1])
    altered = pending.receipt[:at] + bytes(KEY_BYTES) + pending.receipt[at + KEY_BYTES :]  # another prompt
    sender = Sender(got.inbox, got.slot, got.nonce, altered, done=got.nonce + 3)
    try:
        assert sender.claimed is False and pending.poll() is None
        assert pending.cancel() is True  # nobody claimed it
    finally:
        sender.stop()


def test_a_done_word_out_of_range_or_of_another_nonce_counts_nothing() -> None:
    box = inboxes.Inbox()
    pending = receiving(box, chunks=2)
    got = Receipt(pending.receipt)
    sender = claiming(pending, done=got.nonce + 3)  # more chunks than asked for
    try:
        assert sender.claimed is True and pending.poll() is None
        assert box.delivered(got.slot, got.nonce + 1, 2) is None
    finally:
        sender.stop()


def test_a_receipt_cancelled_before_a_claim_frees_its_blocks_and_cannot_be_claimed_after() -> None:
    box = inboxes.Inbox()
    pending = receiving(box)
    got = Receipt(pending.receipt)
    assert pending.cancel() is True
    late = claiming(pending, done=got.nonce + 3)
    try:
        assert late.claimed is False and pending.poll() is None
        assert box.delivered(got.slot, got.nonce, 3) is None  # the slot's nonce is cleared
    finally:
        late.stop()


def test_blocks_claimed_by_a_live_sender_stay_held_until_it_is_gone() -> None:
    box = inboxes.Inbox()
    pending = receiving(box)
    got = Receipt(pending.receipt)
    sender = claiming(pending)  # claims, never writes done
    assert sender.claimed is True
    try:
        assert pending.cancel() is False  # its copy may still land
        assert pending.wait(timeout_s=0.01) is None
    finally:
        sender.stop(kill=True)
    assert pending.cancel() is True  # its process (and any copy of it) is gone
    assert pending.poll() is None
    again = receiving(box)  # the slot is free for another receipt
    assert Receipt(again.receipt).slot == got.slot


def test_a_sender_that_exits_cleanly_without_delivering_frees_the_blocks_too() -> None:
    box = inboxes.Inbox()
    pending = receiving(box)
    sender = claiming(pending)
    assert pending.cancel() is False
    sender.stop()
    assert pending.cancel() is True


def test_a_sender_keeps_its_claim_through_a_refused_retry_and_a_forged_open() -> None:
    """A refused claim of the same receipt, and an open of the same inbox by a forged id (closed
    again at once), leave the first claim's liveness lock in place."""
    box = inboxes.Inbox()
    pending = receiving(box)
    sender = claiming(pending)
    try:
        assert sender.claimed is True
        assert sender.ask("again") is False
        assert pending.cancel() is False
        assert "not the receipt's inbox" in sender.ask("forged")
        assert pending.cancel() is False  # still claimed by a live sender
        assert sender.ask("finish") is True
        assert pending.cancel() is True  # its claim is over and nothing landed
    finally:
        sender.stop()


def test_ending_an_earlier_claim_of_a_slot_keeps_a_later_one_alive() -> None:
    box = inboxes.Inbox()
    first = receiving(box, nonce=0x1111 | 1)
    got = Receipt(first.receipt)
    sender = claiming(first, done=got.nonce + 3)
    try:
        assert first.wait(timeout_s=30) == 768  # read: the slot is released
        second = receiving(box, nonce=0x2222 | 1)
        assert Receipt(second.receipt).slot == got.slot  # the same slot, posted again
        assert sender.ask((got.slot, 0x2222 | 1, second.receipt)) is True
        assert sender.ask("finish") is True  # the first claim ends; the second runs on
        assert second.cancel() is False
    finally:
        sender.stop()
    assert second.cancel() is True


def test_an_inbox_of_another_identity_is_refused() -> None:
    box = inboxes.Inbox()
    pending = receiving(box)
    got = Receipt(pending.receipt)
    pid, fd, inode, inbox_id = got.inbox
    for address, match in (
        ((pid, fd, inode + 1, inbox_id), "not the receipt's inbox"),
        ((pid, fd, inode, bytes(16)), "not the receipt's inbox"),
        ((pid, 0, inode, inbox_id), "not the receipt's inbox"),  # stdin: not the memfd
        ((2**31 - 1, fd, inode, inbox_id), "No such file"),
    ):
        sender = claiming(pending, address=address)
        try:
            assert isinstance(sender.claimed, str) and match in sender.claimed, sender.claimed
        finally:
            sender.stop()
    with pytest.raises(ValueError, match="outside the inbox"):
        inboxes.Inboxes().claim(got.inbox, inboxes.SLOTS, got.nonce, pending.receipt)
    assert pending.cancel() is True


def test_an_inbox_with_every_slot_awaiting_a_sender_refuses_another_receipt() -> None:
    box = inboxes.Inbox()
    held = [box.post(n + 1, lambda slot: b"r%d" % slot)[0] for n in range(inboxes.SLOTS)]
    assert sorted(held) == list(range(inboxes.SLOTS))
    with pytest.raises(inboxes.InboxFull, match="await their senders"):
        box.post(7, lambda slot: b"r")
    assert box.cancel(held[5], 6, 1) is True
    assert box.post(7, lambda slot: b"r")[0] == held[5]
    assert box.cancel(held[6], 7, 1) is True
    with pytest.raises(ZeroDivisionError):  # a receipt that cannot be made leaves the slot free
        box.post(8, lambda slot: bytes(1 // 0))
    assert box.post(9, lambda slot: b"r")[0] == held[6]


def test_a_delivery_that_lands_as_the_receipt_is_given_up_still_counts() -> None:
    box = inboxes.Inbox()
    pending = receiving(box)
    got = Receipt(pending.receipt)
    sender = claiming(pending, done=got.nonce + 3)
    try:
        assert box.cancel(got.slot, got.nonce, 3) is False  # landed: not freed by the cancel
        assert pending.cancel() is False and pending.wait(timeout_s=0) == 768
        assert pending.cancel() is False
    finally:
        sender.stop()
    again = receiving(box)  # the slot was released once its delivery was read
    assert Receipt(again.receipt).slot == got.slot


def test_receipts_with_bytes_changed_at_random_are_refused_or_read_within_their_length() -> None:
    """Any bytes: a ValueError, or a receipt whose parts are all within the bytes given."""
    import random

    good = receiving(inboxes.Inbox()).receipt
    rng = random.Random(7)
    for _ in range(3000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.2:
            data = data[: rng.randrange(len(data) + 1)]
        try:
            got = Receipt(bytes(data))
        except ValueError:
            continue
        assert len(got.keys) == got.chunks * KEY_BYTES and got.blocks.size == got.chunks * got.per_chunk
        assert len(got.raw) == len(data) and 0 < got.per_chunk <= 4096


def test_a_cache_off_the_gpu_and_a_receipt_of_another_geometry_are_refused_by_name(daemon: Daemon) -> None:
    import torch

    from kvstore_client import KVStoreClient
    from tests.test_lends import SPEC

    cache = [torch.zeros((2, 64, 16, SPEC.num_kv_heads, SPEC.head_dim), dtype=torch.float16)]
    with KVStoreClient.connect(daemon.address, SPEC) as client:
        with pytest.raises(ValueError, match="expect: the KV cache must be on a CUDA device"):
            client.expect(list(range(256)), cache, list(range(16)))
        pending = receiving(inboxes.Inbox())  # 2 blocks a chunk: this spec's are 16
        with pytest.raises(ValueError, match="receipt: 2 blocks a chunk"):
            client.deliver(pending.receipt, list(range(768)), cache, list(range(48)))
        with pytest.raises(ValueError, match="not a kvstore receipt"):
            client.deliver(b"XXXX" + pending.receipt[4:], list(range(768)), cache, list(range(48)))
        assert pending.cancel() is True  # nothing was claimed


def test_a_receipt_dropped_unread_frees_its_slot_at_a_later_post_once_nothing_can_land() -> None:
    import gc

    box = inboxes.Inbox()
    free = receiving(box)
    free_slot = Receipt(free.receipt).slot
    del free
    gc.collect()
    claimed = receiving(box, nonce=0x3333 | 1)
    got = Receipt(claimed.receipt)
    assert got.slot == free_slot  # nobody had claimed it: free again at this post
    sender = claiming(claimed)
    try:
        assert sender.claimed is True
        del claimed
        gc.collect()
        assert Receipt(receiving(box).receipt).slot != got.slot  # a live sender's copy may land
    finally:
        sender.stop(kill=True)
    later = [Receipt(receiving(box, nonce=n | 1).receipt).slot for n in range(0x100, 0x103)]
    assert got.slot in later  # the sender is gone: the slot came back
