"""Client-side metrics of the serving benchmark, checked by hand, and the
streaming client's parsing of what servers send (no network: httpx's
MockTransport)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from carpool.bench.client import Target, send_request
from carpool.bench.loadgen import parse_queue_gauges
from carpool.bench.sweep import capacity, rescale, sweep_rates
from carpool.workload.spec import BenchItem
from carpool.workload.stats import (
    FAILED,
    OK,
    REJECTED,
    RequestRecord,
    meets_slo,
    peak_concurrency,
    phase_summaries,
    phase_windows,
    summarize,
    timeseries,
)


def _ok(index, sent, chunks, tokens, input_tokens=10):
    return RequestRecord(index, sent, input_tokens, 16, sent=sent, status=OK,
                         chunk_times=list(chunks), finished=chunks[-1], output_tokens=tokens)


def _records():
    return [
        _ok(0, 0.0, [1.0, 1.5, 2.5], 3),  # ttft 1.0, e2e 2.5, tpot 0.75, itl 0.5 1.0
        _ok(1, 1.0, [1.5, 2.0], 2),  # ttft 0.5, e2e 1.0, tpot 0.5, itl 0.5
        RequestRecord(2, 2.0, 10, 16, sent=2.0, status=REJECTED, reason="http_429",
                      finished=2.01),
        RequestRecord(3, 2.2, 10, 16, sent=2.2, status=FAILED, reason="timeout", finished=10.0),
        _ok(4, 2.4, [4.4], 1),  # ttft 2.0, e2e 2.0, no tpot, no itl
        RequestRecord(5, 11.0, 10, 16),  # never sent (time limit)
    ]


def test_summary_matches_hand_computed_values():
    s = summarize(_records(), duration=10.0, slo={"ttft": 1.5, "tpot": 0.6})
    assert (s["requests"], s["completed"], s["rejected"], s["failed"], s["unsent"]) == \
        (5, 3, 1, 1, 1)
    assert s["rejected_by_reason"] == {"http_429": 1}
    assert s["failed_by_reason"] == {"timeout": 1}
    assert s["rejected_share"] == pytest.approx(0.2)
    assert s["ttft"]["mean"] == pytest.approx(3.5 / 3)
    assert s["ttft"]["p50"] == pytest.approx(1.0)
    assert s["ttft"]["p90"] == pytest.approx(1.8)  # 1.0 + 0.8 * (2.0 - 1.0)
    assert s["ttft"]["max"] == pytest.approx(2.0)
    assert s["tpot"]["mean"] == pytest.approx(0.625)
    assert s["tpot"]["p99"] == pytest.approx(0.5 + 0.99 * 0.25)
    assert s["itl"]["mean"] == pytest.approx(2.0 / 3)
    assert s["itl"]["p50"] == pytest.approx(0.5)
    assert s["e2e"]["p50"] == pytest.approx(2.0)
    assert s["e2e"]["p95"] == pytest.approx(2.0 + 0.9 * 0.5)
    assert s["output_tokens"] == 6 and s["input_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(0.3)
    assert s["output_throughput"] == pytest.approx(0.6)
    assert s["total_token_throughput"] == pytest.approx(3.6)
    # only request 1 meets ttft<=1.5 and tpot<=0.6 (0: tpot 0.75; 4: ttft 2.0)
    assert s["goodput"] == pytest.approx(0.1)
    assert s["slo_attainment"] == pytest.approx(0.2)
    # 2.4 s: requests 0, 3 and 4 in flight (1 ended at 2.0, 2 at 2.01)
    assert s["peak_concurrency"] == 3


def test_no_slo_no_goodput_and_empty_runs_do_not_crash():
    s = summarize(_records(), 10.0)
    assert s["goodput"] is None and s["slo_attainment"] is None
    empty = summarize([RequestRecord(0, 0.0, 1, 1)], 0.0)
    assert empty["completed"] == 0 and empty["ttft"]["p99"] is None


def test_a_one_token_answer_cannot_miss_a_tpot_limit():
    s = summarize([_ok(0, 0.0, [0.1], 1)], 1.0, {"tpot": 0.001})
    assert s["slo_attainment"] == 1.0


def test_timeseries_counts_in_flight_and_spreads_tokens_over_chunks():
    series = timeseries(_records(), 10.0, [(0.2, 4.0, 1.0), (3.0, 0.0, 2.0)])
    assert series["interval"] == 0.5
    assert len(series["t"]) == 20
    t = series["t"].index(2.0)  # bin [2.0, 2.5) ends at 2.5: only 3 (failed later) and 4
    assert series["in_flight"][t] == 2
    assert sum(series["output_tok_s"]) * 0.5 == pytest.approx(6.0)
    assert series["server_waiting"][0] == 4.0 and series["server_waiting"][-1] == 0.0
    assert series["server_running"][6] == 2.0


def test_queue_gauges_parsed_from_prometheus_text_of_any_server():
    text = ("# HELP carpool:num_requests_waiting x\ncarpool:num_requests_waiting 3.0\n"
            'vllm:num_requests_running{model_name="m"} 2\nvllm:num_requests_running'
            '{model_name="n"} 1\nother_metric 5\n')
    assert parse_queue_gauges(text) == {"waiting": 3.0, "running": 3.0}
    assert parse_queue_gauges("nothing here 1\n") == {}


def _sse(*events, done=True):
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    return (body + ("data: [DONE]\n\n" if done else "")).encode()


def _send(handler, endpoint="completions", max_tokens=4):
    target = Target("http://127.0.0.1:9/v1", "m", endpoint)
    record = RequestRecord(0, 0.0, 5, max_tokens)
    ticks = iter(range(100))

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await send_request(client, target, "hi", record, lambda: float(next(ticks)),
                               count_tokens=lambda text: len(text.split()))
    asyncio.run(go())
    return record


def test_client_times_content_chunks_and_reads_usage():
    seen = {}

    def handler(request):
        seen.update(json.loads(request.content))
        return httpx.Response(200, content=_sse(
            {"choices": [{"text": ""}]}, {"choices": [{"text": "a "}]},
            {"choices": [{"text": "b "}]}, {"choices": [{"text": "c"}]},
            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}))
    record = _send(handler)
    assert seen["stream"] and seen["ignore_eos"] and seen["max_tokens"] == 4
    assert seen["stream_options"] == {"include_usage": True} and seen["prompt"] == "hi"
    assert record.status == OK and record.sent == 0.0
    assert record.chunk_times == [2.0, 3.0, 4.0]  # the empty first chunk is not content
    assert record.output_tokens == 3 and record.counted_tokens is None  # usage not recounted
    assert record.server_input_tokens == 5 and record.text == "a b c"


def test_client_reads_chat_deltas_and_counts_tokens_without_usage():
    def handler(request):
        assert request.url.path == "/v1/chat/completions"
        assert json.loads(request.content)["messages"][0]["content"] == "hi"
        return httpx.Response(200, content=_sse(
            {"choices": [{"delta": {"role": "assistant"}}]},
            {"choices": [{"delta": {"content": "x y"}}]}))
    record = _send(handler, "chat")
    assert record.status == OK and record.output_tokens == 2 and len(record.chunk_times) == 1


@pytest.mark.parametrize("status,outcome,reason", [
    (429, REJECTED, "http_429"), (503, REJECTED, "http_503"), (400, FAILED, "http_400"),
    (500, FAILED, "http_500")])
def test_client_counts_refusals_apart_from_failures(status, outcome, reason):
    record = _send(lambda request: httpx.Response(status, json={"error": {"message": "no"}}))
    assert (record.status, record.reason) == (outcome, reason)
    assert record.ttft is None and record.finished is not None
    assert '"message": "no"' in record.error.replace('":"', '": "')  # why, kept for reports


def test_client_fails_cut_streams_errors_and_dead_servers():
    cut = _send(lambda r: httpx.Response(200, content=_sse({"choices": [{"text": "a"}]},
                                                           done=False)))
    assert (cut.status, cut.reason) == (FAILED, "incomplete_stream")
    err = _send(lambda r: httpx.Response(200, content=_sse({"error": {"message": "boom"}})))
    assert (err.status, err.reason) == (FAILED, "stream_error") and "boom" in err.error

    def refuse(request):
        raise httpx.ConnectError("refused")
    dead = _send(refuse)
    assert (dead.status, dead.reason) == (FAILED, "connection")


def _item(offset):
    return BenchItem(index=0, offset=offset, prompt="p", input_tokens=1, output_tokens=1)


def test_sweep_rescales_arrivals_and_picks_the_highest_rate_meeting_the_slo():
    plan = [_item(t) for t in (0.0, 1.0, 3.0, 4.0)]  # 3 gaps over 4 s: 0.75 req/s
    assert [i.offset for i in rescale(plan, 1.5)] == pytest.approx([0.0, 0.5, 1.5, 2.0])
    assert [i.offset for i in rescale([_item(0.0)] * 3, 2.0)] == [0.0, 0.5, 1.0]
    assert sweep_rates(1.0, 5.0, 3) == pytest.approx([2.0, 3.0, 4.0])
    with pytest.raises(ValueError):
        sweep_rates(1.0, 2.0, 0)
    runs = [{"mode": "synchronous", "rate": 0.5, "meets_slo": True},
            {"mode": "rate", "rate": 1.0, "meets_slo": True},
            {"mode": "rate", "rate": 2.0, "meets_slo": False},
            {"mode": "rate", "rate": 1.5, "meets_slo": True}]
    assert capacity(runs, 0.9) == 1.5
    assert capacity(runs[:1], 0.9) is None


def test_an_itl_limit_holds_for_every_gap_of_a_request():
    steady = _ok(0, 0.0, [0.1, 0.2, 0.3], 3)
    stalled = _ok(1, 0.0, [0.1, 0.2, 0.9], 3)
    assert meets_slo(steady, {"itl": 0.15}) and not meets_slo(stalled, {"itl": 0.15})
    assert summarize([steady, stalled], 1.0, {"itl": 0.15})["slo_attainment"] == 0.5


def test_back_to_back_requests_do_not_overlap():
    first, second = _ok(0, 0.0, [0.5, 1.0], 2), _ok(1, 1.0, [1.5, 2.0], 2)
    overlapping = _ok(2, 0.9, [1.2], 1)
    assert peak_concurrency([first, second]) == 1
    assert peak_concurrency([first, second, overlapping]) == 2
    assert peak_concurrency([]) == 0


def test_surges_cut_the_run_into_calm_and_surge_phases():
    surge = {"start": 10.0, "duration": 5.0, "factor": 3.0}
    assert phase_windows([surge], 30.0) == [("calm 1", 0.0, 10.0), ("surge 1 x3", 10.0, 15.0),
                                            ("calm 2", 15.0, 30.0)]
    overlapping = [surge, {"start": 12.0, "duration": 6.0, "factor": 2.0}]
    assert phase_windows(overlapping, 20.0)[1] == ("surge 1 x3", 10.0, 18.0)
    assert phase_windows([], 7.0) == [("all", 0.0, 7.0)]
    assert phase_windows([{"start": 0.0, "duration": 4.0}], 4.0) == [("surge 1 x1", 0.0, 4.0)]


def test_phase_summaries_count_each_request_in_the_phase_it_was_scheduled_in():
    records = [
        _ok(0, 0.0, [0.2, 0.4, 0.6], 3),  # calm: ttft 0.2, tpot 0.2
        _ok(1, 1.0, [1.1, 1.2], 2),  # calm: ttft 0.1, tpot 0.1
        _ok(2, 2.0, [3.0, 3.1], 2),  # surge: ttft 1.0 (misses ttft<=0.5)
        RequestRecord(3, 2.5, 10, 16, sent=2.5, status=REJECTED, reason="http_429",
                      finished=2.5),
        _ok(4, 3.5, [3.7, 3.8], 2),  # surge
        _ok(5, 4.0, [4.1, 4.2], 2),  # calm 2: the last send ends the phase
    ]
    phases = phase_summaries(records, [{"start": 2.0, "duration": 2.0, "factor": 3.0}],
                             {"ttft": 0.5})
    assert [p["phase"] for p in phases] == ["calm 1", "surge 1 x3", "calm 2"]
    calm, surge, after = phases
    assert (calm["requests"], calm["rejected"], calm["completed"]) == (2, 0, 2)
    assert calm["offered_rate"] == pytest.approx(1.0) and calm["goodput"] == pytest.approx(1.0)
    assert calm["ttft"]["max"] == pytest.approx(0.2) and calm["tpot"]["max"] == pytest.approx(0.2)
    assert surge["requests"] == 3 and surge["rejected_share"] == pytest.approx(1 / 3)
    assert surge["goodput"] == pytest.approx(0.5)  # one of three within the SLO, over 2 s
    assert surge["completed_rate"] == pytest.approx(1.0)
    assert after["requests"] == 1 and after["end"] == pytest.approx(4.0)
    assert phase_summaries(records, [])[0]["goodput"] is None  # no SLO: no goodput


def test_prompts_go_as_token_ids_when_asked():
    import argparse

    from carpool.bench.serve import target_from_args

    class Words:  # a stand-in tokenizer: one id per character
        def encode(self, text):
            return [ord(c) for c in text]

    args = argparse.Namespace(base_url="http://127.0.0.1:9/v1", model="m", endpoint="completions",
                              api_key=None, temperature=0.0, ignore_eos=True,
                              prompt_format="token-ids")
    target = target_from_args(args, Words())
    assert target.payload("hi", 4)["prompt"] == [104, 105]
    args.prompt_format = "text"
    assert target_from_args(args, Words()).payload("hi", 4)["prompt"] == "hi"
    args.endpoint, args.prompt_format = "chat", "token-ids"
    with pytest.raises(ValueError, match="token-ids needs --endpoint completions"):
        target_from_args(args, Words())
