"""Issue 14's goals, checked on two ``carpool bench serve`` results of one
surge schedule: ``plain.json`` (``carpool serve --adaptive false``) and
``adaptive.json`` (default ``carpool serve``), judged by the same ``--slo``.

    python scripts/surge_verdict.py plain.json adaptive.json [capacity.json]

Per phase (calm / surge / calm, by send time) it prints TTFT p99 and TPOT
p99 of the admitted requests, the rejected share and goodput of both, and
checks: adaptive TTFT and TPOT p99 within the SLO in every phase; in the
surge, rejected share <= excess + 1% and goodput >= 1.3x plain; in the calm
phases no rejection and goodput >= 0.98x plain. The calm after a surge
counts its rejections from ``backlog_until`` (``phase_summaries``: the
surge's last admitted request's first token, checked to come within the TTFT
target): arrivals before it queue behind what the surge left.

The excess is 1 - capacity / offered in the surge, for the capacity under
the SLO: what cannot be served in time is what must be turned away. Without
``capacity.json`` the capacity is the plain server's completions per second
while the surge lasts (by finish time): that server turns nobody away and
is saturated then, so it is its maximum throughput, an upper bound of the
capacity under the SLO, and the excess it gives a lower bound of the real
one (strict). With it (``surge_compare.sh`` writes it from its probes), the
capacity is ``slo_capacity_below``: the lowest Poisson rate at which the
plain server missed the SLO, still an upper bound of the capacity under the
SLO, closer to it. Both excesses are printed. Exits 0 when every check
passes, 1 otherwise.
"""
from __future__ import annotations

import json
import sys


def _p99(phase: dict, metric: str) -> float | None:
    return (phase.get(metric) or {}).get("p99")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def saturated_rate(result: dict, start: float, end: float) -> float:
    """Completions per second with their finish inside [start, end)."""
    done = [r for r in result["requests"]
            if r["status"] == "ok" and r["finished"] is not None and start <= r["finished"] < end]
    return len(done) / max(end - start, 1e-9)


def verdict(plain: dict, adaptive: dict, capacity: dict | None = None,
            ) -> list[tuple[str, bool]]:
    slo = adaptive["summary"]["slo"]
    checks = []
    phases = zip(plain["phases"], adaptive["phases"])
    for base, ours in phases:
        name = ours["phase"]
        print(f"{name:<12} offered {ours['offered_rate']:.2f}/s | "
              f"plain: TTFT p99 {_ms(_p99(base, 'ttft'))}, TPOT p99 {_ms(_p99(base, 'tpot'))}, "
              f"rejected {base['rejected_share']:.1%}, goodput {base['goodput']:.2f}/s | "
              f"adaptive: TTFT p99 {_ms(_p99(ours, 'ttft'))}, TPOT p99 "
              f"{_ms(_p99(ours, 'tpot'))}, rejected {ours['rejected_share']:.1%}, goodput "
              f"{ours['goodput']:.2f}/s")
        for metric in ("ttft", "tpot"):
            value = _p99(ours, metric)
            checks.append((f"{name}: {metric} p99 {_ms(value)} <= {_ms(slo[metric])}",
                           value is not None and value <= slo[metric]))
        ratio = ours["goodput"] / base["goodput"] if base["goodput"] else float("inf")
        if name.startswith("surge"):
            offered = ours["offered_rate"]
            served = saturated_rate(plain, ours["start"], ours["end"])
            excess = max(0.0, 1 - served / offered)
            basis = f"plain served {served:.2f}/s"
            if capacity is not None:
                missed = capacity["slo_capacity_below"]
                basis = (f"the plain server missed the SLO at {missed:.2f}/s; over what it "
                         f"served: {excess:.1%}")
                excess = max(0.0, 1 - missed / offered)
            checks.append((f"{name}: rejected {ours['rejected_share']:.1%} <= excess "
                           f"{excess:.1%} + 1% ({basis})",
                           ours["rejected_share"] <= excess + 0.01))
            checks.append((f"{name}: goodput {ratio:.2f}x plain >= 1.3x", ratio >= 1.3))
        else:
            after = ours.get("rejected_after_backlog", ours["rejected"])
            backlog = ours.get("backlog_until", ours["start"]) - ours["start"]
            checks.append((f"{name}: no rejections after the backlog of the phase before "
                           f"({after}; {ours['rejected'] - after} in its first {backlog:.1f} s)",
                           after == 0))
            if backlog > 0:  # the surge's admitted requests kept their promise
                checks.append((f"{name}: the backlog cleared within the TTFT target "
                               f"({backlog:.2f} s <= {slo['ttft']:.2f} s)", backlog <= slo["ttft"]))
            checks.append((f"{name}: goodput {ratio:.2f}x plain >= 0.98x", ratio >= 0.98))
    return checks


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        return 2
    plain, adaptive, *capacity = (json.loads(open(path, encoding="utf-8").read())
                                  for path in argv)
    checks = verdict(plain, adaptive, capacity[0] if capacity else None)
    for text, ok in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {text}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
