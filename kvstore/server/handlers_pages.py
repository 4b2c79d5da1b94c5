"""Put and Get: a lease's page bytes sent inline, for clients that cannot map the arena.

- `put_pages(store, header, messages)`: writes the data messages that follow a Put's header
  into the lease's pages, exactly their bytes and no more; a Put that fails part-way marks the
  lease broken (`Store.end_put`), so that its Commit stores nothing.
- `write_pages(store, lease, offsets, page_bytes, messages)`: the writes alone, each checked
  against the lease (`Store.write_leased`); returns the bytes written.
- `get_pages(store, request, message_bytes)`: a load lease's pages, in pieces, each read while
  the lease holds it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.errors import InvalidArgument
from kvstore.store.leases import Lease
from kvstore.store.store import Store


async def put_pages(
    store: Store, header: pb.PutHeader, messages: AsyncIterator[pb.PutRequest]
) -> pb.PutResponse:
    lease, slots = store.begin_put(header.namespace, header.lease_id)
    try:
        position = await write_pages(store, lease, slots.offsets, slots.page_bytes, messages)
    except BaseException as exc:
        store.end_put(lease, f"its Put failed part-way ({exc})")
        raise
    store.end_put(lease)
    return pb.PutResponse(bytes_written=position)


async def write_pages(
    store: Store,
    lease: Lease,
    offsets: list[int],
    page_bytes: int,
    messages: AsyncIterator[pb.PutRequest],
) -> int:
    total, position = len(offsets) * page_bytes, 0
    async for message in messages:
        if message.WhichOneof("part") != "data":
            raise InvalidArgument("Put: only the first message may be a PutHeader; the rest carry data")
        data = memoryview(message.data)
        if position + len(data) > total:
            raise InvalidArgument(
                f"Put: more than the {total} bytes of the lease's {len(offsets)} pages of {page_bytes} bytes"
            )
        while data:
            page, within = divmod(position, page_bytes)
            n = min(page_bytes - within, len(data))
            store.write_leased(lease, offsets[page], data[:n], within)
            data, position = data[n:], position + n
    if position != total:
        raise InvalidArgument(
            f"Put: received {position} bytes; the lease's {len(offsets)} pages "
            f"of {page_bytes} bytes need exactly {total}"
        )
    return position


async def get_pages(store: Store, request: pb.LeaseRequest, message_bytes: int) -> AsyncIterator[bytes]:
    """A load lease's pages in pieces of at most `message_bytes`, each read while the lease holds
    it (`Store.read_leased`): a Get's stream."""
    lease, result = await store.begin_get(request.namespace, request.lease_id)
    for offset in result.offsets:
        for start in range(0, result.page_bytes, message_bytes):
            length = min(message_bytes, result.page_bytes - start)
            yield store.read_leased(lease, offset + start, length)
