"""Progress of a long start-up step (the disk tier's recovery scan): a bar on a terminal, log lines otherwise.

- `progress_reporter(what, stream, interval_s) -> (done, total) callback`: on a terminal, one
  line redrawn in place (`what [#####.....] 1234/5678`), ended by the last call; elsewhere (a
  service's journal), an info log line at most every `interval_s` and one at the end.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

log = logging.getLogger("kvstored")

BAR_WIDTH = 30


def progress_reporter(
    what: str, stream: TextIO | None = None, interval_s: float = 5.0
) -> Callable[[int, int], None]:
    out = sys.stderr if stream is None else stream
    terminal = out.isatty()
    last = -float("inf")

    def report(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        finished = done >= total
        if terminal:
            filled = BAR_WIDTH * done // total if total else BAR_WIDTH
            bar = "#" * filled + "." * (BAR_WIDTH - filled)
            out.write(f"\r{what} [{bar}] {done}/{total}" + ("\n" if finished else ""))
            out.flush()
        elif finished or now - last >= interval_s:
            log.info("%s: %d of %d (%.0f%%)", what, done, total, 100 * done / total if total else 100)
            last = now

    return report
