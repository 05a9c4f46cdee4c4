"""Generated workloads in the shape of the field's own benchmarks.

Each shape yields ``TraceRequest`` lengths at full scale with Mooncake-style
``hash_ids`` (one id per ``MOONCAKE_BLOCK_TOKENS``-token block; equal ids,
equal blocks), so ``--token-scale`` shrinks them as it does a Mooncake trace,
the simulator's caches share exactly the blocks the shape shares, and
``carpool bench serve`` writes prompts whose text repeats where the ids do.
Arrivals come from the workload's arrival process (``--arrival``,
``--rate``, ``--ramp``), as for a trace without timestamps.

- ``llm-d-prefix``: llm-d's prefix-cache benchmark (inference-perf's
  ``shared_prefix`` data): 150 tenants, each a 6,000-token system prompt;
  5 users per tenant, each a 1,200-token question; 1,000-token outputs.
  Every request is one of the 750 (tenant, user) prompts, drawn uniformly:
  a repeat hits the whole prompt, a new user of a known tenant its system
  prompt. llm-d ramps Poisson load from 3 to 60 QPS: ``--rate 3 --ramp
  1x-20x@0+D``.
- ``tool-agent``: agents that call tools: a 4,000-token system prompt with
  the tool schemas (shared by every agent), a 600-token task, then turns
  whose context grows by the last answer (a short tool call, 20 to 200
  tokens) and its tool's result (200 to 2,000 tokens), up to 16 turns or
  32k tokens; 128 agents interleaved. Long, growing prompts with short
  outputs: the prefix each turn shares with the previous one is all but
  its newest blocks.

A system prompt that does not fill whole blocks shares only its whole
blocks (the remainder joins the first block of what follows, which differs
per request), as a paged cache would.
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator

from carpool.workload.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

LLM_D_TENANTS = 150
LLM_D_USERS = 5
LLM_D_SYSTEM_TOKENS = 6000
LLM_D_QUESTION_TOKENS = 1200
LLM_D_OUTPUT_TOKENS = 1000

AGENT_SYSTEM_TOKENS = 4000
AGENT_TASK_TOKENS = 600
AGENT_MAX_TURNS = 16
AGENT_MAX_CONTEXT = 32768
# Agents at work at once: their contexts (up to 4M tokens) outgrow one
# replica's KV (an H100's holds 0.43M for Llama-3-8B), so where each turn
# goes decides whether it finds its history (16 fitted in every replica).
AGENT_CONCURRENT = 128


def _blocks(tokens: int) -> int:
    return -(-tokens // MOONCAKE_BLOCK_TOKENS)


class _Ids:
    """Fresh hash ids, never repeated (``take(n)``: the next n)."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def take(self, count: int) -> tuple[int, ...]:
        return tuple(next(self._next) for _ in range(count))


def llm_d_prefix(count: int, rng: random.Random) -> list[TraceRequest]:
    """``count`` requests of llm-d's prefix-cache benchmark (module docstring)."""
    ids = _Ids()
    shared = LLM_D_SYSTEM_TOKENS // MOONCAKE_BLOCK_TOKENS  # whole blocks only
    prompt_tokens = LLM_D_SYSTEM_TOKENS + LLM_D_QUESTION_TOKENS
    own = _blocks(prompt_tokens) - shared
    tenants = [ids.take(shared) for _ in range(LLM_D_TENANTS)]
    prompts = {(t, u): tenants[t] + ids.take(own)
               for t in range(LLM_D_TENANTS) for u in range(LLM_D_USERS)}
    requests = []
    for _ in range(count):
        key = (rng.randrange(LLM_D_TENANTS), rng.randrange(LLM_D_USERS))
        requests.append(TraceRequest(None, prompt_tokens, LLM_D_OUTPUT_TOKENS, prompts[key]))
    return requests


def _agent_turns(rng: random.Random, system: tuple[int, ...], ids: _Ids
                 ) -> Iterator[TraceRequest]:
    """One agent's turns: each prompt is the previous one, its answer and
    the tool's result; the ids of the blocks it shares with the previous
    turn are the previous turn's (only its last, partial block changes)."""
    context = AGENT_SYSTEM_TOKENS + AGENT_TASK_TOKENS
    hashes = system + ids.take(_blocks(context) - len(system))
    for _ in range(AGENT_MAX_TURNS):
        answer = rng.randint(20, 200)
        yield TraceRequest(None, context, answer, hashes)
        grown = context + answer + rng.randint(200, 2000)
        if grown + 200 > AGENT_MAX_CONTEXT:
            return
        kept = context // MOONCAKE_BLOCK_TOKENS  # whole blocks the next turn shares
        hashes = hashes[:kept] + ids.take(_blocks(grown) - kept)
        context = grown


def tool_agent(count: int, rng: random.Random) -> list[TraceRequest]:
    """``count`` turns of ``AGENT_CONCURRENT`` interleaved agents, each
    replaced by a new one when it ends (module docstring)."""
    ids = _Ids()
    system = ids.take(AGENT_SYSTEM_TOKENS // MOONCAKE_BLOCK_TOKENS)
    agents = [_agent_turns(rng, system, ids) for _ in range(AGENT_CONCURRENT)]
    requests: list[TraceRequest] = []
    while len(requests) < count:
        slot = rng.randrange(len(agents))
        turn = next(agents[slot], None)
        if turn is None:
            agents[slot] = _agent_turns(rng, system, ids)
            continue
        requests.append(turn)
    return requests


SHAPES: dict[str, Callable[[int, random.Random], list[TraceRequest]]] = {
    "llm-d-prefix": llm_d_prefix, "tool-agent": tool_agent}
