"""Fill under continuous batching (issue 42): the step token budget's and
the sequence slots' occupancy, counted by the engine at every step against
the live knobs, summed over a fleet, carried across the process boundary,
and exported as ``token_budget_fill`` / ``seq_slot_fill``; ``batch_fill_rate``
is the token budget's fill there and keeps its padding meaning under
static / dynamic batching."""
from __future__ import annotations

import dataclasses
import math

import msgspec
import pytest

from carpool.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.stats import EngineCounters, EngineStats, merge_stats
from carpool.engine.wire import Progress, to_front_decoder
from carpool.sampling_params import SamplingParams
from carpool.server.metrics import RateWindow


def _engine(tiny_model_dir, **scheduler) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig.from_dict({
        "model": str(tiny_model_dir), "attention_backend": "torch", "kv_cache_memory": "16MiB",
        **scheduler}))


def _stats(counters: EngineCounters, batching: str = "continuous") -> EngineStats:
    return EngineStats(time=0.0, num_running=0, num_waiting=0, waiting_tokens=0,
                       kv_num_blocks=1, kv_used_blocks=0, prefix_queries=0, prefix_hits=0,
                       num_preemptions=0, counters=counters, rejections={}, sessions={},
                       knobs={}, batching=batching)


def _rates(before: EngineStats, after: EngineStats) -> dict[str, float]:
    window = RateWindow(window_s=10.0)
    window.update(before, now=0.0)
    window.update(after, now=1.0)
    return window.rates()


def test_each_step_counts_the_live_budget_and_slots_it_ran_under(tiny_model_dir):
    engine = _engine(tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request(list(range(5, 25)), params)
    engine.add_request(list(range(30, 40)), params)
    before = engine.stats()
    engine.step()  # both prompts: 30 tokens, 2 sequences
    engine.scheduler.knobs.max_num_batched_tokens = 32  # as the controller moves it
    engine.scheduler.knobs.max_num_seqs = 2
    while engine.has_unfinished:
        engine.step()  # three steps of 2 decodes
    c = engine.counters
    assert c.steps == 4 and c.computed_tokens == 30 + 3 * 2
    assert c.budget_tokens == 64 + 3 * 32
    assert c.seq_slots == 4 + 3 * 2
    assert c.slot_seqs == 4 * 2
    rates = _rates(before, engine.stats())
    assert rates["token_budget_fill"] == pytest.approx(36 / 160)
    assert rates["seq_slot_fill"] == pytest.approx(8 / 10)
    assert rates["batch_fill_rate"] == rates["token_budget_fill"]  # continuous: no padding


def test_a_full_budget_reads_one_and_an_idle_window_reads_nan(tiny_model_dir):
    engine = _engine(tiny_model_dir, max_num_seqs=8, max_num_batched_tokens=16)
    before = engine.stats()
    assert math.isnan(_rates(before, engine.stats())["token_budget_fill"])  # no step ran
    for i in range(3):
        engine.add_request(list(range(40 + i, 80 + i)), SamplingParams(max_tokens=1))
    engine.step()  # 120 prompt tokens wait: the step takes its whole budget
    rates = _rates(before, engine.stats())
    assert engine.counters.computed_tokens == engine.counters.budget_tokens == 16
    assert rates["token_budget_fill"] == 1.0
    # The first prompt's chunk took the whole budget: one of eight slots held.
    assert rates["seq_slot_fill"] == pytest.approx(1 / 8)


def test_static_and_dynamic_batching_keep_the_padding_meaning():
    before = _stats(EngineCounters(), batching="static")
    after = _stats(EngineCounters(steps=4, computed_tokens=300, slot_tokens=400,
                                  budget_tokens=4 * 1024, seq_slots=4 * 8, slot_seqs=4 * 6),
                   batching="static")
    rates = _rates(before, after)
    assert rates["batch_fill_rate"] == pytest.approx(0.75)  # 1 - the padding's share
    assert rates["token_budget_fill"] == pytest.approx(300 / 4096)
    assert rates["seq_slot_fill"] == pytest.approx(0.75)
    continuous = _rates(dataclasses.replace(before, batching="continuous"),
                        dataclasses.replace(after, batching="continuous"))
    assert continuous["batch_fill_rate"] == pytest.approx(300 / 4096)


def test_slots_held_past_a_cut_limit_read_as_full():
    """A request admitted before ``max_num_seqs`` was cut keeps its slot
    (``slot_limit``): more holders than slots is a full batch, never over 1."""
    after = _stats(EngineCounters(steps=2, computed_tokens=10, slot_tokens=10,
                                  budget_tokens=100, seq_slots=4, slot_seqs=6))
    assert _rates(_stats(EngineCounters()), after)["seq_slot_fill"] == 1.0


def test_a_fleet_sums_every_counter():
    fields = [f.name for f in dataclasses.fields(EngineCounters) if f.name != "finished"]
    one = EngineCounters(**{name: i + 1 for i, name in enumerate(fields)})
    merged = merge_stats([_stats(one), _stats(one.copy())]).counters
    assert {name: getattr(merged, name) for name in fields} == \
        {name: 2 * (i + 1) for i, name in enumerate(fields)}


def test_the_counters_cross_the_process_boundary():
    counters = EngineCounters(steps=3, computed_tokens=50, budget_tokens=300, seq_slots=12,
                              slot_seqs=7)
    sent = msgspec.msgpack.encode(Progress(outputs=[], stats=_stats(counters)))
    assert to_front_decoder.decode(sent).stats.counters == counters
    # A snapshot from a worker without the new counters decodes with them at 0.
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(counters))
    for name in ("budget_tokens", "seq_slots", "slot_seqs"):
        del old[name]
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=EngineCounters)
    assert (decoded.steps, decoded.budget_tokens, decoded.slot_seqs) == (3, 0, 0)


def test_the_snapshot_names_the_live_batching_regime(tiny_model_dir):
    """The emergency switch moves a continuous server to static batching:
    the snapshot says so, and batch_fill_rate takes the padding meaning."""
    engine = _engine(tiny_model_dir)
    assert engine.stats().batching == "continuous"
    assert "preferred_batch_size" not in engine.stats().knobs
    engine.scheduler.set_batching("static")
    stats = engine.stats()
    assert stats.batching == "static" and "preferred_batch_size" in stats.knobs
    assert engine.config.scheduler.batching == "continuous"  # the configured one stays
