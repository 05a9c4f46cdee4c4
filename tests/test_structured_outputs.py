"""Structured outputs: the request forms, the token mask in the sampler, and
the official ``openai`` client against a live ``carpool serve`` on the real
default model (``chat.completions.parse`` with a pydantic model, streamed
and not; vLLM's guided_* fields; 400s for what cannot compile)."""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from server_utils import ServerProcess

from carpool.model.grammar import (
    GrammarCompiler,
    apply_token_bitmask,
    fill_bitmask,
    new_bitmask,
)
from carpool.model.sampler import Sampler, SamplingRow
from carpool.sampling_params import SamplingParams
from carpool.structured_output import MAX_SPEC_BYTES, StructuredOutput, from_request

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "population": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"enum": ["capital", "port", "old"]}, "maxItems": 3}},
    "required": ["city", "population", "tags"], "additionalProperties": False}


# -- the request forms -----------------------------------------------------------------

def test_every_request_form_becomes_one_constraint():
    schema_text = json.dumps(SCHEMA, sort_keys=True)
    assert from_request() is None and from_request({"type": "text"}) is None
    assert from_request({"type": "json_object"}) == StructuredOutput("json_object")
    got = from_request({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                               "strict": True}})
    assert got == StructuredOutput("json", schema_text)
    assert from_request(guided_json=SCHEMA) == got == from_request(guided_json=json.dumps(SCHEMA))
    assert from_request(structured_outputs={"json": SCHEMA}) == got
    assert from_request(guided_regex=r"\d+") == StructuredOutput("regex", r"\d+")
    assert from_request(guided_choice=["a", "b"]) == StructuredOutput("choice", '["a", "b"]')
    assert from_request(structured_outputs={"grammar": 'root ::= "x"'}).kind == "grammar"
    assert from_request(structured_outputs={"json_object": True}).kind == "json_object"


@pytest.mark.parametrize("fields,message", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"guided_json": "{not json"}, "guided_json is not valid JSON"),
    ({"guided_json": "[1]"}, "JSON schema object"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "not several"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"xml": "<a/>"}}, "unknown field"),
    ({"guided_regex": "a" * (MAX_SPEC_BYTES + 1)}, "at most"),
])
def test_malformed_requests_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        from_request(**fields)


@pytest.fixture(scope="module")
def grammars(real_model_path):
    from carpool.model.loader import load_tokenizer

    tokenizer = load_tokenizer(str(real_model_path))
    return GrammarCompiler(tokenizer, tokenizer.vocab_size), tokenizer


def _allowed(constraint, vocab: int) -> set[int]:
    bitmask = new_bitmask(1, vocab)
    constraint.fill(bitmask, 0)
    bits = ((bitmask[0].unsqueeze(-1) >> torch.arange(32)) & 1).view(-1)[:vocab]
    return set(torch.nonzero(bits).flatten().tolist())


@pytest.mark.real_model
def test_choices_take_special_characters_literally(grammars):
    compiler, tokenizer = grammars
    choices = ["a.b", "(x|y)", "1+1=2?", "[z]", "back\\slash", "{n}", "^$"]
    spec = StructuredOutput("choice", json.dumps(choices))
    for choice in choices:
        constraint = compiler.constraint(spec)
        assert all(constraint.accept(t) for t in tokenizer.encode(choice)), choice
        assert tokenizer.eos_token_ids[0] in _allowed(constraint, tokenizer.vocab_size)
    assert not compiler.constraint(spec).accept(tokenizer.encode("axb")[0] if
                                                tokenizer.encode("axb")[0] !=
                                                tokenizer.encode("a.b")[0] else 0)


@pytest.mark.real_model
def test_special_tokens_never_count_as_text_inside_json(grammars):
    """Inside a JSON string the grammar allows ordinary text but never a
    chat-control token (whose text would pass as characters otherwise)."""
    compiler, tokenizer = grammars
    constraint = compiler.constraint(StructuredOutput("json", json.dumps(
        {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]})))
    for token in tokenizer.encode('{"note": "hel'):
        assert constraint.accept(token)
    allowed = _allowed(constraint, tokenizer.vocab_size)
    assert len(allowed) > 1000
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert tokenizer.token_to_id(special) not in allowed, special


@pytest.mark.real_model
@pytest.mark.parametrize("mode,text,ok", [
    ("optional", '<think>so: } { "a" </thin no</think>\n\n{"a": 5}', True),
    ("optional", '{"a": 5}', True),  # no thought at all
    ("optional", 'So {"a": 5}', False),  # text before the answer is a thought, or nothing
    ("optional", '<think>x</think>{"b": 5}', False),  # the answer still obeys its schema
    ("inside", 'we need a</think>\n\n{"a": 1}', True),  # the prompt opened the thought
    ("inside", 'a</think>' + '\n' * 9 + '{"a": 1}', False),  # blank lines are bounded
    ("inside", '{"a": 1}', False),  # ...so the answer waits for its close tag
])
def test_with_a_reasoning_parser_the_constraint_starts_after_the_thought(grammars, mode,
                                                                          text, ok):
    compiler, tokenizer = grammars
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                         "required": ["a"], "additionalProperties": False})
    constraint = compiler.constraint(StructuredOutput("json", schema, mode))
    taken = all(constraint.accept(t) for t in tokenizer.encode(text))
    eos = tokenizer.eos_token_ids[0]
    assert (taken and eos in _allowed(constraint, tokenizer.vocab_size)) == ok
    # Other kinds wrap the same way; the cache tells the modes apart.
    choice = compiler.constraint(StructuredOutput("choice", '["yes", "no"]', "optional"))
    assert all(choice.accept(t) for t in tokenizer.encode("<think>hm</think> no"))
    assert compiler.compile(StructuredOutput("json", schema)) is not \
        compiler.compile(StructuredOutput("json", schema, mode))


@pytest.mark.real_model
def test_a_batch_fill_is_each_rows_own(grammars):
    """The batched fill (llguidance's threads) writes what row-by-row does."""
    compiler, tokenizer = grammars
    specs = [(StructuredOutput("json", json.dumps(SCHEMA)), '{"city": "Ro'),
             (StructuredOutput("regex", "[0-9]{2,4}-[a-z]+"), "12"),
             (StructuredOutput("choice", '["alpha", "beta"]'), ""),
             (StructuredOutput("json", json.dumps(SCHEMA), "optional"), "<think>so"),
             (StructuredOutput("json_object"), '{"a": [1, ')]
    constraints = []
    for spec, prefix in specs * 3:
        constraint = compiler.constraint(spec)
        assert all(constraint.accept(t) for t in tokenizer.encode(prefix))
        constraints.append(constraint)
    batched = new_bitmask(len(constraints), tokenizer.vocab_size)
    fill_bitmask(constraints, batched)
    rows = new_bitmask(len(constraints), tokenizer.vocab_size)
    for k, constraint in enumerate(constraints):
        constraint.fill(rows, k)
    assert torch.equal(batched, rows) and not torch.equal(rows[0], rows[1])


class _Engine:
    """What ``WorkerLoop`` asks of an engine when adding requests."""

    def __init__(self, compiler) -> None:  # noqa: ANN001
        self.compiler, self.added = compiler, []

    def grammars(self):  # noqa: ANN201
        return self.compiler

    def add_request(self, prompt, params, request_id, **_) -> None:  # noqa: ANN001
        self.compiler.constraint(params.structured)  # the engine's own use: cached by now
        self.added.append(request_id)


@pytest.mark.real_model
def test_a_worker_compiles_new_grammars_off_its_engine_thread(real_model_path):
    """A new spec is compiled on the compiler's threads while the loop goes
    on; the request is added once it is ready, refused if it fails, and an
    abort meanwhile refuses it (its front let go)."""
    from carpool.engine.wire import Add, Progress
    from carpool.engine.worker import WorkerLoop
    from carpool.model.loader import load_tokenizer

    tokenizer = load_tokenizer(str(real_model_path))
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    loop = WorkerLoop.__new__(WorkerLoop)
    loop.engine, loop._compiling = _Engine(compiler), []

    def add(request_id: str, spec: StructuredOutput) -> Add:
        return Add(request_id, [1, 2], SamplingParams(max_tokens=4, structured=spec))

    good = StructuredOutput("json", json.dumps(SCHEMA))
    progress = Progress()
    loop._add(add("a", good), progress)
    loop._add(add("bad", StructuredOutput("regex", "([a-z")), progress)
    loop._add(add("gone", StructuredOutput("choice", '["x", "y"]')), progress)
    assert loop.engine.added == [] and len(loop._compiling) == 3
    loop._drop_compiling({"gone"}, progress)
    for future, _, _ in loop._compiling:
        future.exception(timeout=10)
    loop._add_compiled(progress)
    assert loop.engine.added == ["a"] and progress.accepted == ["a"]
    assert {r.request_id: r.message.split(":")[0] for r in progress.refused} == {
        "gone": "aborted", "bad": "invalid regex constraint"}
    loop._add(add("again", good), progress)  # cached now: added at once
    assert loop.engine.added == ["a", "again"] and loop._compiling == []


def test_what_cannot_compile_names_the_problem(grammars):
    compiler, _ = grammars
    for spec, needle in [(StructuredOutput("regex", "([a-z"), "invalid regex"),
                         (StructuredOutput("json", '{"type": "nonsense"}'), "invalid json"),
                         (StructuredOutput("json", '{"type": "array", "uniqueItems": true}'),
                          "uniqueItems"),
                         (StructuredOutput("grammar", "root ::= missing"), "invalid grammar")]:
        with pytest.raises(ValueError, match=needle):
            compiler.compile(spec)


# -- the mask in the sampler -----------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 100), seed=st.integers(0, 2**31))
def test_bitmask_keeps_exactly_the_allowed_tokens(rows, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (rows, (vocab + 31) // 32 * 32), generator=gen, dtype=torch.int64)
    words = (bits.view(rows, -1, 32) << torch.arange(32)).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    logits = torch.randn(rows, vocab, generator=gen)
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask)
    allowed = bits[:, :vocab].bool()
    assert torch.equal(masked[allowed], logits[allowed])
    assert bool(torch.isneginf(masked[~allowed]).all())


class _OnlyTokens:
    """A constraint allowing a fixed set of tokens; records what it accepts."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed, self.accepted = allowed, []

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for token in self.allowed:
            bitmask[row, token // 32] |= torch.tensor(1 << (token % 32)).to(torch.int32)

    def accept(self, token: int) -> bool:
        self.accepted.append(token)
        return token in self.allowed


def test_constrained_rows_draw_allowed_tokens_and_leave_their_batch_mates_alone():
    vocab = 300
    sampler = Sampler(vocab)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=3),
              SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.7, seed=5)]
    free = [SamplingRow(p, 7, 0) for p in params]
    want = [r.token_id for r in sampler.sample(logits, free)]
    constraints = [_OnlyTokens([5, 77, 290]), None, _OnlyTokens([31, 32]), None]
    rows = [SamplingRow(p, 7, 0, constraint=c) for p, c in zip(params, constraints)]
    got = sampler.sample(logits, rows)
    assert got[0].token_id == max((5, 77, 290), key=lambda t: logits[0, t].item())
    assert got[2].token_id in (31, 32) and constraints[2].accepted == [got[2].token_id]
    assert [got[1].token_id, got[3].token_id] == [want[1], want[3]]
    # Log-probabilities stay the raw distribution's, as without a constraint.
    raw = torch.log_softmax(logits[2], -1)
    assert got[2].logprob == pytest.approx(raw[got[2].token_id].item(), abs=1e-5)


# -- the live server -------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(real_model_path):
    with ServerProcess([str(real_model_path), "--served-model-name", MODEL,
                        "--max-num-seqs", "16", "--kv-cache-memory", "256MiB"]) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    kind: Literal["capital", "town", "village"]
    founded: int


ASK = [{"role": "user", "content": "Describe Paris as JSON."}]


@pytest.mark.real_model
def test_parse_with_a_pydantic_model_end_to_end(client):
    reply = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=City,
                                          max_tokens=120, temperature=0)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City) and message.parsed.kind in ("capital", "town",
                                                                        "village")


@pytest.mark.real_model
def test_streamed_json_schema_is_the_non_streamed_text(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA,
                                                  "strict": True}}
    kwargs = dict(model=MODEL, messages=ASK, response_format=fmt, max_tokens=120, temperature=0)
    text = client.chat.completions.create(**kwargs).choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    chunks = client.chat.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


@pytest.mark.real_model
def test_vllm_guided_fields_on_both_endpoints(client):
    choice = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=8,
        temperature=0.8, seed=1, extra_body={"guided_choice": ["yes", "no", "it depends"]})
    assert choice.choices[0].message.content in ("yes", "no", "it depends")
    phone = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20,
                                      temperature=0,
                                      extra_body={"guided_regex": r" \d{3}-\d{4}"})
    assert phone.choices[0].text[0] == " " and phone.choices[0].text[4] == "-"
    obj = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # the budget ran out mid-object: still a valid prefix's length
        assert obj.usage.completion_tokens == 60


@pytest.mark.real_model
@pytest.mark.parametrize("extra,needle", [
    ({"guided_regex": "([a-z"}, "invalid regex"),
    ({"guided_json": {"type": "nonsense"}}, "invalid json"),
    ({"guided_grammar": "root ::= missing"}, "invalid grammar"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_what_cannot_compile_is_a_400(client, extra, needle):
    with pytest.raises(openai.BadRequestError, match=needle):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                       extra_body=extra)
    # The server serves on.
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices


# -- P/D: the decode replica replays the prefill's token into its grammar ----------------

@pytest.mark.real_model
def test_a_constrained_request_split_between_prefill_and_decode(real_model_path):
    from carpool import LLM
    from carpool.engine.llm_engine import LLMEngine
    from carpool.engine.wire import Handoff
    from carpool.kv_transfer.blocks import KVBlockIO, weights_fingerprint
    from carpool.kv_transfer.connector import StoreConnector
    from carpool.kv_transfer.stores import MemoryStore

    llm = LLM(str(real_model_path), kv_cache_memory="64MiB",
              block_hash_key="00112233445566778899aabbccddeeff")
    choices = ["Paris is the capital", "Lyon is a city", "Nice"]
    so = StructuredOutput("choice", json.dumps(choices))
    prompt = llm.engine.tokenizer.encode_chat(
        [{"role": "user", "content": "Name a French city."}], True)
    params = SamplingParams(max_tokens=16, temperature=0.0, structured=so)
    whole = llm.generate([prompt], params)[0].text
    store = MemoryStore(64 << 20)

    def replica() -> LLMEngine:
        base, executor = llm.engine, llm.engine.executor
        fingerprint = weights_fingerprint(executor.model, f"{base.model_config!r}")
        connector = StoreConnector(store, KVBlockIO(executor.kv_caches), fingerprint,
                                   handoff_wait_s=5.0, model=executor.model)
        return LLMEngine(base.config, base.tokenizer, base.model_config, executor,
                         base.max_model_len, kv_connector=connector)

    def run(engine, params, handoff, request_id):
        engine.add_request(prompt, params, request_id=request_id, handoff=handoff)
        outputs = []
        while engine.has_unfinished:
            outputs += engine.step()
        return outputs[-1]

    prefill = replica()
    first = run(prefill, SamplingParams(max_tokens=1, temperature=0.0, structured=so),
                Handoff("prefill"), "p")
    prefill.kv_connector.flush()
    decode = replica()
    final = run(decode, params, Handoff("decode", list(first.token_ids)), "d")
    assert final.text == whole and final.text in choices
    with pytest.raises(ValueError, match="does not match"):  # a token the grammar refuses
        replica().add_request(prompt, params, request_id="x",
                              handoff=Handoff("decode", [llm.engine.tokenizer.encode("zzz")[0]]))
