"""The GPU-tier benchmark's loads: two prompts in one daemon, one in each tier, and the ways of
loading them that the rows time.

- `Prompts.make(tokens)`: prompt A and prompt B (their tokens and random KV caches) and the cache
  the loads land in.
- `TierLoads(client, prompts)`: `prepare()` stores both, pins B into the GPU tier (A stays in the
  CPU tier) and registers the target cache; `runs()` the rows timed in turn, each load made
  once and checked byte for byte first: a d2d copy, each tier's load (plain, keys from the
  lookup, keys + registered cache), `IN_FLIGHT` loads in flight, one program per SM, the
  scatter alone from the daemon's pool (`pool_of_b`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu_tier_setup import BLOCK, CHUNK, SPEC, cache, tiers_of
from kvstore.proto import kvstore_pb2 as pb
from kvstore.shared.keys import pack_keys
from kvstore.tiers import Tier
from kvstore_client import KVStoreClient
from kvstore_kernels import TransferOptions, scatter

IN_FLIGHT = 4  # loads issued before the first is waited for: an engine's batch of requests


@dataclasses.dataclass(frozen=True)
class Prompts:
    """Prompt A (to stay in the CPU tier) and prompt B (to be pinned into the GPU tier): their
    tokens and KV caches; `target`, the cache every load lands in (block ids in order)."""

    tokens: int
    prompt_a: list[int]
    prompt_b: list[int]
    source_a: list[torch.Tensor]
    source_b: list[torch.Tensor]
    target: list[torch.Tensor]
    block_ids: list[int]

    @classmethod
    def make(cls, tokens: int) -> Prompts:
        blocks = tokens // BLOCK
        return cls(
            tokens=tokens,
            prompt_a=list(range(tokens)),
            prompt_b=list(range(1 << 20, (1 << 20) + tokens)),
            source_a=cache(blocks),
            source_b=cache(blocks),
            target=cache(blocks, fill=0.0),
            block_ids=list(range(blocks)),
        )

    @property
    def chunks(self) -> int:
        return self.tokens // CHUNK

    @property
    def total(self) -> int:
        """The bytes of a prompt's pages."""
        return self.chunks * SPEC.page.page_bytes


class TierLoads:
    """The loads of `prompts` through `client`, once `prepare()` has put them in their tiers."""

    def __init__(self, client: KVStoreClient, prompts: Prompts) -> None:
        self.client = client
        self.prompts = prompts
        self.registered: Any = None  # the target cache as `register_kv_caches` returns it
        self.keys_a: list[bytes] = []  # each prompt's chunk keys, as an engine's lookup hashed them
        self.keys_b: list[bytes] = []

    def prepare(self) -> float:
        """Stores both prompts, pins B into the GPU tier and waits until it is there (A stays in
        the CPU tier), registers the target cache, hashes the prompts' keys; returns the seconds
        B took to move."""
        client, p = self.client, self.prompts
        assert client.store(p.prompt_a, p.source_a, p.block_ids) == p.chunks
        assert client.store(p.prompt_b, p.source_b, p.block_ids) == p.chunks
        started = time.perf_counter()
        pin = pb.PinRequest(
            namespace=client.namespace, keys=pack_keys(client.keys(p.prompt_b)), ttl_ms=3_600_000
        )
        client._rpc("Pin", pin)
        while tiers_of(client, p.prompt_b) != bytes([Tier.GPU]) * p.chunks:
            time.sleep(0.001)
        promote_s = time.perf_counter() - started
        assert tiers_of(client, p.prompt_a) == bytes([Tier.CPU]) * p.chunks
        self.registered = client.register_kv_caches(p.target)
        self.keys_a, self.keys_b = client.keys(p.prompt_a), client.keys(p.prompt_b)
        return promote_s

    def check(self, source: list[torch.Tensor]) -> None:
        for got, want in zip(self.prompts.target, source, strict=True):
            if not torch.equal(got, want):
                raise AssertionError("loaded bytes differ from the stored ones")

    def load(
        self, prompt: list[int], source: list[torch.Tensor], keys: Any = None, kv: Any = None
    ) -> Callable[[], None]:
        """`client.load` of `prompt` into `kv` (the target cache by default), made once and checked
        against `source` first."""
        client, block_ids, tokens = self.client, self.prompts.block_ids, self.prompts.tokens
        kv = self.prompts.target if kv is None else kv

        def run() -> None:
            assert client.load(prompt, kv, block_ids, keys=keys) == tokens

        self._checked(run, source)
        return run

    def in_flight(self, prompt: list[int], source: list[torch.Tensor], keys: Any) -> Callable[[], None]:
        """`IN_FLIGHT` `load_async`s (keys, registered cache) issued before the first is waited for."""
        client, registered = self.client, self.registered
        block_ids, tokens = self.prompts.block_ids, self.prompts.tokens

        def run() -> None:
            handles = [client.load_async(prompt, registered, block_ids, keys=keys) for _ in range(IN_FLIGHT)]
            assert [handle.wait() for handle in handles] == [tokens] * IN_FLIGHT

        self._checked(run, source)
        return run

    def _checked(self, run: Callable[[], None], source: list[torch.Tensor]) -> None:
        for layer in self.prompts.target:  # the check below then sees this load's bytes
            layer.zero_()
        run()
        self.check(source)

    def with_programs(self, programs: int | None, run: Callable[[], None]) -> Callable[[], None]:
        """`run` with the client's GPU-pool loads capped at `programs` programs."""
        pools = self.client._gpu_pools

        def timed() -> None:
            pools.max_programs = programs
            try:
                run()
            finally:
                pools.max_programs = None

        return timed

    def pool_of_b(self) -> tuple[torch.Tensor, list[int]]:
        """The daemon's GPU pool (as this client maps it) holding B, and B's offsets in it."""
        client, p = self.client, self.prompts
        hit = client._rpc(
            "Lookup",
            pb.LookupRequest(
                namespace=client.namespace, keys=pack_keys(client.keys(p.prompt_b)), lease=True, gpu_pools=[0]
            ),
        )
        lease = pb.LeaseRequest(namespace=client.namespace, lease_id=hit.lease_id, epoch=client.epoch)
        acquired = client._rpc("Acquire", lease)
        assert bytes(acquired.tiers) == bytes([Tier.GPU]) * p.chunks
        pool = client._gpu_pools.tensors[acquired.pools[0]]
        offsets = list(acquired.offsets)
        client._rpc("Release", lease)  # the Pin keeps the pages in the pool for what follows
        return pool, offsets

    def runs(self, pool: torch.Tensor, offsets: list[int]) -> dict[str, Callable[[], Any]]:
        """The rows timed in turn, by name (each load made once and checked as it is built)."""
        p, registered = self.prompts, self.registered
        src = torch.empty(p.total, dtype=torch.uint8, device="cuda")
        dst = torch.empty(p.total, dtype=torch.uint8, device="cuda")
        a, b = (p.prompt_a, p.source_a, self.keys_a), (p.prompt_b, p.source_b, self.keys_b)
        runs: dict[str, Callable[[], Any]] = {
            "d2d copy": lambda: dst.copy_(src),
            "load, CPU tier": self.load(*a[:2]),
            "load, GPU tier": self.load(*b[:2]),
            # An engine hashes a prompt's chunks once, when it looks the prompt up, and hands the
            # keys to the load it schedules next.
            "load, CPU tier, keys from the lookup": self.load(*a),
            "load, GPU tier, keys from the lookup": self.load(*b),
            # ... and registers its KV cache once (`register_kv_caches`), as vLLM's connectors do.
            "load, CPU tier, keys + registered cache": self.load(*a, registered),
            "load, GPU tier, keys + registered cache": self.load(*b, registered),
            # A batch of requests: each load's host work overlaps the copies of the loads before it.
            f"{IN_FLIGHT} loads in flight, CPU tier": self.in_flight(*a),
            f"{IN_FLIGHT} loads in flight, GPU tier": self.in_flight(*b),
        }
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.client._gpu_pools.max_programs = sms  # the first call, which checks the bytes, with them too
        runs[f"load, GPU tier, {sms} programs"] = self.with_programs(sms, self.load(*b[:2]))
        self.client._gpu_pools.max_programs = None
        for programs in (None, sms):
            options = TransferOptions(max_programs=programs)
            label = f"scatter only, {programs or 'default'} programs"
            runs[label] = functools.partial(
                scatter, SPEC, p.target, p.block_ids, range(p.chunks), pool, offsets, options=options
            )
        return runs
