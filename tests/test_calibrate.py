"""Serve-time latency targets on the tiny model: the start-up measurement,
the rule with its floors, where each target came from, and that offline
engines stay without the controller (they never shed)."""
from __future__ import annotations

import pytest

from carpool.config import EngineConfig
from carpool.engine.calibrate import PRIOR_BATCH, measure_unloaded, prepare_serving
from carpool.engine.llm_engine import LLMEngine
from carpool.sampling_params import SamplingParams
from carpool.slo import (
    CALIBRATION_RUNS,
    FALLBACK_TPOT,
    FALLBACK_TTFT,
    MIN_TPOT_TARGET,
    MIN_TTFT_TARGET,
    TPOT_MULTIPLE,
    TTFT_MULTIPLE,
)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    """One loaded tiny model; each test takes a fresh engine on it."""
    config = EngineConfig.from_dict({"model": str(tiny_model_dir), "attention_backend": "torch",
                                     "kv_cache_memory": "16MiB"})
    return LLMEngine.from_config(config)


def fresh(loaded, **settings) -> LLMEngine:
    config = EngineConfig.from_dict({"model": vars(loaded.config.model),
                                     "cache": vars(loaded.config.cache), **settings})
    return loaded.renewed(config.validate())


def test_measurement_leaves_the_engine_untouched(loaded):
    engine = fresh(loaded)
    free = engine.scheduler.kv.pool.num_free_blocks
    result = measure_unloaded(engine)
    assert 0 < result.ttft < 1.0 and 0 < result.tpot < 1.0
    assert 1 <= result.runs <= CALIBRATION_RUNS and result.prompt_tokens == 128
    assert engine.counters.steps == 0 and not engine.has_unfinished
    assert engine.scheduler.kv.pool.num_free_blocks == free
    assert not engine.scheduler.cost_model.ready  # the probe's steps were its own
    assert engine.stats().prefix_queries == 0


def test_serve_turns_the_controller_on_with_floored_calibrated_targets(loaded):
    engine = fresh(loaded)
    assert engine.scheduler.controller is None  # adaptive: null is off until serve decides
    serving = prepare_serving(engine)
    slo = serving.slo
    assert serving.config.controller.adaptive is True and serving.scheduler.controller
    assert slo.sources == {"ttft": "calibrated", "tpot": "calibrated"}
    # The rule; a 2-layer model answers in milliseconds, so (unless this machine
    # is very busy) its multiples are below the floors.
    assert slo.ttft == max(MIN_TTFT_TARGET, TTFT_MULTIPLE * slo.ttft_unloaded)
    assert slo.tpot == max(MIN_TPOT_TARGET, TPOT_MULTIPLE * slo.tpot_unloaded)
    # Measured targets steer the controller but shed nothing and cap no batch
    # (issue 42): without an operator's SLO arrivals queue up to the bounds.
    assert serving.scheduler.admission.ttft_target is None
    assert serving.scheduler.controller.config.tpot_target == slo.tpot
    assert serving.scheduler.controller.config.batch_limit_by_tpot is False
    assert slo.regime == "queue" and "no operator SLO" in slo.regime_reason
    assert "measured at start-up" in slo.describe() and "admission: queue" in slo.describe()
    stats = serving.stats()
    assert stats.adaptive and stats.slo["ttft_target"] == slo.ttft
    assert stats.slo["sources"]["tpot"] == "calibrated" and "median of 3" in stats.slo["rule"]
    assert serving.counters.steps == 0 and serving.counters.requests_added == 0


def test_explicit_targets_are_kept_and_only_the_rest_is_measured(loaded):
    serving = prepare_serving(fresh(loaded, slo="ttft=700ms"), {"ttft": "flag"})
    assert serving.slo.ttft == pytest.approx(0.7) and serving.slo.sources["ttft"] == "flag"
    assert serving.slo.sources["tpot"] == "calibrated" and serving.slo.tpot_unloaded > 0
    both = prepare_serving(fresh(loaded, controller={"ttft_target": 1.5, "tpot_target": 0.3}))
    assert (both.slo.ttft, both.slo.tpot) == (1.5, 0.3)
    assert both.slo.sources == {"ttft": "config", "tpot": "config"}
    # The operator's targets: admission sheds for the TTFT one, the TPOT one caps the batch.
    assert both.slo.regime == "slo" and both.scheduler.admission.ttft_target == 1.5
    assert both.scheduler.controller.config.batch_limit_by_tpot is True
    # Only a TTFT target: shedding for it; the measured TPOT caps nothing.
    assert serving.slo.regime == "slo"
    assert serving.scheduler.admission.ttft_target == pytest.approx(0.7)
    assert serving.scheduler.controller.config.batch_limit_by_tpot is False
    # The levers set explicitly win over auto either way.
    forced = prepare_serving(fresh(loaded, calibrate=False, shed_on_ttft_target=True,
                                   batch_limit_by_tpot=True))
    assert forced.slo.regime == "slo" and forced.scheduler.admission.ttft_target == FALLBACK_TTFT
    off = prepare_serving(fresh(loaded, calibrate=False, slo="ttft=1s",
                                shed_on_ttft_target=False))
    assert off.slo.regime == "queue" and off.scheduler.admission.ttft_target is None
    assert "shed_on_ttft_target is false" in off.slo.regime_reason
    # Still measured: the serving cost model starts from the probe's steps, a
    # batch of up to 16 sequences among them (a fresh fit on small batches alone
    # overpriced bigger ones and kept the limit small).
    assert both.slo.calibration_seconds is not None
    cost = both.scheduler.admission.cost_model
    assert cost.ready and not cost.steps()  # the prior, not the window
    # Which batch prices higher is the tiny model's timing noise (~2 ms steps:
    # it once fitted a 16-sequence step below a single one); what is checked is
    # that the probe's batched steps are in the prior.
    measured = measure_unloaded(loaded)
    assert max(seqs for _, seqs, _ in measured.steps) == PRIOR_BATCH
    assert cost.num_prior_steps >= PRIOR_BATCH


def test_an_e2e_target_is_kept_live_from_finished_requests(loaded):
    serving = prepare_serving(fresh(loaded, calibrate=False, slo="e2e=2s"))
    assert serving.slo.e2e == 2.0 and serving.slo.sources["e2e"] == "config"
    assert "e2e 2.00 s" in serving.slo.describe() and serving.stats().slo["e2e_target"] == 2.0
    serving.add_request([5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True))
    while serving.has_unfinished:
        serving.step()
    window = serving.scheduler.controller.window
    now = serving.scheduler.clock()
    assert window.outputs.values(now) == [6.0] and 0 < window.e2e.values(now)[0] < 2.0
    assert serving.scheduler.controller.limit_target(
        window.signals(now, waiting=0, waiting_tokens=0, running=0, kv_usage=0.0, busy=0.0,
                       batch_limit=1)) is not None


def test_without_calibration_auto_targets_are_the_fallbacks(loaded):
    serving = prepare_serving(fresh(loaded, calibrate=False))
    assert (serving.slo.ttft, serving.slo.tpot) == (FALLBACK_TTFT, FALLBACK_TPOT)
    assert serving.slo.sources == {"ttft": "fallback", "tpot": "fallback"}


def test_adaptive_false_serves_plainly(loaded):
    engine = fresh(loaded, adaptive=False)
    assert prepare_serving(engine) is engine
    assert engine.slo is None and engine.scheduler.controller is None
    assert not engine.stats().adaptive and engine.stats().slo is None


def test_offline_engines_never_shed_at_the_defaults(loaded):
    engine = fresh(loaded)
    assert engine.scheduler.controller is None and engine.scheduler.admission.ttft_target is None
    for i in range(40):  # far more than the batch: all queue, none is turned away
        engine.add_request([5 + i % 7] * 30, SamplingParams(max_tokens=8, ignore_eos=True))
    done = 0
    while engine.has_unfinished:
        done += sum(o.finished and o.finish_reason == "length" for o in engine.step())
    assert done == 40


def test_a_pool_too_small_for_the_probe_measures_a_shorter_prompt(tiny_model_dir):
    small = LLMEngine.from_config(EngineConfig.from_dict({
        "model": str(tiny_model_dir), "attention_backend": "torch", "num_blocks": 4}))
    result = measure_unloaded(small)  # 4 blocks of 16 tokens: 64 tokens in all
    assert result.prompt_tokens + result.decode_tokens <= 64 and result.ttft > 0
