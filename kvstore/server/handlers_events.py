"""The Events stream's conversions: where a consumer starts reading, and each event's message.

- `start_of(log, request, tenant)`: the cursor a stream reads from (its `since`, or the last
  event with `from_now`) and why it must resync first ("": it need not).
- `resync_reason(request, epoch)`: why a `since` cannot be trusted ("": it can).
- `event_message(log, event)`: a `kvstore.store.events.Event` as a `KVEvent`, with its model's name.
"""

from __future__ import annotations

from kvstore.proto import kvstore_pb2 as pb
from kvstore.store.events import Event, EventLog

EVENTS_PER_BATCH = 512


def start_of(log: EventLog, request: pb.EventsRequest, tenant: str | None) -> tuple[int, str]:
    """Where a stream of `tenant`'s events (None: the daemon's) starts, and its resync reason."""
    if request.from_now:
        return log.last(tenant), ""
    return request.since, resync_reason(request, log.epoch)


def resync_reason(request: pb.EventsRequest, epoch: int) -> str:
    """Why a `since` cannot be trusted (empty: it can). Sequence numbers restart with each daemon
    start, so a `since` means something only with the epoch of the event it names; one without
    an epoch (a consumer older than epochs) may be from a start before this one."""
    if not request.since or request.epoch == epoch:
        return ""
    if not request.epoch:
        return "since names no epoch: it may be from before the daemon restarted"
    return "since is from another epoch: the daemon restarted"


def event_message(log: EventLog, event: Event) -> pb.KVEvent:
    _, model = log.names(event.namespace)
    return pb.KVEvent(
        sequence=event.sequence,
        kind=pb.KVEvent.Kind.Value(event.kind.name),
        tier=pb.Tier.Value(f"TIER_{event.tier.name}"),
        namespace=event.namespace,
        model=model,
        tenant=event.tenant,
        key=event.key,
        parent=event.parent,
        reason=event.reason,
        epoch=log.epoch,
    )
