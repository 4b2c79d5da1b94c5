"""Errors the store raises; the gRPC layer maps each class to one status code.

Messages are written for the person reading them: what was wrong, and what to do.
Clients get the same classes back (`from_rpc_error`), so a worker can catch
`ResourceExhausted` or `ValueError` without knowing gRPC. Status codes are `Code`, gRPC's
numbers: this module does not import grpc, so a caller on the local channel alone (`kvctl
stats`) never loads it.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class Code(IntEnum):
    """gRPC's status codes, by the numbers every gRPC implementation uses (`grpc.StatusCode`'s
    `value[0]`)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


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


STATUS_CODES: dict[type[KVStoreError], Code] = {
    InvalidArgument: Code.INVALID_ARGUMENT,
    NotFound: Code.NOT_FOUND,
    FailedPrecondition: Code.FAILED_PRECONDITION,
    ResourceExhausted: Code.RESOURCE_EXHAUSTED,
    Unauthenticated: Code.UNAUTHENTICATED,
    PermissionDenied: Code.PERMISSION_DENIED,
    Unavailable: Code.UNAVAILABLE,
    DeadlineExceeded: Code.DEADLINE_EXCEEDED,
    StaleEpoch: Code.ABORTED,
}
_ERRORS = {code: cls for cls, code in STATUS_CODES.items()}


def status_of(exc: Exception) -> tuple[Code, str] | None:
    """The status a handler's error maps to; None for an unexpected (internal) error."""
    if type(exc) is ValueError:  # validation in shared modules (keys, spec) raises ValueError
        return Code.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, KVStoreError):
        code = next((STATUS_CODES[cls] for cls in type(exc).__mro__ if cls in STATUS_CODES), None)
        return code or Code.UNKNOWN, str(exc)
    return None


def code_of(code: Any) -> Code:
    """A status code as `Code`: from its number, or from a `grpc.StatusCode` (value (number, name))."""
    number = code.value[0] if isinstance(getattr(code, "value", None), tuple) else code
    try:
        return Code(int(number))
    except (TypeError, ValueError):
        return Code.UNKNOWN


def error_for(code: Any, method: str, details: str) -> KVStoreError:
    """The KVStoreError a failed call stands for, its message prefixed with the RPC's name;
    `code`: a number, a `Code` or a `grpc.StatusCode`."""
    status = code_of(code)
    error = _ERRORS.get(status, KVStoreError)(f"{method}: {details} ({status.name})")
    error.code = status  # type: ignore[attr-defined]
    return error


def from_rpc_error(exc: Any, method: str) -> KVStoreError:
    """The KVStoreError a `grpc.RpcError` stands for."""
    code = exc.code() if hasattr(exc, "code") else Code.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return error_for(code, method, details or "")
