"""kvstore as SGLang's HiCache storage backend: SGLang's own factory and MHA host pool, a real kvstored.

The pool and the backend live in a worker process (`tests/sglang_pool.py`): SGLang's pool
module takes seconds to import and needs a torchvision stand-in. Every page read back is
compared byte for byte with the page written, in host slots poisoned with NaN first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.keys import KEY_BYTES, chunk_keys, foreign_keys
from kvstore_client import KVSpec, KVStoreClient
from tests.harness import Daemon

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")  # tests/install-sglang

WORKER = Path(__file__).with_name("sglang_pool.py")
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def run_worker(
    address: str,
    layout: str,
    steps: list[dict[str, Any]],
    seed: int = 0,
    meanwhile: Callable[[], object] | None = None,
) -> list[dict[str, Any]]:
    """The worker's result per step; `meanwhile` runs where a step is `wait`."""
    worker = subprocess.Popen(
        [sys.executable, str(WORKER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert worker.stdin is not None and worker.stdout is not None
    worker.stdin.write(
        json.dumps({"address": address, "layout": layout, "steps": steps, "seed": seed}) + "\n"
    )
    worker.stdin.flush()
    results = []
    try:
        for line in worker.stdout:
            reply = json.loads(line)
            if reply.get("waiting"):
                if meanwhile is not None:
                    meanwhile()
                worker.stdin.write("go\n")
                worker.stdin.flush()
                continue
            results.append(reply)
        worker.wait(timeout=120)
    finally:
        if worker.poll() is None:
            worker.kill()
    stderr = worker.stderr.read() if worker.stderr is not None else ""
    assert worker.returncode == 0, stderr[-4000:]
    for reply in results:
        assert "error" not in reply, reply.get("traceback")
    return results


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sglang_builds_the_backend_and_its_pages_come_back_byte_identical(
    daemon: Daemon, layout: str
) -> None:
    filled, stored, hits, cleared, got, legacy = run_worker(
        daemon.address,
        layout,
        [
            {"op": "fill", "pages": 6},
            {"op": "set"},
            {"op": "exists"},
            {"op": "clear_pool"},
            {"op": "get"},
            {"op": "legacy"},
        ],
    )
    assert cleared["available"] > 0
    assert filled["keys"] == 6
    assert stored["results"] == [True] * 6
    assert hits["hits"] == 6
    assert got["results"] == [True] * 6 and got["identical"] == [True] * 6
    assert legacy == {
        "op": "legacy",
        "set": True,
        "exists": True,
        "got": True,
        "identical": True,
        "missing": True,
    }
    probe = KVSpec(model="probe", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")
    with KVStoreClient.connect(daemon.address, probe) as client:
        namespaces = {n["model"]: n for n in client.stats()["namespaces"]}
    assert namespaces["sglang-test"]["pages"] == 7  # 6 pages and the legacy one


def test_pages_stored_from_one_layout_load_into_another(daemon: Daemon) -> None:
    run_worker(daemon.address, "page_first", [{"op": "fill", "pages": 4}, {"op": "set"}], seed=3)
    _, got = run_worker(daemon.address, "layer_first", [{"op": "fill", "pages": 4}, {"op": "get"}], seed=3)
    assert got["results"] == [True] * 4 and got["identical"] == [True] * 4


def test_sglang_storage_threads_at_once_get_their_own_bytes(daemon: Daemon) -> None:
    _, done = run_worker(
        daemon.address,
        "page_first_direct",
        [{"op": "fill", "pages": 12}, {"op": "concurrent", "threads": 3, "rounds": 5}],
    )
    assert done == {
        "op": "concurrent",
        "all_set": True,
        "all_hit": True,
        "all_got": True,
        "all_identical": True,
    }


def test_missing_and_partly_present_pages(daemon: Daemon) -> None:
    _, stored, everything, gap, got, unknown, none = run_worker(
        daemon.address,
        "page_first",
        [
            {"op": "fill", "pages": 5},
            {"op": "set", "keys": [0, 1, 2]},
            {"op": "exists"},
            {"op": "exists", "missing": [1]},
            {"op": "get"},
            {"op": "exists", "missing": [0, 1, 2, 3, 4]},
            {"op": "get", "missing": [0, 1, 2, 3, 4]},
        ],
    )
    assert stored["results"] == [True] * 3
    assert everything["hits"] == 3 and gap["hits"] == 1  # a run from the first key
    assert got["results"] == [True, True, True, False, False]
    assert got["identical"][:3] == [True] * 3
    assert unknown["hits"] == 0
    assert none["results"] == [False] * 5


def test_a_daemon_that_is_down_is_a_miss_never_an_exception(daemon: Daemon, tmp_path: Path) -> None:
    absent = f"unix://{tmp_path / 'no-daemon.sock'}"
    _, stored, hits, got = run_worker(
        absent, "page_first", [{"op": "fill", "pages": 3}, {"op": "set"}, {"op": "exists"}, {"op": "get"}]
    )
    assert stored["results"] == [False] * 3 and hits["hits"] == 0 and got["results"] == [False] * 3

    results = run_worker(
        daemon.address,
        "page_first",
        [
            {"op": "fill", "pages": 3},
            {"op": "set"},
            {"op": "wait"},
            {"op": "exists"},
            {"op": "get"},
            {"op": "set"},
        ],
        meanwhile=lambda: daemon.stop(),
    )
    stored, _, hits, got, again = results[1:]
    assert stored["results"] == [True] * 3
    assert hits["hits"] == 0 and got["results"] == [False] * 3 and again["results"] == [False] * 3


def test_sglang_page_names_map_to_keys_of_their_own() -> None:
    namespace, other = bytes(range(16)), bytes(range(1, 17))
    names = ["5d85718e" * 8, "4681c010" * 8]
    keys = foreign_keys(namespace, names, b"sglang-page-sha256\n")
    assert keys == foreign_keys(namespace, names, b"sglang-page-sha256\n")  # the same in every process
    assert len(set(keys)) == 2 and all(len(key) == KEY_BYTES for key in keys)
    assert not set(keys) & set(foreign_keys(other, names, b"sglang-page-sha256\n"))  # per namespace
    assert not set(keys) & set(chunk_keys(namespace, list(range(32)), 16))  # never a token-id key
    with pytest.raises(ValueError, match="namespace: expected 16 bytes"):
        foreign_keys(b"short", names, b"x")
