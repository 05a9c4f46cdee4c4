"""The open-loop load generator behind ``carpool bench serve`` and ``sweep``.

Each request is sent at its scheduled offset whether or not earlier ones
have answered (open loop: a slow server builds a queue, as in production),
unless ``max_concurrency`` caps the requests in flight; then a request
waits on the client for a free slot and its latency counts from the
actual send. A run is bounded: no request is sent after ``max_duration``
seconds, and every request gives up after ``request_timeout`` seconds.
"""
from __future__ import annotations

import asyncio
import bisect
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from carpool.bench.client import Target, send_request
from carpool.workload.results import LoadRun
from carpool.workload.spec import BenchItem
from carpool.workload.stats import FAILED, RequestRecord

# Prometheus gauges polled from the server's /metrics when it has them;
# any prefix matches (carpool:, vllm:, sglang: ...).
_GAUGE = re.compile(r"^[\w:]*num_requests_(waiting|running)(?:\{[^}]*\})?\s+([-+0-9.eE]+|NaN)\s*$")
_PROGRESS_EVERY_S = 0.5


@dataclass
class LoadLimits:
    max_concurrency: int | None = None
    max_duration: float | None = None  # seconds; no request is sent after this
    request_timeout: float = 600.0


async def run_load(plan: list[BenchItem], target: Target, limits: LoadLimits,
                   count_tokens: Callable[[str], int] | None = None,
                   progress: bool = True, metrics_interval: float = 0.5,
                   description: str = "bench") -> LoadRun:
    """Send ``plan`` against ``target``; returns when every request has an outcome."""
    started = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - started

    records = [RequestRecord(i, p.offset, p.input_tokens, p.output_tokens)
               for i, p in enumerate(plan)]
    slots = asyncio.Semaphore(limits.max_concurrency) if limits.max_concurrency else None
    monitor = _Progress(len(plan), description, progress)
    connections = httpx.Limits(max_connections=limits.max_concurrency,
                               max_keepalive_connections=limits.max_concurrency or 100)
    timeout = httpx.Timeout(limits.request_timeout, connect=min(30.0, limits.request_timeout))
    async with httpx.AsyncClient(timeout=timeout, limits=connections) as client:
        stop_polling = asyncio.Event()
        poller = asyncio.create_task(_poll_gauges(client, target, clock, metrics_interval,
                                                  stop_polling))

        async def one(request: BenchItem, record: RequestRecord) -> None:
            if slots is not None:
                async with slots:
                    await _send_bounded(client, target, request, record, clock, limits,
                                        count_tokens)
            else:
                await _send_bounded(client, target, request, record, clock, limits, count_tokens)
            monitor.finished(record)

        tasks = []
        for request, record in zip(plan, records):
            if limits.max_duration is not None and request.offset > limits.max_duration:
                break  # the rest stay unsent
            delay = request.offset - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request, record)))
        await asyncio.gather(*tasks)
        duration = clock()
        stop_polling.set()
        samples = await poller
    monitor.close()
    return LoadRun(records, duration, samples)


async def _send_bounded(client, target, request, record, clock, limits, count_tokens) -> None:
    if limits.max_duration is not None and clock() > limits.max_duration:
        return  # waited for a slot past the time limit: never sent
    try:
        await asyncio.wait_for(send_request(client, target, request.prompt, record, clock,
                                            count_tokens), limits.request_timeout)
    except asyncio.TimeoutError:
        record.status, record.reason, record.finished = FAILED, "timeout", clock()


async def _poll_gauges(client: httpx.AsyncClient, target: Target, clock, interval: float,
                       stop: asyncio.Event) -> list[tuple[float, float | None, float | None]]:
    """Sample the server's waiting/running gauges until ``stop``; gives up
    quietly (no samples) when the server has no such metrics."""
    url = re.sub(r"/v1/?$", "", target.base_url.rstrip("/")) + "/metrics"
    samples: list[tuple[float, float | None, float | None]] = []
    while not stop.is_set():
        try:
            response = await client.get(url, headers=target.headers, timeout=5.0)
        except httpx.HTTPError:
            return samples
        if response.status_code != 200:
            return samples
        gauges = parse_queue_gauges(response.text)
        if not gauges:
            return samples
        samples.append((clock(), gauges.get("waiting"), gauges.get("running")))
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass
    return samples


def parse_queue_gauges(text: str) -> dict[str, float]:
    """``{"waiting": n, "running": m}`` summed over label sets, from Prometheus text."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _GAUGE.match(line)
        if match and match.group(2) != "NaN":
            out[match.group(1)] = out.get(match.group(1), 0.0) + float(match.group(2))
    return out


class _Progress:
    """A tqdm bar (stderr) with the running TTFT p50/p99 and outcome counts."""

    def __init__(self, total: int, description: str, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=description, unit="req", file=sys.stderr,
                        disable=None if enabled else True, dynamic_ncols=True)
        self.ttfts: list[float] = []
        self.counts = {"ok": 0, "rejected": 0, "failed": 0}
        self.last_shown = 0.0

    def finished(self, record: RequestRecord) -> None:
        self.counts[record.status] = self.counts.get(record.status, 0) + 1
        if record.ttft is not None:
            bisect.insort(self.ttfts, record.ttft)
        self.bar.update(1)
        now = time.perf_counter()
        if now - self.last_shown >= _PROGRESS_EVERY_S and self.ttfts:
            self.last_shown = now
            p50 = self.ttfts[len(self.ttfts) // 2]
            p99 = self.ttfts[min(len(self.ttfts) - 1, int(0.99 * len(self.ttfts)))]
            self.bar.set_postfix_str(
                f"TTFT p50 {p50 * 1000:.0f}ms p99 {p99 * 1000:.0f}ms ok {self.counts['ok']} "
                f"rej {self.counts['rejected']} fail {self.counts['failed']}")

    def close(self) -> None:
        self.bar.close()
