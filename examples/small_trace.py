"""A small Mooncake-format trace cut from a larger one, for `kvctl replay` to run as the README prints.

    python examples/small_trace.py conversation_trace.jsonl > examples/conversation_trace_2k.jsonl

Keeps the first `--requests` requests (2,000) in order, each prompt cut to its first `--blocks`
blocks (16 of 512 tokens: `input_length` at most 8,192), and numbers the block ids again in the
order they first appear, so the file stays small. A cut keeps a prompt's leading blocks, which
are its prefix chain, so two requests that shared a prefix still share it as far as both reach.
`examples/conversation_trace_2k.jsonl` is this run on the Mooncake conversation trace (12,031
requests, 288,500 blocks): 2,000 requests, 22,977 blocks, 15,420 distinct.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

BLOCK_TOKENS = 512  # the Mooncake traces' block


def cut(lines: Iterable[str], requests: int, blocks: int) -> Iterator[dict[str, Any]]:
    """The first `requests` records of `lines`, each cut to `blocks` blocks, ids renumbered."""
    ids: dict[int, int] = {}
    kept = 0
    for line in lines:
        if kept == requests:
            return
        if not line.strip():
            continue
        record = json.loads(line)
        record["hash_ids"] = [ids.setdefault(block, len(ids)) for block in record["hash_ids"][:blocks]]
        record["input_length"] = min(record["input_length"], blocks * BLOCK_TOKENS)
        kept += 1
        yield record


def write(records: Iterable[dict[str, Any]], out: TextIO) -> None:
    for record in records:
        out.write(json.dumps(record, separators=(",", ":")) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", help="a Mooncake-format JSONL trace")
    parser.add_argument("--requests", type=int, default=2000, help="requests kept, from the start")
    parser.add_argument("--blocks", type=int, default=16, help="blocks kept of each prompt, from its start")
    args = parser.parse_args()
    with open(args.trace, encoding="utf-8") as lines:
        write(cut(lines, args.requests, args.blocks), sys.stdout)


if __name__ == "__main__":
    main()
