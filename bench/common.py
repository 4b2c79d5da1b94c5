"""Helpers every benchmark shares.

- `start_daemon(config)` / `running_daemon(config)`: a real `kvstored` process in its own
  temporary directory, started from a config dict and ready (health SERVING); `Daemon.stop()`
  ends it with SIGTERM and returns its exit status.
- `Latency.of(samples_s)`: p50 / p99 / mean of timed calls, in microseconds.
- `print_table(headers, rows)`: a plain-text table on stdout.
- `write_results(name, payload)`: `bench/results/<name>.json` (the latest, kept in git) and a
  copy of every run in `bench/results/runs/<name>-<UTC timestamp>.json` (ignored by git: a run
  that a note cites is copied beside `<name>.json` by hand), each with a `meta` block
  describing the machine.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import datetime as dt
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"
RUNS_DIR = RESULTS_DIR / "runs"  # every run, timestamped; ignored by git
STARTUP_TIMEOUT_S = 60.0
_PR_SET_PDEATHSIG = 1


class Daemon:
    """A kvstored process started by `start_daemon`; owns its run directory."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        run_dir: Path,
        socket_path: Path,
        log_path: Path,
        owns_run_dir: bool,
    ) -> None:
        self.process = process
        self.run_dir = run_dir
        self.socket_path = socket_path
        self.log_path = log_path
        self._owns_run_dir = owns_run_dir

    @property
    def address(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def cpu_seconds(self) -> float:
        """User + system CPU time the daemon has used so far (Linux /proc)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait for the exit status; the run directory is removed if we created it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise RuntimeError(f"kvstored did not stop {timeout_s} s after SIGTERM:\n{self.log()}") from None
        if self._owns_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return code


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that has Linux send the daemon SIGTERM when the benchmark dies (even by SIGKILL),
    so the daemon still removes its arena; None where prctl is not available."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # resolved before the fork: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def _wait_serving(daemon: Daemon) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with grpc.insecure_channel(daemon.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if daemon.process.poll() is not None:
                raise RuntimeError(f"kvstored exited with {daemon.process.returncode}:\n{daemon.log()}")
            with contextlib.suppress(grpc.RpcError):
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.05)
    raise TimeoutError(f"kvstored did not report SERVING within {STARTUP_TIMEOUT_S} s:\n{daemon.log()}")


def start_daemon(config: dict[str, Any], run_dir: Path | None = None) -> Daemon:
    """Start kvstored with `config` (a dict in the YAML's shape) and wait until it serves.

    The socket goes in `run_dir` (a new temporary directory, removed at `stop()`, when None)
    unless `config["server"]["unix_socket"]` names one.
    """
    import yaml

    owns_run_dir = run_dir is None
    run_dir = Path(tempfile.mkdtemp(prefix="kvstore-bench-")) if run_dir is None else run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(config)
    server = config.setdefault("server", {})
    server.setdefault("unix_socket", str(run_dir / "kvstored.sock"))
    socket_path = Path(server["unix_socket"])
    config_path = run_dir / "kvstored.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = run_dir / "kvstored.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvstore.daemon", "--config", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_child_env(),
            cwd=REPO_ROOT,
            preexec_fn=_die_with_parent(),
        )
    daemon = Daemon(process, run_dir, socket_path, log_path, owns_run_dir)
    try:
        _wait_serving(daemon)
    except BaseException:
        process.kill()
        process.wait()
        if owns_run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return daemon


@contextlib.contextmanager
def running_daemon(config: dict[str, Any]) -> Iterator[Daemon]:
    """A started daemon, stopped with SIGTERM on exit; a non-zero exit status is an error."""
    daemon = start_daemon(config)
    try:
        yield daemon
    finally:
        log = daemon.log()
        code = daemon.stop()
        if code != 0:
            raise RuntimeError(f"kvstored exited with {code} after SIGTERM:\n{log}")


class Latency(NamedTuple):
    """Summary of timed calls, in microseconds."""

    calls: int
    p50_us: float
    p99_us: float
    mean_us: float
    min_us: float
    max_us: float

    @classmethod
    def of(cls, samples_s: Sequence[float]) -> Latency:
        if not samples_s:
            raise ValueError("samples_s: expected at least one timed call")
        us = sorted(s * 1e6 for s in samples_s)
        return cls(len(us), _percentile(us, 50), _percentile(us, 99), statistics.fmean(us), us[0], us[-1])


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Columns sized to their widest cell; numbers right-aligned, text left-aligned."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max([len(header)] + [len(row[i]) for row in cells]) for i, header in enumerate(headers)]
    numeric = [
        bool(rows) and all(isinstance(row[i], int | float) for row in rows) for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    print(line(list(headers)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print(line(row))


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "PASS" if value else "FAIL"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.2f}"
    return str(value)


def machine_meta() -> dict[str, Any]:
    """Where and when the figures were taken."""
    meta: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": None,
        "gpu": None,
    }
    try:
        import torch
    except ImportError:
        return meta
    meta["torch"] = torch.__version__
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name(0)
    return meta


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def write_results(name: str, payload: dict[str, Any]) -> Path:
    """Write `payload` plus a `meta` block to `runs/<name>-<timestamp>.json` and to `<name>.json`;
    returns the latter."""
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    document = {"meta": machine_meta(), **payload}
    text = json.dumps(document, indent=2, default=str) + "\n"
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    (RUNS_DIR / f"{name}-{stamp}.json").write_text(text)
    latest = RESULTS_DIR / f"{name}.json"
    latest.write_text(text)
    return latest
