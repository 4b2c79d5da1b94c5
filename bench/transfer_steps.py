"""Where a public store's or load's time goes: host timestamps of its steps.

- `StepClock`: marks the local channel's calls, the transfer calls and the CUDA event waits of
  whichever tree is imported (`installed()` wraps them), so that the client's time beyond the
  copy splits into the round trips, the host work before the copy, the wait, the closing call.
- `step_summary(rounds)`: per step, the median ms over the rounds.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

import torch

import kvstore_kernels


class StepClock:
    """Host timestamps of the steps of one public store or load (`installed()` wraps the local
    channel's calls, the transfer calls and CUDA event waits of whichever tree is imported), so
    that the client's time beyond the copy can be split: the round trips, the host work before
    the copy starts, the wait, the closing call."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        self.marks.append((name, time.perf_counter()))

    def take(self) -> list[tuple[str, float]]:
        """The marks since the last take, in ms from the first."""
        marks, self.marks = self.marks, []
        start = marks[0][1] if marks else 0.0
        return [(name, round((at - start) * 1e3, 4)) for name, at in marks]

    @contextlib.contextmanager
    def installed(self) -> Any:
        from kvstore.shared.channel import LocalChannel

        clock, patched = self, []

        def wrap(owner: Any, name: str, before: str, after: str) -> None:
            original = getattr(owner, name)

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                label = lambda text: text.format(method=args[1] if len(args) > 1 else "")  # noqa: E731
                clock.mark(label(before))
                try:
                    return original(*args, **kwargs)
                finally:
                    clock.mark(label(after))

            patched.append((owner, name, original))
            setattr(owner, name, wrapper)

        original_call = LocalChannel.call

        def call(channel: Any, method: str, request: Any, meanwhile: Any = None, *rest: Any) -> Any:
            def timed_meanwhile() -> Any:
                clock.mark(f"{method} meanwhile")
                try:
                    return meanwhile()
                finally:
                    clock.mark(f"{method} meanwhile done")

            clock.mark(f"{method} sent")
            try:
                return original_call(channel, method, request, timed_meanwhile if meanwhile else None, *rest)
            finally:
                clock.mark(f"{method} reply")

        patched.append((LocalChannel, "call", original_call))
        LocalChannel.call = call  # type: ignore[method-assign,assignment]
        wrap(LocalChannel, "send_frame", "{method} send", "{method} sent, not waited")
        wrap(kvstore_kernels, "gather", "gather call", "gather issued")
        wrap(kvstore_kernels, "scatter", "scatter call", "scatter issued")
        prepared = getattr(kvstore_kernels, "Prepared", None)
        if prepared is not None:
            wrap(prepared, "run", "prepared run", "prepared issued")
        wrap(torch.cuda.Event, "synchronize", "wait for the copy", "copy done")
        try:
            yield self
        finally:
            for owner, name, original in reversed(patched):
                setattr(owner, name, original)


def step_summary(rounds: list[list[tuple[str, float]]]) -> list[dict[str, Any]]:
    """Per step (the interval from one mark to the next), the median ms over the rounds whose marks
    carry the same names as the first round's."""
    if not rounds:
        return []
    names = [name for name, _ in rounds[0]]
    same = [marks for marks in rounds if [name for name, _ in marks] == names]
    return [
        {
            "from": names[i],
            "to": names[i + 1],
            "ms": round(statistics.median(m[i + 1][1] - m[i][1] for m in same), 4),
            "rounds": len(same),
        }
        for i in range(len(names) - 1)
    ]
