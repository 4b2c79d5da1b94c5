"""What a worker's mapping of pinned slabs costs the stores running beside it (issue 31, part 1).

A worker maps each slab of the daemon's pinned arena for its GPU (`kvstore_client.imported`:
import, map, `cuMemSetAccess`) while its stores run. This bench asks which way of granting the
GPU the slabs costs the stores least:

- daemon 1 (a pinned arena of 24 GiB, all mapped by the worker's client before the clock) takes
  8k-token stores of Llama-3.1-8B's geometry (1 GiB each) back to back, each timed, for the
  whole run;
- meanwhile a thread maps 64 slabs (16 GiB) of daemon 2's pinned arena (descriptors fetched
  ahead, over its local channel) into a range of its own, one way at a time, then unmaps them:
  per slab (as the client does), 4, 16 or all 64 slabs granted in one `cuMemSetAccess`, or per
  slab with 5 ms between slabs; each way three times, in turns. `--another-process`: another
  process maps, one slab a call (does a grant slow the GPU's copies, or its own process's?).

"extra ms per slab" is the stores' time over the median of the stores that overlapped no
mapping (and no unmapping), summed over the stores that overlapped the window, per slab
mapped: the fill time a worker loses per 256 MiB it maps beside its stores.

    python bench/pinned_grants.py [--name pinned-grants]

Prints a table and writes bench/results/<name>.json. Needs a GPU (the driver's VMM calls).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, running_daemon, write_results  # noqa: E402
from bench.connect_processes import ReserveWatch  # noqa: E402
from bench.connect_worker import SPEC, PromptSet  # noqa: E402

SLAB = 256 << 20
SLABS = 64
SKIP = 8  # slabs of daemon 2 its own client may have mapped before its registrar stopped
WAYS = [("per slab", 1, 0.0), ("4 slabs a call", 4, 0.0), ("16 a call", 16, 0.0),
        ("64 in one call", 64, 0.0), ("per slab, 5 ms apart", 1, 0.005)]  # fmt: skip


def descriptors_only(address: str) -> tuple[Any, Any]:
    """A client of daemon 2 whose own mapping of the arena is stopped at once: its local channel
    brings the slabs' descriptors (`Fetchers`), and nothing of this process maps them but the bench."""
    import kvstore_client.arena as arena_module
    from kvstore_client import KVStoreClient

    captured: dict[str, Any] = {}
    real = arena_module.map_pinned

    def stopped(size: int, slab_bytes: int, fetchers: Any, device: int) -> Any:
        captured["fetch"] = fetchers
        imported, registrar = real(size, slab_bytes, fetchers, device)
        registrar.stop()
        return imported, registrar

    arena_module.map_pinned = stopped
    try:
        client = KVStoreClient.connect(address, SPEC)
    finally:
        arena_module.map_pinned = real
    return client, captured["fetch"]


def map_one_way(
    vmm: Any, fetch: Any, base: int, group: int, gap_s: float, marks: list[dict[str, Any]]
) -> None:
    """Maps `SLABS` slabs at `base`, granting `group` slabs a call, then unmaps them; the windows
    of both go to `marks`."""
    fds: list[int] = []
    while len(fds) < SLABS:
        got = fetch(SKIP + len(fds), min(16, SLABS - len(fds)))
        if not got:
            time.sleep(0.05)
        fds.extend(got)
    handles, grants = [], []
    with vmm.on_device(0):
        started = time.perf_counter()
        for first in range(0, SLABS, group):
            for slab in range(first, first + group):
                handle = vmm.import_fd(fds[slab])
                os.close(fds[slab])
                vmm.map(base + slab * SLAB, SLAB, handle)
                handles.append(handle)
            begun = time.perf_counter()
            vmm.set_access(base + first * SLAB, group * SLAB, (0,), host=False)
            grants.append((time.perf_counter() - begun) * 1e3)
            if gap_s:
                time.sleep(gap_s)
        marks.append({"t0": started, "t1": time.perf_counter(), "grant_ms": grants})
        time.sleep(0.3)
        unmapped = time.perf_counter()
        for slab, handle in enumerate(handles):
            vmm.unmap(base + slab * SLAB, SLAB)
            vmm.release(handle)
        marks.append({"name": "unmap", "t0": unmapped, "t1": time.perf_counter()})
        time.sleep(0.4)


def mapper_process(address: str, ways: list[tuple[str, int, float]], out: Any) -> None:
    """`--another-process`: the mapping in a process of its own, its windows put on `out`
    (`time.perf_counter` is the system's monotonic clock, the same in both processes)."""
    from kvstore.shared.cuda_vmm import load_vmm

    side, fetch = descriptors_only(address)
    vmm = load_vmm()
    with vmm.on_device(0):
        base = vmm.reserve(SLABS * SLAB)
    marks: list[dict[str, Any]] = []
    time.sleep(0.5)
    for name, group, gap_s in ways * 3:
        map_one_way(vmm, fetch, base, group, gap_s, marks)
        marks[-2]["name"] = name
    side.close()
    out.put(marks)


def measure(another_process: bool) -> dict[str, Any]:
    import multiprocessing

    import torch

    from kvstore.shared.cuda_vmm import load_vmm
    from kvstore_client import KVStoreClient

    torch.cuda.init()
    prompts = PromptSet(8192, 2, 5, torch.device("cuda"))
    pinned = {"slab_bytes": "256MiB", "pinned": True}
    stored = {"tiers": {"cpu": {"bytes": "24GiB", **pinned}}}
    mapped = {"tiers": {"cpu": {"bytes": f"{(SLABS + SKIP) // 4}GiB", **pinned}}}
    stores: list[tuple[float, float]] = []
    marks: list[dict[str, Any]] = []
    with running_daemon(stored) as first, running_daemon(mapped) as second:
        ReserveWatch(first, time.perf_counter()).wait(600)
        ReserveWatch(second, time.perf_counter()).wait(600)
        client = KVStoreClient.connect(first.address, SPEC)
        while client._mapped.stats().get("slabs_pending", 1):
            time.sleep(0.01)
        for i in range(6):  # warm: Triton's compile, the arena's first touches
            prompts.store(client, i)
        done = threading.Event()
        if another_process:
            context = multiprocessing.get_context("spawn")
            out = context.Queue()
            child = context.Process(target=mapper_process, args=(second.address, WAYS[:1], out))
            child.start()

            def mapper() -> None:
                try:
                    marks.extend(out.get(timeout=600))
                finally:
                    done.set()

        else:
            side, fetch = descriptors_only(second.address)
            vmm = load_vmm()
            with vmm.on_device(0):
                base = vmm.reserve(SLABS * SLAB)

            def mapper() -> None:
                try:
                    time.sleep(0.5)
                    for name, group, gap_s in WAYS * 3:
                        map_one_way(vmm, fetch, base, group, gap_s, marks)
                        marks[-2]["name"] = name
                finally:
                    done.set()

        thread = threading.Thread(target=mapper)
        thread.start()
        i = 10
        while not done.is_set():
            torch.cuda.synchronize()
            begun = time.perf_counter()
            source = prompts.prompts[i % 2]
            client.store(prompts.tokens(i), source.source, source.blocks)
            torch.cuda.synchronize()
            stores.append((begun, time.perf_counter()))
            i += 1
        thread.join()
        if another_process:
            child.join()
        else:
            side.close()
        client.close()
    return {
        "gpu": torch.cuda.get_device_name(0),
        "another_process": another_process,
        **summarize(stores, marks),
    }


def summarize(stores: list[tuple[float, float]], marks: list[dict[str, Any]]) -> dict[str, Any]:
    windows = [(m["t0"], m["t1"]) for m in marks]
    quiet = [(b - a) * 1e3 for a, b in stores if not any(a < y and b > x for x, y in windows)]
    steady = statistics.median(quiet)
    ways: dict[str, list[dict[str, Any]]] = {}
    for mark in marks:
        touching = [(a, b) for a, b in stores if a < mark["t1"] and b > mark["t0"]]
        extra = sum((b - a) * 1e3 - steady for a, b in touching)
        ways.setdefault(mark["name"], []).append({
            "window_ms": (mark["t1"] - mark["t0"]) * 1e3,
            "stores": len(touching),
            "extra_ms": extra,
            "extra_ms_per_slab": extra / SLABS,
            "grant_ms_sum": sum(mark.get("grant_ms", [])),
        })  # fmt: skip
    return {"slabs": SLABS, "steady_store_ms": steady, "quiet_stores": len(quiet), "ways": ways}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--name", default="pinned-grants")
    parser.add_argument(
        "--another-process",
        action="store_true",
        help="map (one slab a call) in another process than the one storing: do grants slow the GPU's "
        "copies, or this process's?",
    )
    args = parser.parse_args()
    result = measure(args.another_process)
    rows = [
        [name, len(reps), f"{statistics.median(r['extra_ms_per_slab'] for r in reps):.3f}",
         f"{statistics.median(r['grant_ms_sum'] for r in reps) / SLABS:.2f}",
         f"{statistics.median(r['window_ms'] for r in reps):.0f}"]
        for name, reps in result["ways"].items()
    ]  # fmt: skip
    print(f"stores beside nothing: {result['steady_store_ms']:.2f} ms each ({result['gpu']})")
    print_table(["way", "runs", "extra ms per slab", "grant ms per slab", "window ms"], rows)
    print(f"wrote {write_results(args.name, result)}")


if __name__ == "__main__":
    main()
