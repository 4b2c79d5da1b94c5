"""A worker's line to kvstored: gRPC, the local channel on the daemon's host, and outages.

- `rpc(method, request, meanwhile=None)`: one call, over the local channel where it is open
  (`meanwhile()` runs while the daemon answers), else gRPC. A local channel the daemon refused
  at its caps is closed, and the calls go over gRPC with the credential the refusal carried
  (`credential_of_refusal`): with tenants, this process is still its tenant's member there.
- `call(method, make_request, meanwhile=None)`: `rpc` with outages handled. In an outage it
  first connects again; a call that finds the daemon restarted (a stale epoch, a forgotten
  namespace, a closed channel) connects again and is made once more, with a request made anew.
  Unavailable when the daemon cannot serve it now (a slow one included: a miss, not a second
  wait); other errors are the request's own.
- `lost(exc)`: a call found the daemon not serving: one warning for the outage, the local
  channel closed. `reconnect()` runs the owner's handshake again, at most every
  RECONNECT_INTERVAL_S; where nothing answers it runs it once more on a new gRPC channel (the old
  one fails every call with its last attempt's error until its own backoff ends, however long the
  daemon has been serving again), and where nothing answers there either the daemon is gone:
  `on_gone()` lets its arena go at once, so that its memory is free for the next daemon's.
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.shared.channel import LocalChannel, Refused
from kvstore.shared.errors import (
    DAEMON_STOPPING,
    Code,
    DeadlineExceeded,
    InvalidArgument,
    KVStoreError,
    NotFound,
    ResourceExhausted,
    StaleEpoch,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
)
from kvstore.shared.wire import HEADER, UNKNOWN_METHOD

log = logging.getLogger(__name__)

_CHANNEL_LIMIT = 64 << 20
_NOT_REGISTERED = "is not registered with this daemon"
RECONNECT_INTERVAL_S = 0.25  # in an outage, the least time between two attempts to connect again
# gRPC's own reconnection backoff (default: up to 120 s) would keep a restarted daemon unused. A
# reconnect does not wait for it (it opens a new channel), but a call between two does.
_RECONNECT_BACKOFF_MS = 250
# What the daemon's refusal of a local connection at its caps says (kvstore.server.local.LOCAL_CHANNEL_FULL).
LOCAL_CHANNEL_FULL = "local channel is full"
_PROBE_METHOD = 255  # a method no daemon serves: an admitted connection answers it at once, with an error


def is_outage(exc: KVStoreError) -> bool:
    """Whether `exc` says the daemon cannot serve now (down, stopping, restarted, too slow),
    as opposed to a fault of the request."""
    if isinstance(exc, Unavailable | DeadlineExceeded | StaleEpoch):
        return True
    if isinstance(exc, NotFound):
        return _NOT_REGISTERED in str(exc)
    return getattr(exc, "code", None) == Code.CANCELLED


TLS_ENV = ("KVSTORE_TLS_CA_FILE", "KVSTORE_TLS_CERT_FILE", "KVSTORE_TLS_KEY_FILE")


@dataclass(frozen=True)
class ClientTls:
    """TLS to a daemon over TCP (`server.tls`): the CA its certificate chains to, and for mutual
    TLS this client's certificate chain and key (PEM files)."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None

    @classmethod
    def from_env(cls) -> ClientTls | None:
        """From $KVSTORE_TLS_CA_FILE (and _CERT_FILE, _KEY_FILE); None without a CA."""
        ca, cert, key = (os.environ.get(name) or None for name in TLS_ENV)
        return cls(ca, cert, key) if ca else None

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("tls: give cert_file and key_file together (mutual TLS), or neither")
        files = [self.ca_file, self.key_file, self.cert_file]
        ca, key, cert = (None if f is None else _read(f) for f in files)
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise ValueError(f"tls: cannot read {path}: {err.strerror}") from None


def is_refusal(exc: KVStoreError, first_reply: bool) -> bool:
    """Whether a local call's error says the daemon refused the connection at its caps."""
    if isinstance(exc, Refused):
        return True
    return first_reply and isinstance(exc, ResourceExhausted) and LOCAL_CHANNEL_FULL in str(exc)


def credential_of_refusal(path: str, timeout_s: float) -> str:
    """The gRPC credential a daemon hands a local connection it refuses at its caps ("" if none
    comes: no tenants, an older daemon, or a connection admitted this time). It reads that
    connection's frames (why, then a ConnectResponse with the credential) up to the end; a probe
    request of a method no daemon serves makes an admitted one answer at once instead."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        buffer = bytearray()
        try:
            sock.connect(path)
            with contextlib.suppress(OSError):  # refused and closed already: its frames are still there
                sock.sendall(HEADER.pack(0, _PROBE_METHOD), socket.MSG_NOSIGNAL)
            while True:
                while len(buffer) >= HEADER.size:
                    length, status = HEADER.unpack_from(buffer)
                    end = HEADER.size + length
                    if len(buffer) < end:
                        break
                    body = bytes(buffer[HEADER.size : end])
                    del buffer[:end]
                    if status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
                        continue  # the refusal's reason: the credential follows, if there is one
                    if status != 0:
                        return ""  # admitted this time: its answer to the probe
                    try:
                        return str(pb.ConnectResponse.FromString(body).credential)
                    except DecodeError:
                        return ""
                part = _receive(sock)
                if not part:
                    return ""
                buffer += part
        except OSError:
            return ""


def _receive(sock: socket.socket) -> bytes:
    """Bytes from `sock`; any descriptor that comes with them is closed (none is expected)."""
    part, ancillary, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(16))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
            for fd in fds:
                os.close(fd)
    return part


def open_channel(address: str, tls: ClientTls | None) -> grpc.Channel:
    """A gRPC channel to `address` with a connection of its own: with gRPC's process-wide
    subchannel pool, every client of one address in a process shares one connection and its
    state, so one client's calls while the daemon was down would fail another's calls, and a new
    channel would take over the old one's failure."""
    options = [
        ("grpc.max_receive_message_length", _CHANNEL_LIMIT),
        ("grpc.max_send_message_length", _CHANNEL_LIMIT),
        ("grpc.initial_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS),
        ("grpc.min_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS),
        ("grpc.use_local_subchannel_pool", 1),
    ]
    if tls is not None and not address.startswith("unix:"):
        return grpc.secure_channel(address, tls.credentials(), options=options)
    return grpc.insecure_channel(address, options=options)


def default_address() -> str:
    from kvstore.shared.paths import default_socket_path

    return f"unix://{default_socket_path()}"


class Connection:
    def __init__(
        self,
        address: str,
        timeout_s: float,
        token: str | None,
        handshake: Callable[[], None],
        on_gone: Callable[[], None],
        tls: ClientTls | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._token = token
        self._credential = False  # gRPC calls carry a credential the daemon issued (void at its restart)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._tls = tls
        self.channel = open_channel(address, tls)
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self.local: LocalChannel | None = None
        self.outage = False  # a call found the daemon not serving since the last connect
        self._reconnect_at = 0.0  # in an outage: no attempt to connect again before this
        self._handshake = handshake
        self._on_gone = on_gone

    def rpc(
        self,
        method: str,
        request: Any,
        meanwhile: Callable[[], Any] | None = None,
        fds: list[int] | None = None,
    ) -> Any:
        """The reply to `request`; `meanwhile()` runs while the daemon answers (over the local
        channel; before the call over gRPC). `fds`: see `LocalChannel.call`. A Query (`wire.QUERY`)
        is asked as a Lookup over gRPC, and of a daemon whose local channel has no Query."""
        local = self.local
        if method == "Query" and (local is None or not local.queries):
            method, request = "Lookup", request.as_lookup()
        if local is not None:
            first_reply = not local.answered
            try:
                return local.call(method, request, meanwhile, fds)
            except (Refused, ResourceExhausted) as exc:
                if not is_refusal(exc, first_reply):
                    raise
                self._refused(exc)
                if not isinstance(exc, Refused) or exc.ran_meanwhile:
                    meanwhile = None
            except InvalidArgument as exc:
                if method != "Query" or UNKNOWN_METHOD not in str(exc):
                    raise
                local.queries = False  # a daemon from before the Query: a Lookup from now on
                return self.rpc(method, request, meanwhile, fds)
        if method == "Query":
            method, request = "Lookup", request.as_lookup()
        if meanwhile is not None:
            meanwhile()
        try:
            return getattr(self.stub, method)(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, method) from None

    def _refused(self, exc: KVStoreError) -> None:
        """The daemon refused the local channel at its caps: it is closed, and gRPC calls carry
        the credential the refusal handed this process (unless it has a token of its own)."""
        assert self.local is not None
        path = self.local.path
        log.info("%s: control calls use gRPC", exc)
        self.close_local()
        if not self._token:
            self.use_credential(credential_of_refusal(path, self.timeout_s))

    def call(
        self,
        method: str,
        make_request: Any,
        meanwhile: Callable[[], Any] | None = None,
        fds: list[int] | None = None,
    ) -> Any:
        if self.outage:
            self.reconnect()
        for again in (False, True):
            try:
                return self.rpc(method, make_request(), meanwhile, fds)
            except KVStoreError as exc:
                # A daemon that restarted no longer knows the credential it issued: connect again.
                if not (is_outage(exc) or (self._credential and isinstance(exc, Unauthenticated))):
                    raise
                self.lost(exc)
                if again or isinstance(exc, DeadlineExceeded):
                    raise Unavailable(str(exc)) from None
            self.reconnect()
        raise AssertionError("unreachable")

    def lost(self, exc: BaseException) -> None:
        if not self.outage:
            self.outage = True
            self._reconnect_at = 0.0
            log.warning(
                "kvstored at %s is not serving (%s): lookups and loads are misses and stores are "
                "dropped until it serves again",
                self.address,
                exc,
            )
        else:
            log.debug("kvstored still not serving: %s", exc)
        self.close_local()

    def reconnect(self) -> None:
        """Connects again; Unavailable if it cannot now. Whatever fails here is the outage going on
        (a daemon restarted with a config this client cannot use included), never an error of
        the caller's call."""
        if time.monotonic() < self._reconnect_at:
            raise Unavailable(f"kvstored at {self.address} is not serving; trying again shortly")
        try:
            self._handshake_on_a_fresh_connection()
        except Exception as exc:
            self._reconnect_at = time.monotonic() + RECONNECT_INTERVAL_S
            if isinstance(exc, Unavailable) and DAEMON_STOPPING not in str(exc):
                self._on_gone()
            self.lost(exc)
            raise Unavailable(f"kvstored at {self.address}: {exc}") from None

    def _handshake_on_a_fresh_connection(self) -> None:
        """The owner's handshake; where nothing answered it, once more on a new gRPC channel. A
        channel whose attempt to connect failed while the daemon was down fails every call at
        once with that attempt's error until its backoff ends: a daemon that serves again in
        between would be taken for gone, and the call that found it serving would be a miss."""
        try:
            self._handshake()
        except Unavailable as exc:
            if DAEMON_STOPPING in str(exc):
                raise  # it answered: the channel is connected, and may carry calls still in flight
            self._renew_channel()
            self._handshake()

    def _renew_channel(self) -> None:
        """A new gRPC channel in place of one on which nothing answered (a call still on it would
        fail anyway); the new one connects at its first call."""
        old = self.channel
        self.channel = open_channel(self.address, self._tls)
        self.stub = pb_grpc.KVStoreStub(self.channel)
        old.close()

    def check_local(self, request: Any, namespace: bytes) -> None:
        """Keeps the local channel only if the daemon knows this process there as it knew it on
        gRPC: with tenants, a client that connected with a token (its tenant's) may be another
        tenant's member, or none, by its uid."""
        assert self.local is not None
        try:
            same = self.local.call("Connect", request).namespace == namespace
            handed = self.local.take_fd()
            if handed is not None:
                os.close(handed)
        except KVStoreError as exc:
            same, reason = False, str(exc)
        else:
            reason = "it knows this process as a member of another tenant by its uid"
        if not same:
            log.info("the daemon's local channel is not used (%s): control calls use gRPC", reason)
            self.close_local()

    @property
    def has_token(self) -> bool:
        """The caller gave a token: the daemon knows this client by it, not by its uid."""
        return bool(self._token)

    def use_credential(self, credential: str) -> None:
        """gRPC calls carry the credential the daemon issued at Connect (who this client is, for
        a daemon with tenants), unless the caller gave a token of its own. A reply without one (a
        Connect over gRPC) leaves the one held: a daemon that restarted refuses it, and the
        client connects again."""
        if not self._token and credential:
            self._credential = True
            self.metadata = (("authorization", f"Bearer {credential}"),)

    def serving(self, epoch: int) -> None:
        """A handshake went through: the outage, if any, is over."""
        if self.outage:
            log.info("kvstored at %s serves again (arena epoch %#x)", self.address, epoch)
            self.outage = False

    def open_local(self, path: str) -> None:
        """Unary calls go over the daemon's local channel at `path` where it is reachable (one
        already open there stays: the daemon knows this client on it)."""
        if self.local is not None and path and self.local.path == path:
            return
        self.close_local()
        if not path:
            return
        try:
            self.local = LocalChannel(path, self.timeout_s)
        except OSError as exc:
            log.info("local channel %s not reachable (%s): control calls use gRPC", path, exc)

    def close_local(self) -> None:
        if self.local is not None:
            self.local.close()
            self.local = None

    def close(self) -> None:
        self.close_local()
        self.channel.close()
