"""Config loading: defaults, the shipped files, sizes, modes, and the messages a user sees."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore.config.root import (
    Config,
    ConfigError,
    CpuTierConfig,
    EvictionConfig,
    LeaseConfig,
    ServerConfig,
    load_config,
    parse_config,
    parse_size,
)
from kvstore.shared.paths import default_runtime_dir, default_socket_path

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TOKEN_HINT = "(clients send it as 'authorization: Bearer <token>' metadata)"


def error_of(data: Any) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return str(info.value)


# --- defaults and shipped files ---------------------------------------------------------------


def test_empty_config_gives_every_default() -> None:
    config = parse_config({})

    assert config == Config() == parse_config(None)
    assert config.log_level == "info"
    assert config.chunk_tokens == 256
    assert config.server == ServerConfig()
    assert config.server.unix_socket == "auto"
    assert config.server.socket_mode == 0o660
    assert config.server.tcp is None and config.server.token is None
    assert config.server.max_message_bytes == 1088 * 2**10
    assert config.server.grace_s == 5.0
    assert config.leases == LeaseConfig(ttl_s=30.0, max_ttl_s=600.0, reap_interval_s=0.25, quarantine_s=300.0)
    assert config.tiers.cpu == CpuTierConfig(
        bytes=2**30, slab_bytes=256 * 2**20, shm_dir="/dev/shm", file_mode=0o600, prefault=True
    )
    assert config.eviction == EvictionConfig(policy="lfuda", pin_fraction=0.1, max_pin_ttl_s=86400.0)


def test_shipped_default_file_is_exactly_the_defaults() -> None:
    assert load_config(CONFIGS / "kvstored.yaml") == Config()


def all_keys(data: dict[str, Any]) -> list[str]:
    nested = [all_keys(value) if isinstance(value, dict) else [] for value in data.values()]
    return [*data, *(key for keys in nested for key in keys)]


def test_shipped_default_file_spells_out_every_key() -> None:
    text = (CONFIGS / "kvstored.yaml").read_text()
    keys = all_keys(Config().to_dict())

    missing = [key for key in keys if not re.search(rf"^\s*{key}:", text, re.MULTILINE)]

    assert missing == []


def test_shipped_tcp_file_adds_a_listener_with_a_token_file() -> None:
    config = load_config(CONFIGS / "kvstored-tcp.yaml")

    assert config.server.tcp == "127.0.0.1:50051"
    assert config.server.auth_token_file == "/etc/kvstore/token"
    assert config.tiers == Config().tiers


def test_shipped_remote_file_shares_pages_through_a_server() -> None:
    config = load_config(CONFIGS / "kvstored-remote.yaml")

    remote = config.tiers.remote
    assert (remote.enabled, remote.url, remote.write) == (True, "redis://kv-cache.internal:6379/0", "through")
    assert config.tiers.disk.enabled and config.tiers.cpu == Config().tiers.cpu


def test_systemd_unit_runs_the_daemon_with_the_etc_config() -> None:
    lines = set((CONFIGS / "kvstored.service").read_text().splitlines())

    for line in (
        "ExecStart=/usr/bin/env kvstored --config /etc/kvstore/kvstored.yaml",  # from the unit's PATH
        "Environment=PATH=/opt/kvstore/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin",
        "RuntimeDirectory=kvstore",
        "Restart=on-failure",
        "KillSignal=SIGTERM",
        "TimeoutStopSec=30",
        "LimitMEMLOCK=infinity",
    ):
        assert line in lines
    # A private /dev (the host's /dev/shm and /dev/hugepages stay shared); the GPU tier's drop-in
    # gives the NVIDIA devices back.
    assert "PrivateDevices=yes" in lines
    gpu = set((CONFIGS.parent / "deploy" / "systemd" / "gpu.conf").read_text().splitlines())
    assert {"PrivateDevices=no", "DeviceAllow=char-nvidia* rw"} <= gpu


def test_to_dict_round_trips_and_hides_the_token() -> None:
    tls = {"cert_file": "/etc/kvstore/tls/k.crt", "key_file": "/etc/kvstore/tls/k.key"}
    server = {"tcp": "0.0.0.0:50051", "auth_token": "s3cret", "tls": tls}
    config = parse_config({"server": server, "log_level": "DEBUG"})

    assert parse_config(config.to_dict(redact=False)) == config
    assert config.to_dict()["server"]["auth_token"] == "<redacted>"
    assert config.to_dict()["tiers"]["cpu"]["bytes"] == 2**30


# --- sizes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 536870912),
        ("8GiB", 8 * 2**30),
        ("1.5GiB", 3 * 2**29),
        ("64KiB", 65536),
        ("1TiB", 2**40),
        ("2GB", 2 * 10**9),
        ("4096", 4096),
        (4096, 4096),
        (" 8 gib ", 8 * 2**30),
        ("0", 0),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["lots", "", "8G", "-1", -1, "1.5", "1.3KiB", "8 GiB 2", "1e3", True, "0x10"]
)
def test_parse_size_refuses(text: Any) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_sizes_in_the_config() -> None:
    config = parse_config({"tiers": {"cpu": {"bytes": "8GiB", "slab_bytes": 64 * 2**20}}})

    assert config.tiers.cpu.bytes == 8 * 2**30
    assert config.tiers.cpu.slab_bytes == 64 * 2**20


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"tiers": {"cpu": {"bytes": "lots"}}}, "tiers.cpu.bytes: expected a size like 8GiB, got 'lots'"),
        ({"tiers": {"cpu": {"bytes": 1.5}}}, "tiers.cpu.bytes: expected a size like 8GiB, got 1.5"),
        ({"tiers": {"cpu": {"bytes": 0}}}, "tiers.cpu.bytes: expected a value >= 4KiB, got 0"),
        ({"tiers": {"cpu": {"bytes": 1000}}}, "tiers.cpu.bytes: expected a value >= 4KiB, got 1000"),
        (
            {"tiers": {"cpu": {"bytes": "64MiB", "slab_bytes": 100}}},
            "tiers.cpu.slab_bytes: expected a value >= 4KiB, got 100",
        ),
        ({"tiers": {"gpu": {"slab_bytes": 100}}}, "tiers.gpu.slab_bytes: expected a value >= 4KiB, got 100"),
        ({"chunk_tokens": 1000000000000}, "chunk_tokens: expected a value <= 1048576, got 1000000000000"),
        (
            {"tiers": {"cpu": {"bytes": "128MiB"}}},
            "tiers.cpu.slab_bytes: expected at most tiers.cpu.bytes (128MiB), got 256MiB",
        ),
        (
            {"server": {"max_message_bytes": "32KiB"}},
            "server.max_message_bytes: expected a value >= 64KiB, got 32KiB",
        ),
        (
            {"server": {"max_message_bytes": "1GiB"}},
            "server.max_message_bytes: expected a value <= 64MiB, got 1GiB",
        ),
    ],
)
def test_bad_sizes_name_the_key(data: dict[str, Any], message: str) -> None:
    assert error_of(data) == message


# --- unknown keys and wrong types -------------------------------------------------------------------


def test_unknown_key_suggests_the_close_one() -> None:
    assert (
        error_of({"tiers": {"cpu": {"byts": "1GiB"}}})
        == "tiers.cpu.byts: unknown key (did you mean 'bytes'?)"
    )


def test_unknown_key_without_a_close_one_lists_the_valid_keys() -> None:
    assert (
        error_of({"leases": {"zzz": 1}})
        == "leases.zzz: unknown key (valid keys: ttl_s, max_ttl_s, reap_interval_s, quarantine_s)"
    )
    assert error_of({"gpu": {}}).startswith(
        "gpu: unknown key (valid keys: log_level, log_format, chunk_tokens, server,"
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"chunk_tokens": "abc"}, "chunk_tokens: expected an integer, got 'abc'"),
        ({"chunk_tokens": True}, "chunk_tokens: expected an integer, got True"),
        ({"chunk_tokens": 2.5}, "chunk_tokens: expected an integer, got 2.5"),
        ({"chunk_tokens": 0}, "chunk_tokens: expected a value > 0, got 0"),
        ({"leases": [1, 2]}, "leases: expected a mapping, got a list"),
        ({"tiers": {"cpu": "big"}}, "tiers.cpu: expected a mapping, got 'big'"),
        ({"tiers": {"cpu": {"prefault": "yes"}}}, "tiers.cpu.prefault: expected true or false, got 'yes'"),
        ({"tiers": {"cpu": {"prefault": 1}}}, "tiers.cpu.prefault: expected true or false, got 1"),
        ({"tiers": {"cpu": {"shm_dir": "shm"}}}, "tiers.cpu.shm_dir: expected an absolute path, got 'shm'"),
        ({"leases": {"ttl_s": "soon"}}, "leases.ttl_s: expected a number, got 'soon'"),
        ({"leases": {"ttl_s": None}}, "leases.ttl_s: expected a number, got nothing (null)"),
        ({"leases": {"ttl_s": ".nan"}}, "leases.ttl_s: expected a number, got '.nan'"),
        ({"leases": {"ttl_s": 0}}, "leases.ttl_s: expected a value > 0, got 0.0"),
        (
            {"leases": {"ttl_s": 60, "max_ttl_s": 30}},
            "leases.max_ttl_s: expected a value >= leases.ttl_s (60.0), got 30.0",
        ),
        ({"server": {"grace_s": -1}}, "server.grace_s: expected a value >= 0, got -1.0"),
        ({"server": {"gc_freeze_s": -1}}, "server.gc_freeze_s: expected a value >= 0, got -1.0"),
        ({"server": {"gc_full_s": "hourly"}}, "server.gc_full_s: expected a number, got 'hourly'"),
        ({"server": {"auth_token": 12345}}, "server.auth_token: expected a string, got 12345"),
        ({"server": {"unix_socket": ""}}, "server.unix_socket: expected a non-empty string"),
        ({"eviction": {"policy": " "}}, "eviction.policy: expected a non-empty string"),
        ([1], "(top level): expected a mapping, got a list"),
    ],
)
def test_wrong_values_name_the_dotted_key(data: Any, message: str) -> None:
    assert error_of(data) == message


def test_numbers_convert_to_floats_including_yaml_exponents() -> None:
    config = parse_config({"leases": {"ttl_s": 10, "max_ttl_s": "1e3"}, "server": {"grace_s": 0}})

    assert config.leases.ttl_s == 10.0 and isinstance(config.leases.ttl_s, float)
    assert config.leases.max_ttl_s == 1000.0
    assert config.server.grace_s == 0.0


def test_an_empty_section_keeps_its_defaults() -> None:
    assert parse_config({"leases": None, "tiers": {"cpu": None}}) == Config()


@pytest.mark.parametrize(
    ("given", "stored"), [("DEBUG", "debug"), ("Warning", "warning"), ("error", "error")]
)
def test_log_level_is_case_insensitive(given: str, stored: str) -> None:
    assert parse_config({"log_level": given}).log_level == stored


def test_log_level_outside_the_choices() -> None:
    assert (
        error_of({"log_level": "verbose"})
        == "log_level: expected one of debug, info, warning, error, got 'verbose'"
    )


# --- octal modes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "mode"), [(0o660, 0o660), ("0660", 0o660), ("0o640", 0o640), ("600", 0o600), (0, 0)]
)
def test_modes(given: Any, mode: int) -> None:
    config = parse_config({"server": {"socket_mode": given}, "tiers": {"cpu": {"file_mode": given}}})

    assert config.server.socket_mode == mode
    assert config.tiers.cpu.file_mode == mode


def test_yaml_octal_mode_is_read_as_octal(tmp_path: Path) -> None:
    path = tmp_path / "kvstored.yaml"
    path.write_text("server:\n  socket_mode: 0660\ntiers:\n  cpu:\n    file_mode: '0o640'\n")

    config = load_config(path)

    assert config.server.socket_mode == 0o660
    assert config.tiers.cpu.file_mode == 0o640


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            660,
            "server.socket_mode: expected a file mode like 0660 or '0o660', got 660 "
            "(= 0o1224; write the mode with a leading 0)",
        ),
        ("0689", "server.socket_mode: expected a file mode like 0660 or '0o660', got '0689'"),
        ("rw-rw----", "server.socket_mode: expected a file mode like 0660 or '0o660', got 'rw-rw----'"),
        (True, "server.socket_mode: expected a file mode like 0660 or '0o660', got True"),
        (-1, "server.socket_mode: expected a file mode like 0660 or '0o660', got -1"),
    ],
)
def test_bad_modes(given: Any, message: str) -> None:
    assert error_of({"server": {"socket_mode": given}}) == message


# --- TCP and tokens ---------------------------------------------------------------------------------


def test_tcp_without_a_token_is_refused() -> None:
    assert error_of({"server": {"tcp": "127.0.0.1:50051"}}) == (
        "server.tcp: a TCP listener needs server.auth_token or server.auth_token_file " + TOKEN_HINT
    )


def test_both_token_fields_are_refused() -> None:
    message = error_of({"server": {"auth_token": "a", "auth_token_file": "/etc/kvstore/token"}})

    assert message == "server.auth_token: set server.auth_token or server.auth_token_file, not both"


@pytest.mark.parametrize(
    "address", ["127.0.0.1:50051", "[::1]:50051", "0.0.0.0:1", "[::]:65535", "kv-host.local:80"]
)
def test_tcp_addresses(address: str) -> None:
    tls = {"cert_file": "/etc/kvstore/tls/k.crt", "key_file": "/etc/kvstore/tls/k.key"}
    config = parse_config({"server": {"tcp": address, "auth_token": "t0ken", "tls": tls}})

    assert config.server.tcp == address
    assert config.server.token == "t0ken"


@pytest.mark.parametrize(
    "address", ["50051", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536", "::1:50051", "a b:1", ":50051"]
)
def test_bad_tcp_addresses(address: str) -> None:
    message = error_of({"server": {"tcp": address, "auth_token": "t0ken"}})

    assert message == (
        "server.tcp: expected host:port with a port in 1..65535, like 127.0.0.1:50051 or [::1]:50051, "
        f"got {address!r}"
    )


def test_token_is_read_from_the_file_and_stripped(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("  s3cret-token\n")

    server = parse_config({"server": {"tcp": "127.0.0.1:50051", "auth_token_file": str(token_file)}}).server

    assert server.token == "s3cret-token"


def test_unreadable_or_empty_token_file_names_the_key(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")

    with pytest.raises(ConfigError, match=r"^server\.auth_token_file: cannot read the token: .*No such file"):
        _ = ServerConfig(auth_token_file=str(tmp_path / "missing")).token
    with pytest.raises(
        ConfigError, match=r"^server\.auth_token_file: '.*empty' is empty; write the token into it$"
    ):
        _ = ServerConfig(auth_token_file=str(empty)).token


def test_token_must_fit_in_grpc_metadata() -> None:
    assert error_of({"server": {"auth_token": "two words"}}) == (
        "server.auth_token: expected a token of printable ASCII characters without spaces"
    )


# --- files --------------------------------------------------------------------------------------


def test_errors_from_a_file_are_prefixed_with_it(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("tiers:\n  cpu:\n    bytes: lots\n")

    with pytest.raises(ConfigError) as info:
        load_config(path)

    assert str(info.value) == f"{path}: tiers.cpu.bytes: expected a size like 8GiB, got 'lots'"
    assert (info.value.source, info.value.key) == (str(path), "tiers.cpu.bytes")


def test_a_policy_error_names_the_file(tmp_path: Path) -> None:
    from kvstore.store.policy import policy_names

    path = tmp_path / "policy.yaml"
    path.write_text("eviction:\n  policy: fifo\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (
        str(info.value) == f"{path}: eviction.policy: unknown policy 'fifo'; choose one of {policy_names()}"
    )
    assert (info.value.source, info.value.key) == (str(path), "eviction.policy")

    path.write_text("eviction:\n  policy: lru-plain\n")  # a replay baseline, not for serving
    with pytest.raises(ConfigError, match=rf"^{path}: eviction.policy: 'lru-plain' may evict a chain's head"):
        load_config(path)
    assert load_config(CONFIGS / "kvstored.yaml").eviction.policy in policy_names()


def kvstored(*args: str, stdout: int = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.server.daemon", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
    )


def test_check_config_prints_modes_in_octal_as_the_loader_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "modes.yaml"
    path.write_text(f"server:\n  unix_socket: {tmp_path / 's.sock'}\n  socket_mode: 0640\n")
    result = kvstored("--check-config", str(path))
    assert result.returncode == 0 and result.stderr == f"kvstored: {path} is valid\n", result.stderr
    effective = json.loads(result.stdout)
    assert (effective["server"]["socket_mode"], effective["tiers"]["cpu"]["file_mode"]) == ("0o640", "0o600")
    assert '"socket_mode": "0o640"' in result.stdout
    assert effective["server"].pop("socket_path") == str(tmp_path / "s.sock")
    assert parse_config(effective) == load_config(path)


def test_check_config_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(f"server:\n  unix_socket: {tmp_path / 's.sock'}\n")
    read_end, write_end = os.pipe()
    os.close(read_end)  # as `| head` does once it has its lines: nothing reads what follows
    try:
        result = kvstored("--check-config", str(path), stdout=write_end)
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (128 + signal.SIGPIPE, "")


def test_a_check_after_loading_names_the_file_too(tmp_path: Path) -> None:
    path = tmp_path / "caps.yaml"
    path.write_text("server:\n  max_local_connections: 8\n  max_local_connections_per_uid: 16\n")
    for option in ("--check-config", "--config"):
        result = kvstored(option, str(path))
        assert (result.returncode, result.stdout) == (1, "")
        assert result.stderr == (
            f"kvstored: {path}: server.max_local_connections_per_uid: expected at most "
            f"server.max_local_connections (8), got 16\n"
        )


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"

    with pytest.raises(ConfigError) as info:
        load_config(path)

    assert str(info.value) == f"{path}: cannot read the config file: No such file or directory"


def test_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("server:\n  tcp: [127.0.0.1:50051\nleases: {}\n")

    with pytest.raises(ConfigError, match=rf"^{path}: line 3, column \d+: invalid YAML: "):
        load_config(path)


def test_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text("tiers:\n  cpu:\n    bytes: 1GiB\n    bytes: 2GiB\n")

    with pytest.raises(ConfigError) as info:
        load_config(path)

    assert str(info.value) == f"{path}: line 4, column 5: invalid YAML: duplicate key 'bytes'"


def test_an_empty_file_gives_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set\n")

    assert load_config(path) == Config()


# --- runtime directory and socket -------------------------------------------------------------------


@pytest.fixture
def no_runtime_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    return monkeypatch


def test_runtime_dir_as_root(no_runtime_env: pytest.MonkeyPatch) -> None:
    no_runtime_env.setattr(os, "geteuid", lambda: 0)
    no_runtime_env.setenv("XDG_RUNTIME_DIR", "/run/user/0")

    assert default_runtime_dir() == Path("/run/kvstore")
    assert default_socket_path() == Path("/run/kvstore/kvstored.sock")


def test_runtime_dir_of_a_user_session(no_runtime_env: pytest.MonkeyPatch) -> None:
    no_runtime_env.setattr(os, "geteuid", lambda: 1000)
    no_runtime_env.setenv("XDG_RUNTIME_DIR", "/run/user/1000")

    assert default_runtime_dir() == Path("/run/user/1000/kvstore")


def test_runtime_dir_without_a_session(no_runtime_env: pytest.MonkeyPatch) -> None:
    """Never a path under /tmp that another user could create first: the user's home."""
    no_runtime_env.setattr(os, "geteuid", lambda: 1000)
    no_runtime_env.setenv("HOME", "/home/alice")

    assert default_runtime_dir() == Path("/home/alice/.kvstore")
    assert ServerConfig().socket_path == Path("/home/alice/.kvstore/kvstored.sock")


def test_runtime_dir_of_a_systemd_service_user(no_runtime_env: pytest.MonkeyPatch) -> None:
    no_runtime_env.setattr(os, "geteuid", lambda: 999)
    no_runtime_env.setenv("RUNTIME_DIRECTORY", "/run/kvstore")

    assert default_runtime_dir() == Path("/run/kvstore")


def test_explicit_socket_path(tmp_path: Path) -> None:
    config = parse_config({"server": {"unix_socket": str(tmp_path / "kv.sock")}})

    assert config.server.socket_path == tmp_path / "kv.sock"
    assert error_of({"server": {"unix_socket": "/" + "s" * 107}}) == (
        "server.unix_socket: expected a path of at most 107 bytes"
    )


def test_config_error_survives_pickling() -> None:
    error = ConfigError("tiers.cpu.bytes", "expected a size like 8GiB, got 'lots'", "x.yaml")

    copy = pickle.loads(pickle.dumps(error))

    assert str(copy) == str(error) == "x.yaml: tiers.cpu.bytes: expected a size like 8GiB, got 'lots'"
    assert (copy.key, copy.source) == ("tiers.cpu.bytes", "x.yaml")


# --- tenants -------------------------------------------------------------------------------------


def test_tenants_are_read_with_their_shares() -> None:
    config = parse_config(
        {
            "tiers": {"cpu": {"bytes": "4GiB"}, "disk": {"enabled": True, "bytes": "100GiB"}},
            "tenants": [
                {"name": "team-a", "uids": [1001], "cpu_bytes": "3GiB", "disk_bytes": "60GiB"},
                {"name": "team-b", "uids": [1002, 1003], "gids": [2000], "cpu_bytes": "1GiB"},
            ],
            "admins": {"gids": [27]},
        }
    )

    a, b = config.tenants
    assert (a.name, a.uids, a.cpu_bytes, b.gids, b.max_namespaces) == (
        "team-a",
        (1001,),
        3 << 30,
        (2000,),
        64,
    )
    assert config.tenant_disk_bytes(a) == 60 << 30 and config.tenant_disk_bytes(b) == 40 << 30
    assert config.admins.gids == (27,)


TENANT = {"name": "a", "uids": [1001], "cpu_bytes": "256MiB"}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"tenants": [{**TENANT, "name": "Team A"}]}, "tenants[0].name: expected 1-63 lower-case letters"),
        ({"tenants": [{"name": "a"}]}, "tenants[0]: a tenant needs members: uids, gids or a tokens_file"),
        ({"tenants": [{**TENANT, "uids": [-1]}]}, "tenants[0].uids[0]: expected an id in 0..4294967294"),
        (
            {"tenants": [TENANT, {**TENANT, "name": "b"}]},
            "tenants[1].uids: uid 1001 is a member of tenants[0]",
        ),
        ({"tenants": [TENANT, TENANT]}, "tenants[1].name: 'a' is tenants[0]'s name too"),
        (
            {"tenants": [{**TENANT, "cpu_bytes": "1MiB"}]},
            "tenants[0].cpu_bytes: expected at least tiers.cpu.slab",
        ),
        (
            {"tenants": [{**TENANT, "cpu_bytes": "2GiB"}]},
            "tiers.cpu.bytes: the tenants' cpu_bytes add up to 2GiB",
        ),
        (
            {"tenants": [{**TENANT, "max_namespaces": 5000}]},
            "tenants[0].max_namespaces: expected a value <= 4096",
        ),
        (
            {"tenants": [{**TENANT, "disk_bytes": "1TiB"}], "tiers": {"disk": {"enabled": True}}},
            "tiers.disk.bytes: the tenants' disk_bytes add up to 1TiB",
        ),
        (
            {"tenants": [TENANT], "tiers": {"gpu": {"enabled": True}}},
            "tiers.gpu.enabled: the GPU tier cannot be combined with tenants",
        ),
        (
            {"tenants": [TENANT], "tiers": {"cpu": {"pinned": True}}},
            "tiers.cpu.pinned: a pinned arena is not offered with tenants yet",
        ),
    ],
    ids=lambda value: "" if isinstance(value, dict) else value.split(":")[0],
)
def test_bad_tenants_name_the_key(data: dict[str, Any], message: str) -> None:
    assert error_of(data).startswith(message)


def test_a_tokens_file_must_be_private_and_hold_one_tenants_tokens(tmp_path: Path) -> None:
    from kvstore.server.daemon import tenancy

    tokens = tmp_path / "tokens"
    tokens.write_text("# team a\n" + "t" * 32 + "\n")
    tokens.chmod(0o644)
    config = parse_config({"tenants": [{**TENANT, "tokens_file": str(tokens)}]})
    with pytest.raises(
        ConfigError, match=r"tenants\[0\]\.tokens_file: .* is readable by others \(mode 644\)"
    ):
        tenancy(config)
    tokens.chmod(0o600)
    assert tenancy(config).of_token("t" * 32).tenant == "a"
    twice = parse_config(
        {
            "tenants": [
                {**TENANT, "tokens_file": str(tokens)},
                {**TENANT, "name": "b", "uids": [], "gids": [5], "tokens_file": str(tokens)},
            ]
        }
    )
    with pytest.raises(ConfigError, match=r"tenants\[1\]\.tokens_file: holds a token of tenant 'a' too"):
        tenancy(twice)
    short = tmp_path / "short"
    short.write_text("abc\n")
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="at least 16 characters"):
        tenancy(parse_config({"tenants": [{**TENANT, "tokens_file": str(short)}]}))


def test_a_record_key_file_must_exist_be_private_and_hold_a_secret(tmp_path: Path) -> None:
    def remote(key_file: Path, enabled: bool = True) -> dict[str, Any]:
        return {"tiers": {"remote": {"enabled": enabled, "record_key_file": str(key_file)}}}

    key_file = tmp_path / "record.key"
    with pytest.raises(ConfigError, match=r"^tiers\.remote\.record_key_file: cannot read .*record\.key"):
        parse_config(remote(key_file))
    key_file.write_bytes(b"\n")
    key_file.chmod(0o600)
    with pytest.raises(ConfigError, match=r"^tiers\.remote\.record_key_file: .* is empty"):
        parse_config(remote(key_file))
    key_file.write_bytes(b"short secret\n")
    with pytest.raises(
        ConfigError, match=r"^tiers\.remote\.record_key_file: .* holds 12 bytes; expected at least 16"
    ):
        parse_config(remote(key_file))
    key_file.write_bytes(bytes(range(32, 64)) + b"\n")
    key_file.chmod(0o640)
    with pytest.raises(
        ConfigError, match=r"^tiers\.remote\.record_key_file: .* readable by others \(mode 640\)"
    ):
        parse_config(remote(key_file))
    key_file.chmod(0o600)
    config = parse_config(remote(key_file))
    assert config.tiers.remote.record_key() == key_file.read_bytes()[:-1]  # the newline is not the key's
    assert parse_config(remote(tmp_path / "absent", enabled=False)).tiers.remote.enabled is False
