"""The surge goals (issue 42, item 2), checked on two ``carpool bench
serve`` results of one surge schedule: ``plain.json`` (``carpool serve
--adaptive false``) and ``adaptive.json`` (``carpool serve`` with an
operator's ``--slo``), judged by that SLO.

    python scripts/surge_verdict.py plain.json adaptive.json [capacity.json]

Per phase (calm / surge / calm, by send time) it prints TTFT p99 and TPOT
p99 of the admitted requests, the rejected share and goodput of both, and
checks, for the adaptive server:

- admitted TTFT p99 within the operator's TTFT target in every phase, and in
  the surge within 2x the first calm phase's;
- in the surge, rejected share <= the excess over capacity + 2 points;
- nothing lost: no request failed (timeouts, broken streams, 5xx other
  than a 503 rejection) in any phase;
- calm phases: no rejection. The calm after a surge counts its rejections
  from ``backlog_until`` (``phase_summaries``: the surge's last admitted
  request's first token, checked to come within the TTFT target): arrivals
  before it queue behind what the surge left.

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
passes, 1 otherwise, and 2 (void) when, with ``capacity.json``, the plain
server missed the SLO on the calm-1 requests it finished before the surge:
the machine was slower than when the capacity was measured
(``speed_kept``).
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


def surge_excess(plain: dict, surge: dict, capacity: dict | None) -> tuple[float, str]:
    """The share of the surge's offered load over capacity, and its basis."""
    offered = surge["offered_rate"]
    served = saturated_rate(plain, surge["start"], surge["end"])
    excess = max(0.0, 1 - served / offered)
    basis = f"plain served {served:.2f}/s"
    if capacity is not None:
        missed = capacity["slo_capacity_below"]
        basis = (f"the plain server missed the SLO at {missed:.2f}/s; over what it "
                 f"served: {excess:.1%}")
        excess = max(0.0, 1 - missed / offered)
    return excess, basis


def _print_phase(base: dict, ours: dict) -> None:
    goodput = ("-" if not base["goodput"] else f"{ours['goodput'] / base['goodput']:.2f}x")
    print(f"{ours['phase']:<12} offered {ours['offered_rate']:.2f}/s | "
          f"plain: TTFT p99 {_ms(_p99(base, 'ttft'))}, TPOT p99 {_ms(_p99(base, 'tpot'))}, "
          f"rejected {base['rejected_share']:.1%}, goodput {base['goodput']:.2f}/s | "
          f"adaptive: TTFT p99 {_ms(_p99(ours, 'ttft'))}, TPOT p99 "
          f"{_ms(_p99(ours, 'tpot'))}, rejected {ours['rejected_share']:.1%}, goodput "
          f"{ours['goodput']:.2f}/s ({goodput} plain)")


def verdict(plain: dict, adaptive: dict, capacity: dict | None = None,
            ) -> list[tuple[str, bool]]:
    slo = adaptive["summary"]["slo"]
    checks = []
    calm_ttft = _p99(adaptive["phases"][0], "ttft")
    for base, ours in zip(plain["phases"], adaptive["phases"]):
        _print_phase(base, ours)
        name, ttft = ours["phase"], _p99(ours, "ttft")
        checks.append((f"{name}: TTFT p99 {_ms(ttft)} <= target {_ms(slo['ttft'])}",
                       ttft is not None and ttft <= slo["ttft"]))
        checks.append((f"{name}: nothing lost ({ours['failed']} failed)", ours["failed"] == 0))
        if name.startswith("surge"):
            checks.append((f"{name}: TTFT p99 {_ms(ttft)} <= 2x the calm phase's "
                           f"{_ms(calm_ttft)}", None not in (ttft, calm_ttft)
                           and ttft <= 2 * calm_ttft))
            excess, basis = surge_excess(plain, ours, capacity)
            checks.append((f"{name}: rejected {ours['rejected_share']:.1%} <= excess "
                           f"{excess:.1%} + 2 points ({basis})",
                           ours["rejected_share"] <= excess + 0.02))
            continue
        after = ours.get("rejected_after_backlog", ours["rejected"])
        backlog = ours.get("backlog_until", ours["start"]) - ours["start"]
        checks.append((f"{name}: no rejections after the backlog of the phase before "
                       f"({after}; {ours['rejected'] - after} in its first {backlog:.1f} s)",
                       after == 0))
        if backlog > 0:  # the surge's admitted requests kept their promise
            checks.append((f"{name}: the backlog cleared within the TTFT target "
                           f"({backlog:.2f} s <= {slo['ttft']:.2f} s)", backlog <= slo["ttft"]))
    return checks


def _nearest_rank(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, -(-len(ordered) * share // 1) - 1))]


def speed_kept(plain: dict) -> tuple[str, bool]:
    """Whether the machine ran the surge at the speed its capacity was
    measured at: the calm rate is 0.6x the capacity the plain server showed
    within the SLO, so its calm-1 requests that finished before the surge
    began (later ones decode through the surge on a server that admits it
    all) keep the SLO unless the machine got slower since. A run where they
    do not is void, not evidence either way: the excess it would be judged
    by belongs to another machine speed."""
    slo, calm, surge = plain["summary"]["slo"], plain["phases"][0], plain["phases"][1]
    done = [r for r in plain["requests"]
            if r["status"] == "ok" and r["sent"] is not None and r["finished"] is not None
            and calm["start"] <= r["sent"] and r["finished"] < surge["start"]]
    if not done:
        return "no calm-1 request of the plain server finished before the surge", False
    ttft = _nearest_rank([r["ttft"] for r in done], 0.99)
    tpots = [r["tpot"] for r in done if r["tpot"] is not None]
    tpot = _nearest_rank(tpots, 0.99) if tpots else None
    ok = ttft <= slo["ttft"] and (tpot is None or "tpot" not in slo or tpot <= slo["tpot"])
    return (f"the plain server's {len(done)} calm-1 requests done before the surge: TTFT "
            f"p99 {_ms(ttft)}, TPOT p99 {_ms(tpot)}, within the SLO", ok)


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        return 2
    plain, adaptive, *capacity = (json.loads(open(path, encoding="utf-8").read())
                                  for path in argv)
    checks = verdict(plain, adaptive, capacity[0] if capacity else None)
    for text, ok in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {text}")
    speed, kept = speed_kept(plain)
    if capacity and not kept:
        print(f"  VOID  the machine was slower than when the capacity was measured ({speed}: "
              f"no); run it again")
        return 2
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
