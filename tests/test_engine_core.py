"""The engine core both the live engine and the simulator run: a step's
commit, its finishing rules and fast-forward."""
from __future__ import annotations

from test_scheduler_properties import make_scheduler

from carpool.engine.core import EngineCore
from carpool.scheduler import Request, RequestStatus


def _core(max_model_len=None) -> EngineCore:
    return EngineCore(make_scheduler(num_blocks=64, max_seqs=4, budget=64, policy="fcfs"),
                      max_model_len)


def _step(core: EngineCore, token: int = 7, on_stop=None):
    output, _ = core.begin()
    sampled = [(span.request, token) for span in output.spans if span.sample]
    return core.complete(output, sampled, 0.01, on_stop)


def test_stop_token_first_then_length():
    core = _core()
    a = Request("a", [1, 2, 3], 2, 0.0, stop_token_ids=frozenset({9}))
    b = Request("b", [4, 5], 5, 0.0, stop_token_ids=frozenset({7}))
    core.scheduler.add_request(a)
    core.scheduler.add_request(b)
    seen = []
    progressed, finished = _step(core, token=8, on_stop=lambda r, t: seen.append((r, t)))
    assert progressed == [a, b] and finished == [] and seen == []
    # b samples its stop token on the step a reaches its length: both end, each by its rule.
    progressed, finished = _step(core, token=7, on_stop=lambda r, t: seen.append((r, t)))
    assert finished == [a, b] and seen == [(b, 7)]
    assert (a.status, b.status) == (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
    assert not core.scheduler.has_unfinished


def test_a_stop_token_at_the_length_is_a_stop():
    core = _core()
    last = Request("last", [1, 2], 1, 0.0, stop_token_ids=frozenset({7}))
    core.scheduler.add_request(last)
    _, finished = _step(core, token=7)
    assert finished == [last] and last.status == RequestStatus.FINISHED_STOPPED


def test_context_length_finishes_and_aborted_requests_do_not_progress():
    core = _core(max_model_len=5)
    long = Request("long", [1, 2, 3, 4], 10, 0.0)
    core.scheduler.add_request(long)
    _, finished = _step(core)
    assert finished == [long] and long.status == RequestStatus.FINISHED_LENGTH
    gone = Request("gone", [1, 2], 4, 0.0)
    core.scheduler.add_request(gone)
    output, _ = core.begin()
    core.scheduler.abort_request("gone")  # while the step ran
    progressed, finished = core.complete(output, [(gone, 7)], 0.01)
    assert progressed == finished == []


def test_fast_forward_finishes_what_reached_its_length():
    core = _core()
    requests = [Request(f"r{i}", [1, 2, 3 + i], 3 + i, 0.0) for i in range(3)]
    for request in requests:
        core.scheduler.add_request(request)
    _step(core)  # prefill and first tokens
    steps = core.decode_run_limit()
    assert steps == 2  # r0 has two tokens left
    times = [0.01] * steps
    finished = core.fast_forward(times, [0.02, 0.03], lambda t: None, 7)
    assert finished == [requests[0]] and requests[0].num_output_tokens == 3
    assert [r.num_output_tokens for r in requests[1:]] == [3, 3]


def test_fast_forward_stops_where_the_context_fills():
    """A run never decodes past ``max_model_len``: it ends with the step that
    fills the context, and that request finishes by length, as stepping does."""
    core = _core(max_model_len=8)
    short, roomy = Request("short", [1, 2, 3, 4, 5], 20, 0.0), Request("roomy", [1, 2], 20, 0.0)
    core.scheduler.add_request(short)
    core.scheduler.add_request(roomy)
    _step(core)  # prefills; short now holds 6 tokens
    assert core.decode_run_limit() == 2  # tokens 7 and 8
    assert core.decode_run_limit(most=1) == 1
    finished = core.fast_forward([0.01, 0.01], [0.02, 0.03], lambda t: None, 7)
    assert finished == [short] and short.status == RequestStatus.FINISHED_LENGTH
    assert short.num_tokens == 8 and roomy.status == RequestStatus.RUNNING
