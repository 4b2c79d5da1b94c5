"""The daemon as kvctl reaches it: its channel, its credentials, its calls.

- `Admin(address, token, timeout_s, tls)`: the daemon, over its local channel where the address
  is a unix socket and no token is given, else gRPC; `call(method, request)`, `stats()`,
  `channel` and `stub` (gRPC, opened on first use), `close()`.
- `tls_credentials(args)`: the TLS credentials kvctl's --tls-* options or $KVSTORE_TLS_* name.

Loaded by the commands that talk to a daemon, when they run; gRPC only where a call goes over it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.shared.paths import local_socket_of

if TYPE_CHECKING:
    import grpc

    from kvstore.shared.channel import LocalChannel
    from kvstore.shared.errors import KVStoreError


class Admin:
    """The daemon, as kvctl calls it: over its local channel where the address is a unix socket
    and no token is given (the daemon knows the caller by its uid there: root and `admins` may do
    what spans tenants), else gRPC with the token. The gRPC channel is opened on first use."""

    def __init__(
        self, address: str, token: str | None, timeout_s: float, tls: grpc.ChannelCredentials | None = None
    ) -> None:
        self.address, self.tls = address, tls
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self.local: LocalChannel | None = None
        path = local_socket_of(address)
        if path and not token:
            from kvstore.shared.channel import LocalChannel

            try:
                self.local = LocalChannel(path, timeout_s)
            except OSError:
                self.local = None  # no local channel there: gRPC

    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            import grpc

            if self.tls is not None and not self.address.startswith("unix:"):
                self._channel = grpc.secure_channel(self.address, self.tls)
            else:
                self._channel = grpc.insecure_channel(self.address)
        return self._channel

    @property
    def stub(self) -> Any:
        if self._stub is None:
            from kvstore.proto import kvstore_pb2_grpc as pb_grpc

            self._stub = pb_grpc.KVStoreStub(self.channel)
        return self._stub

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
        if self._channel is not None:
            self._channel.close()

    def call(self, method: str, request: Any) -> Any:
        from kvstore.shared.channel import Refused
        from kvstore.shared.errors import KVStoreError, ResourceExhausted, from_rpc_error

        refusal: KVStoreError | None = None
        if self.local is not None:
            first_reply = not self.local.answered
            try:
                return self.local.call(method, request)
            except (Refused, ResourceExhausted) as exc:
                # Refused at the daemon's caps (closed at once, or told so): gRPC, where a daemon
                # without tenants serves anyone who can reach its socket.
                if not (isinstance(exc, Refused) or (first_reply and _told_channel_full(exc))):
                    raise
                self.local.close()
                self.local, refusal = None, exc
        import grpc  # gRPC only here: a call the local channel answers never loads it

        try:
            return getattr(self.stub, method)(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            error = from_rpc_error(exc, method)
            if refusal is not None:
                raise KVStoreError(
                    f"{refusal}; over gRPC instead: {error}. Try again once fewer clients are connected, "
                    f"or run kvctl as root or an admin (admins.uids), who get connections past the caps"
                ) from None
            raise error from None

    def stats(self) -> dict[str, Any]:
        from kvstore.proto import kvstore_pb2 as pb
        from kvstore.shared.wire import stats_to_dict

        return stats_to_dict(self.call("Stats", pb.StatsRequest()))


def _told_channel_full(exc: Exception) -> bool:
    from kvstore.server.local import LOCAL_CHANNEL_FULL  # the daemon's server module: only on this rare path

    return LOCAL_CHANNEL_FULL in str(exc)


def tls_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS credentials from --tls-ca/--tls-cert/--tls-key or $KVSTORE_TLS_CA_FILE, _CERT_FILE, _KEY_FILE."""
    files = [
        getattr(args, f"tls_{part}") or os.environ.get(f"KVSTORE_TLS_{part.upper()}_FILE") or None
        for part in ("ca", "cert", "key")
    ]
    if files[0] is None:
        return None
    import grpc

    if (files[1] is None) != (files[2] is None):
        raise ValueError("--tls-cert and --tls-key go together (mutual TLS)")
    ca, cert, key = (None if f is None else _read_file(f) for f in files)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _read_file(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror}") from None
