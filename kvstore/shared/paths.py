"""Where the daemon's socket lives by default, for the daemon and its clients alike.

- `default_runtime_dir()`: /run/kvstore as root; else $RUNTIME_DIRECTORY (a systemd service),
  $XDG_RUNTIME_DIR/kvstore, or ~/.kvstore: never a predictable path under /tmp, which another
  user could create first.
- `default_socket_path()`: `kvstored.sock` in it (`server.unix_socket: auto`).
- `local_socket_of(address)`: the daemon's local channel beside its gRPC unix socket
  (`<socket>.local`); "" for an address that is not a unix socket.
- `default_token()`: the bearer token a client sends to a daemon over TCP when it is given none:
  $KVSTORE_TOKEN, or the content of the file $KVSTORE_TOKEN_FILE names (`read_token`). Neither
  puts the token on a command line, where every user on the host can read it (/proc/PID/cmdline).
"""

from __future__ import annotations

import os
from pathlib import Path

LOCAL_SUFFIX = ".local"


def local_socket_of(address: str) -> str:
    for scheme in ("unix://", "unix:"):
        if address.startswith(scheme):
            return address[len(scheme) :] + LOCAL_SUFFIX
    return ""


def default_runtime_dir() -> Path:
    uid = os.geteuid()
    if uid == 0:
        return Path("/run/kvstore")
    # A service with RuntimeDirectory= and User= gets no XDG_RUNTIME_DIR, but systemd names its directory.
    systemd_dir = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if systemd_dir:
        return Path(systemd_dir)
    xdg_dir = os.environ.get("XDG_RUNTIME_DIR")
    if xdg_dir:
        return Path(xdg_dir) / "kvstore"
    return Path.home() / ".kvstore"


def default_socket_path() -> Path:
    return default_runtime_dir() / "kvstored.sock"


TOKEN_ENV = "KVSTORE_TOKEN"
TOKEN_FILE_ENV = "KVSTORE_TOKEN_FILE"


def read_token(path: str) -> str:
    """The token in file `path`, stripped; ValueError naming the file if it cannot be read or is empty."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"token file {path}: cannot read it ({err})") from None
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def default_token() -> str | None:
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return token
    path = os.environ.get(TOKEN_FILE_ENV, "")
    return read_token(path) if path else None
