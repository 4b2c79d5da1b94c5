"""Side-by-side comparisons of the control-plane benchmark: two daemons, one feature on and off.

- `open_side(stack, config, spec)`: a daemon from `config`, a client on its local channel and one
  on gRPC, closed with `stack`; `side_calls(client, grpc_client)`: the Lookups each side times
  (the local channel with 1, 64 and 512 keys, gRPC with 1 and 64).
- `side_by_side(...)`: one round, both daemons running, every series timed in turns (a thread
  scraping each daemon's /metrics meanwhile, if asked: `scraping`); `on_off_rounds(...)`:
  `--rounds` such rounds of fresh daemons, which one starts first alternating, samples pooled.
- `on_over_off(latencies)`: each series' figure with the feature on over off; `side_rows`: the
  rows of a report, p50 / p99 of each side and their ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from bench.common import Daemon, Latency, running_daemon
from bench.control_plane_setup import (
    LOOKUP_SIZES,
    Rpc,
    lookup_series,
    store_lookup_pages,
    timed_in_turns,
)
from kvstore_client import KVSpec, KVStoreClient


def open_side(
    stack: contextlib.ExitStack, config: dict[str, Any], spec: KVSpec, token: str | None = None
) -> tuple[Daemon, KVStoreClient, KVStoreClient]:
    """A running daemon, a client (local channel) and a gRPC-only client sending `token`."""
    daemon = stack.enter_context(running_daemon(config))
    client = stack.enter_context(KVStoreClient.connect(daemon.address, spec))
    grpc_client = stack.enter_context(
        KVStoreClient.connect(daemon.address, spec, local_channel=False, token=token)
    )
    return daemon, client, grpc_client


def side_calls(client: KVStoreClient, grpc_client: KVStoreClient) -> list[tuple[str, Rpc, int]]:
    return [("rpc", client._rpc, n) for n in LOOKUP_SIZES] + [("grpc", grpc_client._rpc, n) for n in (1, 64)]


def side_by_side(
    args: argparse.Namespace,
    configs: Mapping[str, Any],
    spec: KVSpec,
    tokens: torch.Tensor,
    grpc_tokens: Mapping[str, str],
    scrape_every_s: float = 0.0,
) -> dict[str, list[float]]:
    """One round of an on/off comparison: both daemons running, every series timed in turns.
    `grpc_tokens`: the token a mode's gRPC client sends; `scrape_every_s`: a thread fetches each
    daemon's /metrics (where it serves them) this often while the series are timed."""
    series: dict[str, Callable[[], object]] = {}
    scrape_urls: list[str] = []
    with contextlib.ExitStack() as stack:
        for mode, config in configs.items():
            _, client, grpc_client = open_side(stack, config, spec, grpc_tokens.get(mode))
            if config["server"].get("metrics_address"):
                scrape_urls.append(f"http://{config['server']['metrics_address']}/metrics")
            if client._local is None:
                raise RuntimeError(f"{mode}: the client did not open the local channel")
            stored = store_lookup_pages(client, spec, tokens)
            if stored != max(LOOKUP_SIZES):
                raise RuntimeError(f"tenants {mode}: stored {stored} of {max(LOOKUP_SIZES)} chunks")
            keys = client.keys(tokens)
            calls = side_calls(client, grpc_client)
            for name, call in lookup_series(calls, client.namespace, keys, f"tenants {mode}").items():
                series[f"{mode}/{name}"] = call
            series[f"{mode}/lookup_chunks_8"] = functools.partial(client.lookup_chunks, keys[:8])
        if scrape_every_s and scrape_urls:
            stack.enter_context(scraping(scrape_urls, scrape_every_s))
        return timed_in_turns(series, args.lookup_calls, args.warmup)


def on_off_rounds(
    args: argparse.Namespace,
    configs_of_round: Callable[[], dict[str, Any]],
    spec: KVSpec,
    tokens: torch.Tensor,
    grpc_tokens: Mapping[str, str],
    scrape_every_s: float = 0.0,
) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """`args.rounds` rounds of `side_by_side` on the configs each round gets (which starts first
    alternates): the pooled latency of each series with the p50 ratio (`p50_ratio`), and the
    ratios of each round."""
    samples: dict[str, list[float]] = {}
    per_round: list[dict[str, float]] = []
    for round_index in range(args.rounds):
        configs = configs_of_round()
        order = list(configs) if round_index % 2 == 0 else list(reversed(configs))
        ordered = {mode: configs[mode] for mode in order}
        taken = side_by_side(args, ordered, spec, tokens, grpc_tokens, scrape_every_s)
        for name, values in taken.items():
            samples.setdefault(name, []).extend(values)
        per_round.append(on_over_off(latencies(taken)))
    results = latencies(samples)
    results["p50_ratio"] = on_over_off(results)
    return results, per_round


def latencies(samples: Mapping[str, list[float]]) -> dict[str, Any]:
    return {name: Latency.of(values)._asdict() for name, values in samples.items()}


def on_over_off(latencies: Mapping[str, Any], figure: str = "p50_us") -> dict[str, float]:
    """Per series, its `figure` with the feature on over the same with it off."""
    return {
        name[3:]: latencies[name][figure] / latencies[f"off/{name[3:]}"][figure]
        for name in latencies
        if name.startswith("on/")
    }


@contextlib.contextmanager
def scraping(urls: list[str], every_s: float) -> Iterator[list[int]]:
    """A thread that fetches each URL every `every_s`, as Prometheus would, until the block ends;
    a scrape that fails stops the benchmark."""
    stop = threading.Event()
    failures: list[BaseException] = []
    scrapes = [0]

    def run() -> None:
        while not stop.wait(every_s):
            for url in urls:
                try:
                    with urllib.request.urlopen(url, timeout=10) as reply:
                        if b"kvstore_lookups_total" not in reply.read():
                            raise RuntimeError(f"{url}: no kvstore_lookups_total in the scrape")
                    scrapes[0] += 1
                except BaseException as exc:
                    failures.append(exc)
                    return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield scrapes
    finally:
        stop.set()
        thread.join()
    if failures:
        raise RuntimeError(f"scraping failed: {failures[0]!r}")
    if not scrapes[0]:
        raise RuntimeError("no scrape happened while the series were timed")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def side_rows(
    results: dict[str, Any], sides: tuple[str, str] = ("on", "off"), digits: int = 3, p99: bool = True
) -> list[list[str]]:
    """Per call: each side's p50 / p99 (µs), the p50 ratio (`digits` places) and, with `p99`, the
    p99 ratio."""
    rows = []
    for call, ratio in results["p50_ratio"].items():
        row = [call, *(_p50_p99(results[f"{side}/{call}"]) for side in sides), f"{ratio:.{digits}f}"]
        if p99:
            row.append(f"{results['p99_ratio'][call]:.3f}")
        rows.append(row)
    return rows


def _p50_p99(latency: Mapping[str, float]) -> str:
    return f"{latency['p50_us']:.0f} / {latency['p99_us']:.0f}"
