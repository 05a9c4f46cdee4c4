"""The official ``openai`` client against a live ``carpool serve`` running the
real default model on 127.0.0.1."""
from __future__ import annotations

import openai
import pytest
from server_utils import ServerProcess

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(real_model_path):
    with ServerProcess([str(real_model_path), "--served-model-name", MODEL,
                        "--max-num-seqs", "16", "--kv-cache-memory", "256MiB"]) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def _count_tokens(server, **body) -> int:
    with server.client() as c:
        return c.post("/tokenize", json=body).json()["count"]


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_non_stream_and_stream_agree_with_right_usage(server, client):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    reply = client.chat.completions.create(**kwargs)
    text = reply.choices[0].message.content
    assert "Paris" in text and reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == _count_tokens(server, messages=QUESTION)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    if reply.choices[0].finish_reason == "length":
        assert reply.usage.completion_tokens == 24

    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        reply.usage.completion_tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == reply.choices[0].finish_reason and set(finishes[:-1]) == {None}


def test_completions_usage_counts_tokens_exactly(server, client):
    prompt = "The three primary colors are"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                      temperature=0, logprobs=1)
    choice = reply.choices[0]
    assert reply.usage.prompt_tokens == _count_tokens(server, prompt=prompt)
    assert reply.usage.completion_tokens == len(choice.logprobs.tokens)
    assert "".join(choice.logprobs.tokens) == choice.text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert streamed == choice.text


def test_stop_string_truncates_and_reports_stop(client):
    base = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=16,
                                     temperature=0).choices[0].text
    stop = base.strip()[2:5]
    assert len(stop) == 3
    cut = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=16,
                                    temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[:base.index(stop)]


def test_n_choices_and_seed_reproducibility(client):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=16, temperature=1.0, n=3,
                  seed=1234)
    first = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) > 1, "the n samples of one seed must differ"
    # usage counts the prompt once and every choice's tokens
    assert 3 <= first.usage.completion_tokens <= 3 * 16
    assert first.usage.prompt_tokens < first.usage.total_tokens
    # One seeded request, repeated under one cache state (a first call warms
    # it), samples the same. Not across states, nor with its n choices split
    # over steps differently: on CPUs with AMX, ATen's bf16 matmul rounds a
    # row differently by the number of rows in the product (README,
    # "packed_linear.cpp"), as vLLM promises seeds per batch state only.
    one = {**kwargs, "n": 1}
    client.chat.completions.create(**one)
    runs = [client.chat.completions.create(**one).choices[0].message.content
            for _ in range(2)]
    assert runs[0] == runs[1]
    other = client.chat.completions.create(**{**one, "seed": 99})
    assert other.choices[0].message.content != runs[0]


def test_chat_logprobs_top_logprobs(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        best = max(t.logprob for t in entry.top_logprobs)
        assert entry.logprob == pytest.approx(best, abs=1e-4)  # greedy picks the top token
        assert entry.logprob <= 0.0
    assert "".join(e.token for e in content) == reply.choices[0].message.content


def test_client_errors_come_back_as_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi " * 9000, max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-this-one", prompt="hi", max_tokens=4)


def test_session_requests_reuse_their_prefix(server, client):
    history = [{"role": "system", "content": "You are a helpful geography tutor. " * 6},
               *QUESTION]
    client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0,
                                   extra_headers={"x-session-id": "conv-1"})
    second = client.chat.completions.create(
        model=MODEL, messages=history + [{"role": "assistant", "content": "Paris."},
                                         {"role": "user", "content": "And of Italy?"}],
        max_tokens=8, temperature=0, extra_body={"session_id": "conv-1", "priority": "high"})
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    with server.client() as c:
        sessions = c.get("/carpool/policy").json()["sessions"]
    assert sessions["session_requests"] >= 2 and sessions["session_prefix_hit_tokens"] >= 64
