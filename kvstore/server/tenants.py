"""Who is calling, and which tenant's pages it may touch.

A caller is known without any secret on the local channel: the kernel gives the daemon the
peer's uid, gid and groups (`kvstore.shared.peers`). gRPC does not expose those, so a gRPC caller is
known by a bearer token: the operator's `server.auth_token` (an admin), a tenant's token
(`tenants[].tokens_file`), or a credential the daemon issued to a caller on the local channel
(`credential`), which the client sends on its gRPC calls (inline Put and Get) from then on.

- Without `tenants`, every caller is in the one tenant "" (today's single-tenant daemon).
- With them, a uid is looked up first, then the primary gid, then the supplementary groups;
  a caller in no tenant can do nothing but Stats (if an admin).
- Admins (root, the daemon's own user, `admins.uids`, `admins.gids`, the holder of
  `server.auth_token`) may do what
  spans tenants: Clear of everything, Stats of every tenant, shortening another's pin.

A credential is `kvc1:<tenant>:<HMAC-SHA256 of the rest under a key made at start>`: nothing
to store, unforgeable without the key, void once the daemon restarts (clients then Connect
again and get a new one), accepted on the unix socket only and never an admin's. On the unix
socket, a token the daemon does not know counts as none.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore.config.root import AdminsConfig, TenantConfig
from kvstore.shared.errors import PermissionDenied, Unauthenticated
from kvstore.shared.peers import Peer

_CREDENTIAL_PREFIX = "kvc1"


@dataclass(frozen=True)
class Caller:
    tenant: str | None  # None: in no tenant
    admin: bool = False
    peer: Peer | None = None  # local-channel callers
    who: str = "a caller"  # for messages: "uid 1001", "a gRPC caller without a token"


class Tenancy:
    def __init__(
        self,
        tenants: Sequence[TenantConfig] = (),
        admins: AdminsConfig | None = None,
        admin_token: str | None = None,
        tenant_tokens: Mapping[str, frozenset[str]] | None = None,
    ) -> None:
        self.enabled = bool(tenants)
        self.names = [t.name for t in tenants] or [""]
        self._by_uid = {uid: t.name for t in tenants for uid in t.uids}
        self._by_gid = {gid: t.name for t in tenants for gid in t.gids}
        admins = admins or AdminsConfig()
        self._admin_uids = frozenset((0, os.geteuid(), *admins.uids))  # root, the daemon's own user
        self._admin_gids = frozenset(admins.gids)
        self._admin_token = admin_token
        self._tokens = {token: name for name, tokens in (tenant_tokens or {}).items() for token in tokens}
        self._key = os.urandom(32)

    # -- who is calling -----------------------------------------------------

    def of_peer(self, peer: Peer) -> Caller:
        """A local-channel caller, by its socket's credentials. A process whose uid and groups
        match more than one tenant is in none: it could open each one's arena."""
        groups = (peer.gid, *peer.groups)
        admin = peer.uid in self._admin_uids or any(g in self._admin_gids for g in groups)
        who = f"uid {peer.uid} (gid {peer.gid})"
        if not self.enabled:
            return Caller("", admin, peer, who)
        matched = {self._by_uid[peer.uid]} if peer.uid in self._by_uid else set()
        matched.update(self._by_gid[g] for g in groups if g in self._by_gid)
        if len(matched) > 1:
            names = " and ".join(repr(name) for name in sorted(matched))
            return Caller(None, admin, peer, f"{who}, which matches tenants {names} (one at most),")
        return Caller(matched.pop() if matched else None, admin, peer, who)

    @property
    def members(self) -> bool:
        """Whether local-channel connections are kept only for tenants' members and admins."""
        return self.enabled

    def of_token(self, token: str | None, unix: bool = True) -> Caller:
        """A gRPC caller, by the bearer token it sent (None: none). On the unix socket a token
        this daemon does not know is no token (a client may carry one for another daemon);
        credentials (`credential`) count only there."""
        anonymous = Caller(None if self.enabled else "", False, None, "a gRPC caller without a token")
        if token is None:
            return anonymous
        if not (token.isascii() and token.isprintable()):
            raise Unauthenticated("the token in 'authorization: Bearer <token>' must be printable ASCII")
        if self._admin_token is not None and hmac.compare_digest(token.encode(), self._admin_token.encode()):
            return Caller(None if self.enabled else "", True, None, "the holder of server.auth_token")
        if unix and token.startswith(_CREDENTIAL_PREFIX + ":"):
            caller = self._redeem(token)
            if caller is not None:
                return caller
        tenant = self._tokens.get(token)
        if tenant is not None:
            return Caller(tenant, False, None, f"a token of tenant {tenant!r}")
        if unix:
            return anonymous
        raise Unauthenticated(
            "the token in 'authorization: Bearer <token>' is not one this daemon knows (server.auth_token, "
            "a tenant's tokens_file, or a credential from a Connect since the daemon last started): "
            "Connect again, or check the token"
        )

    # -- credentials for gRPC, issued on the local channel -------------------

    def credential(self, caller: Caller) -> str:
        """A tenant member's gRPC credential (none without tenants, where gRPC callers on the unix
        socket are the one tenant anyway); it never carries admin rights."""
        if not self.enabled or caller.tenant is None:
            return ""
        body = f"{_CREDENTIAL_PREFIX}:{caller.tenant}"
        return f"{body}:{self._mac(body)}"

    def _mac(self, body: str) -> str:
        return hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()

    def _redeem(self, token: str) -> Caller | None:
        body, _, mac = token.rpartition(":")
        if not hmac.compare_digest(mac.encode(), self._mac(body).encode()):
            return None
        tenant = body.split(":", 1)[1]
        return Caller(tenant, False, None, f"a credential of tenant {tenant!r}")

    # -- what a caller may do ------------------------------------------------

    def tenant_of(self, caller: Caller) -> str:
        """The tenant whose pages `caller` works with, or the reason it has none."""
        if caller.tenant is not None:
            return caller.tenant
        if caller.peer is None and not caller.admin:
            raise Unauthenticated(
                "this daemon has tenants: a gRPC caller is known by a bearer token (a tenant's, from its "
                "tokens_file), or connects over the local channel, where its uid is known (KVStoreClient "
                "does so on the daemon's host)"
            )
        raise PermissionDenied(
            f"{caller.who} is in no tenant of this daemon: an operator adds its uid or a gid to a tenant "
            f"(tenants[].uids, tenants[].gids in the daemon's config)"
        )

    @staticmethod
    def check_admin(caller: Caller, what: str) -> None:
        if not caller.admin:
            raise PermissionDenied(
                f"{what} is for admins (root, admins.uids, admins.gids, or server.auth_token over TCP), "
                f"not {caller.who}"
            )
