"""kvstore_client: the worker-side library for kvstored.

from kvstore_client import KVStoreClient, KVSpec
with KVStoreClient.connect("unix:///run/kvstore/kvstored.sock", spec) as client:
    hit_tokens = client.lookup(token_ids)
    client.load(token_ids[:hit_tokens], kv_caches, block_ids)
    new_chunks = client.store(token_ids, kv_caches, block_ids)
"""

from kvstore.shared.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvstore.shared.spec import KVSpec
from kvstore_client.client import KVStoreClient, default_address
from kvstore_client.connection import ClientTls

__all__ = [
    "ClientTls",
    "FailedPrecondition",
    "InvalidArgument",
    "KVSpec",
    "KVStoreClient",
    "KVStoreError",
    "NotFound",
    "ResourceExhausted",
    "Unavailable",
    "default_address",
]
