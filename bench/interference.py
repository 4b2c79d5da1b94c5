"""What a transfer costs the model: the slowdown of a stream of bf16 matrix products beside it.

- `MatmulStream(size)`: bf16 `size`³ products of random operands on the current stream.
- `MatmulStream.beside(enqueues, transfer_ms, issue_ms)`: one unbroken run of products;
  once the first of them are done (enough to cover the host's time to queue the transfers),
  side streams (one per enqueue) run transfers for about as long as 40 products take. Each
  product is timed with events and classed as alone (entirely outside the transfers'
  window) or beside (entirely inside it); the slowdown is the ratio of their medians, and
  `mean_slowdown` the ratio of their means (bursty work, like the staged path's packing,
  can slow some products and leave the median alone).

Why one unbroken run: a product that follows an idle gap runs faster (clocks recover), so a
baseline taken in a separate burst, or products queued after the host spent milliseconds
issuing transfers, bias the ratio by as much as ±10% (seen on the H100: a plain memcpy
"slowed" products by 1.00-1.14 and staged copies "sped them up" to 0.88).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import NamedTuple

import torch

WARMUP_PRODUCTS = 3  # the first products of a run are not counted as alone


class Interference(NamedTuple):
    alone_ms: float  # median ms per product outside the transfers' window
    beside_ms: float  # median ms per product inside it
    slowdown: float  # beside / alone
    max_slowdown: float  # slowest product inside / alone
    products: int  # products entirely inside the window
    alone_products: int
    transfer_gbps: float  # the transfers' bytes over their window
    mean_slowdown: float  # mean beside / mean alone


class MatmulStream:
    """bf16 matrix products of random `size`×`size` operands (never zeros: they run faster)."""

    def __init__(self, size: int = 8192, device: str = "cuda") -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        self.a = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
        self.b = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
        self.out = torch.empty_like(self.a)
        events = self._enqueue(10)
        torch.cuda.synchronize()
        self.product_ms = statistics.median(
            a.elapsed_time(b) for a, b in zip(events[3:], events[4:], strict=False)
        )

    def _enqueue(self, count: int, events: list[torch.cuda.Event] | None = None) -> list[torch.cuda.Event]:
        """`count` products, each followed by an event; a new list starts with an event before them."""
        if events is None:
            events = [torch.cuda.Event(enable_timing=True)]
            events[0].record()
        for _ in range(count):
            torch.matmul(self.a, self.b, out=self.out)
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
        return events

    def beside(
        self,
        enqueues: list[Callable[[], int]],
        transfer_ms: float,
        issue_ms: float = 0.0,
        beside: int = 40,
        after: int = 20,
    ) -> Interference:
        """Products beside the transfers that `enqueues` queue (each returns its bytes).

        `transfer_ms`: how long one round of `enqueues` takes alone; rounds are repeated to
        last about as long as `beside` products. `issue_ms`: the host time to queue one round;
        enough products are queued first that the GPU never waits for the host.
        """
        rounds = max(1, round(beside * self.product_ms / max(transfer_ms, 0.01)))
        before = 20 + int(rounds * issue_ms / self.product_ms)
        events = self._enqueue(before)
        gate = events[-1]  # the transfers start once the `before` products are done
        sides = [torch.cuda.Stream() for _ in enqueues]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        moved = 0
        for index, (side, enqueue) in enumerate(zip(sides, enqueues, strict=True)):
            side.wait_event(gate)
            with torch.cuda.stream(side):
                if index == 0:
                    start.record()
                moved += sum(enqueue() for _ in range(rounds))
        for side in sides[1:]:
            sides[0].wait_stream(side)
        end.record(sides[0])
        self._enqueue(beside + after, events)
        torch.cuda.synchronize()
        alone, inside = [], []
        for index, (a, b) in enumerate(zip(events, events[1:], strict=False)):
            if start.elapsed_time(a) >= 0 and b.elapsed_time(end) >= 0:
                inside.append(a.elapsed_time(b))
            elif index >= WARMUP_PRODUCTS and (b.elapsed_time(start) >= 0 or end.elapsed_time(a) >= 0):
                alone.append(a.elapsed_time(b))
        gbps = moved / start.elapsed_time(end) / 1e6
        if not inside or not alone:
            nan = float("nan")
            return Interference(nan, nan, nan, nan, len(inside), len(alone), gbps, nan)
        alone_ms, beside_ms = statistics.median(alone), statistics.median(inside)
        return Interference(
            alone_ms,
            beside_ms,
            beside_ms / alone_ms,
            max(inside) / alone_ms,
            len(inside),
            len(alone),
            gbps,
            statistics.fmean(inside) / statistics.fmean(alone),
        )
