"""bench serve counts output tokens from the server's usage and falls back
to our tokenizer only for servers that report none."""
from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest

from carpool.bench.client import Target, send_request
from carpool.workload.results import LoadRun, format_result, make_result
from carpool.workload.stats import OK, REJECTED, RequestRecord

TEXT_CHUNKS = ["Hel", "lo wor", "ld"]


def words(text: str) -> int:
    """A stand-in tokenizer that disagrees with the server's count."""
    return len(text.split())


def _stream(usage: dict | None) -> bytes:
    events = [{"choices": [{"text": t}]} for t in TEXT_CHUNKS]
    if usage is not None:
        events.append({"choices": [], "usage": usage})
    return ("".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n").encode()


def fetch(usage: dict | None, index: int = 0) -> RequestRecord:
    """One request against a fake server streaming TEXT_CHUNKS then ``usage``."""
    record = RequestRecord(index, 0.0, input_tokens=4, max_tokens=8)
    ticks = iter(range(100))

    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=_stream(usage)))
        async with httpx.AsyncClient(transport=transport) as client:
            await send_request(client, Target("http://127.0.0.1:9/v1", "m"), "hi", record,
                               lambda: float(next(ticks)), count_tokens=words)
    asyncio.run(go())
    assert record.status == OK and record.text == "Hello world"
    return record


def test_a_servers_usage_is_taken_as_is_and_not_recounted():
    record = fetch({"prompt_tokens": 4, "completion_tokens": 5})
    assert record.output_tokens == 5  # the server's, though our "tokenizer" says 2
    assert record.counted_tokens is None and record.server_input_tokens == 4


def test_without_usage_our_tokenizer_counts_and_says_so():
    for usage in (None, {"prompt_tokens": 4}, {"prompt_tokens": 4, "completion_tokens": None}):
        record = fetch(usage)
        assert record.output_tokens == record.counted_tokens == 2


def test_a_zero_in_usage_is_the_servers_word_too():
    record = fetch({"prompt_tokens": 4, "completion_tokens": 0})
    assert record.output_tokens == 0 and record.counted_tokens is None


def result_of(records: list[RequestRecord]) -> dict:
    return make_result("fake", {"workload": {"name": "w"}}, LoadRun(records, 10.0), {})


def test_the_report_notes_only_the_tokenizer_fallback():
    with_usage = [fetch({"prompt_tokens": 4, "completion_tokens": 5}, i) for i in range(3)]
    result = result_of(with_usage)
    assert result["summary"]["tokenizer_counted"] == 0
    assert result["summary"]["output_tokens"] == 15
    assert "note:" not in format_result(result)  # no "usage differs from our tokenizer"

    mixed = with_usage + [fetch(None, 3)]
    result = result_of(mixed)
    assert result["summary"]["tokenizer_counted"] == 1
    assert result["summary"]["output_tokens"] == 17
    assert ("note: 1 of 4 responses came without usage; their output tokens are our "
            "tokenizer's count of their text") in format_result(result)


def test_results_written_before_the_fallback_count_still_format():
    result = result_of([fetch({"prompt_tokens": 4, "completion_tokens": 5})])
    del result["summary"]["tokenizer_counted"]
    result["summary"]["token_count_mismatches"] = 1  # the retired cross-check
    assert "note:" not in format_result(result)


def test_cached_tokens_come_from_the_usage_prompt_details():
    record = fetch({"prompt_tokens": 4, "completion_tokens": 5,
                    "prompt_tokens_details": {"cached_tokens": 3}})
    assert record.cached_tokens == 3 and record.to_dict()["cached_tokens"] == 3
    for usage in ({"prompt_tokens": 4, "completion_tokens": 5},  # a server that does not say
                  {"prompt_tokens": 4, "completion_tokens": 5, "prompt_tokens_details": None},
                  {"prompt_tokens": 4, "completion_tokens": 5,
                   "prompt_tokens_details": {"cached_tokens": "3"}}):
        assert fetch(usage).cached_tokens is None


def _done(index: int, input_tokens: int, cached: int | None,
          server_input: int | None = None) -> RequestRecord:
    return RequestRecord(index, 0.0, input_tokens, 8, sent=0.0, status=OK, chunk_times=[0.5],
                         finished=1.0, output_tokens=8, server_input_tokens=server_input,
                         cached_tokens=cached)


def test_prefix_hit_rate_is_cached_over_prompt_tokens_of_the_requests_that_say():
    records = [_done(0, 100, 0, server_input=100), _done(1, 100, 64, server_input=101),
               _done(2, 50, 30),  # no server prompt count: the planned one counts
               _done(3, 1000, None),  # reported no cached count: left out of both sums
               RequestRecord(4, 0.0, 80, 8, sent=0.0, status=REJECTED, reason="http_429",
                             finished=0.1, cached_tokens=80)]  # not completed: left out
    summary = result_of(records)["summary"]
    assert summary["cached_tokens"] == 94 and summary["cache_reported"] == 3
    assert summary["prefix_hit_rate"] == pytest.approx(94 / 251)
    assert ("prefix hit rate 37.5%: 94 prompt tokens from the prefix cache, 3 of 4 requests "
            "reported") in format_result(result_of(records))
    nobody = result_of([_done(0, 100, None)])["summary"]
    assert nobody["prefix_hit_rate"] is None and nobody["cached_tokens"] is None
    all_said = result_of(records[:3])
    assert "prefix hit rate 37.5%: 94 prompt tokens from the prefix cache\n" in \
        format_result(all_said) + "\n"


def test_results_written_before_cached_tokens_load_compare_and_format(tmp_path, capsys):
    from carpool.bench.compare import add_compare_args, run_compare

    new = result_of([_done(0, 100, 25), _done(1, 100, 75)])
    old = json.loads(json.dumps(new))
    for key in ("prefix_hit_rate", "cached_tokens", "cache_reported"):
        del old["summary"][key]
    for request in old["requests"]:
        del request["cached_tokens"]
    assert "prefix hit rate - (no cached-token counts)" in format_result(old)
    paths = []
    for name, doc in (("old.json", old), ("new.json", new)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(doc))
    parser = argparse.ArgumentParser()
    add_compare_args(parser)
    assert run_compare(parser.parse_args([str(p) for p in paths])) == 0
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("prefix hit %"))
    assert row.split()[3:] == ["-", "50.0", "-"]
