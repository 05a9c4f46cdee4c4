"""``carpool plan``: how many replicas a peak load needs, and what they cost.

Two steps, as capacity planners do it:

1. A first estimate from the seeds' formula (Little's law over a target
   utilisation)::

       replicas0 = ceil(peak QPS x mean processing time
                        / (per-replica capacity x target utilisation))

   mean processing time = mean E2E of the workload's requests simulated one
   at a time on one replica (the low-load limit); per-replica capacity =
   min(max_num_seqs, KV tokens of the pool // mean (input + output) tokens
   per request), the requests one replica holds at once.
2. A simulated search, per batching candidate (max_num_seqs x
   max_num_batched_tokens): ``--window`` seconds of traffic at the peak rate
   run through N simulated replicas (carpool's scheduler on a cost model);
   the upper bound doubles from the estimate until the SLO attainment is
   met, then bisection finds the fewest replicas that meet it. This assumes
   attainment does not fall as replicas are added. The candidate with the
   fewest replicas wins (ties: higher attainment); the answer and answer - 1
   are simulated again (same workload, deterministic: this checks the
   search and keeps their full latency summaries).

The cost line is replicas x price per replica-hour; per 1M output tokens it
divides by the output tokens the answer serves per hour at the peak. The
day-long mode and the text report are in carpool/sim/plan_day.py. Pure
Python: no torch.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from carpool.config import EngineConfig
from carpool.sim.costs import CostModel
from carpool.sim.simulate import SimSettings, simulate
from carpool.workload.stats import summarize
from carpool.workload.traces import TraceRequest

PROCESSING_SAMPLE = 200  # requests simulated one at a time for the mean processing time
_ISOLATION_GAP_S = 3600.0  # virtual seconds between them (free on the virtual clock)
ASSUMED_PRICE = 1.0  # $ per replica-hour when --price-per-hour is not given
WINDOW_PROCESSING_RATIO = 10  # a window shorter than this many processing times gets a note


@dataclass(frozen=True)
class Batching:
    """One batching setting: the running-request limit and the step token budget."""

    max_num_seqs: int
    max_num_batched_tokens: int

    @classmethod
    def parse_list(cls, text: str) -> list[Batching]:
        """``64x512,128x1024`` -> candidates (distinct, in the given order)."""
        out: list[Batching] = []
        for part in (p.strip() for p in text.split(",") if p.strip()):
            match = re.fullmatch(r"([0-9]+)[xX]([0-9]+)", part)
            candidate = cls(int(match[1]), int(match[2])) if match else None
            if candidate is None or min(candidate.max_num_seqs,
                                        candidate.max_num_batched_tokens) < 1:
                raise ValueError(f"batching candidate {part!r} is not SEQSxTOKENS with positive "
                                 f"integers (max_num_seqs x max_num_batched_tokens), e.g. 128x1024")
            if candidate not in out:
                out.append(candidate)
        if not out:
            raise ValueError("no batching candidates given, e.g. 64x512,128x1024")
        return out

    def apply(self, config: EngineConfig) -> EngineConfig:
        """A copy of ``config`` with this batching setting."""
        config = copy.deepcopy(config)
        config.scheduler.max_num_seqs = self.max_num_seqs
        config.scheduler.max_num_batched_tokens = self.max_num_batched_tokens
        return config.validate()

    def __str__(self) -> str:
        return f"{self.max_num_seqs}x{self.max_num_batched_tokens}"


# -- the first estimate -----------------------------------------------------------------


def replica_capacity(max_num_seqs: int, kv_tokens: int, mean_tokens: float) -> int:
    """Requests one replica holds at once: min(max_num_seqs, KV tokens //
    mean tokens per request), at least 1."""
    if mean_tokens <= 0:
        raise ValueError(f"mean tokens per request must be > 0, got {mean_tokens}")
    return max(1, min(max_num_seqs, int(kv_tokens // mean_tokens)))


def estimate_replicas(peak_rate: float, mean_processing_s: float, capacity: int,
                      utilization: float) -> int:
    """ceil(peak_rate x mean_processing_s / (capacity x utilization)), at least 1:
    Little's law gives the requests in flight at the peak; each replica
    should hold ``utilization`` of its capacity of them."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--utilization must be in (0, 1], got {utilization}")
    in_flight = peak_rate * mean_processing_s
    return max(1, math.ceil(in_flight / (capacity * utilization) - 1e-9))


def isolated_run(workload: list[TraceRequest], config: EngineConfig, cost: CostModel,
                 num_blocks: int, settings: SimSettings,
                 sample: int = PROCESSING_SAMPLE) -> list:
    """The first ``sample`` requests of ``workload`` simulated one at a time
    on one replica (their records): far enough apart never to overlap, so
    each E2E is pure processing time."""
    lengths = workload[:sample]
    settings = dataclasses.replace(settings, replicas=1, replica_schedule=(), workers=1)
    gap = _ISOLATION_GAP_S
    while True:
        plan = [dataclasses.replace(r, arrival=i * gap) for i, r in enumerate(lengths)]
        records = simulate(plan, config, cost, num_blocks, settings).records
        longest = max((r.finished - r.sent for r in records if r.finished is not None),
                      default=0.0)
        if longest < gap:
            return records
        gap = 2 * longest  # a slow model: space them further apart


def first_estimate(problem: PeakProblem, config: EngineConfig, utilization: float) -> dict:
    """The formula's inputs and answer for ``config``, plus the SLO attainment
    at low load (if that misses the target, no number of replicas helps)."""
    records = isolated_run(problem.workload, config, problem.cost, problem.num_blocks,
                           problem.settings)
    done = [r for r in records if r.ok]
    processing = sum(r.e2e for r in done) / len(done) if done else math.inf
    workload = problem.workload
    mean_tokens = sum(r.input_len + r.output_len for r in workload) / len(workload)
    kv_tokens = problem.num_blocks * config.cache.block_size
    capacity = replica_capacity(config.scheduler.max_num_seqs, kv_tokens, mean_tokens)
    low_load = summarize(records, 1.0, problem.slo)["slo_attainment"]
    replicas = (estimate_replicas(problem.peak_rate, processing, capacity, utilization)
                if done else None)
    return {"peak_rate": problem.peak_rate, "mean_processing_s": processing if done else None,
            "processing_sample": len(records), "max_num_seqs": config.scheduler.max_num_seqs,
            "kv_tokens": kv_tokens, "mean_tokens_per_request": mean_tokens,
            "capacity": capacity, "utilization": utilization, "replicas": replicas,
            "low_load_attainment": low_load}


# -- the simulated search ---------------------------------------------------------------


class Unreachable(ValueError):
    """No replica count up to the bound meets the SLO."""


@dataclass
class Probe:
    """One simulation at the peak with ``replicas`` replicas."""

    replicas: int
    attainment: float
    goodput: float
    p99_ttft: float | None
    p99_tpot: float | None
    output_tokens: int
    meets: bool
    summary: dict | None = field(default=None, repr=False)  # kept for confirmations only

    def to_dict(self) -> dict:
        """JSON-able; the full summary only where it was kept."""
        data = dataclasses.asdict(self)
        if self.summary is None:
            data.pop("summary")
        return data


@dataclass
class PeakProblem:
    """What every probe shares: the peak workload (``peak_rate`` req/s for
    ``window_s`` s), the cost model and pool, simulation settings (replicas
    set per probe) and the SLO with the share of requests that must meet it."""

    workload: list[TraceRequest]
    peak_rate: float
    window_s: float
    cost: CostModel
    num_blocks: int
    settings: SimSettings
    slo: dict[str, float]
    attainment: float

    def probe(self, config: EngineConfig, replicas: int, keep_summary: bool = False) -> Probe:
        """Simulate the peak window on ``replicas`` replicas of ``config``."""
        settings = dataclasses.replace(self.settings, replicas=replicas, replica_schedule=())
        run = simulate(self.workload, config, self.cost, self.num_blocks, settings)
        summary = summarize(run.records, run.duration, self.slo)
        attainment = summary["slo_attainment"]
        return Probe(replicas, attainment, summary["goodput"], summary["ttft"]["p99"],
                     summary["tpot"]["p99"], summary["output_tokens"],
                     attainment >= self.attainment - 1e-12, summary if keep_summary else None)


def fewest_replicas(probe: Callable[[int], Probe], start: int,
                    max_replicas: int) -> tuple[int, dict[int, Probe]]:
    """The fewest replicas whose probe meets the SLO, and every probe made.

    Doubles from ``start`` until a probe meets it (``Unreachable`` past
    ``max_replicas``), then bisects between the most replicas known to
    miss and the fewest known to meet. Assumes attainment does not fall as
    replicas are added; each count is probed at most once.
    """
    probes: dict[int, Probe] = {}

    def meets(replicas: int) -> bool:
        if replicas not in probes:
            probes[replicas] = probe(replicas)
        return probes[replicas].meets

    lo, hi = 0, min(max(1, start), max_replicas)  # lo: misses (0: none known); hi: to try
    while not meets(hi):
        if hi >= max_replicas:
            raise Unreachable(f"even --max-replicas {max_replicas} replicas meet the SLO for "
                             f"only {probes[hi].attainment:.1%} of requests")
        lo, hi = hi, min(2 * hi, max_replicas)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return hi, probes


def search_candidate(problem: PeakProblem, config: EngineConfig, batching: Batching,
                     utilization: float, max_replicas: int) -> dict:
    """Estimate and search for one batching candidate; ``replicas`` is None
    (with ``unreachable`` saying why) when no count up to ``max_replicas`` meets the SLO."""
    config = batching.apply(config)
    estimate = first_estimate(problem, config, utilization)
    row = {"batching": str(batching), "max_num_seqs": batching.max_num_seqs,
           "max_num_batched_tokens": batching.max_num_batched_tokens,
           "estimate": estimate, "replicas": None, "attainment": None, "probes": []}
    if estimate["low_load_attainment"] < problem.attainment:
        row["unreachable"] = (f"{batching}: even at low load (one request at a time) only "
                              f"{estimate['low_load_attainment']:.1%} of requests meet the SLO; "
                              f"no number of replicas can reach "
                              f"{problem.attainment:.1%}")
        return row
    try:
        answer, probes = fewest_replicas(lambda n: problem.probe(config, n),
                                         estimate["replicas"], max_replicas)
    except Unreachable as exc:
        answer, probes = None, {}
        row["unreachable"] = f"{batching}: {exc}"
    row["probes"] = [probes[n].to_dict() for n in sorted(probes)]
    if answer is not None:
        row.update(replicas=answer, attainment=probes[answer].attainment)
    return row


def cost_line(replicas: int, price_per_hour: float, output_tokens_per_hour: float) -> dict:
    """replicas x price -> $/hour; $/1M output tokens = $/hour over the
    millions of output tokens served per hour (None when none are)."""
    per_hour = replicas * price_per_hour
    millions = output_tokens_per_hour / 1e6
    return {"replicas": replicas, "price_per_replica_hour": price_per_hour,
            "dollars_per_hour": per_hour, "output_tokens_per_hour": output_tokens_per_hour,
            "dollars_per_million_output_tokens": per_hour / millions if millions > 0 else None}


def plan_peak(problem: PeakProblem, config: EngineConfig, candidates: list[Batching],
              utilization: float, max_replicas: int, price_per_hour: float) -> dict:
    """Search every candidate, pick the winner, confirm it, price it (see the
    module docstring); ValueError when no candidate can meet the SLO."""
    rows = [search_candidate(problem, config, batching, utilization, max_replicas)
            for batching in candidates]
    reachable = [i for i, row in enumerate(rows) if row["replicas"] is not None]
    if not reachable:
        raise ValueError("no plan meets the SLO: " + "; ".join(r["unreachable"] for r in rows))
    best = min(reachable, key=lambda i: (rows[i]["replicas"], -rows[i]["attainment"], i))
    chosen = candidates[best].apply(config)
    answer = rows[best]["replicas"]
    confirm = problem.probe(chosen, answer, keep_summary=True)
    below = problem.probe(chosen, answer - 1, keep_summary=True) if answer > 1 else None
    tokens_per_hour = confirm.output_tokens * 3600.0 / problem.window_s
    processing = rows[best]["estimate"]["mean_processing_s"]
    notes = []
    if problem.window_s < WINDOW_PROCESSING_RATIO * processing:
        # Queues of an overloaded replica grow with time: too short a window
        # ends before they show, and the plan comes out optimistic.
        notes.append(f"the window ({problem.window_s:g} s) is under {WINDOW_PROCESSING_RATIO}x "
                     f"the mean processing time ({processing:.2f} s): queues may not have built "
                     f"up; a longer --window gives a safer answer")
    return {"candidates": rows, "notes": notes,
            "answer": {"batching": str(candidates[best]), "replicas": answer,
                       "confirm": confirm.to_dict(),
                       "below": below.to_dict() if below else None,
                       "confirmed": confirm.meets and (below is None or not below.meets)},
            "cost": cost_line(answer, price_per_hour, tokens_per_hour)}
