"""The README's five-minute tour, run as printed against a real kvstored.

The tour's code blocks are read from README.md, never copied here. The daemon starts from the
tour's `kvstored` line, the Python block runs as a script, and the shell lines run in order
in one bash process. Each line's exit status and output are checked against what the README
says of it. Like the tour, everything uses the default socket: the daemon and the clients get
the same environment, with XDG_RUNTIME_DIR in the test's directory. As root the default is
/run/kvstore/kvstored.sock whatever the environment, so there the test needs that path free
(a daemon already serving it makes the tour's daemon refuse to start, and the test fail).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.harness import Daemon, launch_daemon, python_env

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TOUR = "## A five-minute tour"
README_TITLE = "# kvstore"
MARK = "@@readme-tour@@"
PRINTED = re.compile(r"^\s*print\(.*\)\s*#\s*([^:\s]+)")  # `print(x)  # 4: what x is` -> "4"
SAYS = re.compile(r"^\s*print\(.*\)\s*#\s*(.+?):\s")  # `print(x.shape)  # torch.Size([1, 2]): ...`
TRANSFORMERS = "### transformers"
MODEL = "llama-3.1-8b"  # the tour's KVSpec


class Block(NamedTuple):
    language: str
    lines: list[str]


class LineRun(NamedTuple):
    line: str
    status: int
    stdout: str
    stderr: str


def tour_blocks() -> list[Block]:
    """The fenced code blocks of the tour section, in order, as printed."""
    return section_blocks(TOUR)


def section_blocks(heading: str) -> list[Block]:
    """The fenced code blocks of the README's section `heading` (up to the next heading of its
    level or above, its subsections included), in order, as printed."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    blocks: list[Block] = []
    block: Block | None = None
    for line in lines[start + 1 :]:
        if block is None and line.startswith("```"):
            block = Block(line[3:].strip(), [])
        elif block is not None and line.startswith("```"):
            blocks.append(block)
            block = None
        elif block is not None:
            block.lines.append(line)
        elif line.startswith("#") and len(line) - len(line.lstrip("#")) <= level:
            break
    assert block is None, f"{heading} has a code block that is not closed"
    return blocks


def comment(line: str) -> str:
    """What a shell line's trailing comment says it does."""
    return line.partition(" #")[2].strip()


def command(line: str) -> str:
    return line.partition(" #")[0].strip()


def number(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match is not None, (pattern, text)
    return int(match.group(1))


def run_lines(lines: list[str], env: dict[str, str], cwd: Path) -> list[LineRun]:
    """Runs `lines` in order in one bash process (a variable set by one is seen by the next),
    with each line's exit status and output apart."""
    script = ["set -o pipefail"]
    for index, line in enumerate(lines):
        script.append(f'echo "{MARK} start {index}"; echo "{MARK} start {index}" >&2')
        script.append(line)
        script.append(f'echo "{MARK} end {index} $?"')
    done = subprocess.run(
        ["bash", "-c", "\n".join(script)], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    runs = []
    for index, line in enumerate(lines):
        out = re.search(rf"^{MARK} start {index}\n(.*?)^{MARK} end {index} (\d+)\n", done.stdout, re.S | re.M)
        err = re.search(rf"^{MARK} start {index}\n(.*?)(?=^{MARK} start |\Z)", done.stderr, re.S | re.M)
        assert out is not None and err is not None, (line, done.stdout, done.stderr)
        runs.append(LineRun(line, int(out.group(2)), out.group(1), err.group(1)))
    return runs


@pytest.fixture
def tour_env(tmp_path: Path) -> dict[str, str]:
    """This checkout's `kvctl` and `kvstored` first on PATH, and a default socket of the test's own
    (except as root)."""
    env = python_env()
    env.pop("RUNTIME_DIRECTORY", None)
    env["XDG_RUNTIME_DIR"] = str(tmp_path / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, module in (("kvctl", "kvstore.ctl.cli"), ("kvstored", "kvstore.server.daemon")):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m {module} "$@"\n')
        shim.chmod(0o755)
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    return env


@pytest.fixture
def tour_daemon(tour_env: dict[str, str], tmp_path: Path) -> Iterator[tuple[Daemon, dict[str, Any]]]:
    """kvstored started from the tour's `kvstored` line, with its effective config; stopped with
    SIGTERM at the end, and it must exit 0 leaving nothing behind."""
    start = tour_blocks()[0]
    (line,) = [line for line in start.lines if line.startswith("kvstored ")]
    argv = shlex.split(command(line).removesuffix("&"))
    config_path = ROOT / argv[argv.index("--config") + 1]
    checked = subprocess.run(
        [sys.executable, "-m", "kvstore.server.daemon", "--check-config", str(config_path)],
        env=tour_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    config = json.loads(checked.stdout)
    socket_path = Path(config["server"]["socket_path"])
    # Where the tour says the default socket is.
    if os.geteuid() == 0:
        assert socket_path == Path("/run/kvstore/kvstored.sock")
    else:
        assert socket_path == Path(tour_env["XDG_RUNTIME_DIR"]) / "kvstore" / "kvstored.sock"
    made_dir = not socket_path.parent.exists()
    daemon = launch_daemon(
        argv[1:], config_path, socket_path, tmp_path / "kvstored.log", env=tour_env, cwd=ROOT
    )
    yield daemon, config
    assert daemon.stop() == 0, daemon.log()
    for suffix in ("", ".local", ".lock"):
        assert not socket_path.with_name(socket_path.name + suffix).exists(), daemon.log()
    assert not daemon.arena_path.exists(), daemon.log()
    if made_dir:
        socket_path.parent.rmdir()


def test_the_tour_runs_as_printed(
    tour_daemon: tuple[Daemon, dict[str, Any]], tour_env: dict[str, str], tmp_path: Path
) -> None:
    daemon, config = tour_daemon
    start, python, look = tour_blocks()
    assert (start.language, python.language, look.language) == ("bash", "python", "bash")
    workdir = tmp_path / "tour"
    workdir.mkdir()

    # The start block: the package is installed and the daemon runs (the fixture started it from
    # the block's `kvstored` line); what is left must answer as the block says.
    rest = [line for line in start.lines if not line.startswith(("pip install ", "kvstored "))]
    assert [command(line) for line in rest] == ["kvctl health"]
    (health,) = run_lines(rest, tour_env, workdir)
    assert (health.status, health.stdout, health.stderr) == (0, comment(health.line) + "\n", "")

    # The Python block, as printed: each print shows the value its comment starts with.
    script = workdir / "tour.py"
    script.write_text("\n".join(python.lines) + "\n")
    ran = subprocess.run(
        [sys.executable, str(script)], env=tour_env, cwd=workdir, capture_output=True, text=True, timeout=240
    )
    assert ran.returncode == 0, f"{ran.stdout}\n{ran.stderr}\n{daemon.log()}"
    printed = [match.group(1) for line in python.lines if (match := PRINTED.match(line))]
    assert printed == ["4", "1024", "1024"]
    assert ran.stdout.splitlines() == printed
    stored = int(printed[0])
    pinned_tokens = json.loads((workdir / "prompt.json").read_text())
    assert pinned_tokens == list(range(1000, 1512))
    # What the tour says of the default config: 2 of its 32 MiB pages may be pinned, not 4.
    pin_bytes = config["eviction"]["pin_fraction"] * config["tiers"]["cpu"]["bytes"]
    assert (config["eviction"]["pin_fraction"], config["tiers"]["cpu"]["bytes"]) == (0.1, 1 << 30)
    assert 2 * (32 << 20) <= pin_bytes < 4 * (32 << 20)

    # The kvctl block: every line exits 0, prints nothing on stderr, and says what its comment says.
    runs = run_lines(look.lines, tour_env, workdir)
    for run in runs:
        assert (run.status, run.stderr) == (0, ""), (run, daemon.log())
    by_command = {command(run.line): run for run in runs}
    assert len(by_command) == len(runs)
    checks: dict[str, Callable[[LineRun], None]] = {}
    facts: dict[str, Any] = {}

    def stats_json(run: LineRun) -> None:
        stats = json.loads(run.stdout)
        (namespace,) = stats["namespaces"]
        page_bytes = namespace["page_bytes"]
        assert page_bytes == 32 << 20  # 32 layers x K,V x 256 tokens x 8 heads x 128 x bf16
        assert namespace == {
            "namespace": namespace["namespace"],
            "model": MODEL,
            "pages": stored,
            "bytes": stored * page_bytes,
            "page_bytes": page_bytes,
        }
        assert stats["tiers"] == {
            "cpu": {
                "bytes_used": stored * page_bytes,
                "bytes_capacity": config["tiers"]["cpu"]["bytes"],
                "pages": stored,
            }
        }
        counters = stats["counters"]
        assert counters["stored_chunks"] == stored and counters["missed_chunks"] == 0
        assert counters["lookups"] >= 2 and counters["hit_chunks"] == stored * counters["lookups"]
        assert counters["evicted_chunks"] == 0 and counters["active_leases"] == 0
        facts.update(namespace=namespace["namespace"], page_bytes=page_bytes, counters=counters)

    def stats_table(run: LineRun) -> None:
        rows = {line.split()[0]: line.split()[1:] for line in run.stdout.splitlines() if line.strip()}
        assert rows["cpu"] == ["128.0", "MiB", "1.0", "GiB", "12.5%", str(stored)]
        # Tiers, then the counters the comment names (and every other), then the namespaces.
        for name, value in facts["counters"].items():
            assert rows[name] == [str(value)], name
        for named in ("lookups", "hit_chunks", "missed_chunks", "evicted_chunks", "active_leases"):
            assert named in rows
        assert rows[facts["namespace"]] == [MODEL, str(stored), "128.0", "MiB", "32.0", "MiB"]

    def ls(run: LineRun) -> None:
        header, rule, *rows = run.stdout.splitlines()
        assert header.split() == ["namespace", "model", "pages", "bytes", "page", "size"]
        assert [row.split() for row in rows] == [
            [facts["namespace"], MODEL, str(stored), "128.0", "MiB", "32.0", "MiB"]
        ]

    def namespace_of_ls(run: LineRun) -> None:
        assert run.stdout == ""  # it sets NS; the pin below shows it named the namespace

    def pin(run: LineRun) -> None:
        chunks = number(r"(\d+) chunks", comment(run.line))
        ttl = number(r"--ttl (\d+)", run.line)
        assert chunks * config["chunk_tokens"] == len(pinned_tokens)
        size = chunks * facts["page_bytes"] / (1 << 20)
        assert run.stdout == (
            f"pinned {chunks} chunks for {ttl} s; the tier holds {chunks} pinned pages ({size:.1f} MiB)\n"
        )

    def clear(run: LineRun) -> None:
        assert run.stdout == f"cleared {stored} pages\n"

    checks["kvctl stats --json"] = stats_json
    checks["kvctl stats"] = stats_table
    checks["kvctl ls"] = ls
    checks["NS=$(kvctl ls | awk 'NR == 3 { print $1 }')"] = namespace_of_ls
    checks['kvctl pin "$NS" --tokens prompt.json --ttl 3600'] = pin
    checks["kvctl clear"] = clear
    assert set(by_command) == set(checks), "a tour line this test does not know what to expect of"
    for name in checks:  # the JSON first: the other checks compare with it
        checks[name](by_command[name])


def test_the_transformers_snippets_run_as_printed(
    tour_daemon: tuple[Daemon, dict[str, Any]], tour_env: dict[str, str], tmp_path: Path
) -> None:
    """Each Python block of the transformers section (HFPrefixCache, then a progressive model's
    stage) runs as printed against the tour's daemon, on the default socket, and prints what its
    comments say."""
    pytest.importorskip("transformers")
    daemon, _ = tour_daemon
    blocks = [block for block in section_blocks(TRANSFORMERS) if block.language == "python"]
    assert len(blocks) == 2
    expected = [
        ["2", "512", "torch.Size([1, 88, 1000])"],  # HFPrefixCache: stored, restored, computed
        ["none", "whole"],  # a stage's prefill before and after its save
    ]
    for index, block in enumerate(blocks):
        script = tmp_path / f"transformers_{index}.py"
        script.write_text("\n".join(block.lines) + "\n")
        ran = subprocess.run(
            [sys.executable, str(script)],
            env=tour_env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert ran.returncode == 0, f"{block.lines[:3]}\n{ran.stdout}\n{ran.stderr}\n{daemon.log()}"
        says = [match.group(1) for line in block.lines if (match := SAYS.match(line))]
        assert says == expected[index]
        assert ran.stdout.splitlines() == says


def test_the_replay_example_runs_as_printed(tour_env: dict[str, str]) -> None:
    """The Operating section's `kvctl replay` lines, run from the repository's root on the trace
    it ships, each print the hit ratios its comment gives (the total's or the fleet's first)."""
    (block,) = [
        block
        for block in section_blocks("## Operating")
        if any("kvctl replay" in line for line in block.lines)
    ]
    assert block.language == "bash" and len(block.lines) == 4
    for run in run_lines(block.lines, tour_env, ROOT):
        assert (run.status, run.stderr) == (0, ""), run
        said = comment(run.line)
        rows = {line.split()[0]: line.split()[-1] for line in run.stdout.splitlines() if line.strip()}
        total = rows["fleet"] if "--hosts" in run.line else rows["total"]
        assert total == said.split()[0], (said, run.stdout)
        for bound in ("belady", "infinite"):
            if bound in said:
                assert rows[bound] == number_text(rf"{bound} ([\d.]+%)", said), (said, run.stdout)
        assert run.stdout.startswith("examples/conversation_trace_2k.jsonl: 2000 requests, 22977 blocks")


def test_the_readme_test_command_is_what_ci_runs() -> None:
    """The README's test command is `.ci/run`'s, word for word: what a newcomer runs is what CI
    times and passes."""
    (block,) = [block for block in section_blocks(README_TITLE) if "-m pytest" in "\n".join(block.lines)]
    ci_run = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert block.lines == [ci_run[-1]]


def number_text(pattern: str, text: str) -> str:
    match = re.search(pattern, text)
    assert match is not None, (pattern, text)
    return match.group(1)
