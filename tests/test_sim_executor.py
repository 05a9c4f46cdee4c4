"""The simulator's executor: the cost model behind the ``Executor`` interface."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from sim_helpers import ConstantCost

from carpool.config import EngineConfig
from carpool.executor.base import BatchItem, Executor, Padding, batch_items, step_padding
from carpool.executor.shapes import StepShape
from carpool.scheduler import Request
from carpool.sim.executor import SAMPLED_TOKEN, CostModelExecutor, batch_shape
from carpool.sim.replica import SimReplica, VirtualClock
from carpool.workload.stats import OK, RequestRecord
from carpool.workload.traces import TraceRequest


class ShapeCost(ConstantCost):
    """Prices a step at its token count (ms) and remembers the shapes it saw."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.shapes: list[StepShape] = []

    def step_seconds(self, shape: StepShape) -> float:
        self.shapes.append(shape)
        return shape.tokens / 1000


def _item(start: int, tokens: int, sampling=None) -> BatchItem:
    return BatchItem("r", [0] * (start + tokens), start, tokens, [0], sampling)


def test_executor_prices_the_batch_and_samples_one_token_per_sampling_item():
    cost = ShapeCost()
    executor = CostModelExecutor(cost, num_blocks=32, block_size=16)
    assert isinstance(executor, Executor)
    items = [_item(0, 100), _item(40, 1, sampling=True), _item(9, 1, sampling=True)]
    assert executor.execute(items) == [SAMPLED_TOKEN, SAMPLED_TOKEN]
    assert cost.shapes == [StepShape.of(items)]
    assert executor.last_step_seconds == 102 / 1000


def test_padded_batch_is_priced_as_its_rectangle():
    items = [_item(0, 5), _item(30, 1)]
    # 3 rows of 5: each item's row from its own start, the missing row all padding
    assert batch_shape(items, Padding(3, "left")) == StepShape.of(
        [SimpleNamespace(start=0, num_tokens=5), SimpleNamespace(start=30, num_tokens=5),
         SimpleNamespace(start=0, num_tokens=5)])
    # fewer rows than items: one row per item
    assert batch_shape(items, Padding(1)).seqs == 2
    assert step_padding(0, "right") is None and step_padding(4, "center") == Padding(4, "center")


def test_batch_items_carry_the_live_lists_and_sampling_rows():
    request = Request("a", [1, 2, 3, 4], 5, arrival_time=0.0)
    span = SimpleNamespace(request=request, start=1, num_tokens=3, sample=True)
    quiet = SimpleNamespace(request=request, start=0, num_tokens=1, sample=False)
    table = [7, 8]
    items = batch_items([span, quiet], {"a": table}, lambda r: ("row", r.request_id))
    assert items[0].token_ids is request.token_ids and items[0].block_table is table
    assert (items[0].start, items[0].num_tokens, items[0].sampling) == (1, 3, ("row", "a"))
    assert items[1].sampling is None


def test_replica_runs_every_step_through_its_executor():
    cost = ShapeCost()
    replica = SimReplica(0, EngineConfig(), 64, cost, VirtualClock(), fast_forward=False)
    assert replica.scheduler.kv.pool.num_blocks == replica.executor.num_blocks == 64
    calls = []
    execute = replica.executor.execute
    replica.executor.execute = lambda items, padding=None: calls.append(len(items)) or execute(
        items, padding)
    record = RequestRecord(0, 0.0, 20, 3)
    replica.receive(TraceRequest(0.0, 20, 3), record, 0.0)
    while replica.next_time is not None:
        replica.advance(replica.next_time)
    assert calls == [1, 1, 1]  # the prompt (samples the first token), then two decodes
    assert [s.tokens for s in cost.shapes] == [20, 1, 1]
    assert replica.clock.now == pytest.approx((20 + 1 + 1) / 1000)
    assert record.status == OK and record.output_tokens == 3


@pytest.mark.parametrize("fast_forward", [False, True])
def test_a_step_after_idling_pays_the_wake_cost_and_back_to_back_steps_do_not(fast_forward):
    """The measured form's wake term: a request arriving at an idle replica
    waits for a step priced c0 + wake; the decodes that follow it, and a
    request arriving while the replica works, pay c0 alone."""
    from carpool.sim.fitted import FittedCostModel

    cost = FittedCostModel((0.010, 0, 0, 0, 0, 0, 0, 0, 0.004))
    replica = SimReplica(0, EngineConfig(), 64, cost, VirtualClock(), fast_forward=fast_forward)
    records = [RequestRecord(i, at, 20, 4) for i, at in enumerate((0.0, 5.0, 5.001))]
    pending = list(records)
    while pending or replica.next_time is not None:
        due = replica.next_time
        if pending and (due is None or pending[0].scheduled <= due):
            record = pending.pop(0)
            replica.receive(TraceRequest(record.scheduled, 20, 4), record, record.scheduled)
        else:
            replica.advance(due)
    ttft = [r.chunk_times[0] - r.scheduled for r in records]
    # the first one arrives as the replica starts (no idle gap); the second
    # after 5 s idle; the third joins the second's next step (no wake cost)
    assert ttft[0] == pytest.approx(0.010)
    assert ttft[1] == pytest.approx(0.010 + 0.004 * (1 - math.exp(-(5.0 - 0.04) / 0.1)))
    assert ttft[2] == pytest.approx(ttft[1] - 0.001 + 0.010)
    assert all(r.status == OK for r in records)


def test_a_token_count_new_to_the_replica_costs_more_once():
    """The measured form's new-shape term, as the live process pays it: the
    first step of a token count builds its kernels, a repeat does not."""
    from carpool.sim.fitted import FittedCostModel

    cost = FittedCostModel((0.010,) + (0.0,) * 8 + (0.002, 1e-4))
    executor = CostModelExecutor(cost, num_blocks=32, block_size=16)
    prices = []
    for _ in range(2):
        executor.execute([_item(0, 30)])
        prices.append(executor.last_step_seconds)
    assert prices == pytest.approx([0.010 + 0.002 + 30e-4, 0.010])
    assert executor.decode_step_seconds(3, 90) == pytest.approx(0.010 + 0.002 + 3e-4)
    assert executor.decode_step_seconds(3, 93) == pytest.approx(0.010)
    executor.execute([_item(0, 2), _item(5, 1)])  # 3 tokens: a count it has run
    assert executor.last_step_seconds == pytest.approx(0.010)


def test_requests_arriving_together_share_the_first_step():
    """A burst at an idle replica: every request of that instant joins the
    first step, as they all sit in the live engine's inbox when it looks
    (the first once ran alone and the rest waited a whole step: simulated
    TTFT p50 +17% on a bursty trace window)."""
    cost = ShapeCost()
    replica = SimReplica(0, EngineConfig(), 64, cost, VirtualClock(), fast_forward=False)
    records = [RequestRecord(i, 1.0, 20, 2) for i in range(4)]
    for record in records:
        replica.receive(TraceRequest(1.0, 20, 2), record, 1.0)
    while replica.next_time is not None:
        replica.advance(replica.next_time)
    assert [shape.tokens for shape in cost.shapes] == [80, 4]
    assert [r.chunk_times[0] for r in records] == pytest.approx([1.080] * 4)
