"""The Prometheus series vLLM's dashboards need, under each ``metrics_prefix``.

No Prometheus here (tests/test_prometheus_dashboards.py runs one): /metrics
of the in-process server on the tiny model is parsed and checked for the
series vLLM's dashboards query, their label names, and values that agree
with each other (phases, samples, steps).
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from carpool.engine.outputs import RequestOutput
from carpool.engine.stats import EngineCounters, EngineStats
from carpool.server.metrics import Metrics
from tests.server_utils import in_process_app

LOCAL = "http://127.0.0.1"
EXPRS = Path(__file__).parent / "data" / "vllm_dashboard_exprs.json"
# Series the issue names besides those the dashboards query.
EXTRA = {"request_inference_time_seconds_count", "cache_config_info",
         "session_requests_total", "session_prefix_hit_tokens_total"}

Samples = dict[tuple[str, frozenset], float]


def _dashboard_series() -> set[str]:
    """Every series vLLM's dashboards name, without the ``vllm:`` prefix."""
    text = " ".join(e for d in json.loads(EXPRS.read_text())["dashboards"] for e in d["exprs"])
    return set(re.findall(r"vllm:([a-z0-9_]+)", text))


def _samples(text: str) -> Samples:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _value(samples: Samples, name: str, **labels: str) -> float:
    matches = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def _scrape(prefix: str, engine) -> tuple[Samples, Samples]:
    """/metrics before and after a plain request, an n=2 request and a
    session turn (the engine's counters count since the engine started)."""
    with TestClient(in_process_app(engine, metrics_prefix=prefix), base_url=LOCAL) as client:
        before = _samples(client.get("/metrics").text)
        for body, headers in (({"prompt": "hello", "max_tokens": 5}, {}),
                              ({"prompt": "two", "max_tokens": 4, "n": 2}, {}),
                              ({"prompt": "turn", "max_tokens": 3}, {"x-session-id": "s1"})):
            reply = client.post("/v1/completions", headers=headers,
                                json={**body, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
        # The engine's snapshot is refreshed between steps: wait until it has
        # every step the step log has (the tiny model's steps are all logged).
        deadline = time.monotonic() + 10
        while True:
            samples = _samples(client.get("/metrics").text)
            steps = [_value(samples, f"{p}:engine_steps_total") for p in _names(prefix)]
            logged = [_value(samples, f"{p}:iteration_tokens_total_count") for p in _names(prefix)]
            if steps == logged or time.monotonic() > deadline:
                return before, samples
            time.sleep(0.05)


def _names(prefix: str) -> tuple[str, ...]:
    return ("carpool", "vllm") if prefix == "both" else (prefix,)


@pytest.mark.parametrize("prefix", ["carpool", "vllm", "both"])
def test_every_dashboard_series_exists_under_the_chosen_prefixes(tiny_async_engine, prefix):
    before, samples = _scrape(prefix, tiny_async_engine)
    names = {name for name, _ in samples}
    wanted = _dashboard_series() | EXTRA
    assert len(wanted) >= 20
    for p in _names(prefix):
        missing = sorted(s for s in wanted if f"{p}:{s}" not in names)
        assert not missing, (p, missing)
    assert all(name.split(":")[0] in _names(prefix) for name in names), sorted(names)[:5]
    p = _names(prefix)[-1]
    for reason in ("stop", "length", "abort"):  # vLLM's finish reasons, there from the start
        assert (f"{p}:request_success_total",
                frozenset({("model_name", "tiny"), ("finished_reason", reason)})) in samples
    finished = [_value(s, f"{p}:request_success_total", finished_reason="length")
                for s in (before, samples)]
    assert finished[1] - finished[0] == 4
    info = next(ls for (n, ls) in samples if n == f"{p}:cache_config_info")
    assert {("block_size", "16"), ("enable_prefix_caching", "True")} <= info
    assert dict(info)["num_gpu_blocks"].isdigit() and dict(info)["model_name"] == "tiny"
    # The CPU kernel plan this machine kind chose at start-up (carpool/kernel_plan.py).
    from carpool.kernel_plan import cpu_tier
    from carpool.machine import cpu_model_and_flags

    kernels = dict(next(ls for (n, ls) in samples if n == f"{p}:cpu_kernels_info"))
    assert kernels["isa"] == cpu_tier(cpu_model_and_flags()[1])
    assert {"dtype", "decode", "batched", "attention", "w8a8"} <= kernels.keys()


def test_both_prefixes_carry_the_same_values(tiny_async_engine):
    _, samples = _scrape("both", tiny_async_engine)
    by_prefix: dict[str, dict] = {"carpool": {}, "vllm": {}}
    for (name, labels), value in samples.items():
        prefix, rest = name.split(":", 1)
        by_prefix[prefix][(rest, labels)] = value
    assert by_prefix["carpool"].keys() == by_prefix["vllm"].keys()
    differ = [k for k, v in by_prefix["carpool"].items()
              if v != by_prefix["vllm"][k] and v == v]  # NaN != NaN: windowed rates at start
    assert not differ, differ[:5]


def test_phase_times_samples_and_steps_agree(tiny_async_engine):
    _, samples = _scrape("vllm", tiny_async_engine)

    def total(name: str) -> float:
        return _value(samples, f"vllm:{name}")

    # prefill + decode = inference, request by request, on the engine's clock.
    assert total("request_prefill_time_seconds_sum") + total("request_decode_time_seconds_sum") \
        == pytest.approx(total("request_inference_time_seconds_sum"), rel=1e-9, abs=1e-9)
    for phase in ("queue", "prefill", "decode", "inference"):
        assert total(f"request_{phase}_time_seconds_count") == 4, phase
    assert total("e2e_request_latency_seconds_sum") >= total("request_inference_time_seconds_sum")
    # One observation per prompt: the n=2 call counts once, with its longer sample.
    assert total("request_max_num_generation_tokens_count") == 3
    assert total("request_max_num_generation_tokens_sum") == 5 + 4 + 3
    assert total("iteration_tokens_total_count") == total("engine_steps_total") > 0
    assert total("session_requests_total") >= 1
    assert _value(samples, "vllm:sessions", stat="session_requests") == \
        total("session_requests_total")


def _stats() -> EngineStats:
    return EngineStats(time=0.0, num_running=0, num_waiting=0, waiting_tokens=0,
                       kv_num_blocks=1, kv_used_blocks=0, prefix_queries=0, prefix_hits=0,
                       num_preemptions=0, counters=EngineCounters(), rejections={},
                       sessions={}, knobs={})


def _final(tokens: int, reason: str = "length") -> RequestOutput:
    return RequestOutput("r", [1, 2], "", list(range(tokens)), "", [], finished=True,
                         finish_reason=reason, arrival_time=1.0, first_scheduled_time=1.5,
                         first_token_time=2.0, finish_time=3.0)


def test_a_prompts_samples_are_observed_once_all_have_ended():
    metrics = Metrics("m", _stats, prefix="vllm")
    first, second, third, fourth = metrics.trackers(num_prompts=2, n=2, received_at=0.0)

    def value(name: str) -> float | None:
        return metrics.registry.get_sample_value(f"vllm:{name}", {"model_name": "m"})

    first.observe(_final(7))
    first.close()  # ended already: no effect
    assert value("request_max_num_generation_tokens_count") == 0  # its sibling still runs
    second.close()  # the client left: no final output
    third.observe(_final(0, "rejected"))
    fourth.close()
    # Prompt 0 counts its one finished sample; prompt 1 finished none.
    assert value("request_max_num_generation_tokens_count") == 1
    assert value("request_max_num_generation_tokens_sum") == 7
    assert value("request_queue_time_seconds_sum") == 0.5
    assert value("request_prefill_time_seconds_sum") == 0.5
    assert value("request_decode_time_seconds_sum") == 1.0
    assert value("request_inference_time_seconds_sum") == 1.5


def test_an_unknown_prefix_is_refused():
    with pytest.raises(ValueError, match="carpool, vllm, both"):
        Metrics("m", _stats, prefix="prom")
    metrics = Metrics("m", _stats)
    with pytest.raises(ValueError):
        metrics.prefix = "VLLM"
    assert metrics.prefix == "carpool"
