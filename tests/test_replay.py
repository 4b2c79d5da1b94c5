"""Trace replay through the real store: exact hit counts on small traces, the reference figures on the
real conversation trace, offline bounds, and `kvctl replay`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.ctl.belady import belady_hits, infinite_hits
from kvstore.ctl.replay import bounds, replay
from kvstore.ctl.trace import Trace, TraceError, load_trace

CONVERSATION_TRACE = Path("/work/shared/traces/conversation_trace.jsonl")

# Three pages of room. Worked by hand (block 3 and 4 are both tails of the chains 1-3 and 1-2-4):
#   lru:       0 + 1 + 2 + 1 + 2 = 6   (r3 evicts 3; r4 evicts 4, a tail; r5 finds 1 2 and evicts 3)
#   lru-plain: 0 + 1 + 2 + 1 + 1 = 5   (r4 evicts 2, the head of 1-2-4: r5 finds only 1)
#   lfuda:     0 + 1 + 2 + 1 + 2 = 6
#   belady:    0 + 1 + 2 + 2 + 1 = 6   (at r3 blocks 2 and 4 are next used equally late; 2 was referenced
#                                       first and goes, stranding 4: the standard Belady is chain-blind)
#   infinite:  0 + 1 + 2 + 2 + 3 = 8
SMALL = [[1, 2], [1, 3], [1, 2, 4], [1, 3], [1, 2, 4]]
# Two pages: block 1 is read twice, then two one-off blocks pass. LRU drops 1 for block 3 (1 was
# used before 2); LFU-DA drops 2 (read once) and keeps 1 (read twice): 1 hit against 2.
FREQUENT = [[1], [1], [2], [3], [1]]


def write_trace(path: Path, requests: list[list[int]]) -> Path:
    path.write_text(
        "".join(json.dumps({"timestamp": i, "hash_ids": ids}) + "\n" for i, ids in enumerate(requests))
    )
    return path


@pytest.mark.parametrize(("policy", "hits"), [("lru", 6), ("lru-plain", 5), ("lfuda", 6)])
def test_small_trace_exact_hits(policy: str, hits: int) -> None:
    result = replay(Trace("small", SMALL), cpu_pages=3, policy=policy)
    assert (result.hit_blocks, result.blocks, result.requests, result.unstored_requests) == (hits, 12, 5, 0)
    assert result.tier_hit_blocks == {"cpu": hits} and result.tier_ratios() == {"cpu": hits / 12}


@pytest.mark.parametrize(("policy", "hits"), [("lru", 1), ("lru-plain", 1), ("lfuda", 2)])
def test_frequency_beats_recency_on_a_block_read_twice(policy: str, hits: int) -> None:
    assert replay(Trace("frequent", FREQUENT), cpu_pages=2, policy=policy).hit_blocks == hits
    assert (infinite_hits(FREQUENT), belady_hits(FREQUENT, 2)) == (2, 2)


def test_offline_bounds_on_the_small_trace() -> None:
    assert infinite_hits(SMALL) == 8
    assert [belady_hits(SMALL, pages) for pages in (0, 1, 2, 3, 4, 5)] == [0, 4, 5, 6, 8, 8]
    assert bounds(Trace("small", SMALL), 3)[1:3] == (8 / 12, 6 / 12)


def test_a_repeated_id_is_stored_once() -> None:
    result = replay(Trace("repeats", [[1, 2, 2, 3], [1, 2, 2, 3]]), cpu_pages=3, policy="lfuda")
    assert (result.hit_blocks, result.blocks, result.unstored_requests) == (4, 8, 0)
    assert infinite_hits([[1, 2, 2, 3], [1, 2, 2, 3]]) == 4


def test_a_request_larger_than_the_tier_is_counted_not_stored() -> None:
    result = replay(Trace("big", [[1, 2, 3], [1, 2, 3], [1]]), cpu_pages=2, policy="lfuda")
    assert (result.hit_blocks, result.unstored_requests) == (0, 2)  # nothing fits; [1] then fits


def test_trace_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"hash_ids": [0, 1]}\n\n{"hash_ids": [0, 1]}\n{"hash_ids": "0 1"}\n')
    with pytest.raises(TraceError, match=":4: expected an object whose `hash_ids` is a list"):
        load_trace(path)
    path.write_text("{not json\n")
    with pytest.raises(TraceError, match=":1: invalid JSON"):
        load_trace(path)
    with pytest.raises(TraceError, match="cannot read the trace"):
        load_trace(tmp_path / "missing.jsonl")


@pytest.mark.skipif(not CONVERSATION_TRACE.exists(), reason="the shared conversation trace is not here")
def test_conversation_trace_reproduces_the_reference_and_lfuda_beats_it() -> None:
    trace = load_trace(CONVERSATION_TRACE)
    assert (len(trace.requests), trace.num_blocks, trace.num_distinct_blocks) == (12031, 288500, 182790)
    for pages, reference, hits in ((1000, 4.45, 12831), (5000, 11.04, 31840)):
        plain = replay(trace, pages, "lru-plain")
        assert plain.hit_blocks == hits and round(100 * plain.hit_ratio, 2) == reference
        assert replay(trace, pages, "lfuda").hit_ratio > plain.hit_ratio
    limits = bounds(trace, 1000)
    assert (round(100 * limits.belady, 1), round(100 * limits.infinite, 1)) == (17.9, 36.6)


def kvctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.ctl.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_kvctl_replay_prints_json_and_a_table(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "small.jsonl", SMALL)
    result = kvctl("replay", str(trace), "--cpu-pages", "3", "--policy", "lru", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["hit_ratio"], data["tiers"], data["belady"], data["infinite"]) == (
        0.5,
        {"cpu": 0.5},
        0.5,
        8 / 12,
    )
    assert (data["policy"], data["cpu_pages"], data["requests"], data["blocks"]) == ("lru", 3, 5, 12)
    table = kvctl("replay", str(trace), "--cpu-pages", "3")
    assert table.returncode == 0 and "policy lfuda" in table.stdout
    assert any(line.split() == ["total", "6", "50.00%"] for line in table.stdout.splitlines())
    assert any(line.split() == ["belady", "50.00%"] for line in table.stdout.splitlines())


def test_kvctl_replay_errors_are_one_line(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "small.jsonl", SMALL)
    missing = kvctl("replay", str(tmp_path / "none.jsonl"), "--cpu-pages", "3")
    assert missing.returncode == 1 and "cannot read the trace" in missing.stderr
    assert "Traceback" not in missing.stderr
    assert kvctl("replay", str(trace), "--cpu-pages", "0").returncode == 2  # argparse: usage error


def test_a_disk_tier_behind_the_cpu_tier_keeps_what_the_cpu_tier_drops(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "small.jsonl", SMALL)
    result = kvctl("replay", str(trace), "--cpu-pages", "3", "--disk-pages", "50", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    # lfuda alone hits 6 blocks; the 2 it evicts and needs again come back from disk: the infinite bound.
    assert data["tier_hit_blocks"] == {"cpu": 6, "disk": 2}
    assert data["hit_blocks"] == 8 and data["hit_ratio"] == data["infinite"] == 8 / 12


@pytest.mark.skipif(not CONVERSATION_TRACE.exists(), reason="the shared conversation trace is not here")
def test_conversation_trace_with_a_disk_tier_reaches_the_infinite_bound() -> None:
    # The trace's first 2,000 requests (54,559 blocks, 38,788 distinct): a disk tier with room for
    # every block keeps all that 1,000 CPU pages drop, so every reuse hits. The whole trace (5,000
    # CPU pages, 50,000 disk pages: 35.66% against the infinite 36.64%) is `kvctl replay
    # --disk-pages`, about a minute on a 2-core machine (the disk tier's writes end before each next request).
    trace = load_trace(CONVERSATION_TRACE)
    head = Trace("head", trace.requests[:2000])
    result = replay(head, cpu_pages=1000, policy="lfuda", disk_pages=50_000)
    assert result.tier_hit_blocks["disk"] > result.tier_hit_blocks["cpu"] > 0
    assert result.hit_blocks == infinite_hits(head.requests) == 15_771
    assert replay(head, cpu_pages=1000, policy="lfuda").hit_ratio < result.hit_ratio / 5  # without it


def test_a_replay_with_a_disk_tier_gives_the_same_hits_every_time() -> None:
    """A disk tier smaller than what the CPU tier drops: which records it keeps depended on how
    far its writer threads had got (5,960 and 6,575 hit blocks in two runs of the shipped trace);
    its writes now end before the next request, on one thread, and no queued write counts as
    room the tier does not have."""
    trace = load_trace(Path(__file__).resolve().parents[1] / "examples" / "conversation_trace_2k.jsonl")
    head = Trace("head", trace.requests[:600])
    first, second = (replay(head, cpu_pages=100, policy="lfuda", disk_pages=400) for _ in range(2))
    assert first.tier_hit_blocks["disk"] > 0
    assert (first.hit_blocks, first.tier_hit_blocks) == (second.hit_blocks, second.tier_hit_blocks)
    assert first.hit_blocks < replay(head, cpu_pages=100, policy="lfuda", disk_pages=100_000).hit_blocks
