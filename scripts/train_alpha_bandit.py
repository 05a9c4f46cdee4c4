"""Train the alpha bandit in the simulator, and evaluate it against the
fixed rule on surges it did not train on (issue 42, item 3).

    python scripts/train_alpha_bandit.py train [--out carpool/scheduler/data/alpha_prior.json]
    python scripts/train_alpha_bandit.py evaluate [--prior FILE]
    python scripts/train_alpha_bandit.py oracle

Both run carpool's scheduler and adaptive controller on the simulator's
virtual clock (``carpool.sim.simulate``) with the default cost model (the
development machine's measured one), continuous batching, an operator's
TTFT and TPOT target (set from the cost model's unloaded TTFT / TPOT by the
start-up rule, so alpha's demand term is live), and 100-token prompts with
48-token outputs under Poisson load at 0.6x capacity with a surge.

``train`` runs the bandit through TRAIN_SURGES x TRAIN_SEEDS one after the
other, each run starting from the table the run before left (the table is
taken from the run's controller), and writes the final table (the prior
``AlphaBandit`` can start from).
``evaluate`` runs the rule and the trained bandit on EVAL_SURGES x
EVAL_SEEDS (other shapes and seeds) and prints goodput (requests within
both targets per second) side by side, then their ratio over all runs.
``oracle`` bounds what any alpha policy could gain on those runs: it pins
alpha at each of FIXED_ALPHAS for the whole run and prints the best of them
per run (chosen in hindsight, so no policy that keeps alpha fixed can do
better) against the rule.
Deterministic: seeded arrivals, virtual time.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from carpool.config import EngineConfig
from carpool.scheduler import alpha_policy
from carpool.sim.cost_flags import DEFAULT_COST_MODEL, pool_blocks
from carpool.sim.costs import StepShape, load_cost_model
from carpool.sim.simulate import simulate
from carpool.slo import CALIBRATION_PROMPT_TOKENS, calibrated_targets
from carpool.workload.command import add_workload_args, workload_spec
from carpool.workload.spec import plan_workload
from carpool.workload.stats import phase_summaries

TRAIN_SURGES = ("3x@30+30", "2x@20+40", "4x@30+20")
TRAIN_SEEDS = (101, 102, 103, 104)
EVAL_SURGES = ("3x@30+45", "2.5x@20+30")
EVAL_SEEDS = (1, 2, 3, 4)
CALM_RATE_SHARE = 0.6
FIXED_ALPHAS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0)


def plan(rate: float, surge: str, seed: int):
    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    factor, rest = surge.split("x@")
    start, length = (float(x) for x in rest.split("+"))
    total = int(rate * (2 * start + float(factor) * length))
    args = parser.parse_args(["--input-len", "100", "--output-len", "48", "--seed", str(seed),
                              "--rate", f"{rate:.3f}", "--surge", surge,
                              "--num-requests", str(total)])
    return plan_workload(workload_spec(args))


def scenario(batching: str, scale: float):
    """(cost model, targets, calm rate): the targets by the start-up rule
    (times ``scale``), the rate 0.6x the plain server's capacity under them
    (0.5 req/s grid) under ``batching``."""
    cost = load_cost_model(DEFAULT_COST_MODEL)
    prompt = CALIBRATION_PROMPT_TOKENS
    ttft, tpot = calibrated_targets(
        cost.step_seconds(StepShape(prompt, 0, prompt, 1, prompt * prompt)),
        cost.decode_step_seconds(1, prompt + 8))
    slo = {"ttft": ttft * scale, "tpot": tpot * scale}
    ttft, tpot = slo["ttft"], slo["tpot"]
    config = EngineConfig.from_dict({"adaptive": False, "batching": batching}).validate()
    capacity, rate = 0.0, 0.5
    while rate < 100:
        steady = plan(rate, "1x@30+30", 7)  # 90 s at one rate
        run = simulate(steady, config, cost, pool_blocks(config, cost, False))
        whole = phase_summaries(run.records, [], slo)[0]
        if whole["ttft"]["p99"] > ttft or whole["tpot"]["p99"] > tpot:
            break
        capacity, rate = rate, rate + 0.5
    return cost, slo, CALM_RATE_SHARE * max(capacity, 0.5)


def run_once(cost, slo, rate, surge, seed, policy, batching, prior=None):
    """Goodput of one simulated run, and the table its bandit ended with."""
    controls = []
    original = alpha_policy.AlphaControl.__init__

    def capture(self, policy, hold, prior_table=None):  # the prior in, the table out
        original(self, policy, hold, prior if prior_table is None else prior_table)
        controls.append(self)

    settings = {"adaptive": True, "ttft_target": slo["ttft"], "tpot_target": slo["tpot"],
                "alpha_policy": policy, "batching": batching}
    config = EngineConfig.from_dict(settings).validate()
    alpha_policy.AlphaControl.__init__ = capture
    try:
        run = simulate(plan(rate, surge, seed), config, cost, pool_blocks(config, cost, False))
    finally:
        alpha_policy.AlphaControl.__init__ = original
    whole = phase_summaries(run.records, [], slo)[0]
    bandit = controls[-1].bandit if controls else None
    return whole["goodput"], (bandit.table() if bandit is not None else None)


def train(out: Path, batching: str, scale: float) -> None:
    cost, slo, rate = scenario(batching, scale)
    print(f"targets {slo}, calm rate {rate:.2f} req/s")
    table = {}
    for surge in TRAIN_SURGES:
        for seed in TRAIN_SEEDS:
            goodput, table = run_once(cost, slo, rate, surge, seed, "bandit", batching, table)
            print(f"train {surge} seed {seed}: goodput {goodput:.3f}/s")
    out.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")


def evaluate(prior_path: Path | None, batching: str, scale: float) -> None:
    cost, slo, rate = scenario(batching, scale)
    prior = {} if prior_path is None else json.loads(prior_path.read_text(encoding="utf-8"))
    print(f"targets {slo}, calm rate {rate:.2f} req/s, {batching}, prior {prior_path}")
    totals = {"rule": 0.0, "bandit": 0.0}
    for surge in EVAL_SURGES:
        for seed in EVAL_SEEDS:
            rule, _ = run_once(cost, slo, rate, surge, seed, "rule", batching)
            bandit, _ = run_once(cost, slo, rate, surge, seed, "bandit", batching, prior)
            totals["rule"] += rule
            totals["bandit"] += bandit
            print(f"eval {surge} seed {seed}: goodput rule {rule:.3f}/s, bandit {bandit:.3f}/s "
                  f"({bandit / rule:.3f}x)")
    print(f"all held-out runs: bandit / rule goodput {totals['bandit'] / totals['rule']:.3f}x")


def run_pinned(cost, slo, rate, surge, seed, batching, alpha: float) -> float:
    """Goodput of one simulated run with alpha held at ``alpha`` throughout."""
    original_init = alpha_policy.AlphaControl.__init__
    original_update = alpha_policy.AlphaControl.update

    def pinned_init(self, policy, hold, prior=None):
        original_init(self, policy, hold, prior)
        self.value = alpha

    alpha_policy.AlphaControl.__init__ = pinned_init
    alpha_policy.AlphaControl.update = lambda self, *args, **kwargs: None
    try:
        settings = {"adaptive": True, "ttft_target": slo["ttft"], "tpot_target": slo["tpot"],
                    "alpha_policy": "rule", "batching": batching}
        config = EngineConfig.from_dict(settings).validate()
        run = simulate(plan(rate, surge, seed), config, cost, pool_blocks(config, cost, False))
    finally:
        alpha_policy.AlphaControl.__init__ = original_init
        alpha_policy.AlphaControl.update = original_update
    return phase_summaries(run.records, [], slo)[0]["goodput"]


def oracle(batching: str, scale: float) -> None:
    cost, slo, rate = scenario(batching, scale)
    print(f"targets {slo}, calm rate {rate:.2f} req/s, {batching}, alphas {FIXED_ALPHAS}")
    totals = {"rule": 0.0, "best": 0.0}
    for surge in EVAL_SURGES:
        for seed in EVAL_SEEDS:
            rule, _ = run_once(cost, slo, rate, surge, seed, "rule", batching)
            pinned = {a: run_pinned(cost, slo, rate, surge, seed, batching, a)
                      for a in FIXED_ALPHAS}
            best = max(pinned, key=pinned.get)
            totals["rule"] += rule
            totals["best"] += pinned[best]
            row = ", ".join(f"{a:g}: {g:.3f}" for a, g in pinned.items())
            print(f"oracle {surge} seed {seed}: rule {rule:.3f}/s | pinned {row} | best "
                  f"alpha {best:g} ({pinned[best] / rule:.3f}x rule)")
    print(f"all held-out runs: best pinned alpha in hindsight / rule goodput "
          f"{totals['best'] / totals['rule']:.3f}x")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("train", "evaluate", "oracle"))
    parser.add_argument("--out", type=Path, default=Path("alpha_prior.json"))
    parser.add_argument("--prior", type=Path, default=None,
                        help="evaluate: the trained table (default: none, the untrained bandit)")
    parser.add_argument("--batching", default="continuous",
                        choices=("continuous", "dynamic", "static"))
    parser.add_argument("--target-scale", type=float, default=1.0,
                        help="the start-up rule's targets times this")
    args = parser.parse_args(argv)
    if args.command == "train":
        train(args.out, args.batching, args.target_scale)
    elif args.command == "oracle":
        oracle(args.batching, args.target_scale)
    else:
        evaluate(args.prior, args.batching, args.target_scale)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
