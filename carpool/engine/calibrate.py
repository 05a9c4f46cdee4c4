"""Serve-time latency targets: from the command line and config, or measured.

``prepare_serving`` runs once in ``carpool serve``, after the model loaded
and before the server listens. It turns ``adaptive: null`` on, and for each
target still ``auto`` it measures this model on this machine
(``measure_unloaded``) and applies the rule of ``carpool.slo``: the targets
are stated multiples of the unloaded TTFT and TPOT, with floors.

The measurement runs on a throw-away engine that shares the model and the
executor (``LLMEngine.renewed``) with prefix caching off and the controller
off, so the serving engine starts with fresh counters, an empty prefix
cache and estimators that never saw the probe; the probe itself is a
warm-up request of the measured shape (first calls pay one-off costs:
kernel selection, allocations), then ``CALIBRATION_RUNS`` requests one at
a time, each with its own prompt; the medians are the unloaded values.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass

from carpool.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.sampling_params import SamplingParams
from carpool.slo import (
    AUTO,
    CALIBRATED_METRICS,
    CALIBRATION_DECODE_TOKENS,
    CALIBRATION_PROMPT_TOKENS,
    CALIBRATION_RUNS,
    FALLBACK_TPOT,
    FALLBACK_TTFT,
    ServingSLO,
    calibrated_targets,
)

# Measured runs stop once this many seconds went into the measurement (at
# least one run is measured): a large model on a CPU still starts quickly.
CALIBRATION_BUDGET_S = 10.0


@dataclass(frozen=True)
class Calibration:
    """Median unloaded TTFT and TPOT (seconds) over ``runs`` requests."""

    ttft: float
    tpot: float
    runs: int
    seconds: float  # wall time of the whole measurement, warm-up included
    prompt_tokens: int
    decode_tokens: int
    # Every step the probe engine ran (tokens, seqs, seconds), the batched
    # probe's included: the serving engine's cost model keeps them as a prior.
    steps: tuple[tuple[int, int, float], ...] = ()


def measure_unloaded(engine: LLMEngine, prompt_tokens: int = CALIBRATION_PROMPT_TOKENS,
                     decode_tokens: int = CALIBRATION_DECODE_TOKENS,
                     runs: int = CALIBRATION_RUNS,
                     budget_s: float = CALIBRATION_BUDGET_S) -> Calibration:
    """TTFT and TPOT of requests run one at a time on an idle engine
    (``engine`` itself is left untouched; see the module docstring)."""
    started = time.perf_counter()
    probe = engine.renewed(_probe_config(engine.config))
    decode_tokens = max(2, min(decode_tokens, engine.max_model_len // 2))
    prompt_tokens = max(1, min(prompt_tokens, engine.max_model_len - decode_tokens))
    while prompt_tokens > 1 and not probe.scheduler.kv.can_ever_fit(prompt_tokens + decode_tokens):
        prompt_tokens //= 2  # a tiny KV pool: a shorter probe rather than no server
    _run_one(probe, _prompt(engine, prompt_tokens, 0), decode_tokens)  # warm-up
    ttfts, tpots = [], []
    for run in range(1, runs + 1):
        ttft, tpot = _run_one(probe, _prompt(engine, prompt_tokens, run), decode_tokens)
        ttfts.append(ttft)
        tpots.append(tpot)
        if time.perf_counter() - started > budget_s:
            break
    _run_batch(probe, decode_tokens)
    return Calibration(statistics.median(ttfts), statistics.median(tpots), len(ttfts),
                       time.perf_counter() - started, prompt_tokens, decode_tokens,
                       tuple(probe.scheduler.admission.cost_model.steps()))


# The batched probe: this many short requests decoding together, so the
# prior holds steps of a real batch next to the single runs' ones.
PRIOR_BATCH = 16
PRIOR_PROMPT_TOKENS = 16


def _run_batch(engine: LLMEngine, decode_tokens: int) -> None:
    """PRIOR_BATCH requests at once, as many as the pool and limit allow."""
    batch = min(PRIOR_BATCH, engine.config.scheduler.max_num_seqs)
    params = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    for run in range(batch):
        prompt = _prompt(engine, PRIOR_PROMPT_TOKENS, 100 + run)
        if not engine.scheduler.kv.can_ever_fit((run + 1) * (len(prompt) + decode_tokens)):
            break  # the whole batch so far must fit the pool at once
        engine.add_request(prompt, params)
    while engine.has_unfinished:
        engine.step()


def _probe_config(config: EngineConfig) -> EngineConfig:
    """The serving settings, run plainly: continuous batching, no controller,
    no prefix cache (every run must compute its whole prompt)."""
    return dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, enable_prefix_caching=False),
        scheduler=dataclasses.replace(config.scheduler, batching="continuous", padding=None),
        controller=dataclasses.replace(config.controller, adaptive=False))


def _prompt(engine: LLMEngine, length: int, run: int) -> list[int]:
    """``length`` ordinary token ids, different for every ``run``."""
    vocab = engine.model_config.vocab_size
    special = set(engine.tokenizer.all_special_ids) | set(engine.model_config.eos_token_ids)
    ids, step, token = [], 7919 + 2 * run, 101 + 37 * run
    while len(ids) < length:
        token = (token + step) % vocab
        if token not in special:
            ids.append(token)
    return ids


def _run_one(engine: LLMEngine, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    engine.add_request(prompt, SamplingParams(max_tokens=decode_tokens, temperature=0.0,
                                              ignore_eos=True))
    final = None
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                final = output
    if final is None or final.first_token_time is None or final.finish_reason != "length":
        raise RuntimeError(f"the calibration request did not complete ({final!r})")
    ttft = final.first_token_time - final.arrival_time
    tpot = (final.finish_time - final.first_token_time) / (decode_tokens - 1)
    return ttft, tpot


def prepare_serving(engine: LLMEngine, sources: dict[str, str] | None = None,
                    log=None) -> LLMEngine:
    """The engine ``carpool serve`` runs: the controller on unless the
    settings say ``adaptive: false``, with every target resolved
    (``resolve_targets``) and recorded as ``engine.slo``. Returns ``engine``
    itself when the controller stays off."""
    config = engine.config
    config.controller.resolve_adaptive(serving=True)
    if not config.controller.adaptive:
        return engine
    # Measured even when every target is explicit: the serving cost model
    # keeps the probe's steps as its prior (``StepCostModel.add_prior``).
    measured = None
    if config.controller.calibrate and engine.kernels_pending:
        # The portable path's step costs, measured while a compiler competes
        # for the cores, say nothing of the engine once it switches: and the
        # measurement would hold the first start back by a minute or more.
        if log is not None:
            log("carpool: skipping the start-up measurement while the CPU kernels compile: "
                "fallback latency targets for auto (--slo to set them)")
    elif config.controller.calibrate:
        if log is not None:
            auto = config.controller.auto_targets
            log("carpool: measuring the unloaded TTFT / TPOT and a batch's step costs ("
                + (f"targets for {' and '.join(auto)}; " if auto else "")
                + "--calibrate false skips this)...")
        measured = measure_unloaded(engine)
    slo = _resolve(config.controller, measured, sources or {})
    serving = engine.renewed(config)  # the controller built with the resolved targets
    serving.slo = slo
    if measured is not None:
        serving.scheduler.admission.cost_model.add_prior(measured.steps)
    return serving


def resolve_targets(engine: LLMEngine, sources: dict[str, str] | None = None,
                    log=None) -> ServingSLO:
    """Replace every ``auto`` target of ``engine.config.controller``: measured
    on ``engine`` and calibrated (unless ``calibrate: false``: the
    fallbacks); explicit ones stay. ``sources`` names where explicit targets
    came from (``{"ttft": "flag"}``; others say ``config``); ``log`` gets a
    line before a measurement."""
    return _resolve(engine.config.controller, _measure_if_auto(engine, log), sources or {})


def _measure_if_auto(engine: LLMEngine, log=None) -> Calibration | None:
    """``measure_unloaded`` when a target is ``auto`` and calibration is on."""
    controller = engine.config.controller
    auto = controller.auto_targets
    if not (auto and controller.calibrate):
        return None
    if log is not None:
        log(f"carpool: measuring the unloaded TTFT / TPOT for the latency targets "
            f"({' and '.join(auto)}; --slo or --calibrate false skips this)...")
    return measure_unloaded(engine)


def _resolve(controller, measured: Calibration | None, sources: dict[str, str]) -> ServingSLO:
    """Set each target of ``controller`` and say where it came from."""
    controller.resolve_levers()  # before measured targets replace "auto"
    calibrated = (calibrated_targets(measured.ttft, measured.tpot)
                  if measured is not None else None)
    fallback = {"ttft": FALLBACK_TTFT, "tpot": FALLBACK_TPOT}
    origin = {}
    for index, metric in enumerate(CALIBRATED_METRICS):
        name = f"{metric}_target"
        if getattr(controller, name) != AUTO:
            origin[metric] = sources.get(metric, "config")
        elif calibrated is not None:
            setattr(controller, name, calibrated[index])
            origin[metric] = "calibrated"
        else:
            setattr(controller, name, fallback[metric])
            origin[metric] = "fallback"
    if controller.e2e_target is not None:
        origin["e2e"] = sources.get("e2e", "config")
    return ServingSLO(controller.ttft_target, controller.tpot_target, origin,
                      measured.ttft if measured else None, measured.tpot if measured else None,
                      measured.seconds if measured else None,
                      regime=controller.regime, regime_reason=_regime_reason(controller, origin),
                      e2e=controller.e2e_target)


def _regime_reason(controller, origin: dict[str, str]) -> str:
    """Why admission sheds or only queues (the start-up line, /carpool/policy)."""
    if controller.regime == "slo":
        return (f"the TTFT target is the operator's ({origin.get('ttft', 'config')}): "
                "the controller keeps the targets and arrivals predicted to miss the TTFT "
                "target are answered 429 + Retry-After")
    if controller.shed_on_ttft_target is False and controller.ttft_target is not None \
            and origin.get("ttft") in ("flag", "config"):
        return "shed_on_ttft_target is false: nothing is shed for the TTFT target"
    return ("no operator SLO: the controller steers the batching by these targets, "
            "arrivals queue up to the queue bounds and nothing is shed for a target "
            "(--slo sets one)")


def print_log(message: str) -> None:
    """Progress lines of ``prepare_serving`` go to stderr, as the loader's do."""
    print(message, file=sys.stderr, flush=True)
