"""The socket path, claimed as a root daemon must: nothing another user plants there is followed,
truncated or deleted, and nothing the daemon creates is ever wider than its configured mode."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.server.daemon import arena_name
from tests.harness import launch_daemon, python_env, start_daemon, write_config

NOBODY = 65534


def refused(config: Path) -> str:
    """Runs kvstored on `config`, which must refuse to start; its stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "kvstore.server.daemon", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=python_env(),
    )
    assert result.returncode == 1, result.stderr
    return result.stderr


def run_dir(tmp_path: Path) -> tuple[Path, Path]:
    directory = tmp_path / "run"
    directory.mkdir(mode=0o755)
    socket_path = directory / "kvstored.sock"
    return write_config(tmp_path / "kvstored.yaml", socket_path), socket_path


def test_a_regular_file_at_the_socket_path_is_never_deleted(tmp_path: Path) -> None:
    config, socket_path = run_dir(tmp_path)
    socket_path.write_bytes(b"someone's data")
    stderr = refused(config)
    assert "server.unix_socket" in stderr and "is not a socket" in stderr
    assert socket_path.read_bytes() == b"someone's data"


def test_a_symlink_at_the_socket_path_is_never_followed_or_deleted(tmp_path: Path) -> None:
    config, socket_path = run_dir(tmp_path)
    target = tmp_path / "target"
    target.write_bytes(b"kept")
    socket_path.symlink_to(target)
    assert "is a symlink" in refused(config)
    assert socket_path.is_symlink() and target.read_bytes() == b"kept"


def test_a_symlink_planted_at_the_lock_file_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    config, socket_path = run_dir(tmp_path)
    target = tmp_path / "root-owned"
    target.write_bytes(b"root's file\n")
    lock = socket_path.with_name("kvstored.sock.lock")
    lock.symlink_to(target)
    stderr = refused(config)
    assert "server.unix_socket" in stderr and "kvstored.sock.lock is a symlink" in stderr
    assert target.read_bytes() == b"root's file\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_lock_file_of_another_user_is_refused(tmp_path: Path) -> None:
    config, socket_path = run_dir(tmp_path)
    lock = socket_path.with_name("kvstored.sock.lock")
    lock.write_bytes(b"4242\n")
    os.chown(lock, NOBODY, NOBODY)
    assert "not a regular file of this daemon's user" in refused(config)
    assert lock.read_bytes() == b"4242\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_socket_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    config, socket_path = run_dir(tmp_path)
    os.chown(socket_path.parent, NOBODY, NOBODY)
    stderr = refused(config)
    assert "server.unix_socket" in stderr and f"belongs to uid {NOBODY}" in stderr
    assert list(socket_path.parent.iterdir()) == []


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_a_socket_directory_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    config, socket_path = run_dir(tmp_path)
    socket_path.parent.chmod(mode)
    stderr = refused(config)
    assert "server.unix_socket" in stderr and "writable by its group or by others" in stderr
    assert list(socket_path.parent.iterdir()) == []


def test_a_socket_directory_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    (tmp_path / "link").symlink_to(real)
    config = write_config(tmp_path / "kvstored.yaml", tmp_path / "link" / "kvstored.sock")
    assert "is a symlink; name the real directory" in refused(config)
    assert list(real.iterdir()) == []


def test_a_missing_socket_directory_is_created_private_to_writes(tmp_path: Path) -> None:
    socket_path = tmp_path / "new" / "deeper" / "kvstored.sock"
    config = write_config(tmp_path / "kvstored.yaml", socket_path)
    daemon = launch_daemon(["--config", str(config)], config, socket_path, tmp_path / "kvstored.log")
    try:
        directory = daemon.socket_path.parent
        # Writable by its owner only, and open for other users' clients to reach the socket in it
        # (the socket's own mode decides who may connect).
        assert stat.S_IMODE(directory.stat().st_mode) == 0o755
        assert stat.S_IMODE(directory.parent.stat().st_mode) == 0o755
    finally:
        assert daemon.stop() == 0


def test_under_umask_000_every_file_gets_its_own_mode(tmp_path: Path) -> None:
    """The sockets are created private and then given server.socket_mode; the lock file is 0600;
    nothing the daemon made is world-writable at any time after start."""
    (tmp_path / "kvstored").mkdir(mode=0o755)  # the daemon's directory, made before the umask
    previous = os.umask(0)
    try:
        daemon = start_daemon(tmp_path)
    finally:
        os.umask(previous)
    try:
        socket_path = daemon.socket_path
        modes = {
            path.name: stat.S_IMODE(path.lstat().st_mode)
            for path in socket_path.parent.iterdir()
            if path.name.startswith("kvstored.sock")
        }
        assert modes == {"kvstored.sock": 0o660, "kvstored.sock.local": 0o660, "kvstored.sock.lock": 0o600}
        assert stat.S_IMODE(daemon.arena_path.stat().st_mode) == 0o600
    finally:
        assert daemon.stop() == 0


# -- tiers.cpu.shm_dir: the arena's directory may be shared (/dev/shm), its file is the daemon's own --


def shm_dir_config(tmp_path: Path, mode: int) -> tuple[Path, Path, Path]:
    """A config whose arena lives in tmp_path/shm (given `mode`); the config, shm dir, arena path."""
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(mode)
    (tmp_path / "run").mkdir(mode=0o755)
    socket_path = tmp_path / "run" / "kvstored.sock"
    config = write_config(tmp_path / "kvstored.yaml", socket_path, tiers__cpu__shm_dir=str(shm))
    return config, shm, shm / arena_name(socket_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_an_shm_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    config, shm, _ = shm_dir_config(tmp_path, 0o755)
    os.chown(shm, NOBODY, NOBODY)
    stderr = refused(config)
    assert "tiers.cpu.shm_dir" in stderr and f"belongs to uid {NOBODY}" in stderr
    assert list(shm.iterdir()) == []


def test_an_shm_dir_others_can_write_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    config, shm, _ = shm_dir_config(tmp_path, 0o777)
    stderr = refused(config)
    assert "tiers.cpu.shm_dir" in stderr and "without the sticky bit" in stderr
    assert list(shm.iterdir()) == []


def test_a_shared_sticky_shm_dir_like_dev_shm_serves_with_an_arena_of_the_daemons_own(tmp_path: Path) -> None:
    config, shm, arena = shm_dir_config(tmp_path, 0o1777)
    daemon = launch_daemon(
        ["--config", str(config)], config, tmp_path / "run" / "kvstored.sock", tmp_path / "log"
    )
    try:
        info = arena.lstat()
        assert (
            stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o600
        )
    finally:
        assert daemon.stop() == 0
    assert not arena.exists()


def test_a_symlink_planted_at_the_arena_path_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    config, shm, arena = shm_dir_config(tmp_path, 0o1777)
    target = tmp_path / "root-owned"
    target.write_bytes(b"root's file\n")
    arena.symlink_to(target)
    stderr = refused(config)
    assert "tiers.cpu.shm_dir" in stderr and "is a symlink" in stderr
    assert arena.is_symlink() and target.read_bytes() == b"root's file\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_file_of_another_user_at_the_arena_path_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    config, shm, arena = shm_dir_config(tmp_path, 0o1777)
    arena.write_bytes(b"someone's data")
    os.chown(arena, NOBODY, NOBODY)
    stderr = refused(config)
    assert "tiers.cpu.shm_dir" in stderr and f"a file of uid {NOBODY}" in stderr
    assert arena.read_bytes() == b"someone's data" and arena.stat().st_uid == NOBODY


def test_a_stale_arena_of_the_daemons_own_is_replaced(tmp_path: Path) -> None:
    config, shm, arena = shm_dir_config(tmp_path, 0o1777)
    arena.write_bytes(b"a dead daemon's arena")
    daemon = launch_daemon(
        ["--config", str(config)], config, tmp_path / "run" / "kvstored.sock", tmp_path / "log"
    )
    try:
        assert arena.stat().st_size == 64 << 20  # the new arena, of tiers.cpu.bytes
    finally:
        assert daemon.stop() == 0
