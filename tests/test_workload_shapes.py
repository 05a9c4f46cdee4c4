"""Generated workloads in the peers' benchmark shapes (carpool.workload.shapes)."""
from __future__ import annotations

import random

from carpool.workload.arrivals import Ramp
from carpool.workload.shapes import (
    AGENT_MAX_CONTEXT,
    LLM_D_TENANTS,
    LLM_D_USERS,
    llm_d_prefix,
    tool_agent,
)
from carpool.workload.spec import WorkloadSpec, describe_workload, plan_workload
from carpool.workload.traces import MOONCAKE_BLOCK_TOKENS


def test_llm_d_prefix_is_750_prompts_on_150_shared_system_prompts():
    requests = llm_d_prefix(3000, random.Random(0))
    assert {(r.input_len, r.output_len) for r in requests} == {(7200, 1000)}
    assert {len(r.hash_ids) for r in requests} == {-(-7200 // MOONCAKE_BLOCK_TOKENS)}
    prompts = {r.hash_ids for r in requests}
    assert 700 < len(prompts) <= LLM_D_TENANTS * LLM_D_USERS  # drawn, nearly all seen
    shared = 6000 // MOONCAKE_BLOCK_TOKENS  # the system prompt's whole blocks
    tenants = {p[:shared] for p in prompts}
    assert len(tenants) == LLM_D_TENANTS
    for tenant in list(tenants)[:10]:  # its users share the system prompt, nothing more
        users = [p for p in prompts if p[:shared] == tenant]
        assert 1 <= len(users) <= LLM_D_USERS
        assert len({p[shared] for p in users}) == len(users)
    other_blocks = [set(p[shared:]) for p in prompts]
    assert sum(map(len, other_blocks)) == len(set().union(*other_blocks))


def test_tool_agent_contexts_grow_turn_by_turn_with_short_outputs():
    requests = tool_agent(2000, random.Random(1))
    assert all(20 <= r.output_len <= 200 for r in requests)
    assert all(r.input_len <= AGENT_MAX_CONTEXT for r in requests)
    system = requests[0].hash_ids[:4000 // MOONCAKE_BLOCK_TOKENS]
    assert all(r.hash_ids[:len(system)] == system for r in requests)
    # Each turn extends an earlier turn of its agent: all but that turn's
    # last (partial) block are its own first blocks.
    by_prefix = {}
    grown = 0
    for r in requests:
        previous = [p for p in by_prefix.values()
                    if p.input_len < r.input_len
                    and r.hash_ids[:p.input_len // MOONCAKE_BLOCK_TOKENS]
                    == p.hash_ids[:p.input_len // MOONCAKE_BLOCK_TOKENS]
                    and p.hash_ids[len(system):len(system) + 1]
                    == r.hash_ids[len(system):len(system) + 1]]
        grown += bool(previous)
        by_prefix[r.hash_ids] = r
    assert grown > 0.8 * len(requests)
    assert sum(r.input_len for r in requests) / len(requests) > 8000  # long contexts


def test_shapes_plan_like_traces_with_a_ramp_and_a_token_scale():
    spec = WorkloadSpec(workload="llm-d-prefix", num_requests=400, rate=3.0,
                        ramp=(Ramp.parse("1x-20x@0+60"),), token_scale=0.1,
                        max_input_len=100_000, max_output_len=100_000)
    plan = plan_workload(spec)
    assert len(plan) == 400 and {(r.input_len, r.output_len) for r in plan} == {(720, 100)}
    offsets = [r.arrival for r in plan]
    assert offsets == sorted(offsets)
    first_gaps = (offsets[50] - offsets[0]) / 50
    last_gaps = (offsets[-1] - offsets[-51]) / 50
    assert first_gaps > 2 * last_gaps  # the rate ramps up
    assert plan == plan_workload(spec)  # seeded
    described = describe_workload(spec, plan=plan)
    assert described["format"] == "shape" and described["path"] is None
    assert described["mooncake_block_tokens"] == 51
