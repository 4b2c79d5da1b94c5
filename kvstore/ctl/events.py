"""`kvctl events`: follow the daemon's KV events, every page entering or leaving a tier.

- `follow_events(admin, args)`: the event stream, one line (or one JSON object) per event, from a
  sequence and epoch, or from now; stops after `--count` events or at Ctrl-C.
- `event_line(event, as_json)`: one event as a line.

Loaded when the command runs.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from kvstore.ctl.cli import hex_bytes, printable

if TYPE_CHECKING:
    from kvstore.ctl.admin import Admin


def follow_events(admin: Admin, args: argparse.Namespace) -> int:
    """Follows the daemon's KV events (every page entering or leaving a tier), one line each."""
    import grpc

    from kvstore.proto import kvstore_pb2 as pb
    from kvstore.shared.errors import from_rpc_error

    request = pb.EventsRequest(
        since=args.since,
        epoch=args.epoch,
        namespace=hex_bytes(args.namespace, "namespace") if args.namespace else b"",
        from_now=args.from_now,
    )
    shown = 0
    try:
        for batch in admin.stub.Events(request, metadata=admin.metadata):
            for event in batch.events:
                print(event_line(event, args.json), flush=True)
                shown += 1
                if args.count and shown >= args.count:
                    return 0
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, "Events") from None
    except KeyboardInterrupt:
        pass
    return 0


def event_line(event: Any, as_json: bool) -> str:
    from kvstore.proto import kvstore_pb2 as pb

    fields = {
        "sequence": event.sequence,
        "kind": pb.KVEvent.Kind.Name(event.kind).lower(),
        "tier": pb.Tier.Name(event.tier).removeprefix("TIER_").lower(),
        "namespace": event.namespace.hex(),
        "tenant": event.tenant,
        "model": event.model,
        "key": event.key.hex(),
        "parent": event.parent.hex(),
        "reason": event.reason,
        "epoch": event.epoch,
    }
    if as_json:
        return json.dumps(fields)  # ASCII only: control characters come out as \\u escapes
    owner = f"{fields['tenant']}/{fields['model']}" if fields["tenant"] else fields["model"]
    return printable(
        f"{fields['sequence']:>10} {fields['kind']:<7} {fields['tier']:<6} {fields['namespace'][:12]} "
        f"{owner} {fields['key']} {fields['reason']}"
    )
