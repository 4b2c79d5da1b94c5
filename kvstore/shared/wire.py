"""What the daemon and its clients share on the wire, beside the generated protobuf modules.

- `UNARY_METHODS`: the unary calls of kvstore.v1.KVStore, name -> (request type, reply type), in
  wire order: the local channel numbers methods by position (`METHOD_NAMES`).
- `QUERY`, `QueryRequest`, `QueryReply`: the local channel's one call without protobuf, a plain
  Lookup (the call a scheduler makes most); `LOCAL_IDS` / `LOCAL_REPLIES`: every call the local
  channel carries, by name: its method byte and its reply's type.
- The local channel's framing (`kvstore.server.local` serves it, `kvstore.shared.channel` calls it):
  `HEADER` (u32 length, u8 method or status), `frame(code, body)`, `MAX_FRAME_BYTES` (a reply).
- `MAX_REQUEST_BYTES`: the largest unary request the daemon reads (65,536 keys and room for
  the rest), on either channel; `parse_request(name, payload)`: the message, or InvalidArgument
  for one too large or undecodable, before anything else is allocated for it.
- `page_spec_message(page)` / `page_spec_of(message, default_chunk_tokens)`: a `PageSpec` and
  its `kvstore.v1.PageSpec`, field by field from the dataclass (one field list, `kvstore.shared.spec`).
- `stats_to_dict(reply)`: a Stats reply as the plain dict `KVStoreClient.stats()` returns and
  `kvctl stats --json` prints: `{"version", "uptime_s", "event_epoch", "tiers": {name: {...}},
  "namespaces": [{...}], "counters": {...}}`.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any, NamedTuple

from google.protobuf.message import DecodeError

from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.domain import MAX_KEYS_PER_REQUEST
from kvstore.shared.errors import InvalidArgument
from kvstore.shared.spec import PageSpec

UNARY_METHODS: dict[str, tuple[type, type]] = {
    "Connect": (pb.ConnectRequest, pb.ConnectResponse),
    "Lookup": (pb.LookupRequest, pb.LookupResponse),
    "Reserve": (pb.ReserveRequest, pb.ReserveResponse),
    "Commit": (pb.LeaseRequest, pb.CommitResponse),
    "Abort": (pb.LeaseRequest, pb.LeaseResponse),
    "Acquire": (pb.LeaseRequest, pb.AcquireResponse),
    "Release": (pb.LeaseRequest, pb.LeaseResponse),
    "Stats": (pb.StatsRequest, pb.StatsResponse),
    "Clear": (pb.ClearRequest, pb.ClearResponse),
    "Pin": (pb.PinRequest, pb.PinResponse),
    "Renew": (pb.RenewRequest, pb.RenewResponse),
    "ArenaSlabs": (pb.ArenaSlabsRequest, pb.ArenaSlabsResponse),  # the local channel's alone
    "Lend": (pb.LendRequest, pb.LendResponse),  # the local channel's alone
    "Lends": (pb.LendsRequest, pb.LendsResponse),
    "Returned": (pb.ReturnedRequest, pb.LeaseResponse),
}
METHOD_NAMES = tuple(UNARY_METHODS)
METHOD_IDS = {name: index for index, name in enumerate(METHOD_NAMES)}

# The local channel's Query: a plain Lookup with no protobuf on either side (a query of the tiers,
# neither a use nor a lease; lent blocks count, as `lookup_chunks`' Lookup asks), answered by the
# same store call as a Lookup without `lease` or `each`. It is what an engine's scheduler asks of
# every waiting request at every step, so it is the call the daemon's one core answers most: its
# reply costs it no message built, parsed or serialized (bench/NOTES-control-plane.md).
#     request: u8 method QUERY | namespace (16 bytes) | keys (16 bytes each)
#     reply:   OK | u32 hit_chunks | tiers (a byte per hit chunk)
# A daemon before it answers INVALID_ARGUMENT ("unknown local-channel method"); the client then
# asks with a Lookup, as over gRPC.
QUERY = 0x80
UNKNOWN_METHOD = "unknown local-channel method"  # a daemon's answer to a method it does not serve
QUERY_HIT = struct.Struct("<I")
NAMESPACE_BYTES = 16


class QueryRequest(NamedTuple):
    namespace: bytes
    keys: bytes  # packed, 16 bytes each

    def SerializeToString(self) -> bytes:  # noqa: N802 - as a message's, for the channel
        return self.namespace + self.keys

    def as_lookup(self) -> pb.LookupRequest:
        """The same question as a Lookup: over gRPC, or of a daemon without the Query."""
        return pb.LookupRequest(namespace=self.namespace, keys=self.keys, lent_devices=["*"])


class QueryReply(NamedTuple):
    hit_chunks: int
    tiers: bytes

    @classmethod
    def FromString(cls, body: bytes) -> QueryReply:  # noqa: N802 - as a message type's, for the channel
        if len(body) < QUERY_HIT.size:
            raise InvalidArgument(f"Query: a reply of {len(body)} bytes; it starts with a u32 count")
        return cls(QUERY_HIT.unpack_from(body)[0], body[QUERY_HIT.size :])

    def to_bytes(self) -> bytes:
        return QUERY_HIT.pack(self.hit_chunks) + self.tiers


LOCAL_IDS = {**METHOD_IDS, "Query": QUERY}
LOCAL_REPLIES: dict[str, Any] = {name: reply for name, (_, reply) in UNARY_METHODS.items()}
LOCAL_REPLIES["Query"] = QueryReply

HEADER = struct.Struct("<IB")  # request: length, method index; reply: length, grpc.StatusCode value
MAX_FRAME_BYTES = 16 << 20
KEY_BYTES = 16  # kvstore.shared.keys.KEY_BYTES (not imported: that module loads numpy)
MAX_REQUEST_BYTES = MAX_KEYS_PER_REQUEST * KEY_BYTES + (64 << 10)


def parse_request(name: str, request_type: Any, payload: bytes) -> Any:
    """`payload` as a `request_type` message of method `name`; InvalidArgument if it is larger
    than MAX_REQUEST_BYTES (checked before parsing) or not such a message."""
    if len(payload) > MAX_REQUEST_BYTES:
        raise InvalidArgument(
            f"{name}: a request of {len(payload)} bytes; at most {MAX_REQUEST_BYTES} "
            f"({MAX_KEYS_PER_REQUEST} keys): split it"
        )
    try:
        return request_type.FromString(payload)
    except DecodeError as exc:
        raise InvalidArgument(f"{name}: the request is not a {request_type.__name__} ({exc})") from None


def frame(code: int, body: bytes) -> bytes:
    return HEADER.pack(len(body), code) + body


_PAGE_FIELDS = tuple(field.name for field in dataclasses.fields(PageSpec))


def page_spec_message(page: PageSpec, **fields: Any) -> pb.PageSpec:
    """`page` as the wire's PageSpec; `fields` replace some of its values (a Connect asks for
    chunk_tokens 0 where it takes the daemon's)."""
    values = {name: getattr(page, name) for name in _PAGE_FIELDS}
    values["kv_sharing"] = dict(page.kv_sharing)
    values["weights"] = [pb.LayerWeights(stop=stop, id=ident) for stop, ident in page.weights]
    if page.hidden_layer < 0:
        del values["hidden_layer"]
    return pb.PageSpec(**(values | fields))


def page_spec_of(message: pb.PageSpec, default_chunk_tokens: int) -> PageSpec:
    """The PageSpec a Connect names; unset chunk_tokens and tp_size take the defaults."""
    values = {name: getattr(message, name) for name in _PAGE_FIELDS}
    values["kv_sharing"] = tuple(message.kv_sharing.items())
    values["chunk_tokens"] = message.chunk_tokens or default_chunk_tokens
    values["tp_size"] = message.tp_size or 1
    values["weights"] = tuple((entry.stop, entry.id) for entry in message.weights)
    values["layer_ids"] = tuple(message.layer_ids)
    values["hidden_layer"] = message.hidden_layer if message.HasField("hidden_layer") else -1
    return PageSpec(**values)


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def _node(node: pb.RemoteNode) -> dict[str, Any]:
    return {field: getattr(node, field) for field in pb.RemoteNode.DESCRIPTOR.fields_by_name}


def stats_to_dict(msg: pb.StatsResponse) -> dict[str, Any]:
    return {
        "version": msg.version,
        "uptime_s": round(msg.uptime_s, 3),
        "event_epoch": msg.event_epoch,
        "tiers": {
            t.name: {
                "bytes_used": t.bytes_used,
                "bytes_capacity": t.bytes_capacity,
                "pages": t.pages,
                **{k: _number(v) for k, v in sorted(t.extra.items())},
                **({"nodes": [_node(node) for node in t.nodes]} if t.nodes else {}),
            }
            for t in msg.tiers
        },
        "namespaces": [
            {
                "namespace": n.namespace.hex(),
                "model": n.model,
                "pages": n.pages,
                "bytes": n.stored_bytes,
                "page_bytes": n.page_bytes,
                **({"tenant": n.tenant} if n.tenant else {}),
                **({"contents": n.contents} if n.contents else {}),
            }
            for n in msg.namespaces
        ],
        "counters": {k: _number(v) for k, v in sorted(msg.counters.items())},
    }
