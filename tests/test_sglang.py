"""kvstore as SGLang's HiCache storage backend: SGLang's own factory and MHA host pool, a real kvstored.

The pool and the backend live in a worker process (`tests/sglang_pool.py`): SGLang's pool
module takes seconds to import and needs a torchvision stand-in. One worker per module imports
it once and runs each scenario in a process forked for it. Every page read back is compared
byte for byte with the page written, in host slots poisoned with NaN first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.shared.keys import KEY_BYTES, chunk_keys, foreign_keys
from kvstore_client import KVSpec, KVStoreClient
from tests.harness import Daemon

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")  # tests/install-sglang

WORKER = Path(__file__).with_name("sglang_pool.py")
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_unified")  # all SGLang 0.5.23 builds
MLA_PAGE_BYTES = 3 * 16 * (512 + 64) * 2  # the worker's pool: 3 layers, 16 tokens, bf16 latent 512 + 64
MHA_PAGE_BYTES = 2 * 4 * 16 * 2 * 16 * 2  # its MHA pools: K and V, 4 layers, 16 tokens, 2 heads of 16, bf16
MAMBA_STATE_BYTES = 3 * (
    3 * 8 * 2 + 2 * 4 * 5 * 4
)  # its Mamba pool: 3 layers of a bf16 conv and fp32 temporal state


def namespaces_of(daemon: Daemon, model: str) -> list[dict[str, Any]]:
    """The daemon's namespaces of `model`, from its stats."""
    probe = KVSpec(model="probe", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")
    with KVStoreClient.connect(daemon.address, probe) as client:
        return [n for n in client.stats()["namespaces"] if n["model"] == model]


def mla(layout: str, **fields: Any) -> dict[str, Any]:
    return {"kind": "mla", "layout": layout, "seed": 5} | fields


RunWorker = Callable[..., list[dict[str, Any]]]


class Worker:
    """`tests/sglang_pool.py --serve`: SGLang imported once, each request in a process forked for it."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(WORKER), "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )

    def run(
        self,
        address: str,
        layout: str,
        steps: list[dict[str, Any]],
        seed: int = 0,
        meanwhile: Callable[[], object] | None = None,
        instances: list[dict[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        """The worker's result per step; `meanwhile` runs where a step is `wait`. `instances`: the
        host pools and backends (`tests/sglang_pool.py`), else one MHA pool of `layout`."""
        if instances is None:
            instances = [{"kind": "mha", "layout": layout, "seed": seed}]
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps({"address": address, "instances": instances, "steps": steps}) + "\n")
        stdin.flush()
        results = []
        for line in stdout:
            reply = json.loads(line)
            if reply.get("waiting"):
                if meanwhile is not None:
                    meanwhile()
                stdin.write("go\n")
                stdin.flush()
                continue
            if "exit" in reply:
                assert reply["exit"] == 0, self.log_path.read_text()[-4000:]
                break
            results.append(reply)
        else:
            raise AssertionError(f"the worker exited: {self.log_path.read_text()[-4000:]}")
        for reply in results:
            assert "error" not in reply, reply.get("traceback")
        return results

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    worker = Worker(tmp_path_factory.mktemp("sglang") / "worker.log")
    try:
        yield worker
    finally:
        worker.close()


@pytest.fixture
def run_worker(worker: Worker) -> RunWorker:
    return worker.run


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sglang_builds_the_backend_and_its_pages_come_back_byte_identical(
    run_worker: RunWorker, daemon: Daemon, layout: str
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
    (namespace,) = namespaces_of(daemon, "sglang-test")
    assert namespace["pages"] == 7  # 6 pages and the legacy one


def test_pages_stored_from_one_layout_load_into_another(run_worker: RunWorker, daemon: Daemon) -> None:
    run_worker(daemon.address, "page_first", [{"op": "fill", "pages": 4}, {"op": "set"}], seed=3)
    _, got = run_worker(daemon.address, "layer_first", [{"op": "fill", "pages": 4}, {"op": "get"}], seed=3)
    assert got["results"] == [True] * 4 and got["identical"] == [True] * 4


@pytest.mark.parametrize("kind, layout", [("mha", "page_first_direct"), ("mla", "page_unified")])
def test_sglang_storage_threads_at_once_get_their_own_bytes(
    run_worker: RunWorker, daemon: Daemon, kind: str, layout: str
) -> None:
    _, done = run_worker(
        daemon.address,
        layout,
        [{"op": "fill", "pages": 12}, {"op": "concurrent", "threads": 3, "rounds": 5}],
        instances=[{"kind": kind, "layout": layout}],
    )
    assert done == {
        "op": "concurrent",
        "all_set": True,
        "all_hit": True,
        "all_got": True,
        "all_identical": True,
    }


def test_missing_and_partly_present_pages(run_worker: RunWorker, daemon: Daemon) -> None:
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


def test_a_daemon_that_is_down_is_a_miss_never_an_exception(
    run_worker: RunWorker, daemon: Daemon, tmp_path: Path
) -> None:
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


# -- MLA host pools: one latent per token and layer, the same on every TP rank -------------


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_pages_stored_by_one_instance_load_byte_exact_into_others(
    run_worker: RunWorker, daemon: Daemon, layout: str
) -> None:
    """Instance 0 stores; instance 1 (same layout) and instance 2 (the next layout) know only what
    to expect, and load into host slots poisoned first."""
    other = MLA_LAYOUTS[(MLA_LAYOUTS.index(layout) + 1) % len(MLA_LAYOUTS)]
    legacy = [{"op": "legacy"}] if layout != "page_unified" else []  # SGLang gives page_unified no flat pages
    filled, stored, _, hits, got, _, got_other, *rest = run_worker(
        daemon.address,
        layout,
        [
            {"op": "fill", "pages": 6},
            {"op": "set"},
            {"op": "fill", "pages": 6, "write": False, "on": 1},
            {"op": "exists", "on": 1},
            {"op": "get", "on": 1},
            {"op": "fill", "pages": 6, "write": False, "on": 2},
            {"op": "get", "on": 2},
            *legacy,
        ],
        instances=[mla(layout), mla(layout), mla(other)],
    )
    assert filled["written"] == [True] * 6  # the pool holds the random latent, read back by SGLang's calls
    assert stored["results"] == [True] * 6
    assert hits["hits"] == 6
    for loaded in (got, got_other):
        assert loaded["results"] == [True] * 6
        assert loaded["identical"] == [True] * 6
    if legacy:
        assert rest[0] == {
            "op": "legacy",
            "set": True,
            "exists": True,
            "got": True,
            "identical": True,
            "missing": True,
        }
    (namespace,) = namespaces_of(daemon, "sglang-mla-test")
    assert namespace["pages"] == 6 + len(legacy)
    assert namespace["page_bytes"] == MLA_PAGE_BYTES


def test_mla_pages_are_stored_once_for_every_tp_rank(run_worker: RunWorker, daemon: Daemon) -> None:
    """TP 2: both ranks hold the same latent; rank 0 stores it (as SGLang's storage writer),
    rank 1's store of the same keys is skipped, both ranks and a TP 1 instance load it."""
    ranks = [mla("page_first", tp_rank=0, tp_size=2), mla("page_first", tp_rank=1, tp_size=2)]
    single = mla("layer_first", tp_rank=0, tp_size=1)
    results = run_worker(
        daemon.address,
        "page_first",
        [
            {"op": "fill", "pages": 5, "on": 0},
            {"op": "fill", "pages": 5, "on": 1},
            {"op": "fill", "pages": 5, "write": False, "on": 2},
            {"op": "set", "on": 0},
            {"op": "set", "on": 1},
            {"op": "exists", "on": 1},
            {"op": "get", "on": 0},
            {"op": "get", "on": 1},
            {"op": "get", "on": 2},
        ],
        instances=[*ranks, single],
    )
    stored, stored_again, hits, *loads = results[3:]
    assert stored["results"] == [True] * 5 and stored_again["results"] == [True] * 5
    assert hits["hits"] == 5
    for got in loads:
        assert got["results"] == [True] * 5 and got["identical"] == [True] * 5
    (namespace,) = namespaces_of(daemon, "sglang-mla-test")  # one namespace for every rank and TP size
    assert namespace["pages"] == 5  # one copy, not one per rank
    assert namespace["page_bytes"] == MLA_PAGE_BYTES


def test_a_missing_mla_page_is_a_miss_from_there_on(run_worker: RunWorker, daemon: Daemon) -> None:
    """Pages 0, 1 and 3 stored: a load gets 0 and 1 and leaves every slot after them poisoned."""
    results = run_worker(
        daemon.address,
        "page_first_direct",
        [
            {"op": "fill", "pages": 5},
            {"op": "set", "keys": [0, 1, 3]},
            {"op": "fill", "pages": 5, "write": False, "on": 1},
            {"op": "exists", "on": 1},
            {"op": "get", "on": 1},
            {"op": "exists", "missing": [0], "on": 1},
            {"op": "get", "missing": [1], "on": 1},
            {"op": "get", "missing": [0, 1, 2, 3, 4], "on": 1},
        ],
        instances=[mla("page_first_direct"), mla("layer_first")],
    )
    stored, _, hits, got, none_first, gap, unknown = results[1:]
    assert stored["results"] == [True] * 3
    assert hits["hits"] == 2 and none_first["hits"] == 0
    assert got["results"] == [True, True, False, False, False]
    assert got["identical"][:2] == [True] * 2 and got["poisoned"] == [False, False, True, True, True]
    assert gap["results"] == [True, False, False, False, False]
    assert gap["identical"][0] and gap["poisoned"] == [False, True, True, True, True]
    assert unknown["results"] == [False] * 5 and unknown["poisoned"] == [True] * 5


def hybrid(side: str = "mamba", **fields: Any) -> dict[str, Any]:
    return {"kind": "mha", "layout": "page_first", "seed": 9, "side": side} | fields


@pytest.mark.parametrize("side", ["mamba", "swa"])
def test_a_hybrid_model_s_sidecar_pages_come_back_byte_identical_beside_its_kv(
    run_worker: RunWorker, daemon: Daemon, side: str
) -> None:
    """A hybrid's instance stores 8 KV pages and the sidecar pages (Mamba states, or a
    sliding-window pool's KV) of pages 3 and 7 through SGLang's v2 calls; another instance finds
    the prefixes it can restore (4 and 8 pages) and loads the KV and page 7's sidecar page into
    poisoned slots, byte for byte."""
    _, _, stored, _, _, found, got = run_worker(
        daemon.address,
        "",
        [
            {"op": "fill", "pages": 8},
            {"op": "fill_states"},
            {"op": "set_v2", "states": [3, 7]},
            {"op": "fill", "pages": 8, "write": False, "on": 1},
            {"op": "fill_states", "write": False, "on": 1},
            {"op": "exists_v2", "on": 1},
            {"op": "get_v2", "on": 1},
        ],
        instances=[hybrid(side), hybrid(side)],
    )
    assert stored["kv"] == [True] * 8 and stored["side"] == [True, True]
    assert found == {"op": "exists_v2", "kv_hit_pages": 8, "pools": {"kv": 8, side: 8}, "restorable": [4, 8]}
    assert got["kv"] == [True] * 8 and got["side"] == [True]
    assert got["identical"] == [True] * 8 and got["state_identical"]
    (kv_namespace, side_namespace) = sorted(namespaces_of(daemon, "sglang-test"), key=lambda n: -n["pages"])
    assert kv_namespace["pages"] == 8 and side_namespace["pages"] == 2
    assert side_namespace["page_bytes"] == (MAMBA_STATE_BYTES if side == "mamba" else MHA_PAGE_BYTES)


def test_a_hybrid_prefix_stops_at_the_last_page_whose_state_is_stored(
    run_worker: RunWorker, daemon: Daemon
) -> None:
    """States after pages 2 and 5 only: a prompt of 8 stored KV pages restores 6 pages at most, and
    one whose 4th page is unknown restores 3; with the trailing 2 pages' states needed, none."""
    _, _, _, last, gap, pair = run_worker(
        daemon.address,
        "",
        [
            {"op": "fill", "pages": 8},
            {"op": "fill_states"},
            {"op": "set_v2", "states": [2, 5]},
            {"op": "exists_v2"},
            {"op": "exists_v2", "missing": [3]},
            {"op": "exists_v2", "trailing": 2},
        ],
        instances=[hybrid(seed=11)],
    )
    assert last["kv_hit_pages"] == 6 and last["restorable"] == [3, 6]
    assert gap["kv_hit_pages"] == 3 and gap["restorable"] == [3]
    assert pair["kv_hit_pages"] == 0 and pair["restorable"] == []


def test_mla_pools_and_settings_not_served_are_refused_at_start_naming_what(
    run_worker: RunWorker, daemon: Daemon
) -> None:
    (said,) = run_worker(daemon.address, "", [{"op": "refusals"}], instances=[])
    assert "page_first_kv_split" in said["page_first_kv_split"]
    assert "layer_first, page_first, page_first_direct, page_unified" in said["page_first_kv_split"]
    assert "allocator-only MLA host pool" in said["allocator_only"]
    assert "layer-sharded MLA host pool" in said["layer_sharded"]
    assert "decode context parallelism (2 ranks" in said["dcp"]
    assert "got a MHATokenToKVPoolHost" in said["mha_pool_of_an_mla_model"]
    assert "'indexer'" in said["sidecar"] and "mamba and swa sidecar pools, not this one" in said["sidecar"]
