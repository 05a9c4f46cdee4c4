#!/usr/bin/env python
"""A chaos soak: a fleet under a looped trace for hours, with faults on a
schedule, and a verdict on what it lost and what it leaked.

    python scripts/soak.py --duration 7200 --out soak-2h            # the defaults
    python scripts/soak.py --model DIR --duration 60 --kill-every 20 --out /tmp/soak

It starts ``carpool serve MODEL --replicas N`` (plus ``--serve-args``) on
127.0.0.1, and, with ``--store-restart-every``, the fleet's KV store as its
own ``carpool kv-store`` process. It replays ``--trace``'s requests (token
counts times ``--token-scale``, Poisson arrivals at ``--rate``), greedy,
streamed and not in turn, in a loop until ``--duration`` ends, and injects:

- a SIGKILL of one engine worker every ``--kill-every`` seconds;
- a restart of the KV store every ``--store-restart-every`` seconds;
- a client that leaves mid-stream every ``--disconnect-every`` seconds;
- ``--burst-factor`` times the rate for ``--burst-s`` every ``--burst-every``.

Every ``--sample-s`` seconds it records each process's RSS, file
descriptors and threads (the API process and its workers, from /proc),
the KV blocks in use and the requests in flight. At the end it stops the
load, waits for what is in flight, stops the server with SIGTERM and
checks that no process of it is left. ``OUT/soak.json`` holds every
sample, every fault and the verdict: requests lost (failed, not counting
the injected disconnects), hung (no answer within ``--hang-s``), refused
(429/503: counted, not lost), and per series the growth over the second
half (a least-squares slope times the half's length, over its mean; a
leak is more than ``--leak-percent``). ``OUT/soak.png`` draws it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from carpool.bench.client import Target, send_request
from carpool.settings_fields import add_setting_args, setting, values_from_args
from carpool.workload.stats import FAILED, OK, REJECTED, RequestRecord
from carpool.workload.traces import load_trace, scale_tokens


@dataclass
class SoakSettings:
    """The soak's knobs (module docstring)."""

    model: str | None = setting(None, "--model", "MODEL", "the model served (default: carpool's)")
    out: str = setting("soak-out", "--out", "DIR", "where soak.json and soak.png go")
    duration: float = setting(7200.0, "--duration", "SECONDS", "how long the load runs",
                              parse=float)
    replicas: int = setting(2, "--replicas", "N", "engine replicas", parse=int)
    serve_args: str = setting("", "--serve-args", "ARGS", "more `carpool serve` flags")
    trace: str = setting("azure-conv", "--trace", "NAME", "the trace replayed in a loop")
    token_scale: float = setting(0.05, "--token-scale", "X", "token counts times this",
                                 parse=float)
    rate: float = setting(1.0, "--rate", "REQ/S", "mean arrivals per second", parse=float)
    kill_every: float = setting(600.0, "--kill-every", "SECONDS",
                                "SIGKILL an engine worker this often (0: never)", parse=float)
    store_restart_every: float = setting(
        0.0, "--store-restart-every", "SECONDS",
        "restart the KV store this often (runs it as `carpool kv-store`; 0: no store)",
        parse=float)
    disconnect_every: float = setting(60.0, "--disconnect-every", "SECONDS",
                                      "a client leaves mid-stream this often (0: never)",
                                      parse=float)
    burst_every: float = setting(1800.0, "--burst-every", "SECONDS",
                                 "a burst this often (0: never)", parse=float)
    burst_s: float = setting(120.0, "--burst-s", "SECONDS", "how long a burst lasts",
                             parse=float)
    burst_factor: float = setting(3.0, "--burst-factor", "X", "a burst's rate multiple",
                                  parse=float)
    sample_s: float = setting(10.0, "--sample-s", "SECONDS", "between two samples",
                              parse=float)
    hang_s: float = setting(300.0, "--hang-s", "SECONDS", "a request unanswered this long hung",
                            parse=float)
    leak_percent: float = setting(2.0, "--leak-percent", "PCT",
                                  "second-half growth above this is a leak", parse=float)
    seed: int = setting(0, "--seed", "N", "arrivals' and faults' seed", parse=int)


@dataclass
class Soak:
    """One run's state: the processes, the records, the samples, the faults."""

    settings: SoakSettings
    url: str = ""
    server: subprocess.Popen | None = None
    store: subprocess.Popen | None = None
    store_port: int = 0
    started: float = field(default_factory=time.monotonic)
    records: list[RequestRecord] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)
    seen_pids: set[int] = field(default_factory=set)
    bursting: bool = False

    def now(self) -> float:
        return time.monotonic() - self.started

    def fault(self, kind: str, **detail) -> None:
        self.faults.append({"t": round(self.now(), 3), "fault": kind, **detail})


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_store(soak: Soak) -> None:
    soak.store_port = soak.store_port or _free_port()
    soak.store = subprocess.Popen([sys.executable, "-m", "carpool.cli", "kv-store", "--host",
                                   "127.0.0.1", "--port", str(soak.store_port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", soak.store_port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the KV store did not start")


def start_server(soak: Soak, log) -> None:  # noqa: ANN001 - a file
    s = soak.settings
    port = _free_port()
    command = [sys.executable, "-m", "carpool.cli", "serve", *([s.model] if s.model else []),
               "--host", "127.0.0.1", "--port", str(port), "--replicas", str(s.replicas),
               "--served-model-name", "soak", *s.serve_args.split()]
    if s.store_restart_every > 0:
        command += ["--kv-store", f"tcp://127.0.0.1:{soak.store_port}"]
    soak.server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    soak.url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if soak.server.poll() is not None:
            raise RuntimeError(f"the server exited ({soak.server.returncode}); see its log")
        try:
            if httpx.get(soak.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy in 600 s")


# -- load and faults ------------------------------------------------------------------


async def prompt_fit(soak: Soak, client: httpx.AsyncClient) -> tuple[float, int]:
    """(this model's tokens per prompt word, its context length): prompts are
    sized in words so that each request fits the context."""
    words = " ".join(f"w{k}" for k in range(200))
    tokenized = (await client.post(soak.url + "/tokenize", json={"model": "soak",
                                                                  "prompt": words})).json()
    return tokenized["count"] / 200, tokenized["max_model_len"]


async def run_load(soak: Soak, client: httpx.AsyncClient, target: Target) -> None:
    s = soak.settings
    per_word, context = await prompt_fit(soak, client)
    items = scale_tokens(load_trace(s.trace), s.token_scale, max_input_len=context // 2,
                         max_output_len=context // 4)
    rng = random.Random(s.seed)
    tasks: set[asyncio.Task] = set()
    index = 0
    while soak.now() < s.duration:
        rate = s.rate * (s.burst_factor if soak.bursting else 1.0)
        await asyncio.sleep(rng.expovariate(rate))
        item = items[index % len(items)]
        record = RequestRecord(index, soak.now(), item.input_len, item.output_len)
        soak.records.append(record)
        count = max(1, int(item.input_len / per_word))  # about input_len tokens
        words = " ".join(f"w{(index * 31 + k) % 997}" for k in range(count))
        stream = index % 2 == 0
        task = asyncio.ensure_future(_ask(client, target, words, record, soak, stream))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        index += 1
    if tasks:
        await asyncio.wait(tasks, timeout=s.hang_s)


async def _ask(client, target, prompt, record, soak, stream) -> None:  # noqa: ANN001
    if stream:
        await send_request(client, target, prompt, record, soak.now)
        return
    record.sent = soak.now()  # not streamed: one answer at the end
    body = {**target.payload(prompt, record.max_tokens), "stream": False}
    body.pop("stream_options")
    try:
        reply = await client.post(target.url, json=body, headers=target.headers)
    except httpx.TimeoutException:
        record.status, record.reason, record.finished = FAILED, "timeout", soak.now()
        return
    except httpx.HTTPError as exc:
        record.status, record.reason, record.finished = FAILED, "connection", soak.now()
        record.error = str(exc)[:300]
        return
    record.finished = soak.now()
    if reply.status_code in (429, 503):
        record.status, record.reason = REJECTED, f"http_{reply.status_code}"
    elif reply.status_code != 200:
        record.status, record.reason, record.error = FAILED, f"http_{reply.status_code}", \
            reply.text[:300]
    else:
        record.status = OK
        record.output_tokens = reply.json()["usage"]["completion_tokens"]
        record.chunk_times = [record.finished]


async def every(period: float, soak: Soak, action) -> None:  # noqa: ANN001
    """Run ``action()`` every ``period`` seconds of the load (0: never)."""
    if period <= 0:
        return
    while soak.now() + period < soak.settings.duration:
        await asyncio.sleep(period)
        await action()


async def kill_a_worker(soak: Soak, client: httpx.AsyncClient, rng: random.Random) -> None:
    policy = (await client.get(soak.url + "/carpool/policy")).json()
    pools = [policy.get("routing", {}), *policy.get("pd", {}).values()]  # P/D: both pools
    pids = [r["pid"] for pool in pools if isinstance(pool, dict)
            for r in pool.get("replicas", []) if r.get("pid")]
    if not pids:
        soak.fault("kill", skipped="no worker up")
        return
    pid = rng.choice(pids)
    os.kill(pid, signal.SIGKILL)
    soak.fault("kill", pid=pid)


async def restart_store(soak: Soak) -> None:
    soak.store.kill()
    soak.store.wait()
    await asyncio.to_thread(start_store, soak)
    soak.fault("store_restart", pid=soak.store.pid)


async def disconnect(soak: Soak, client: httpx.AsyncClient, target: Target) -> None:
    body = {**target.payload("leaving early " * 8, 200)}
    async with client.stream("POST", target.url, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                break  # one event, then the client is gone
    soak.fault("disconnect")


async def burst(soak: Soak) -> None:
    soak.bursting = True
    soak.fault("burst_start")
    await asyncio.sleep(soak.settings.burst_s)
    soak.bursting = False
    soak.fault("burst_end")


# -- samples and the verdict ----------------------------------------------------------


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def process_sample(pid: int) -> dict | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024 if "VmRSS" in fields else 0.0,
            "threads": int(fields["Threads"]), "fds": fds}


async def sample(soak: Soak, client: httpx.AsyncClient) -> None:
    pids = descendants(soak.server.pid)
    soak.seen_pids.update(pids)
    procs = {pid: p for pid in pids if (p := process_sample(pid)) is not None}
    front = procs.get(soak.server.pid, {"rss_mb": 0.0, "threads": 0, "fds": 0})
    row = {"t": round(soak.now(), 3), "front_rss_mb": front["rss_mb"],
           "workers_rss_mb": sum(p["rss_mb"] for pid, p in procs.items()
                                 if pid != soak.server.pid),
           "fds": sum(p["fds"] for p in procs.values()),
           "threads": sum(p["threads"] for p in procs.values()), "processes": len(procs)}
    try:
        metrics = (await client.get(soak.url + "/metrics")).text
        row.update(_gauges(metrics))
    except httpx.HTTPError:
        pass
    soak.samples.append(row)


def _gauges(metrics: str) -> dict:
    wanted = {"carpool:kv_cache_usage_perc{": "kv_usage",
              "carpool:num_requests_running{": "running",
              "carpool:num_requests_waiting{": "waiting"}
    out = {}
    for line in metrics.splitlines():
        for prefix, name in wanted.items():
            if line.startswith(prefix):
                out[name] = float(line.split()[-1])
    return out


def growth(samples: list[dict], key: str) -> float | None:
    """Percent growth over the second half: least-squares slope times the
    half's length, over the half's mean (None: too few samples)."""
    half = [(r["t"], r[key]) for r in samples[len(samples) // 2:] if key in r]
    if len(half) < 3:
        return None
    times, values = zip(*half)
    mean = statistics.fmean(values)
    slope = statistics.linear_regression(times, values).slope
    return 100.0 * slope * (times[-1] - times[0]) / mean if mean else 0.0


def verdict(soak: Soak, orphans: list[int]) -> dict:
    records = soak.records
    lost = [r for r in records if r.status == FAILED and r.reason != "timeout"]
    hung = [r for r in records if r.status == FAILED and r.reason == "timeout"
            or r.status not in (OK, FAILED, REJECTED)]
    growths = {key: growth(soak.samples, key)
               for key in ("front_rss_mb", "workers_rss_mb", "fds", "threads", "kv_usage")}
    # Judged: what lives through the run. Killed workers restart from scratch,
    # so their RSS is a sawtooth whose slope says nothing about a leak.
    judged = {"front_rss_mb", "fds", "threads"} | (
        {"workers_rss_mb"} if soak.settings.kill_every <= 0 else set())
    leaks = {key: value for key, value in growths.items()
             if key in judged and value is not None and value > soak.settings.leak_percent}
    refused = [r for r in records if r.status == REJECTED]
    in_bursts = [r for r in refused if _in_burst(soak, r.scheduled)]
    return {"requests": len(records), "ok": sum(r.status == OK for r in records),
            "refused": len(refused), "refused_in_bursts": len(in_bursts),
            "lost": len(lost),
            # every request that did not end well: (sent at, status, reason)
            "not_ok": [(round(r.scheduled, 3), r.status, r.reason) for r in records
                       if r.status != OK][:10_000],
            "hung": len(hung), "lost_examples": [f"{r.reason}: {r.error[:120]}" for r in lost[:5]],
            "second_half_growth_percent": growths, "leaks": leaks, "orphans": orphans,
            "faults": {kind: sum(f["fault"] == kind for f in soak.faults)
                       for kind in sorted({f["fault"] for f in soak.faults})},
            "passed": not lost and not hung and not leaks and not orphans}


def _in_burst(soak: Soak, t: float) -> bool:
    """Whether ``t`` falls in a burst or the ``burst_s`` after it (its
    queues drain then): where refusals are the burst's, not a fault's."""
    start = None
    for fault in soak.faults:
        if fault["fault"] == "burst_start":
            start = fault["t"]
        elif fault["fault"] == "burst_end" and start is not None:
            if start <= t <= fault["t"] + soak.settings.burst_s:
                return True
            start = None
    return start is not None and t >= start


def plot(soak: Soak, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = soak.samples
    times = [r["t"] / 60 for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    axes[0].plot(times, [r["front_rss_mb"] for r in rows], label="API process")
    axes[0].plot(times, [r["workers_rss_mb"] for r in rows], label="engine workers")
    axes[0].set_ylabel("RSS (MiB)")
    axes[1].plot(times, [r["fds"] for r in rows], label="file descriptors")
    axes[1].plot(times, [r["threads"] for r in rows], label="threads")
    axes[2].plot(times, [r.get("kv_usage", 0.0) for r in rows], label="KV blocks in use")
    axes[2].set_ylabel("KV usage (0-1)")
    bin_s = max(10.0, soak.settings.duration / 120)  # about 120 bins
    bins = int(soak.settings.duration // bin_s) + 2
    for status, color in ((OK, "tab:green"), (REJECTED, "tab:orange"), (FAILED, "tab:red")):
        counts = [0] * bins
        for r in soak.records:
            if r.status == status and r.finished is not None:
                counts[min(bins - 1, int(r.finished // bin_s))] += 1
        axes[3].step([(i + 0.5) * bin_s / 60 for i in range(bins)],
                     [c * 60 / bin_s for c in counts], where="mid", color=color, label=status)
    axes[3].set_ylabel("requests ended / min")
    axes[3].set_xlabel("minutes")
    colors = {"kill": "red", "store_restart": "purple", "burst_start": "orange"}
    for fault in soak.faults:
        if fault["fault"] in colors:
            for ax in axes:
                ax.axvline(fault["t"] / 60, color=colors[fault["fault"]], alpha=0.25, lw=0.8)
    for ax in axes:
        ax.legend(loc="upper left", fontsize=8)
    axes[0].set_title("carpool soak: red lines worker kills, purple store restarts, "
                      "orange bursts")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


async def soak_loop(soak: Soak) -> None:
    s = soak.settings
    rng = random.Random(s.seed + 1)
    target = Target(soak.url + "/v1", "soak", temperature=0.0)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=s.hang_s, limits=limits) as client:
        load = asyncio.ensure_future(run_load(soak, client, target))
        chores = [asyncio.ensure_future(job) for job in (
            every(s.sample_s, soak, lambda: sample(soak, client)),
            every(s.kill_every, soak, lambda: kill_a_worker(soak, client, rng)),
            every(s.store_restart_every, soak, lambda: restart_store(soak)),
            every(s.disconnect_every, soak, lambda: disconnect(soak, client, target)),
            every(s.burst_every, soak, lambda: burst(soak)))]
        await load
        for chore in chores:
            chore.cancel()
        await asyncio.gather(*chores, return_exceptions=True)
        await sample(soak, client)


def stop_server(soak: Soak) -> list[int]:
    """SIGTERM the server, wait; the pids of it that are still alive."""
    soak.seen_pids.update(descendants(soak.server.pid))
    soak.server.send_signal(signal.SIGTERM)
    try:
        soak.server.wait(soak.settings.hang_s)
    except subprocess.TimeoutExpired:
        soak.server.kill()
    time.sleep(1.0)
    return sorted(pid for pid in soak.seen_pids if process_sample(pid) is not None
                  and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_setting_args(parser, SoakSettings)
    settings = values_from_args(SoakSettings, parser.parse_args(argv))
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    soak = Soak(settings)
    with open(out / "server.log", "w") as log:
        if settings.store_restart_every > 0:
            start_store(soak)
        try:
            start_server(soak, log)
            soak.started = time.monotonic()
            asyncio.run(soak_loop(soak))
            orphans = stop_server(soak)
        finally:
            for proc in (soak.server, soak.store):
                if proc is not None and proc.poll() is None:
                    proc.kill()
    result = {"settings": asdict(settings), "verdict": verdict(soak, orphans),
              "faults": soak.faults, "samples": soak.samples}
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(soak, out / "soak.png")
    print(json.dumps(result["verdict"], indent=1))
    return 0 if result["verdict"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
