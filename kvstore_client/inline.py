"""Page bytes through gRPC, where the daemon's arena cannot be mapped (another host, or
`shared_memory=False`): a store lease's pages go up in a Put stream, a load lease's come down
in a Get stream, each message at most the daemon's `max_message_bytes`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import torch

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.errors import Unavailable, from_rpc_error


def put_pages(
    stub: Any,
    namespace: bytes,
    lease_id: int,
    staging: torch.Tensor,
    max_message_bytes: int,
    timeout_s: float,
    metadata: Any,
    is_outage: Any,
) -> None:
    """Sends `staging` (the lease's pages, in order) to the daemon."""
    data = memoryview(staging.numpy().data)
    step = max_message_bytes - 1024

    def messages() -> Iterator[pb.PutRequest]:
        yield pb.PutRequest(header=pb.PutHeader(namespace=namespace, lease_id=lease_id))
        for start in range(0, len(data), step):
            yield pb.PutRequest(data=bytes(data[start : start + step]))

    try:
        stub.Put(messages(), timeout=timeout_s, metadata=metadata)
    except grpc.RpcError as exc:
        error = from_rpc_error(exc, "Put")
        raise (Unavailable(str(error)) if is_outage(error) else error) from None


def get_pages(
    stub: Any,
    lease: pb.LeaseRequest,
    pages: int,
    page_bytes: int,
    timeout_s: float,
    metadata: Any,
    is_outage: Any,
) -> torch.Tensor:
    """A load lease's pages, streamed straight into one buffer; a short stream yields whole pages only."""
    staging = torch.empty(pages * page_bytes, dtype=torch.uint8)
    view, position = memoryview(staging.numpy().data).cast("B"), 0
    try:
        for message in stub.Get(lease, timeout=timeout_s, metadata=metadata):
            end = position + len(message.data)
            if end > len(view):
                raise RuntimeError(f"Get returned more than the lease's {pages} pages")
            view[position:end] = message.data
            position = end
    except grpc.RpcError as exc:
        error = from_rpc_error(exc, "Get")
        raise (Unavailable(str(error)) if is_outage(error) else error) from None
    return staging[: position - position % page_bytes]
