"""Claiming the daemon's paths (its socket, its disk directory, its arena), safely for a daemon
that runs as root.

Each may be in a directory that other users can reach (`server.unix_socket`,
`tiers.disk.path` and `tiers.cpu.shm_dir` name any path). Nothing another user can plant there
is followed, truncated, deleted or read as the daemon's own:

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
- `claim_private_directory(directory, key) -> fd`: a directory only the daemon writes (the disk
  tier's): created 0700 if missing, else a real directory of this user or root that no one else
  can write, the very one opened (O_NOFOLLOW, checked through the descriptor). The caller works
  through the descriptor (`/proc/self/fd/<fd>`), so a parent that another user owns can rename
  the directory away but never slip another one in under the daemon. Another user's directory
  is refused, not worked around: its owner could fill it or swap it at any time.
- `check_shared_directory(directory, key)`: a directory that others may create files in (a
  tmpfs like /dev/shm, root's and sticky): of this user or root, and writable by others only
  with the sticky bit, so that no one else can remove or rename a file the daemon made there.
- `remove_stale_file(path, key)`, `create_private_file(path, mode, key) -> fd`: a new file of
  this user at `path` (the arena), made with O_CREAT|O_EXCL|O_NOFOLLOW and checked through its
  descriptor; a stale one this user left there is replaced, anything else refused.

Every refusal names the config key to change (`server.unix_socket`, or the key given).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from pathlib import Path

from kvstore.config.root import ConfigError

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


def _refuse_open(path: Path, exc: OSError, key: str) -> ClaimRefused:
    if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and os.path.islink(path)):
        return ClaimRefused(f"{path} is a symlink; name the real directory (it is never followed)", key)
    if exc.errno == errno.ENOTDIR:
        return ClaimRefused(f"{path} is not a directory", key)
    return ClaimRefused(f"cannot use {path}: {exc.strerror}", key)


def claim_private_directory(directory: Path, key: str) -> int:
    """A descriptor (O_DIRECTORY) on `directory`, made 0700 if missing, which only this user may write."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:  # a dangling symlink, or a file
        pass
    except OSError as exc:
        raise _refuse_open(directory, exc, key) from None
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _refuse_open(directory, exc, key) from None
    info, uid = os.fstat(fd), os.geteuid()
    problem = None
    if info.st_uid not in (uid, 0):
        problem = (
            f"{directory} belongs to uid {info.st_uid}, not to this daemon's user ({uid}) or root: its "
            f"owner could plant records there that the daemon would serve; name a directory of this "
            f"user, or a path that does not exist yet"
        )
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = (
            f"{directory} is writable by its group or by others (mode {stat.S_IMODE(info.st_mode):o}): "
            f"anyone who can write it could plant records there that the daemon would serve; make it "
            f"writable by its owner only (chmod go-w) or name another directory"
        )
    if problem is not None:
        os.close(fd)
        raise ClaimRefused(problem, key)
    return fd


def check_shared_directory(directory: Path, key: str) -> None:
    """`directory` may hold other users' files, but none of them can remove or rename the daemon's."""
    try:
        info = os.stat(directory)
    except OSError as exc:
        raise ClaimRefused(f"cannot use {directory}: {exc.strerror}", key) from None
    uid = os.geteuid()
    if not stat.S_ISDIR(info.st_mode):
        raise ClaimRefused(f"{directory} is not a directory", key)
    if info.st_uid not in (uid, 0):
        raise ClaimRefused(
            f"{directory} belongs to uid {info.st_uid}, not to this daemon's user ({uid}) or root: its "
            f"owner could replace the daemon's files there; use a directory of this user or root",
            key,
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise ClaimRefused(
            f"{directory} is writable by others without the sticky bit (mode "
            f"{stat.S_IMODE(info.st_mode):o}): anyone could replace the daemon's files there; use a "
            f"directory like /dev/shm (mode 1777) or one only its owner can write",
            key,
        )


def remove_stale_file(path: Path, key: str, what: str = "file") -> None:
    """Removes a regular file this user left at `path` (`what`: its name in the log, "arena");
    refuses anything else there."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        if stat.S_ISLNK(info.st_mode):
            kind = "a symlink"
        elif stat.S_ISREG(info.st_mode):
            kind = f"a file of uid {info.st_uid}"
        else:
            kind = "not a regular file"
        raise ClaimRefused(
            f"{path} exists and is {kind}: the daemon replaces only a file it left there; remove it "
            f"yourself or name a directory of the daemon's own",
            key,
        )
    log.warning("replacing stale %s %s, left by a daemon that did not shut down", what, path)
    path.unlink()


def create_private_file(path: Path, mode: int, key: str) -> int:
    """A new regular file of this user at `path`, open read-write (after `remove_stale_file`)."""
    remove_stale_file(path, key)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except FileExistsError:
        raise ClaimRefused(f"{path} was created by someone else while the daemon made it", key) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_nlink != 1:
        os.close(fd)
        raise ClaimRefused(f"{path} is not the daemon's own new file", key)
    return fd
