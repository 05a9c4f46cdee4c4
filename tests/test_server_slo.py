"""``carpool serve`` (tiny model) runs the adaptive controller by default:
the start-up line states the targets and how they were measured,
``/carpool/policy`` shows them with their sources and admission's regime;
with an operator's TTFT target a request predicted to miss it gets 429 +
Retry-After at once, without one it queues; ``--adaptive false`` serves
plainly."""
from __future__ import annotations

import re

import pytest
from server_utils import ServerProcess

TINY = ["--attention-backend", "torch", "--kv-cache-memory", "16MiB"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerProcess([str(tiny_model_dir), *TINY]) as proc:
        yield proc


def test_default_serve_measures_its_targets_and_says_so(server):
    # The targets line follows the "serving" line the fixture waits for.
    assert server.wait_for_output("admission: queue"), server.text()
    line = re.search(r"carpool: SLO ttft ([0-9.]+) s, tpot ([0-9.]+) s \((.*)\); admission: "
                     r"queue \(no operator SLO", server.text())
    assert line, server.text()
    assert "measured at start-up in" in line.group(3)
    with server.client() as c:
        policy = c.get("/carpool/policy").json()
    slo = policy["slo"]
    assert policy["adaptive"] is True and policy["mode"] in ("latency", "balanced", "throughput")
    assert slo["sources"] == {"ttft": "calibrated", "tpot": "calibrated"}
    assert slo["ttft_target"] == pytest.approx(float(line.group(1)), abs=0.006)
    assert slo["ttft_target"] >= 0.25 and slo["tpot_target"] >= 0.025  # the floors
    assert slo["ttft_unloaded"] > 0 and "median of 3" in slo["rule"]
    assert slo["regime"] == "queue" and policy["admission"]["regime"] == "queue"
    assert "no operator SLO" in policy["admission"]["reason"]
    assert "controller_latency_correction" in policy["knobs"]
    # What admission predicts with: the step-cost fit (from the start-up probe's
    # steps, then the served ones) and its error.
    assert policy["predictions"]["step_cost"] is not None
    with server.client() as c:
        done = c.post("/v1/completions", json={"prompt": "Count: 1 2 3", "max_tokens": 12,
                                                "ignore_eos": True})
        assert done.status_code == 200, done.text
        predictions = c.get("/carpool/policy").json()["predictions"]
    cost = predictions["step_cost"]
    assert cost is not None and cost["fixed_s"] + cost["per_token_s"] * 128 > 0
    assert predictions["ttft_error_factor"] >= 1.0


def test_a_predicted_ttft_miss_is_rejected_at_once_with_retry_after(tiny_model_dir):
    flags = [str(tiny_model_dir), *TINY, "--slo", "ttft=250ms,tpot=1s", "--max-num-seqs", "1"]
    with ServerProcess(flags) as server, server.client() as c:
        assert server.wait_for_output("(ttft from flag; tpot from flag)"), server.text()
        body = {"prompt": "a long story", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as long_one:
            lines = long_one.iter_lines()
            seen = 0
            while seen < 12:  # it runs (and the cost model has seen its steps)
                seen += next(lines).startswith("data: ")
            # The one sequence slot frees only after ~460 more decode steps.
            late = c.post("/v1/completions", json={"prompt": "quick", "max_tokens": 4})
            for _ in lines:
                pass
        assert late.status_code == 429, late.text
        assert late.json()["error"]["code"] == "predicted_ttft_miss"
        assert int(late.headers["retry-after"]) >= 1
        assert "its priority class is allowed" in late.json()["error"]["message"]
        policy = c.get("/carpool/policy").json()
        assert policy["rejections"].get("predicted_ttft_miss") == 1
        assert policy["slo"]["sources"] == {"ttft": "flag", "tpot": "flag"}


def test_without_an_operator_slo_a_predicted_miss_queues_instead(tiny_model_dir):
    """Issue 42: the same long request holding the only slot as above, on the
    default server (targets measured, none set): the quick one waits its turn
    and is answered; nothing is rejected."""
    flags = [str(tiny_model_dir), *TINY, "--max-num-seqs", "1"]
    with ServerProcess(flags) as server, server.client() as c:
        assert server.wait_for_output("admission: queue"), server.text()
        body = {"prompt": "a long story", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as long_one:
            lines = long_one.iter_lines()
            seen = 0
            while seen < 12:
                seen += next(lines).startswith("data: ")
            quick = c.post("/v1/completions", json={"prompt": "quick", "max_tokens": 4})
            for _ in lines:
                pass
        assert quick.status_code == 200, quick.text
        policy = c.get("/carpool/policy").json()
        assert policy["rejections"] == {} and policy["admission"]["regime"] == "queue"


def test_adaptive_false_serves_without_targets(tiny_model_dir):
    with ServerProcess([str(tiny_model_dir), *TINY, "--adaptive", "false"]) as server, \
            server.client() as c:
        assert server.wait_for_output("adaptive controller off"), server.text()
        assert "measuring the unloaded" not in server.text()
        policy = c.get("/carpool/policy").json()
        assert policy["adaptive"] is False and policy["slo"] is None
        assert policy["mode"] == "fixed" and policy["admission"]["regime"] == "queue"
