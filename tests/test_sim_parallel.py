"""The simulator's cost of a replica over several GPUs: communication priced
as bytes over link bandwidth plus latency per hop, the two-micro-batch
overlap, and one GPU without a split giving today's analytic cost exactly."""
from __future__ import annotations

import argparse
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.executor.shapes import StepShape
from carpool.sim.analytic import HARDWARE, MODELS, AnalyticCostModel
from carpool.sim.parallel import (
    INTERCONNECTS,
    Link,
    ParallelShape,
    allreduce_seconds,
    alltoall_bytes,
    alltoall_seconds,
    overlapped_seconds,
    parse_micro_batches,
)
from carpool.sim.parallel_cost import ParallelCostModel, parallel_from_names

H800 = INTERCONNECTS["h800"]
DSV3 = MODELS["deepseek-v3"]


def _model(ep=1, tp=1, split="off", hardware="h800-fp8", model="deepseek-v3", dtype=1):
    return ParallelCostModel(HARDWARE[hardware], MODELS[model], dtype, 1.0,
                             ParallelShape(tp, ep, split), H800)


shapes = st.builds(
    lambda prefill, decodes, context: StepShape(prefill, decodes, context + decodes,
                                                decodes + (1 if prefill else 0)),
    st.integers(0, 4096), st.integers(0, 2048), st.integers(0, 2_000_000))


def test_link_prices_bytes_over_bandwidth_plus_latency_per_hop():
    link = Link("x", 100e9, 0.5, 1e-5)
    assert link.seconds(50e9, hops=3) == pytest.approx(1.0 + 3e-5)
    assert link.seconds(0, hops=3) == 0.0
    with pytest.raises(ValueError):
        Link("bad", 1e9, 1.5, 0.0)


def test_ring_allreduce_and_all_to_all_split_between_nvlink_and_rdma():
    link = Link("x", 100e9, 1.0, 1e-6)
    # 8 ranks: 2 * 7 / 8 of the buffer in 14 hops
    assert allreduce_seconds(8e9, 8, link) == pytest.approx(14e9 / 100e9 + 14e-6)
    assert allreduce_seconds(8e9, 1, link) == 0.0
    # one node: 7 of 8 copies leave the GPU, over NVLink
    assert alltoall_bytes(2.0, 8, 8, 8) == (14.0, 0.0)
    # two nodes: the token crosses once unless all 8 copies stay home
    intra, inter = alltoall_bytes(2.0, 8, 16, 8)
    assert intra == 14.0 and inter == pytest.approx(2.0 * (1 - 0.5 ** 8))
    # four nodes, one copy: 3/4 of the time it crosses
    assert alltoall_bytes(1.0, 1, 32, 8)[1] == pytest.approx(0.75)
    assert alltoall_bytes(2.0, 8, 1, 8) == (0.0, 0.0)
    both = alltoall_seconds(7e9, 24e9, H800)
    assert both == pytest.approx(max(7e9 / (160e9 * 0.95), 24e9 / (50e9 * 0.9)) + 15e-6)
    assert alltoall_seconds(7e9, 0.0, H800) == pytest.approx(7e9 / (160e9 * 0.95) + 5e-6)


def test_expert_parallel_communication_by_hand():
    cost = _model(ep=16)
    tokens = 4096
    mine = tokens / 16 * 7168  # a GPU's tokens x hidden
    crossing = 1 - 0.5 ** 8  # two nodes: the other one is needed unless all 8 stay
    expected = 0.0
    for size in (1, 2):  # FP8 dispatch, bf16 combine
        intra, inter = mine * size * 8 * 7 / 8, mine * size * crossing
        expected += 58 * (max(intra / (160e9 * 0.95), inter / (50e9 * 0.9)) + 15e-6)
    assert cost.comm_seconds(tokens) == pytest.approx(expected)
    assert cost.comm_bytes(tokens) == pytest.approx((58 * 3 * mine * 7, 58 * 3 * mine * crossing))


def test_tensor_parallel_all_reduces_two_per_layer_over_nvlink():
    cost = _model(tp=8, hardware="h100-sxm", model="llama-3-70b", dtype=2)
    tokens = 1000
    buffer = tokens * 8192 * 2
    per = 2 * 7 / 8 * buffer / (160e9 * 0.95) + 14 * 5e-6
    assert cost.comm_seconds(tokens) == pytest.approx(2 * 80 * per)


@settings(max_examples=60, deadline=None)
@given(shapes, st.sampled_from([("h800-fp8", "deepseek-v3", 1), ("h100-sxm", "llama-3-8b", 2),
                                ("h200", "qwen3-30b-a3b", 2)]))
def test_one_gpu_without_a_split_is_todays_cost_exactly(shape, preset):
    hardware, model, dtype = preset
    today = AnalyticCostModel(HARDWARE[hardware], MODELS[model], dtype)
    for split in ("off", "on", "auto"):  # nothing to overlap on one GPU
        sliced = _model(split=split, hardware=hardware, model=model, dtype=dtype)
        assert sliced.step_seconds(shape) == today.step_seconds(shape)
        assert sliced.decode_step_seconds(shape.seqs, shape.context_tokens) == \
            today.decode_step_seconds(shape.seqs, shape.context_tokens)
    assert _model(hardware=hardware, model=model, dtype=dtype).max_kv_tokens() == \
        today.max_kv_tokens()


def test_parallel_from_names_keeps_todays_model_for_one_gpu():
    plain = parallel_from_names("h100-sxm", "llama-3-8b", ParallelShape())
    assert type(plain) is AnalyticCostModel
    sliced = parallel_from_names("h800-fp8", "deepseek-v3", ParallelShape(1, 16, "auto"), 1)
    assert isinstance(sliced, ParallelCostModel) and sliced.gpus == 16
    with pytest.raises(ValueError, match="whole node"):
        parallel_from_names("8xh200", "deepseek-v3", ParallelShape(8, 1))
    with pytest.raises(ValueError, match="no experts"):
        parallel_from_names("h100-sxm", "llama-3-8b", ParallelShape(1, 8))
    with pytest.raises(ValueError, match="multiple"):
        ParallelShape(4, 6)


@given(st.floats(0, 10), st.floats(0, 10), st.integers(1, 128))
def test_overlap_hides_at_most_the_smaller_of_compute_and_comm(compute, comm, layers):
    step = overlapped_seconds(compute, comm, layers)
    hidden = 2 * compute + 2 * comm - step
    assert step >= max(2 * compute, 2 * comm) - 1e-12
    assert -1e-9 <= hidden <= min(2 * compute, 2 * comm) + 1e-9


@settings(max_examples=80, deadline=None)
@given(shapes, st.sampled_from([(1, 16), (1, 32), (8, 8), (2, 16)]))
def test_auto_split_is_never_slower_and_on_never_exposes_more_than_it_moves(shape, sizes):
    tp, ep = sizes
    if shape.tokens == 0:
        return
    pairs = shape.context_tokens
    off = _model(tp=tp, ep=ep).breakdown(shape.tokens, shape.seqs, shape.context_tokens, pairs)
    auto = _model(tp=tp, ep=ep, split="auto").breakdown(
        shape.tokens, shape.seqs, shape.context_tokens, pairs)
    on = _model(tp=tp, ep=ep, split="on").breakdown(
        shape.tokens, shape.seqs, shape.context_tokens, pairs)
    assert auto.seconds <= off.seconds
    assert off.exposed_s == off.comm_s and not off.split
    assert on.compute_s == off.compute_s and on.comm_s == off.comm_s
    assert 0 <= on.exposed_s
    if on.split:  # the halves' exposed part is at most their communication
        half = _model(tp=tp, ep=ep).comm_seconds(shape.tokens / 2)
        assert on.exposed_s <= 2 * half + 1e-12


def test_two_micro_batches_hide_most_communication_where_both_halves_work():
    cost = _model(ep=16, split="on")
    for batch in (512, 2048, 8192):  # decodes with 2k tokens of context each
        step = cost.breakdown(batch, batch, 2048 * batch, 2048 * batch)
        assert step.split and step.exposed_s <= 0.2 * step.comm_s, batch
    # A memory-bound step reads every weight once per half: the split only
    # pays where the step computes more than it reads (auto then takes it).
    for batch, pays in ((512, False), (8192, True), (16384, True)):
        shape = (batch, batch, 2048 * batch, 2048 * batch)
        on, off = cost.breakdown(*shape), _model(ep=16).breakdown(*shape)
        assert (on.seconds < off.seconds) == pays, batch
        assert _model(ep=16, split="auto").breakdown(*shape).seconds == min(on.seconds,
                                                                           off.seconds)


def test_kv_pool_of_a_sliced_replica():
    ep16 = _model(ep=16)
    free = 80e9 * 0.9 * 16 - ((DSV3.params - DSV3.routed_params) * 16 + DSV3.routed_params)
    assert ep16.max_kv_tokens() == int(free // DSV3.kv_bytes_per_token(1))
    # TP 2: the dense weights once per 8 groups, MLA's one latent on both ranks
    free = 80e9 * 0.9 * 16 - ((DSV3.params - DSV3.routed_params) * 8 + DSV3.routed_params)
    assert _model(tp=2, ep=16).max_kv_tokens() == int(free // (DSV3.kv_bytes_per_token(1) * 2))
    assert _model(ep=8).max_kv_tokens() == 0  # one H800 node holds no FP8 DeepSeek-V3
    assert _model(ep=1, tp=1).max_kv_tokens() == 0  # 671B in FP8 fits no 80 GB GPU


def test_saved_parallel_model_loads_back(tmp_path):
    from carpool.sim.costs import load_cost_model, save_cost_model

    cost = _model(ep=16, tp=2, split="auto")
    loaded = load_cost_model(save_cost_model(cost, tmp_path / "c.json"))
    assert loaded == cost
    shape = StepShape(100, 300, 600_000, 301)
    assert loaded.step_seconds(shape) == cost.step_seconds(shape)


def test_flags_build_the_sliced_model():
    from carpool.sim.cost_flags import add_cost_model_args, cost_model_from_args

    parser = argparse.ArgumentParser()
    add_cost_model_args(parser)
    args = parser.parse_args(["--hardware", "h800-fp8", "--model-shape", "deepseek-v3",
                              "--dtype-bytes", "1", "--sim-expert-parallel-size", "16",
                              "--sim-micro-batches", "2"])
    cost = cost_model_from_args(args)
    assert cost.parallel == ParallelShape(1, 16, "on")
    plain = cost_model_from_args(parser.parse_args(["--hardware", "h100-sxm",
                                                    "--model-shape", "llama-3-8b"]))
    assert type(plain) is AnalyticCostModel
    with pytest.raises(ValueError, match="analytic"):
        cost_model_from_args(parser.parse_args(["--sim-micro-batches", "auto"]))
    assert parse_micro_batches("1") == "off" and parse_micro_batches("AUTO") == "auto"
    with pytest.raises(ValueError):
        parse_micro_batches("3")
    assert dataclasses.replace(cost.parallel, micro_batches="off").trivial is False
