"""The fleet simulation (`kvctl replay --hosts N --remote-pages R`): exact hits on small traces,
worked by hand, through the real store and policy of each host."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.ctl.fleet import SharedTier, fleet_replay
from kvstore.ctl.trace import Trace
from tests.test_replay import write_trace

# Two hosts, round-robin (r0, r2, r4 on host 0; r1, r3 on host 1), room for everything:
#   r0 host 0 [1 2 3]  nothing anywhere                          0
#   r1 host 1 [1 2 4]  its own tier: none; shared: 1 2           2 (remote)
#   r2 host 0 [5 6]    nothing                                   0
#   r3 host 1 [1 2 3]  its own: 1 2 (from r1); shared: 3         3 (1 remote)
#   r4 host 0 [5 6 7]  its own: 5 6 (from r2); shared: no 7      2
# 7 hits of 14 blocks, 3 of them from the shared tier; host 0: 2 of 8, host 1: 5 of 6.
# Without a shared tier: 0 + 0 + 0 + 2 + 2 = 4.
FLEET = [[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3], [5, 6, 7]]


def trace(requests: list[list[int]]) -> Trace:
    return Trace("test", requests)


def test_a_shared_tier_serves_what_another_host_stored() -> None:
    result = fleet_replay(trace(FLEET), hosts=2, cpu_pages=100, remote_pages=100)
    assert (result.blocks, result.hit_blocks, result.remote_hit_blocks) == (14, 7, 3)
    assert (result.host_blocks, result.host_hit_blocks) == ([8, 6], [2, 5])
    alone = fleet_replay(trace(FLEET), hosts=2, cpu_pages=100, remote_pages=0)
    assert (alone.hit_blocks, alone.remote_hit_blocks) == (4, 0)
    one = fleet_replay(trace(FLEET), hosts=1, cpu_pages=100, remote_pages=0)
    assert one.hit_blocks == 2 + 3 + 2  # one host holds everything: r1 1 2, r3 1 2 3, r4 5 6


def test_the_shared_tier_keeps_the_most_recently_used_pages() -> None:
    shared = SharedTier(2)
    shared.write([1, 2])
    assert shared.leading([1]) == 1  # a hit is a use: 2 is now the least recent
    shared.write([3])
    assert (shared.leading([2]), shared.leading([1, 3]), shared.leading([3, 1])) == (0, 2, 2)
    none = SharedTier(0)
    none.write([1])
    assert none.leading([1]) == 0


# Affinity, two hosts, 8-block conversations (mean request 8.25 blocks; a request served beyond
# the least loaded host costs half of that): r0 host 0 (a tie); r1 host 1 (host 0 has served
# one more); r2 host 0 (a tie again, the lower number); r3 continues r0's conversation: host 0
# computes 1 block plus 4.1 of load, host 1 all 9: host 0, 8 hits. Round-robin puts r3 on host 1,
# which holds r1's conversation: no hit.
CONVERSATIONS = [list(range(1, 9)), list(range(30, 38)), list(range(40, 48)), list(range(1, 10))]


def test_affinity_sends_a_conversation_back_to_the_host_that_holds_it() -> None:
    routed = fleet_replay(trace(CONVERSATIONS), hosts=2, cpu_pages=100, remote_pages=0, assign="affinity")
    assert routed.hit_blocks == 8 and routed.host_blocks == [25, 8]
    spread = fleet_replay(trace(CONVERSATIONS), hosts=2, cpu_pages=100, remote_pages=0)
    assert spread.hit_blocks == 0 and spread.host_blocks == [16, 17]


def test_random_assignment_repeats_and_bad_arguments_are_errors() -> None:
    first = fleet_replay(trace(FLEET * 4), hosts=3, cpu_pages=100, remote_pages=10, assign="random")
    again = fleet_replay(trace(FLEET * 4), hosts=3, cpu_pages=100, remote_pages=10, assign="random")
    assert first.host_hit_blocks == again.host_hit_blocks and sum(first.host_blocks) == 56
    with pytest.raises(ValueError, match="assign: expected one of"):
        fleet_replay(trace(FLEET), hosts=2, cpu_pages=10, remote_pages=0, assign="nearest")
    with pytest.raises(ValueError, match="hosts, cpu_pages, remote_pages"):
        fleet_replay(trace(FLEET), hosts=0, cpu_pages=10, remote_pages=0)


def test_kvctl_replay_of_a_fleet_prints_json_and_a_table(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "fleet.jsonl", FLEET)
    command = [
        sys.executable,
        "-m",
        "kvstore.ctl.cli",
        "replay",
        str(path),
        "--cpu-pages",
        "100",
        "--hosts",
        "2",
    ]
    out = subprocess.run(
        [*command, "--remote-pages", "100", "--json"], capture_output=True, text=True, check=True
    )
    data = json.loads(out.stdout)
    assert (data["hosts"], data["blocks"], data["hit_ratio"], data["remote_ratio"]) == (2, 14, 0.5, 3 / 14)
    assert data["host_hit_ratios"] == [2 / 8, 5 / 6]
    shown = subprocess.run(
        [*command, "--remote-pages", "100"], capture_output=True, text=True, check=True
    ).stdout
    assert "fleet       14       50.00%" in shown and "the shared tier served 21.43% of the blocks" in shown
    refused = subprocess.run([*command, "--disk-pages", "5"], capture_output=True, text=True)
    assert (
        refused.returncode != 0 and "--disk-pages: the fleet simulation has no disk tiers" in refused.stderr
    )
