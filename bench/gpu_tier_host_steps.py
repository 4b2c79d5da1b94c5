"""The host steps a GPU-tier load takes after the Lookup reply, each timed alone (`--profile`).

- `HostSteps(client, registered, block_ids, chunks, pool, offsets)`: what the steps work on,
  made once; its steps: the reply's parsing, the pieces, the checks, planning and routing, the
  kernel's tables and launch (`reply_steps`), and the torch calls and launch pieces around them
  (`launch_steps`).
- `host_steps(made)`: median µs of each step called many times in a row (warm: the steps'
  floor, not what a load after a pause pays).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import kvstore_kernels
from bench.gpu_tier_setup import SPEC
from kvstore.proto import kvstore_pb2 as pb
from kvstore.tiers import Tier
from kvstore_client import KVStoreClient
from kvstore_kernels import TransferOptions, check_blocks, scatter, staging, triton_copy
from kvstore_kernels.geometry import geometry_of
from kvstore_kernels.routing import choose
from kvstore_kernels.validate import plan_transfer


def host_steps(made: HostSteps, calls: int = 1000) -> dict[str, float]:
    """Median microseconds of each host step a GPU-tier load takes after the Lookup reply, each
    called `calls` times in a row (warm: the steps' floor, not what a load after a pause pays)."""
    steps = made.reply_steps() | made.launch_steps()
    timed: dict[str, float] = {}
    for name, step in steps.items():
        samples = []
        for _ in range(calls):
            torch.cuda.synchronize()  # untimed: no call waits for the GPU (a full ring, a full queue)
            started = time.perf_counter()
            step()
            samples.append(time.perf_counter() - started)
        timed[name] = statistics.median(samples) * 1e6
    torch.cuda.synchronize()
    return timed


class HostSteps:
    """What the steps work on, made once: the checked block table, the plan, the geometry and
    tables, the kernel's launch (run once, its compiled kernel kept), an Acquire reply."""

    def __init__(
        self,
        client: KVStoreClient,
        registered: Any,
        block_ids: list[int],
        chunks: int,
        pool: torch.Tensor,
        offsets: list[int],
    ) -> None:
        self.client, self.registered, self.block_ids = client, registered, block_ids
        self.chunks, self.pool, self.offsets = chunks, pool, offsets
        self.stream = client._streams.side(pool.device)
        self.checked = check_blocks(SPEC, registered, block_ids, chunks, writes_cache=True)
        self.plan = plan_transfer(
            SPEC, registered, self.checked, range(chunks), pool, offsets, None, 0, writes_cache=True
        )
        self.geometry = geometry_of(SPEC, self.plan)
        self.values, _ = self.geometry.table_values(self.plan.blocks)  # type: ignore[arg-type]
        self.launch = triton_copy.Launch(
            SPEC, self.plan, self.geometry, to_page=False, tuning=triton_copy.DEVICE_TUNING
        )
        self.reply = pb.AcquireResponse(
            ready_chunks=chunks, offsets=offsets, tiers=bytes([Tier.GPU]) * chunks, pools=[0] * chunks
        )
        self.wire = self.reply.SerializeToString()
        # no segment moves (0..0) when timed
        self.compiled = self.launch.run(0, self.geometry.num_segments, 1 << 20)

    def reply_steps(self) -> dict[str, Callable[[], Any]]:
        """From the Acquire reply to the kernel's launch, step by step."""
        # Locals, not attributes, in the timed calls: a step pays for its own lookups only.
        client, registered, checked, plan = self.client, self.registered, self.checked, self.plan
        chunks, pool, offsets, geometry = self.chunks, self.pool, self.offsets, self.geometry
        block_ids, values, launch, reply, wire = (
            self.block_ids,
            self.values,
            self.launch,
            self.reply,
            self.wire,
        )
        return {
            "AcquireResponse.FromString (32 chunks)": lambda: pb.AcquireResponse.FromString(wire),
            "pieces": lambda: client._gpu_pools.pieces(reply, client.arena),  # type: ignore[arg-type]
            "check_blocks (in the Lookup's shadow)": lambda: check_blocks(
                SPEC, registered, block_ids, chunks, writes_cache=True
            ),
            "plan_transfer (registered, checked blocks)": lambda: plan_transfer(
                SPEC, registered, checked, range(chunks), pool, offsets, None, 0, writes_cache=True
            ),
            "choose (route)": lambda: choose(SPEC, plan, TransferOptions(), to_page=False),
            "TransferOptions()": TransferOptions,
            "geometry_of (kept)": lambda: geometry_of(SPEC, plan),
            "table_values": lambda: geometry.table_values(plan.blocks),  # type: ignore[arg-type]
            "staging.to_device (tables)": lambda: staging.to_device(values, pool.device),
            "torch.empty on the device": lambda: torch.empty(
                values.size, dtype=torch.int64, device=pool.device
            ),
            "Launch(...) (tables included)": lambda: triton_copy.Launch(
                SPEC, plan, geometry, to_page=False, tuning=triton_copy.DEVICE_TUNING
            ),
            "Launch.run (kernel launch)": lambda: launch.run(0, geometry.num_segments, 1 << 20),
        }

    def launch_steps(self) -> dict[str, Callable[[], Any]]:
        """The torch calls around a launch, the public call's paths, and the launch's pieces."""
        registered, checked, plan, launch = self.registered, self.checked, self.plan, self.launch
        chunks, pool, offsets, stream = self.chunks, self.pool, self.offsets, self.stream
        geometry, compiled = self.geometry, self.compiled

        def in_stream() -> None:
            with torch.cuda.stream(stream):
                pass

        def event() -> None:
            torch.cuda.Event().record(stream)

        def in_device() -> None:
            with torch.cuda.device(pool.device):
                pass

        def compiled_run() -> None:  # the compiled kernel's own launch, with the arguments `Launch` made
            compiled.run(
                1, 1, 1, stream.cuda_stream, compiled.function, compiled.packed_metadata, None, None, None,
                *launch._pointers, 0, 0, 0, *launch._constants,
            )  # fmt: skip

        return {
            "torch.cuda.stream(s) enter+exit": in_stream,
            "torch.cuda.current_stream()": torch.cuda.current_stream,
            "torch.cuda.Event() + record": event,
            "stream.wait_stream(current)": lambda: stream.wait_stream(torch.cuda.current_stream()),
            "scatter(...) public call, registered + checked (short path)": lambda: scatter(
                SPEC, registered, checked, range(chunks), pool, offsets
            ),
            "the same, the general path (options given)": lambda: scatter(
                SPEC, registered, checked, range(chunks), pool, offsets, options=TransferOptions()
            ),
            "kvstore_kernels._run(plan)": lambda: kvstore_kernels._run(SPEC, plan, TransferOptions(), False),
            "triton_copy.launch(plan)": lambda: triton_copy.launch(SPEC, plan, to_page=False),
            "torch.cuda.device(d) enter+exit": in_device,
            "shape_of": lambda: triton_copy.shape_of(
                SPEC, plan, geometry, False, triton_copy.DEVICE_TUNING, False
            ),
            "tensor slice": lambda: launch.tables[5:],
            "no_launch_hooks()": triton_copy.no_launch_hooks,
            "compiled.run alone": compiled_run,
        }
