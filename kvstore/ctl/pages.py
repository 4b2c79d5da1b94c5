"""`kvctl clear` and `kvctl pin`: what an admin does to the stored pages.

- `clear_pages(admin, args)`: drop every stored page, or one namespace's.
- `pin_chain(admin, args)`: keep a chain (a system prompt), given as token ids or chunk keys,
  out of eviction for a while; exit 1 where none of it is stored.

Loaded when one of these commands runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.ctl.cli import hex_bytes, human_bytes

if TYPE_CHECKING:
    from kvstore.ctl.admin import Admin


def clear_pages(admin: Admin, args: argparse.Namespace) -> int:
    from kvstore.proto import kvstore_pb2 as pb

    namespace = hex_bytes(args.namespace, "--namespace") if args.namespace else b""
    pages = admin.call("Clear", pb.ClearRequest(namespace=namespace)).pages
    print(f"cleared {pages} pages" + (f" of namespace {args.namespace}" if args.namespace else ""))
    return 0


def _tokens(path: str) -> list[int]:
    """Token ids from a file ("-": stdin): a JSON list, or integers separated by spaces or commas."""
    from kvstore.shared.errors import KVStoreError

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise KVStoreError(f"--tokens: cannot read {path}: {err.strerror}") from None
    try:
        tokens = json.loads(text) if text.lstrip().startswith("[") else text.replace(",", " ").split()
        return [int(token) for token in tokens]
    except (ValueError, TypeError):
        raise KVStoreError(f"--tokens: expected token ids in {path}, as a JSON list or integers") from None


def pin_chain(admin: Admin, args: argparse.Namespace) -> int:
    from kvstore.proto import kvstore_pb2 as pb
    from kvstore.shared.errors import KVStoreError
    from kvstore.shared.keys import pack_keys

    if (args.tokens is None) == (args.keys is None):
        raise KVStoreError("pin: give the chain as --tokens FILE or as --keys HEX,..., not both")
    request = pb.PinRequest(namespace=hex_bytes(args.namespace, "namespace"), ttl_ms=round(args.ttl * 1000))
    if args.tokens is not None:
        request.tokens.extend(_tokens(args.tokens))
    else:
        request.keys = pack_keys([hex_bytes(key, "--keys") for key in args.keys.split(",")])
    reply = admin.call("Pin", request)
    if not reply.pinned_chunks:  # nothing to keep: say so, and fail, so that a script notices
        print(
            f"kvctl: pin: no chunk of the chain is stored in namespace {args.namespace} (its first chunk "
            f"is not there: check the namespace with `kvctl ls`, and that the tokens or keys are the "
            f"prompt's, from its start)",
            file=sys.stderr,
        )
    if args.json:
        print(
            json.dumps(
                {
                    "pinned_chunks": reply.pinned_chunks,
                    "ttl_s": args.ttl,
                    "pinned_pages": reply.pinned_pages,
                    "pinned_bytes": reply.pinned_bytes,
                }
            )
        )
    else:
        print(
            f"pinned {reply.pinned_chunks} chunks for {args.ttl:g} s; the tier holds "
            f"{reply.pinned_pages} pinned pages ({human_bytes(reply.pinned_bytes)})"
        )
    return 0 if reply.pinned_chunks else 1
