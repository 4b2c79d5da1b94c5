"""Where the daemon's socket lives by default, for the daemon and its clients alike.

- `default_runtime_dir()`: /run/kvstore as root; else $RUNTIME_DIRECTORY (a systemd service),
  $XDG_RUNTIME_DIR/kvstore, or ~/.kvstore: never a predictable path under /tmp, which another
  user could create first.
- `default_socket_path()`: `kvstored.sock` in it (`server.unix_socket: auto`).
"""

from __future__ import annotations

import os
from pathlib import Path


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
