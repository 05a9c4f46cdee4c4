"""The ASGI app in-process (Starlette's TestClient) on the tiny model: CORS,
metrics names, extensions, windowed rates and server settings."""
from __future__ import annotations

import math

import pytest
from starlette.testclient import TestClient

from carpool.cli import build_parser, engine_config_from_args, server_config_from_args
from carpool.engine.stats import EngineCounters, EngineStats
from carpool.server.metrics import RateWindow
from tests.server_utils import in_process_app

LOCAL = "http://127.0.0.1"  # a loopback Host, as a keyless loopback server requires


def test_cors_is_off_unless_configured(tiny_async_engine):
    with TestClient(in_process_app(tiny_async_engine), base_url=LOCAL) as client:
        response = client.get("/v1/models", headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in response.headers
    app = in_process_app(tiny_async_engine, cors_origins=["https://app.example"], api_key="k")
    with TestClient(app, base_url=LOCAL) as client:
        preflight = client.options("/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"


VLLM_STYLE_NAMES = [
    "carpool:num_requests_running", "carpool:num_requests_waiting",
    "carpool:kv_cache_usage_perc", "carpool:prefix_cache_queries_total",
    "carpool:prefix_cache_hits_total", "carpool:num_preemptions_total",
    "carpool:prompt_tokens_total", "carpool:generation_tokens_total",
    "carpool:time_to_first_token_seconds_bucket", "carpool:inter_token_latency_seconds_bucket",
    "carpool:request_time_per_output_token_seconds_bucket",
    "carpool:e2e_request_latency_seconds_bucket", "carpool:request_queue_time_seconds_bucket",
    'carpool:request_outcomes_total{model_name="tiny",outcome="length"}',
    "carpool:effective_tokens_per_second", "carpool:batch_fill_rate", "carpool:reject_rate",
    "carpool:long_request_share", "carpool:engine_busy_fraction",
    'carpool:controller_mode{batching="continuous",mode="fixed",model_name="tiny"} 1.0',
    'carpool:scheduler_knob{knob="max_num_seqs",model_name="tiny"}',
]


def test_metrics_expose_the_vllm_style_set_and_business_metrics(tiny_async_engine):
    with TestClient(in_process_app(tiny_async_engine), base_url=LOCAL) as client:
        reply = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5,
                                                      "ignore_eos": True})
        assert reply.json()["usage"]["completion_tokens"] == 5
        text = client.get("/metrics").text
    for name in VLLM_STYLE_NAMES:
        assert name in text, name
    ttft_count = next(line for line in text.splitlines()
                      if line.startswith("carpool:time_to_first_token_seconds_count"))
    assert float(ttft_count.split()[-1]) >= 1


def test_policy_endpoint_and_extension_headers(tiny_async_engine):
    with TestClient(in_process_app(tiny_async_engine), base_url=LOCAL) as client:
        policy = client.get("/carpool/policy").json()
        assert policy["batching"] == "continuous" and policy["knobs"]["max_num_seqs"] >= 1
        ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                         headers={"x-priority": "high", "x-session-id": "s1",
                                  "x-deadline-ms": "60000"})
        assert ok.status_code == 200, ok.text
        for header, value in (("x-priority", "urgent"), ("x-deadline-ms", "soon"),
                              ("x-deadline-ms", "-5")):
            bad = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                              headers={header: value})
            assert bad.status_code == 400, (header, value)


def test_tokenize_detokenize_round_trip(tiny_async_engine):
    with TestClient(in_process_app(tiny_async_engine), base_url=LOCAL) as client:
        tokens = client.post("/tokenize", json={"prompt": "The quick brown fox"}).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0
        text = client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
        assert text == "The quick brown fox"
        assert client.post("/detokenize", json={"tokens": [-1]}).status_code == 400
        chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.json()["count"] > 1


def _stats(t: float, computed: int, busy: float, added: int, long: int, rejected: int):
    counters = EngineCounters(requests_added=added, long_requests_added=long,
                              computed_tokens=computed, slot_tokens=computed,
                              budget_tokens=computed * 2, seq_slots=computed // 10,
                              slot_seqs=computed // 40,
                              generation_tokens=computed // 2, busy_seconds=busy)
    return EngineStats(time=t, num_running=0, num_waiting=0, waiting_tokens=0, kv_num_blocks=1,
                       kv_used_blocks=0, prefix_queries=0, prefix_hits=0, num_preemptions=0,
                       counters=counters, rejections={"queue_full": rejected}, sessions={},
                       knobs={}, arrivals=added + rejected)


def test_rate_window_rates_over_the_window():
    window = RateWindow(window_s=10.0)
    assert math.isnan(window.rates()["effective_tokens_per_second"])
    window.update(_stats(0, 0, 0.0, 0, 0, 0), now=100.0)
    window.update(_stats(0, 1000, 4.0, 8, 2, 2), now=105.0)
    rates = window.rates()
    assert rates["effective_tokens_per_second"] == pytest.approx(200.0)
    assert rates["generation_tokens_per_second"] == pytest.approx(100.0)
    assert rates["engine_busy_fraction"] == pytest.approx(0.8)
    # Continuous batching never pads: its fill is the token budget's occupancy.
    assert rates["batch_fill_rate"] == rates["token_budget_fill"] == pytest.approx(0.5)
    assert rates["seq_slot_fill"] == pytest.approx(0.25)
    assert rates["reject_rate"] == pytest.approx(2 / 10)
    assert rates["long_request_share"] == pytest.approx(2 / 8)
    # 30 s later with no new work: the old samples leave the window, rates fall to zero
    window.update(_stats(0, 1000, 4.0, 8, 2, 2), now=120.0)
    window.update(_stats(0, 1000, 4.0, 8, 2, 2), now=135.0)
    assert window.rates()["effective_tokens_per_second"] == 0.0


def test_serve_settings_precedence(tmp_path):
    config_file = tmp_path / "serve.yaml"
    config_file.write_text("scheduler: {max_num_seqs: 7}\nserver: {port: 9001, max_n: 4}\n")
    args = build_parser().parse_args(
        ["serve", "some/model", "--profile", "latency", "--config", str(config_file),
         "--port", "9002"])
    args.engine_model = args.model_path
    engine_config = engine_config_from_args(args)
    server_config = server_config_from_args(args)
    assert engine_config.scheduler.max_num_seqs == 7  # file over profile (16)
    assert engine_config.scheduler.max_queue_requests == 64  # from the profile
    assert server_config.port == 9002 and server_config.max_n == 4  # flag over file
    assert server_config.host == "127.0.0.1"
    bad = build_parser().parse_args(["serve", "--profile", "no-such-profile"])
    with pytest.raises(ValueError, match="unknown profile"):
        engine_config_from_args(bad)
