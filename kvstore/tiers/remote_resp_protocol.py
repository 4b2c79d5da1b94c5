"""The pieces of RESP (the Redis protocol) that need no connection (`remote_resp` holds those).

- `command(*parts)`: a command, encoded.
- `RespError`: the server answered with an error, or with something the tier did not ask for.
- `Redirect`: a cluster's `-MOVED` or `-ASK` (the slot, the node that serves it, and whether it
  is only for this one request), parsed; where to follow one, if anywhere, is the tier's
  decision (`remote_nodes.Nodes.follow`).
- `error_of(line)`: the exception for an error reply (a `Redirect` where it is one).
- `line_reply(line)`: a one-line reply parsed (an integer, a status, or an error, returned).
"""

from __future__ import annotations

import contextlib
from typing import Any


class RespError(OSError):
    """The server answered with an error, or with something the tier did not ask for."""


class Redirect(RespError):
    """A cluster node's `MOVED slot host:port` (the slot lives there now) or `ASK slot host:port`
    (this one request goes there, after ASKING)."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        kind, slot, where = line.split()
        host, _, port = where.rpartition(":")
        self.ask = kind == "ASK"
        self.slot = int(slot)
        self.address: tuple[str, int] = (host.removeprefix("[").removesuffix("]"), int(port))
        if not (0 <= self.slot < 16384 and 0 < self.address[1] < 65536 and host):
            raise ValueError(f"not a redirect: {line[:64]!r}")


def error_of(line: bytes) -> RespError:
    """The exception for an error reply `line` (without its leading '-')."""
    text = line.decode(errors="replace")
    if text.startswith(("MOVED ", "ASK ")) and len(text.split()) == 3:
        with contextlib.suppress(ValueError):  # a malformed one is an error like any other
            return Redirect(text)
    return RespError(text)


def line_reply(line: bytes) -> Any:
    kind = line[:1]
    if kind == b":":
        if not line[1:].lstrip(b"-").isdigit():
            raise RespError(f"an integer reply that is not a number: {line[:64]!r}")
        return int(line[1:])
    if kind == b"+":
        return line[1:]
    if kind == b"-":
        return error_of(line[1:])
    raise RespError(f"expected a one-line reply, got {line[:64]!r}")


def command(*parts: bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)
