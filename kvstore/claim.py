"""Claiming the daemon's socket path, safely for a daemon that runs as root.

The socket's directory may be one that other users can reach (`server.unix_socket` names any
path). Nothing another user can plant there is followed, truncated or deleted:

- `check_directory(directory)`: created 0755 if missing (its parents too); an existing one
  must be a real directory (not a symlink), owned by this user or root, and writable by no
  one else (no group or other write bit): anyone who could write it could unlink the socket
  and bind their own, or plant the lock file.
- `SocketClaim(socket_path)`: an flock on `<socket>.lock`, opened with O_NOFOLLOW (a symlink
  planted there is refused, never followed into a file of root's) and checked to be a regular
  file of this user before the daemon writes its pid into it. A live daemon holding the lock:
  `AlreadyRunning`. Then whatever is left at the socket path is removed only if it is a socket
  of this user (a dead daemon's); anything else there is refused (`ClaimRefused`).
- `remove_stale_socket(path, key)`: that last rule, for the local channel's socket too.

Every refusal names the config key to change (`server.unix_socket`, or the key given).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from pathlib import Path

from kvstore.config import ConfigError

log = logging.getLogger("kvstored")

KEY = "server.unix_socket"


class AlreadyRunning(RuntimeError):
    pass


class ClaimRefused(ConfigError):
    def __init__(self, message: str, key: str = KEY) -> None:
        super().__init__(key, message)


def check_directory(directory: Path, key: str = KEY) -> None:
    if not os.path.lexists(directory):
        previous = os.umask(0o022)  # the daemon's umask (077) would keep other users' clients out
        try:
            directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        finally:
            os.umask(previous)
    info = os.lstat(directory)
    uid = os.geteuid()
    if stat.S_ISLNK(info.st_mode):
        raise ClaimRefused(f"the socket's directory {directory} is a symlink; name the real directory", key)
    if not stat.S_ISDIR(info.st_mode):
        raise ClaimRefused(f"the socket's directory {directory} is not a directory", key)
    if info.st_uid not in (uid, 0):
        raise ClaimRefused(
            f"the socket's directory {directory} belongs to uid {info.st_uid}, not to this daemon's user "
            f"({uid}) or root: its owner could replace the socket; use a directory of this user",
            key,
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ClaimRefused(
            f"the socket's directory {directory} is writable by its group or by others "
            f"(mode {stat.S_IMODE(info.st_mode):o}): anyone who can write it could replace the socket; "
            f"use a directory only its owner can write (e.g. /run/kvstore)",
            key,
        )


def remove_stale_socket(path: Path, key: str = KEY) -> None:
    """Removes a socket this user left at `path`; refuses anything else there."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a socket"
        raise ClaimRefused(
            f"{path} exists and is {kind}: the daemon removes only a socket it left there; "
            f"remove it yourself or choose another path",
            key,
        )
    if info.st_uid != os.geteuid():
        raise ClaimRefused(
            f"{path} is a socket of uid {info.st_uid}, not this daemon's: choose another path", key
        )
    log.warning("removing stale socket %s left by a daemon that did not shut down", path)
    path.unlink()


class SocketClaim:
    """Exclusive ownership of a socket path, through an flock on `<socket>.lock`."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.lock_path = socket_path.with_name(socket_path.name + ".lock")
        check_directory(socket_path.parent)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self._fd = os.open(self.lock_path, flags, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ClaimRefused(
                    f"{self.lock_path} is a symlink: remove it; it is never followed"
                ) from None
            raise
        try:
            info = os.fstat(self._fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise ClaimRefused(
                    f"{self.lock_path} is not a regular file of this daemon's user (uid {info.st_uid}): "
                    f"remove it or choose another path"
                )
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
                raise AlreadyRunning(
                    f"another kvstored (pid {pid}) is serving {socket_path}; stop it first "
                    f"or set server.unix_socket to another path"
                ) from None
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
            remove_stale_socket(socket_path)
        except BaseException:
            os.close(self._fd)
            raise

    def release(self) -> None:
        self.socket_path.unlink(missing_ok=True)
        self.lock_path.unlink(missing_ok=True)
        os.close(self._fd)
