"""A fleet of hosts that share one remote tier, replayed over a trace: what sharing buys a fleet.

`fleet_replay(trace, hosts, cpu_pages, remote_pages, assign)` sends each request to one host:
`round-robin`, `random` (seeded, so a run repeats), or `affinity`, as a cache-aware router
sends it (Dynamo's, llm-d's, fed by the hosts' KV events): to the host with the least work, the
blocks of the prompt its CPU tier does not hold plus, as load, the requests it has served beyond
the least loaded host's, each worth half a mean request's blocks (`LOAD_WEIGHT`). Without the
load term every request of a trace whose prompts share a first block would go to one host. The host looks the
prompt up in its own CPU tier: the real store and eviction policy, as `kvctl replay` runs them
(`replay.replay_store`). The blocks after that hit continue in the shared tier, which is modelled as
the server keeps it: `remote_pages` pages, the least recently used evicted, as Redis or Valkey
do under `allkeys-lru`. The blocks found there count as the remote tier's hits and come up into
the host. The host then stores the whole request, and each block it stores is written through
to the shared tier, as `tiers.remote.write: through` does.

The result is the fleet's prefix-hit ratio, each host's, and the share the shared tier served.
With `remote_pages=0` it is the same fleet without a shared tier.
"""

from __future__ import annotations

import contextlib
import random
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from kvstore.config.root import EvictionConfig
from kvstore.ctl.replay import REPLAY_SPEC, replay_store, request_keys
from kvstore.ctl.trace import Trace
from kvstore.shared.errors import ResourceExhausted

if TYPE_CHECKING:
    from kvstore.store.store import Store

ASSIGNMENTS = ("round-robin", "random", "affinity")
LOAD_WEIGHT = 0.5  # affinity: a request served beyond the least loaded host's, in mean requests


class FleetResult(NamedTuple):
    hosts: int
    assign: str
    cpu_pages: int
    remote_pages: int
    blocks: int
    hit_blocks: int
    remote_hit_blocks: int  # hits the shared tier served (the rest: each host's own CPU tier)
    host_blocks: list[int]
    host_hit_blocks: list[int]
    elapsed_s: float

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / (self.blocks or 1)

    @property
    def remote_ratio(self) -> float:
        return self.remote_hit_blocks / (self.blocks or 1)

    def host_ratios(self) -> list[float]:
        return [
            hits / (blocks or 1) for hits, blocks in zip(self.host_hit_blocks, self.host_blocks, strict=True)
        ]

    def as_dict(self) -> dict[str, Any]:
        ratios = self.host_ratios()
        return {
            "hosts": self.hosts,
            "assign": self.assign,
            "cpu_pages": self.cpu_pages,
            "remote_pages": self.remote_pages,
            "blocks": self.blocks,
            "hit_ratio": self.hit_ratio,
            "remote_ratio": self.remote_ratio,
            "host_hit_ratios": ratios,
            "host_hit_ratio_min": min(ratios),
            "host_hit_ratio_max": max(ratios),
            "replay_s": round(self.elapsed_s, 3),
        }


class SharedTier:
    """The shared server's pages: at most `pages`, the least recently used evicted first."""

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self._held: OrderedDict[int, None] = OrderedDict()

    def leading(self, blocks: list[int]) -> int:
        """How many of `blocks`, from the first, the server holds (each a use)."""
        found = 0
        for block in blocks:
            if block not in self._held:
                break
            self._held.move_to_end(block)
            found += 1
        return found

    def write(self, blocks: list[int]) -> None:
        if not self.pages:
            return
        for block in blocks:
            self._held[block] = None
            self._held.move_to_end(block)
        while len(self._held) > self.pages:
            self._held.popitem(last=False)


def assigner(assign: str, hosts: int, seed: int = 0) -> Callable[[int], int]:
    """The host of the `index`-th request, for the assignments that do not look at the hosts."""
    if assign == "round-robin":
        return lambda index: index % hosts
    if assign == "random":
        rng = random.Random(seed)
        return lambda index: rng.randrange(hosts)
    raise ValueError(f"assign: expected one of {', '.join(ASSIGNMENTS)}, got {assign!r}")


def fleet_replay(
    trace: Trace,
    hosts: int,
    cpu_pages: int,
    remote_pages: int,
    assign: str = "round-robin",
    policy: str = EvictionConfig().policy,
    progress: Callable[[int], None] | None = None,
) -> FleetResult:
    """Replays `trace` over `hosts` hosts of `cpu_pages` pages each, sharing a remote tier of
    `remote_pages` pages (0: none); calls `progress(requests done)` now and then."""
    _check_fleet(hosts, cpu_pages, remote_pages, assign)
    host_of = assigner(assign, hosts) if assign != "affinity" else None
    shared = SharedTier(remote_pages)
    load = LOAD_WEIGHT * trace.num_blocks / len(trace.requests)
    every = max(1, len(trace.requests) // 200)
    tally = _Tally(hosts)
    with _host_stores(hosts, cpu_pages, policy) as stores:
        started = time.perf_counter()
        namespaces = [store.connect(REPLAY_SPEC).id for store in stores]
        for index, (blocks, keys) in enumerate(zip(trace.requests, request_keys(trace), strict=True)):
            if host_of is not None:
                host = host_of(index)
            else:
                host = _affinity_host(stores, namespaces, keys, tally.served, load)
            local, remote = _serve(stores[host], namespaces[host], blocks, keys, shared)
            tally.add(host, len(blocks), local, remote)
            if progress is not None and (index + 1) % every == 0:
                progress(index + 1)
        elapsed = time.perf_counter() - started
    return tally.result(assign, cpu_pages, remote_pages, elapsed)


def _check_fleet(hosts: int, cpu_pages: int, remote_pages: int, assign: str) -> None:
    if hosts <= 0 or cpu_pages <= 0 or remote_pages < 0:
        raise ValueError(
            f"hosts, cpu_pages, remote_pages: expected positive counts (remote_pages may be 0), "
            f"got {hosts}, {cpu_pages}, {remote_pages}"
        )
    if assign not in ASSIGNMENTS:
        raise ValueError(f"assign: expected one of {', '.join(ASSIGNMENTS)}, got {assign!r}")


@contextlib.contextmanager
def _host_stores(hosts: int, cpu_pages: int, policy: str) -> Iterator[list[Store]]:
    """One replay store per host, each in its own folder of a temporary directory; closed after."""
    with tempfile.TemporaryDirectory(prefix="kvstore-fleet-") as run_dir:
        stores = []
        for host in range(hosts):
            (Path(run_dir) / f"host{host}").mkdir()
            stores.append(replay_store(Path(run_dir) / f"host{host}", cpu_pages, policy))
        try:
            yield stores
        finally:
            for store in stores:
                store.cpu.close()


def _affinity_host(
    stores: list[Store], namespaces: list[bytes], keys: list[bytes], served: list[int], load: float
) -> int:
    """The host with the least work: the blocks to compute, plus the load beyond the least loaded
    host's (a lookup that is not a use)."""
    least = min(served)
    return min(
        range(len(stores)),
        key=lambda h: (
            len(keys)
            - stores[h].lookup(namespaces[h], keys, touch=False).hit_chunks
            + (served[h] - least) * load,
            h,
        ),
    )


def _serve(
    store: Store, ns: bytes, blocks: list[int], keys: list[bytes], shared: SharedTier
) -> tuple[int, int]:
    """One request on its host: the hit in its CPU tier, then in the shared tier after it; the
    whole request stored on the host and written through. Returns (local hits, shared hits)."""
    local = store.lookup(ns, keys).hit_chunks
    remote = shared.leading(blocks[local:])
    try:
        reserved = store.reserve(ns, list(dict.fromkeys(keys)))
    except ResourceExhausted:
        pass  # no room in this host's tier for the whole request: it stores none of it
    else:
        if reserved.lease_id:
            store.commit(ns, reserved.lease_id)
    shared.write(blocks)
    return local, remote


class _Tally:
    """What the fleet served so far: each host's requests, blocks and hits, and the shared tier's."""

    def __init__(self, hosts: int) -> None:
        self.served, self.host_blocks, self.host_hits = [0] * hosts, [0] * hosts, [0] * hosts
        self.remote_hits = 0

    def add(self, host: int, blocks: int, local: int, remote: int) -> None:
        self.served[host] += 1
        self.host_blocks[host] += blocks
        self.host_hits[host] += local + remote
        self.remote_hits += remote

    def result(self, assign: str, cpu_pages: int, remote_pages: int, elapsed_s: float) -> FleetResult:
        return FleetResult(
            len(self.served),
            assign,
            cpu_pages,
            remote_pages,
            sum(self.host_blocks),
            sum(self.host_hits),
            self.remote_hits,
            self.host_blocks,
            self.host_hits,
            elapsed_s,
        )
