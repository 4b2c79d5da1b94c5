"""Errors the store raises; the gRPC layer maps each class to one status code.

Messages are written for the person reading them: what was wrong, and what to do.
Clients get the same classes back (`from_rpc_error`), so a worker can catch
`ResourceExhausted` or `ValueError` without knowing gRPC.
"""

from __future__ import annotations

import grpc


class KVStoreError(Exception):
    """Base of every error the daemon reports to a client."""


class InvalidArgument(KVStoreError, ValueError):
    """The request itself is malformed (bad key length, sizes, counts)."""


class NotFound(KVStoreError, LookupError):
    """A namespace or lease the request names does not exist (or expired)."""


class FailedPrecondition(KVStoreError):
    """The request is well formed but not valid in the current state."""


class ResourceExhausted(KVStoreError):
    """No space can be made: everything evictable is pinned or being written."""


class ArenaWarmingUp(ResourceExhausted):
    """No space yet: the arena is still being reserved behind the serving daemon (a Reserve
    waits for it a while before it answers with this)."""


class Unauthenticated(KVStoreError, PermissionError):
    """A TCP client did not present the configured auth token."""


class PermissionDenied(KVStoreError, PermissionError):
    """The caller is known, but what it asks is not its to do (another tenant's, or an admin's)."""


class Unavailable(KVStoreError, ConnectionError):
    """The daemon is not reachable, shutting down, or a tier is not serving."""


class DeadlineExceeded(KVStoreError, TimeoutError):
    """The daemon did not answer in time."""


DAEMON_STOPPING = "kvstored is stopping"  # in the Unavailable a stopping daemon answers with


class StaleEpoch(KVStoreError):
    """The call names offsets of an arena this daemon does not own (it restarted): nothing was
    done; the client maps the current arena and connects again."""


STATUS_CODES: dict[type[KVStoreError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    StaleEpoch: grpc.StatusCode.ABORTED,
}
_ERRORS = {code: cls for cls, code in STATUS_CODES.items()}


_CODES_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def status_of(exc: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The status a handler's error maps to; None for an unexpected (internal) error."""
    if type(exc) is ValueError:  # validation in shared modules (keys, spec) raises ValueError
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, KVStoreError):
        code = next((STATUS_CODES[cls] for cls in type(exc).__mro__ if cls in STATUS_CODES), None)
        return code or grpc.StatusCode.UNKNOWN, str(exc)
    return None


def error_for(code: grpc.StatusCode | int, method: str, details: str) -> KVStoreError:
    """The KVStoreError a failed call stands for, its message prefixed with the RPC's name."""
    if isinstance(code, int):
        code = _CODES_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    error = _ERRORS.get(code, KVStoreError)(f"{method}: {details} ({code.name})")
    error.code = code  # type: ignore[attr-defined]
    return error


def from_rpc_error(exc: grpc.RpcError, method: str) -> KVStoreError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return error_for(code, method, details or "")
