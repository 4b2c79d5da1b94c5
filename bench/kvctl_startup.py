"""How long a `kvctl` call takes, start to exit, this tree against another revision (issue 33).

Every kvctl call is a fresh process (an admin's, a script's, a probe's), so its imports are most
of its cost. Each round runs every command once from this tree and once from the other (`git
archive REV`, extracted to a temporary directory and put first on PYTHONPATH), interleaved, both
against one kvstored of this tree, as the `kvctl` entry point does (`from kvstore.ctl.cli import
main`; `kvstore.cli` in a tree from before the layer folders). It times them on an idle machine
and again with one busy-looping process per CPU beside them (a CI machine running other work).
Targets: `kvctl --version` <= 0.3 s and `kvctl stats` <= 0.5 s (median, on a 2-core machine).

    python bench/kvctl_startup.py                 # against 59e829c, main before the lazy imports
    python bench/kvctl_startup.py --against HEAD~3 --rounds 30 --conditions idle

Prints a table and writes `bench/results/kvctl_startup.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, running_daemon, write_results  # noqa: E402
from tests.harness import REPO_ROOT, daemon_config  # noqa: E402

# As pip's `kvctl` script does; a tree from before the layer folders has it at kvstore.cli.
ENTRY_POINT = (
    "import sys\ntry:\n    from kvstore.ctl.cli import main\n"
    "except ModuleNotFoundError:\n    from kvstore.cli import main\nsys.exit(main())\n"
)
COMMANDS = {"version": ["--version"], "stats": ["stats"], "health": ["health"], "ls": ["ls"]}
TARGETS_S = {"version": 0.3, "stats": 0.5}
BEFORE = "59e829c"  # main before kvctl imported per command


def extract(rev: str, into: Path) -> Path:
    """`git archive REV` of this repository, unpacked under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", "--format=tar", rev], capture_output=True, check=True
    ).stdout
    tree = into / "tree"
    tree.mkdir()
    with tempfile.TemporaryFile() as file:
        file.write(archive)
        file.seek(0)
        with tarfile.open(fileobj=file) as tar:
            tar.extractall(tree, filter="data")
    return tree


def time_call(tree: Path, args: Sequence[str]) -> float:
    """Seconds from spawning `kvctl ARGS` of `tree` to its exit; it must succeed."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", ENTRY_POINT, *args], cwd=tree, env=env, capture_output=True, text=True
    )
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"kvctl {' '.join(args)} from {tree} failed: {result.stderr.strip()}")
    return elapsed


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy(processes: int) -> Iterator[None]:
    """`processes` processes each keeping a CPU busy, for the duration."""
    context = multiprocessing.get_context("fork")
    spinners = [context.Process(target=_spin, daemon=True) for _ in range(processes)]
    for spinner in spinners:
        spinner.start()
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.join()


def measure(trees: dict[str, Path], address: str, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per call: {command: {tree name: [one per round]}}, the trees interleaved."""
    samples: dict[str, dict[str, list[float]]] = {cmd: {name: [] for name in trees} for cmd in COMMANDS}
    for tree in trees.values():  # warm the page cache and both trees' .pyc files
        for args in COMMANDS.values():
            time_call(tree, ["--address", address, *args])
    for round_ in range(rounds):
        order = list(trees.items()) if round_ % 2 == 0 else list(reversed(trees.items()))
        for command, args in COMMANDS.items():
            for name, tree in order:
                samples[command][name].append(time_call(tree, ["--address", address, *args]))
    return samples


def summary(seconds: Sequence[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "median_s": statistics.median(ordered),
        "p90_s": ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))],
        "min_s": ordered[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", default=BEFORE, help=f"the revision to compare with (default {BEFORE})")
    parser.add_argument("--rounds", type=int, default=20, help="calls of each command per tree and condition")
    parser.add_argument(
        "--conditions",
        nargs="+",
        choices=("idle", "busy"),
        default=["idle", "busy"],
        help="busy: a spinner per CPU",
    )
    args = parser.parse_args()
    cpus = os.cpu_count() or 1
    results: dict[str, Any] = {
        "against": args.against,
        "rounds": args.rounds,
        "cpus": cpus,
        "targets_s": TARGETS_S,
    }
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvctl-startup-") as scratch:
        trees = {"this": REPO_ROOT, args.against: extract(args.against, Path(scratch))}
        with running_daemon(daemon_config(Path(scratch) / "kvstored.sock")) as daemon:
            for condition in args.conditions:
                with busy(cpus if condition == "busy" else 0):
                    samples = measure(trees, daemon.address, args.rounds)
                results[condition] = {
                    command: {name: {**summary(s), "samples_s": s} for name, s in by_tree.items()}
                    for command, by_tree in samples.items()
                }
                for command, by_tree in results[condition].items():
                    this, other = by_tree["this"], by_tree[args.against]
                    target = TARGETS_S.get(command)
                    verdict = "-" if target is None else ("meets" if this["median_s"] <= target else "MISSES")
                    rows.append(
                        (
                            condition,
                            f"kvctl {' '.join(COMMANDS[command])}",
                            round(1000 * this["median_s"]),
                            round(1000 * this["p90_s"]),
                            round(1000 * other["median_s"]),
                            round(1000 * other["p90_s"]),
                            f"{other['median_s'] / this['median_s']:.1f}",
                            "-" if target is None else round(1000 * target),
                            verdict,
                        )
                    )
    print(f"\nkvctl start to exit, ms ({args.rounds} calls each; {cpus} CPUs; against {args.against})")
    print_table(
        ["machine", "command", "median", "p90", f"{args.against} median", f"{args.against} p90", "x faster",
         "target", "this tree"],
        rows,
    )  # fmt: skip
    print(f"\nwrote {write_results('kvctl_startup', results)}")


if __name__ == "__main__":
    main()
