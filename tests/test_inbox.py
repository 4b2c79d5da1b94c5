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

CONTEXT = mp.get_context("spawn")
KEYS = [bytes([i]) * KEY_BYTES for i in range(3)]


def _sender(address: Any, slot: int, nonce: int, done: int | None, pipe: Any) -> None:
    """Claims `slot` of the inbox at `address`; writes `done` into it from the host (where not
    None); reports whether the claim held, then waits to be told to exit."""
    try:
        opened = inboxes.Inboxes().claim(address, slot, nonce)
    except (OSError, ValueError) as exc:
        pipe.send(repr(exc))
        return
    if opened is not None and done is not None:
        opened.words[slot, inboxes.DONE] = done
    pipe.send(opened is not None)
    pipe.recv()


class Sender:
    """A sender process that claims a slot and stays alive until stopped."""

    def __init__(self, address: Any, slot: int, nonce: int, done: int | None = None) -> None:
        self.pipe, theirs = CONTEXT.Pipe()
        self.process = CONTEXT.Process(target=_sender, args=(address, slot, nonce, done, theirs))
        self.process.start()
        assert self.pipe.poll(60), "the sender did not answer"
        self.claimed = self.pipe.recv()

    def stop(self, kill: bool = False) -> None:
        if kill:
            os.kill(self.process.pid, signal.SIGKILL)
        else:
            self.pipe.send("exit")
        self.process.join(60)
        assert self.process.exitcode is not None


def receiving(box: inboxes.Inbox, chunks: int = 3) -> Receiving:
    nonce = 0x1234_5678_9ABC | 1
    slot = box.post(nonce)
    receipt = Receipt.make(
        nonce, box.address(), slot, KEYS[:chunks], list(range(chunks * 2)), "0000:01:00.0", b"{}"
    )
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
    first = Sender(got.inbox, got.slot, got.nonce, done=got.nonce + 2)
    second = Sender(got.inbox, got.slot, got.nonce)  # the same receipt again
    wrong = Sender(got.inbox, got.slot, got.nonce + 2)  # another nonce
    try:
        assert (first.claimed, second.claimed, wrong.claimed) == (True, False, False)
        assert pending.wait(timeout_s=30) == 512  # two chunks of 256 tokens
        assert pending.cancel() is False  # landed: nothing to give up
    finally:
        for sender in (first, second, wrong):
            sender.stop()


def test_a_done_word_out_of_range_or_of_another_nonce_counts_nothing() -> None:
    box = inboxes.Inbox()
    pending = receiving(box, chunks=2)
    got = Receipt(pending.receipt)
    sender = Sender(got.inbox, got.slot, got.nonce, done=got.nonce + 3)  # more chunks than asked for
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
    late = Sender(got.inbox, got.slot, got.nonce, done=got.nonce + 3)
    try:
        assert late.claimed is False and pending.poll() is None
        assert box.delivered(got.slot, got.nonce, 3) is None  # the slot's nonce is cleared
    finally:
        late.stop()


def test_blocks_claimed_by_a_live_sender_stay_held_until_it_is_gone() -> None:
    box = inboxes.Inbox()
    pending = receiving(box)
    got = Receipt(pending.receipt)
    sender = Sender(got.inbox, got.slot, got.nonce)  # claims, never writes done
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
    got = Receipt(pending.receipt)
    sender = Sender(got.inbox, got.slot, got.nonce)
    assert pending.cancel() is False
    sender.stop()
    assert pending.cancel() is True


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
        sender = Sender(address, got.slot, got.nonce)
        try:
            assert isinstance(sender.claimed, str) and match in sender.claimed, sender.claimed
        finally:
            sender.stop()
    with pytest.raises(ValueError, match="outside the inbox"):
        inboxes.Inboxes().claim(got.inbox, inboxes.SLOTS, got.nonce)
    assert pending.cancel() is True


def test_an_inbox_with_every_slot_awaiting_a_sender_refuses_another_receipt() -> None:
    box = inboxes.Inbox()
    held = [box.post(n + 1) for n in range(inboxes.SLOTS)]
    assert sorted(held) == list(range(inboxes.SLOTS))
    with pytest.raises(inboxes.InboxFull, match="await their senders"):
        box.post(7)
    assert box.cancel(held[5], 6, 1) is True
    assert box.post(7) == held[5]


def test_a_delivery_that_lands_as_the_receipt_is_given_up_still_counts() -> None:
    box = inboxes.Inbox()
    pending = receiving(box)
    got = Receipt(pending.receipt)
    sender = Sender(got.inbox, got.slot, got.nonce, done=got.nonce + 3)
    try:
        assert box.cancel(got.slot, got.nonce, 3) is False  # landed: not freed by the cancel
        assert pending.cancel() is False and pending.wait(timeout_s=0) == 768
        assert pending.cancel() is False
    finally:
        sender.stop()
    again = receiving(box)  # the slot was released once its delivery was read
    assert Receipt(again.receipt).slot == got.slot
