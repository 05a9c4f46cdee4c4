"""Priority lanes, aging, priority preemption and the short/long dual queue,
all on a fake clock."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler_properties import (
    FakeClock,
    long_prefill_tokens,
    make_scheduler,
    queue_knobs,
    run_step_output,
)

from carpool.config import SchedulerConfig
from carpool.scheduler import Request, RequestStatus, Scheduler
from carpool.scheduler.queues import LaneQueue


def prompt(base: int, length: int = 6) -> list[int]:
    """Distinct tokens per request: no prefix sharing between requests."""
    return [base * 100 + k for k in range(length)]


def fill_with_low_work(scheduler: Scheduler) -> dict[str, Request]:
    """Four running requests; the worst class has two, and the latest
    arrival overall is of a better class than the worst."""
    specs = [("n", 0), ("w-old", 2), ("w-new", 2), ("l", 1)]
    running = {}
    for index, (name, priority) in enumerate(specs):
        running[name] = Request(name, prompt(index + 1), 20, scheduler.clock(), priority)
        scheduler.add_request(running[name])
        scheduler.clock.now += 0.01
    run_step_output(scheduler)
    assert all(r.status == RequestStatus.RUNNING for r in running.values())
    return running


@pytest.mark.parametrize("short_of", ["slots", "blocks"])
def test_high_request_preempts_the_worst_latest_request_and_runs_next_step(short_of):
    if short_of == "slots":
        scheduler = make_scheduler(num_blocks=64, max_seqs=4, budget=64, policy="priority")
    else:
        scheduler = make_scheduler(num_blocks=8, max_seqs=8, budget=64, policy="priority")
        scheduler.kv.watermark_blocks = 0
    running = fill_with_low_work(scheduler)
    if short_of == "blocks":
        assert scheduler.kv.pool.num_free_blocks == 0  # 4 requests x 2 blocks
    high = Request("h", prompt(9), 3, scheduler.clock(), priority=-1)
    scheduler.add_request(high)
    out, _ = run_step_output(scheduler)
    # Dispatched in the very next step, at the expense of one victim only.
    assert high.first_scheduled_time is not None and high in [s.request for s in out.spans]
    assert [r.request_id for r in out.preempted] == ["w-new"]
    assert running["w-new"].status == RequestStatus.PREEMPTED
    assert scheduler.num_priority_preemptions == scheduler.num_preemptions == 1
    # The victim waits at the front of its lane and resumes once there is room.
    for _ in range(200):
        if not scheduler.has_unfinished:
            break
        run_step_output(scheduler)
        scheduler.check_invariants()
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in running.values())


@pytest.mark.parametrize("arrival_priority", [0, -1])
def test_equal_or_better_priority_work_is_never_preempted_for_an_arrival(arrival_priority):
    scheduler = make_scheduler(num_blocks=64, max_seqs=2, budget=64, policy="priority")
    high = Request("a", prompt(1), 4, 0.0, priority=-1)
    normal = Request("b", prompt(2), 8, 0.0, priority=0)
    for request in (high, normal):
        scheduler.add_request(request)
    run_step_output(scheduler)
    late = Request("c", prompt(3), 2, scheduler.clock(), priority=arrival_priority)
    scheduler.add_request(late)
    if arrival_priority == -1:  # only the strictly worse one may make room
        out, _ = run_step_output(scheduler)
        assert out.preempted == [normal] and late.first_scheduled_time is not None
        assert high.num_preemptions == 0
        return
    while late.first_scheduled_time is None:
        run_step_output(scheduler)
        scheduler.check_invariants()
        assert scheduler.num_preemptions == 0
    # It got the slot that the high request left, not one taken from anybody.
    assert high.status == RequestStatus.FINISHED_LENGTH
    assert normal.status == RequestStatus.RUNNING


def test_a_short_token_budget_shortens_worse_spans_instead_of_preempting():
    scheduler = make_scheduler(num_blocks=64, max_seqs=8, budget=8, policy="priority")
    lows = [Request(f"low{i}", prompt(i + 1, 40), 2, float(i), priority=1) for i in range(2)]
    for request in lows:
        scheduler.add_request(request)
    run_step_output(scheduler)  # low0's first chunk takes the whole budget
    high = Request("h", prompt(9), 2, scheduler.clock(), priority=-1)
    scheduler.add_request(high)
    out, _ = run_step_output(scheduler)
    # low0 gives back just the 6 tokens the arrival needs; low1, of the same
    # class as low0, does not start on tokens taken from it.
    assert [(s.request.request_id, s.num_tokens) for s in out.spans] == [("low0", 2), ("h", 6)]
    assert lows[1].first_scheduled_time is None
    # Nobody lost KV: a shortened chunk costs no recompute.
    assert all(r.status != RequestStatus.PREEMPTED for r in lows)
    assert scheduler.num_preemptions == 0 and lows[0].num_computed_tokens == 10


# -- aging ----------------------------------------------------------------------

STEP_SECONDS = 1.0  # the fake clock's time per step in the stream scenario


def serve_stream(aging_interval: float | None, num_steps: int) -> tuple[Request, int]:
    """One slot; every request needs exactly one step. A backlog of three
    normal requests and one low one at t=0, then one normal arrival per step:
    as many arrive as leave, so normal work never runs out.

    Returns the low request and how many other requests that arrived before
    ``aging_interval`` (k = 1 class to climb) were still waiting then.
    """
    scheduler = make_scheduler(num_blocks=64, max_seqs=1, budget=64, policy="priority",
                               aging_interval=aging_interval)
    for i in range(3):
        scheduler.add_request(Request(f"backlog{i}", prompt(i + 1, 4), 1, 0.0, priority=0))
    low = Request("low", prompt(5, 4), 1, 0.0, priority=1)
    scheduler.add_request(low)
    ahead_at_aging = -1
    for index in range(num_steps):
        scheduler.clock.now = now = index * STEP_SECONDS
        scheduler.add_request(Request(f"s{index}", prompt(10 + index, 4), 1, now, priority=0))
        if aging_interval is not None and now == aging_interval:
            ahead_at_aging = sum(1 for r in scheduler.waiting
                                 if r is not low and r.arrival_time < aging_interval)
        run_step_output(scheduler)
        scheduler.check_invariants()
        if low.first_scheduled_time is not None:
            break
    return low, ahead_at_aging


def test_aging_bounds_the_wait_of_a_low_request_under_a_stream_of_normal_ones():
    interval = 10.0
    low, ahead = serve_stream(interval, num_steps=100)
    # The bound (see LaneQueue): k = low - normal = 1 class, so every request
    # arriving at t0 + k*I = 10 s or later ranks behind the low one; it waits
    # at most k*I plus one step for each earlier arrival still waiting then.
    assert ahead >= 1  # normal work was still queued when the low one aged
    bound = 0.0 + 1 * interval + ahead * STEP_SECONDS
    assert low.first_scheduled_time is not None and low.first_scheduled_time <= bound
    assert low.first_scheduled_time >= interval  # before aging, normal work goes first


def test_without_aging_the_same_low_request_starves():
    low, _ = serve_stream(None, num_steps=100)
    assert low.first_scheduled_time is None and low.status == RequestStatus.WAITING


# -- dual queue -----------------------------------------------------------------

@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_long_prompt_prefill_is_capped_only_while_short_requests_want_the_budget(policy):
    budget = 256
    scheduler = make_scheduler(num_blocks=1200, max_seqs=16, budget=budget, policy=policy,
                               long_prompt_threshold=512, long_prefill_share=0.5)
    cap = scheduler.long_prefill_cap
    assert cap == 128
    long_request = Request("long", prompt(1, 2000), 2, 0.0)
    scheduler.add_request(long_request)
    out, _ = run_step_output(scheduler)
    assert long_prefill_tokens(scheduler, out) == budget  # alone: the full budget

    shorts: list[Request] = []
    # A second long prompt queues ahead of the short ones, and is passed over.
    second_long = Request("long2", prompt(2, 1000), 2, 0.0)
    full_budget_steps = 0
    for index in range(1, 40):
        if index == 1:
            second_long.arrival_time = scheduler.clock()
            scheduler.add_request(second_long)
        arrivals = []
        if index <= 6:
            arrivals = [Request(f"short{index}-{j}", prompt(10 * index + j, 20), 3,
                                scheduler.clock()) for j in range(2)]
        for request in arrivals:
            scheduler.add_request(request)
        shorts += arrivals
        wanting = any(r.num_prompt_tokens <= 512 and not (
            r.num_output_tokens and r.num_pending_tokens == 1)
            for r in list(scheduler.waiting) + scheduler.running)
        out, _ = run_step_output(scheduler)
        scheduler.check_invariants()
        long_tokens = long_prefill_tokens(scheduler, out)
        if wanting:
            assert long_tokens <= cap
        elif long_request.num_output_tokens == 0:
            assert long_tokens == budget - (out.num_tokens - long_tokens)
            full_budget_steps += 1
        # Each short request's first token comes in the step it arrived.
        assert all(r.num_output_tokens >= 1 for r in arrivals)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in shorts)
    assert long_request.num_output_tokens >= 1 and full_budget_steps >= 2
    assert second_long.first_scheduled_time > max(r.first_scheduled_time for r in shorts)


# -- properties -------------------------------------------------------------------

class QueueModel:
    """Reference semantics of ``LaneQueue``: plain lists, brute-force merge."""

    def __init__(self, by_priority: bool, aging: float | None, threshold: int) -> None:
        self.by_priority, self.aging, self.threshold = by_priority, aging, threshold
        self.lanes: dict[tuple[int, bool, bool], list[Request]] = {}
        self.fcfs: list[Request] = []  # the whole queue as one deque

    def is_long(self, request: Request) -> bool:
        return not request.kv_handoff and request.num_prompt_tokens > self.threshold

    def lane(self, request: Request) -> list[Request]:
        key = (request.priority if self.by_priority else 0, self.is_long(request),
               request.kv_handoff)
        return self.lanes.setdefault(key, [])

    def order(self, now: float, include_long: bool = True) -> list[Request]:
        if not self.by_priority:  # FCFS: one deque, P/D handoffs first, whatever the lanes
            kept = [r for r in self.fcfs if include_long or not self.is_long(r)]
            return [r for r in kept if r.kv_handoff] + [r for r in kept if not r.kv_handoff]
        heads = {k: 0 for k, lane in self.lanes.items() if lane and (include_long or not k[1])}
        merged = []
        while heads:
            key = min(heads, key=lambda k: self.rank(self.lanes[k][heads[k]], now))
            merged.append(self.lanes[key][heads[key]])
            heads[key] += 1
            if heads[key] == len(self.lanes[key]):
                del heads[key]
        return merged

    def rank(self, request: Request, now: float) -> tuple[int, bool, float]:
        aged = 0 if self.aging is None else int((now - request.arrival_time) // self.aging)
        return (request.priority - aged, not request.kv_handoff, request.arrival_time)


queue_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(-1, 2), st.integers(1, 12), st.booleans()),
    st.tuples(st.just("prepend"), st.integers(0, 99)),
    st.tuples(st.just("remove"), st.integers(0, 99)),
    st.tuples(st.just("pop")),
    st.tuples(st.just("eligible"), st.integers(2, 4), st.booleans()),
    st.tuples(st.just("wait"), st.floats(0.0, 3.0)),
), max_size=80)


@settings(max_examples=200, deadline=None)
@given(ops=queue_ops, by_priority=st.booleans(), aging=st.sampled_from([None, 0.5, 2.0]))
def test_lane_queue_matches_its_reference_semantics(ops, by_priority, aging):
    """FCFS behaves exactly as one deque with P/D handoffs taken first;
    priority picks the best lane head by (effective priority, handoff first,
    arrival); a prepended request heads its lane; a handoff is never long."""
    clock = FakeClock()
    queue = LaneQueue(clock, by_priority, aging, long_threshold=6)
    model = QueueModel(by_priority, aging, 6)
    out: list[Request] = []  # removed requests, candidates for prepend
    for index, op in enumerate(ops):
        clock.now += 0.001  # distinct arrival times: ties only by construction
        if op[0] == "add":
            request = Request(f"r{index}", [1] * op[2], 1, clock.now, op[1],
                              kv_handoff=op[3])
            queue.add(request)
            model.lane(request).append(request)
            model.fcfs.append(request)
        elif op[0] == "prepend" and out:
            request = out.pop(op[1] % len(out))
            queue.prepend(request)
            model.lane(request).insert(0, request)
            model.fcfs.insert(0, request)
        elif op[0] in ("remove", "pop") and model.fcfs:
            expected = model.order(clock.now)
            request = expected[op[1] % len(expected)] if op[0] == "remove" else expected[0]
            if op[0] == "pop":
                assert queue.pop() is request
            else:
                queue.remove(request)
            model.lane(request).remove(request)
            model.fcfs.remove(request)
            out.append(request)
        elif op[0] == "eligible":
            _, modulus, include_long = op
            def eligible(r: Request, modulus: int = modulus) -> bool:
                return int(r.request_id[1:]) % modulus == 0
            pick = [r for r in model.order(clock.now, include_long) if eligible(r)]
            found = queue.first_eligible(eligible, include_long)
            assert found is (pick[0] if pick else None)
        elif op[0] == "wait":
            clock.now += op[1]
        assert list(queue) == model.order(clock.now)
        assert len(queue) == len(model.fcfs)
        queue.check_invariants()


arrival_bursts = st.lists(st.tuples(
    st.lists(st.tuples(st.integers(-1, 2), st.integers(1, 30), st.integers(1, 8)), max_size=4),
    st.floats(0.0, 3.0)), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(bursts=arrival_bursts, num_blocks=st.integers(8, 24), max_seqs=st.integers(1, 4),
       budget=st.integers(1, 16), knobs=queue_knobs)
def test_priority_contention_keeps_invariants_and_dispatches_the_head(
        bursts, num_blocks, max_seqs, budget, knobs):
    """Bursts of mixed priorities into a small pool. Besides the per-step
    checks of ``run_step_output``: when the queue's head is strictly better
    than every running request, it runs in this very step (unless a running
    request had to be preempted for blocks first)."""
    scheduler = make_scheduler(num_blocks, max_seqs, budget, "priority", **knobs)
    accepted: list[Request] = []
    finished: list[Request] = []
    for index, (arrivals, seconds) in enumerate(bursts):
        for j, (priority, length, max_tokens) in enumerate(arrivals):
            request = Request(f"r{index}-{j}", [(index * 7 + j + k) % 5 for k in range(length)],
                              max_tokens, scheduler.clock(), priority)
            if scheduler.kv.can_ever_fit(length + max_tokens):
                scheduler.add_request(request)
                accepted.append(request)
        head = scheduler.waiting.peek() if scheduler.waiting else None
        better = head is not None and all(r.priority > head.priority for r in scheduler.running)
        growth = scheduler.num_preemptions - scheduler.num_priority_preemptions
        out, done = run_step_output(scheduler)
        finished += done
        scheduler.check_invariants()
        if better and scheduler.num_preemptions - scheduler.num_priority_preemptions == growth:
            assert head in [s.request for s in out.spans], "the better head was not dispatched"
        scheduler.clock.now += seconds
    for _ in range(10 + sum(r.num_prompt_tokens + 2 * r.max_tokens for r in accepted) * 4):
        if not scheduler.has_unfinished:
            break
        finished += run_step_output(scheduler)[1]
        scheduler.check_invariants()
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in accepted)
    assert all(r.num_output_tokens == r.max_tokens for r in accepted)
    assert scheduler.kv.pool.num_free_blocks == num_blocks


def test_config_validates_the_queue_knobs():
    for bad in ({"aging_interval": 0.0}, {"aging_interval": float("nan")},
                {"long_prompt_threshold": 0}, {"long_prefill_share": 0.0},
                {"long_prefill_share": 1.5}, {"long_prefill_share": float("nan")}):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad).validate()
    SchedulerConfig(aging_interval=None, long_prefill_share=1.0).validate()


ENGINE_PROMPTS = [
    "Continuous batching keeps the GPU busy while users get fast answers. " * 2,
    "Numbers 12345 67890 and punctuation!? (yes) [no] {maybe} " * 2,
    "The quick brown fox jumps over the lazy dog, again and again.",
    "def add(a, b):",
    "Emoji: 😀👍🏽",
    "café",
]


def test_priority_preemption_and_shortened_spans_keep_greedy_tokens(tiny_model_dir,
                                                                     monkeypatch):
    """On a real model: high requests arriving into a tight pool full of low
    work preempt and shorten its spans; every request's greedy tokens stay
    those it gets alone in a roomy engine."""
    from carpool import LLM, SamplingParams
    from carpool.scheduler import scheduler as scheduler_module

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    roomy = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="64MiB")
    expected = [o.token_ids for o in roomy.generate(ENGINE_PROMPTS, params)]
    trims = []
    real_trim = scheduler_module.trim_span
    monkeypatch.setattr(scheduler_module, "trim_span",
                        lambda *args: trims.append(args[2]) or real_trim(*args))
    tight = LLM(str(tiny_model_dir), dtype="float32", block_size=8, num_blocks=14,
                max_num_batched_tokens=7, watermark=0.0, policy="priority",
                long_prompt_threshold=16, long_prefill_share=0.5)
    engine = tight.engine
    ids = [engine.add_request(p, params, priority=1) for p in ENGINE_PROMPTS[:3]]
    while engine.scheduler.kv.pool.num_free_blocks > 1:  # low work fills the pool
        engine.step()
    ids += [engine.add_request(p, params, priority=-1) for p in ENGINE_PROMPTS[3:]]
    final = {}
    for _ in range(2000):
        if not engine.has_unfinished:
            break
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output.token_ids
        engine.scheduler.check_invariants()
    assert [final[i] for i in ids] == expected
    assert engine.scheduler.num_priority_preemptions > 0 and trims
    assert engine.scheduler.kv.stats().used_blocks == 0
