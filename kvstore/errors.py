"""Errors the store raises; the gRPC layer maps each class to one status code.

Messages are written for the person reading them: what was wrong, and what to do.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every error the daemon reports to a client."""


class InvalidArgument(KVStoreError):
    """The request itself is malformed (bad key length, sizes, counts)."""


class NotFound(KVStoreError):
    """A namespace or lease the request names does not exist (or expired)."""


class FailedPrecondition(KVStoreError):
    """The request is well formed but not valid in the current state."""


class ResourceExhausted(KVStoreError):
    """No space can be made: everything evictable is pinned or being written."""


class Unauthenticated(KVStoreError):
    """A TCP client did not present the configured auth token."""


class Unavailable(KVStoreError):
    """The daemon is shutting down or a tier is not serving."""
