"""The disk tier's queued work: a page to write, a page to read, and their completion callbacks.

- `Write`: a page waiting to be written (or being written); `dones` run once it is durable
  (True) or will not be (False). `cancelled` is set by `remove` while it is pending.
- `Read`: a read of an indexed record (`record`), or of a write still pending (`page`);
  `done` gets the page, `into` when one was given, or None.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.tiers.codec import Buffer
from kvstore.tiers.disk_index import Record

WriteDone = Callable[[bool], None]
ReadDone = Callable[[Buffer | None], None]


class Write:
    __slots__ = ("namespace", "key", "page", "dones", "started", "cancelled")

    def __init__(self, namespace: bytes, key: bytes, page: bytes, done: WriteDone | None) -> None:
        self.namespace = namespace
        self.key = key
        self.page = page
        self.dones: list[WriteDone] = [] if done is None else [done]
        self.started = False  # taken by a worker
        self.cancelled = False


class Read:
    __slots__ = ("namespace", "key", "record", "page", "done", "into")

    def __init__(
        self,
        namespace: bytes,
        key: bytes,
        record: Record | None,
        page: bytes | None,
        done: ReadDone,
        into: memoryview | None,
    ) -> None:
        self.namespace = namespace
        self.key = key
        self.record = record
        self.page = page
        self.done = done
        self.into = into
