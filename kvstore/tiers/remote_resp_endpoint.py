"""Where and how to reach one Redis or Valkey server (`remote_resp` connects to it).

- `Endpoint.parse(url)`: the address (a unix socket path, or host and port), AUTH with a user
  and a password, SELECT, and TLS for `rediss://`: `ssl_ca_certs`, `ssl_certfile`,
  `ssl_keyfile`, `ssl_cert_reqs=none`, `ssl_check_hostname=false` in the query, as redis-py
  takes them; `endpoint.at(host, port)`: the same credentials and TLS at another node of a
  cluster.
- `Address`, `address_of(settings)`, `format_address(address)`: an address from redis-py's
  parsed URL settings (its defaults for what the URL leaves out), and as text.
- `tls_context(settings)`: the TLS context those settings ask for.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, replace
from typing import Any

DEFAULT_PORT = 6379  # as redis-py takes a URL without a port

Address = str | tuple[str, int]  # a unix socket path, or (host, port)


def address_of(settings: dict[str, Any]) -> Address:
    """A unix socket path, or (host, port) with redis-py's defaults for what the URL leaves out."""
    if "path" in settings:
        return str(settings["path"])
    return str(settings.get("host", "localhost")), int(settings.get("port", DEFAULT_PORT))


def format_address(address: Address) -> str:
    return address if isinstance(address, str) else f"{address[0]}:{address[1]}"


@dataclass(frozen=True)
class Endpoint:
    """Where and how to reach one server."""

    address: Address
    username: str | None = None
    password: str | None = None
    db: int = 0
    tls: ssl.SSLContext | None = None

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        from redis.connection import parse_url

        settings: dict[str, Any] = parse_url(url)
        return cls(
            address_of(settings),
            settings.get("username"),
            settings.get("password"),
            int(settings.get("db") or 0),
            tls_context(settings) if url.startswith("rediss://") else None,
        )

    def at(self, host: str, port: int) -> Endpoint:
        return replace(self, address=(host, port))

    def __str__(self) -> str:
        return format_address(self.address)


def tls_context(settings: dict[str, Any]) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=settings.get("ssl_ca_certs"))
    if settings.get("ssl_certfile"):
        context.load_cert_chain(settings["ssl_certfile"], settings.get("ssl_keyfile"))
    if str(settings.get("ssl_cert_reqs", "required")).lower() == "none":
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif settings.get("ssl_check_hostname") is False:
        context.check_hostname = False
    return context
