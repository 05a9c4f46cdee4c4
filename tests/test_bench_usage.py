"""bench serve counts output tokens from the server's usage and falls back
to our tokenizer only for servers that report none."""
from __future__ import annotations

import asyncio
import json

import httpx

from carpool.bench.client import Target, send_request
from carpool.workload.results import LoadRun, format_result, make_result
from carpool.workload.stats import OK, RequestRecord

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
