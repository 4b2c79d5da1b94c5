"""Parts 6 and 7 of the control-plane benchmark: what serving /metrics costs Lookups.

- `bench_metrics(args)`: a daemon serving /metrics, scraped every `--scrape-interval` meanwhile,
  against one without, side by side in `--rounds` rounds (`control_plane_sides.on_off_rounds`).
- `bench_scrape_turns(args)`: one daemon serving /metrics, its Lookups timed in `--windows` pairs
  of windows, a scraper process fetching /metrics in one and idle (or fetching /healthz, with
  `--quiet-probe`) in the other, in random order; a bootstrap interval of the p99 ratio, the
  calls that overlapped a scrape, and `snapshot_cost`, the daemon's own work per scrape.
- `report_metrics`, `report_scrape_turns`: their tables.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import pickle
import random
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.common import Latency, bootstrap_ratio_interval, overlapping, print_table
from bench.common_timing import time_calls
from bench.control_plane_setup import (
    CHUNK_TOKENS,
    LOOKUP_SIZES,
    in_process_stores,
    lookup_series,
    lookup_spec,
    lookup_tokens,
    small_daemon_config,
    store_lookup_pages,
)
from bench.control_plane_sides import free_port, on_off_rounds, on_over_off, open_side, side_calls, side_rows
from bench.control_plane_tenants import TARGET_TENANTS_RATIO
from kvstore.server.handlers import Handlers
from kvstore.server.metrics import Snapshot

Windows = dict[str, dict[str, list[list[float]]]]  # per mode and series: durations per window


def bench_metrics(args: argparse.Namespace) -> dict[str, Any]:
    """Lookup latency of a daemon serving /metrics, scraped every second meanwhile, against one
    without metrics: side by side, timed in turns, `args.rounds` rounds of fresh daemons."""
    spec = lookup_spec()
    tokens = lookup_tokens(max(LOOKUP_SIZES), seed=5)
    base = small_daemon_config()

    def configs() -> dict[str, Any]:  # a fresh port each round
        return {
            "off": base,
            "on": base | {"server": base["server"] | {"metrics_address": f"127.0.0.1:{free_port()}"}},
        }

    results, per_round = on_off_rounds(args, configs, spec, tokens, {}, scrape_every_s=args.scrape_interval)
    results["p99_ratio"] = on_over_off(results, "p99_us")
    results["p50_ratio_per_round"] = per_round
    results["rounds"] = args.rounds
    results["scrape_interval_s"] = args.scrape_interval
    results["target_ratio"] = TARGET_TENANTS_RATIO
    return results


def report_metrics(results: dict[str, Any]) -> None:
    print(
        f"\nLookup latency with /metrics scraped every {results['scrape_interval_s']:g} s and without "
        "(p50 / p99 µs; on / off p50, p99)"
    )
    print_table(["call", "metrics on", "metrics off", "p50 ratio", "p99 ratio"], side_rows(results))


SCRAPER = r"""
import json, sys, threading, time, urllib.request
urls, every = {"on": sys.argv[1], "off": sys.argv[2]}, float(sys.argv[3])
mode, done = ["idle"], threading.Event()
def control():
    for line in sys.stdin:
        mode[0] = line.strip()
    mode[0] = "idle"
    done.set()
threading.Thread(target=control, daemon=True).start()
spans = []
while not done.is_set():
    current = mode[0]
    url = urls.get(current, "-")
    if url == "-":
        time.sleep(0.005)
        continue
    start = time.monotonic()
    body = urllib.request.urlopen(url, timeout=10).read()
    if current == "on":
        spans.append((start, time.monotonic()))
        assert b"kvstore_lookups_total" in body
    while mode[0] == current and time.monotonic() < start + every:
        time.sleep(0.005)
print(json.dumps(spans))
"""


def bench_scrape_turns(args: argparse.Namespace, window_s: float = 1.0, batch: int = 10) -> dict[str, Any]:
    """One daemon serving /metrics, its Lookups timed in `args.windows` pairs of windows: one while
    a scraper (a process of its own, so that it costs this one nothing) fetches /metrics every
    `args.scrape_interval` s, one while it is idle, in random order within each pair. The same
    daemon, core and caches on both sides: what is left is the scrape's cost.

    Besides the pooled p50 and p99 of each side: a 90% bootstrap interval of the p99 ratio
    (window pairs resampled), the calls that overlapped a scrape (the scraper reports when each
    ran; both processes read CLOCK_MONOTONIC) and their latency, and the daemon's own work per
    scrape, measured in this process."""
    spec = lookup_spec()
    tokens = lookup_tokens(max(LOOKUP_SIZES), seed=6)
    port = free_port()
    with contextlib.ExitStack() as stack:
        _, client, grpc_client = open_side(
            stack, small_daemon_config(metrics_address=f"127.0.0.1:{port}"), spec
        )
        if store_lookup_pages(client, spec, tokens) != max(LOOKUP_SIZES):
            raise RuntimeError("scrape turns: the lookup pages were not all stored")
        calls = side_calls(client, grpc_client)
        series = lookup_series(calls, client.namespace, client.keys(tokens), checked=None)
        scraper = _start_scraper(port, args)
        for call in series.values():
            time_calls(call, args.warmup)
        windows, starts = _timed_windows(series, scraper, args.windows, window_s, batch)
        spans = _scraped_spans(scraper)
        cost = snapshot_cost(args.lookup_calls)
    results = _scrape_summary(list(series), windows, starts, spans)
    results["daemon_work_per_scrape_us"] = cost
    results["scrapes"] = len(spans)
    results["scrape_ms"] = Latency.of([end - start for start, end in spans])._asdict()
    results |= {"windows": args.windows, "window_s": window_s, "scrape_interval_s": args.scrape_interval}
    results["quiet_windows"] = "/healthz fetched as often" if args.quiet_probe else "scraper idle"
    return results


def _start_scraper(port: int, args: argparse.Namespace) -> subprocess.Popen[str]:
    """The scraper process: told "on" or "off" a line at a time on stdin, it prints the spans of
    its /metrics scrapes once stdin closes."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            SCRAPER,
            f"http://127.0.0.1:{port}/metrics",
            f"http://127.0.0.1:{port}/healthz" if args.quiet_probe else "-",
            str(args.scrape_interval),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _timed_windows(
    series: dict[str, Callable[[], object]],
    scraper: subprocess.Popen[str],
    pairs: int,
    window_s: float,
    batch: int,
) -> tuple[Windows, dict[str, list[float]]]:
    """`pairs` pairs of windows, "on" and "off" in random order within each pair, the series called
    `batch` times each in turn for `window_s`; for "on", the calls' start times too."""
    assert scraper.stdin is not None
    order = random.Random(7)
    windows: Windows = {"on": {}, "off": {}}
    starts: dict[str, list[float]] = {}
    # This process's collector runs between windows only: its pauses would land in the
    # timed calls of either side, adding scatter that is not the daemon's.
    gc.collect()
    gc.freeze()
    gc.disable()
    for _ in range(pairs):
        gc.collect()
        for mode in order.sample(("on", "off"), 2):
            scraper.stdin.write(f"{mode}\n")
            scraper.stdin.flush()
            taken: dict[str, list[float]] = {name: [] for name in series}
            end = time.perf_counter() + window_s
            while time.perf_counter() < end:
                for name, call in series.items():
                    for _ in range(batch):
                        start = time.perf_counter()
                        call()
                        taken[name].append(time.perf_counter() - start)
                        if mode == "on":
                            starts.setdefault(name, []).append(start)
            for name, durations in taken.items():
                windows[mode].setdefault(name, []).append(durations)
    gc.enable()
    return windows, starts


def _scraped_spans(scraper: subprocess.Popen[str]) -> list[tuple[float, float]]:
    """The (start, end) of each scrape of /metrics, once the scraper is told to stop."""
    out, _ = scraper.communicate(timeout=30)
    if scraper.returncode != 0:
        raise RuntimeError(f"the scraper failed (exit {scraper.returncode})")
    spans: list[tuple[float, float]] = [tuple(span) for span in json.loads(out)]
    if not spans:
        raise RuntimeError("the scraper never scraped")
    return spans


def _scrape_summary(
    names: list[str], windows: Windows, starts: dict[str, list[float]], spans: list[tuple[float, float]]
) -> dict[str, Any]:
    """Each side's pooled latency, the on / off ratios with the p99's bootstrap interval, and the
    calls that overlapped a scrape."""
    results: dict[str, Any] = {}
    for mode, per_series in windows.items():
        for name, per_window in per_series.items():
            results[f"{mode}/{name}"] = Latency.of([d for window in per_window for d in window])._asdict()
    results["p50_ratio"] = on_over_off(results)
    results["p99_ratio"] = on_over_off(results, "p99_us")
    results["p99_ratio_90ci"] = {
        name: bootstrap_ratio_interval(windows["on"][name], windows["off"][name], 99) for name in names
    }
    results["overlapping_a_scrape"] = {
        name: overlapping(starts[name], [d for window in windows["on"][name] for d in window], spans)
        for name in names
    }
    return results


def snapshot_cost(calls: int) -> dict[str, float]:
    """The daemon's own work per scrape, timed in this process on a store holding the pages the
    daemon holds (p50 µs): the snapshot the event loop takes, and its pickling in the daemon's
    metrics thread. A Lookup that arrives meanwhile waits for at most these."""
    page = lookup_spec().page
    with in_process_stores() as (store,):
        ns = store.connect(page).id
        store.commit(ns, store.reserve(ns, [bytes([i % 256, i // 256]) * 8 for i in range(512)]).lease_id)
        handlers = Handlers({"": store}, CHUNK_TOKENS, 4 << 20)
        snap = Snapshot.take(handlers)
        return {
            "snapshot_on_loop": Latency.of(time_calls(lambda: Snapshot.take(handlers), calls)).p50_us,
            "pickle_in_thread": Latency.of(time_calls(lambda: pickle.dumps(snap), calls)).p50_us,
            "pickled_bytes": len(pickle.dumps(snap)),
        }


def report_scrape_turns(results: dict[str, Any]) -> None:
    print(
        f"\nOne daemon, Lookups in {results['windows']} pairs of {results['window_s']:g} s windows, /metrics "
        f"scraped every {results['scrape_interval_s']:g} s in one ({results['scrapes']} scrapes, "
        f"p50 {results['scrape_ms']['p50_us'] / 1e3:.1f} ms each) and not in the other "
        f"({results['quiet_windows']})"
    )
    rows = side_rows(results)
    for row, name in zip(rows, results["p50_ratio"], strict=True):
        low, high = results["p99_ratio_90ci"][name]
        hit = results["overlapping_a_scrape"][name]
        row += [f"{low:.3f}-{high:.3f}", f"{hit['calls']} ({hit['share']:.2%}), p50 {hit['p50_us']:.0f}"]
    headers = ["call", "scraping", "quiet", "p50 ratio", "p99 ratio", "p99 ratio, 90% interval"]
    print_table([*headers, "overlapping a scrape"], rows)
    cost = results["daemon_work_per_scrape_us"]
    print(
        "The daemon's work per scrape (p50): the snapshot on the event loop "
        f"{cost['snapshot_on_loop']:.0f} µs, its pickling ({cost['pickled_bytes']} bytes) in the metrics "
        f"thread {cost['pickle_in_thread']:.0f} µs"
    )
