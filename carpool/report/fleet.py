"""The fleet part of a simulated run's report: its cost, each replica, and
each pool over time (replicas, queue, utilisation, prefix hit rate), read
from the result's ``simulation`` section (carpool/sim/timeline.py)."""
from __future__ import annotations

import html
from pathlib import Path

from carpool.report.run import _img, _save, html_table, new_figure

_PANELS = (("replicas", "replicas taking requests"), ("waiting", "waiting requests (sum)"),
           ("busy", "utilisation (mean)"), ("hit_rate", "prefix hit rate (mean)"))


def fleet_section(result: dict, out_dir: Path) -> list[str]:
    """HTML parts for a simulated fleet ([] for a run that is not one)."""
    simulation = result.get("simulation")
    if not simulation:
        return []
    parts = ["<h2>Fleet</h2>"]
    cost = simulation.get("cost")
    if cost:
        note = " (assumed price)" if cost.get("price_assumed") else ""
        parts.append(html_table(("replica-hours", "$ per replica-hour", "cost"), [(
            f"{cost['replica_hours']:.3f}", f"{cost['price_per_hour']:g}{note}",
            f"${cost['dollars']:.2f}")]))
    parts.append(html_table(
        ("replica", "role", "steps", "busy s", "prompt tokens cached", "preemptions", "joined s",
         "failed s"),
        [(row["replica"], row.get("role", "mixed"), row["steps"], f"{row['busy_s']:.1f}",
          _share(row.get("cached_tokens"), row.get("prompt_tokens")), row["preemptions"],
          f"{row.get('created_s') or 0:.0f}",
          "" if row.get("failed_s") is None else f"{row['failed_s']:.0f}")
         for row in simulation.get("replicas", [])]))
    for title, key in (("Failures", "failures"), ("Autoscaling events", None)):
        events = (simulation.get(key) if key else
                  (simulation.get("scaling") or {}).get("events"))
        if events:
            parts.append(f"<h3>{html.escape(title)}</h3>")
            parts.append(html_table(tuple(events[0]), [tuple(e.values()) for e in events[:200]]))
    timeline = simulation.get("timeline")
    if timeline and timeline.get("replicas"):
        plot_pools(timeline, out_dir / "fleet.png")
        parts.append(_img("fleet.png", "pools over time"))
    return parts


def _share(part: int | None, whole: int | None) -> str:
    return f"{part / whole:.1%}" if part is not None and whole else ""


def pool_series(timeline: dict) -> tuple[list[float], dict[str, dict[str, list]]]:
    """(sample times, per role: replicas taking requests and alive (starting
    and draining ones too), waiting summed, utilisation and hit rate
    averaged over the replicas alive at each sample)."""
    interval, samples = timeline["interval_s"], timeline["samples"]
    times = [i * interval for i in range(samples)]
    pools: dict[str, dict[str, list]] = {}
    for series in timeline["replicas"].values():
        pool = pools.setdefault(series["role"], {
            "replicas": [0] * samples, "alive": [0] * samples, "waiting": [0] * samples,
            "busy": [0.0] * samples, "hit_rate": [[] for _ in range(samples)]})
        for offset, waiting in enumerate(series["waiting"]):
            row = series["first_sample"] + offset
            pool["replicas"][row] += series["ready"][offset]
            pool["alive"][row] += 1
            pool["waiting"][row] += waiting
            pool["busy"][row] += series["busy"][offset]
            if series["hit_rate"][offset] is not None:
                pool["hit_rate"][row].append(series["hit_rate"][offset])
    for pool in pools.values():
        pool["busy"] = [b / n if n else None for b, n in zip(pool["busy"], pool["alive"])]
        pool["hit_rate"] = [sum(h) / len(h) if h else None for h in pool["hit_rate"]]
    return times, pools


def plot_pools(timeline: dict, path: Path) -> Path:
    times, pools = pool_series(timeline)
    fig = new_figure(9, 8)
    axes = fig.subplots(len(_PANELS), 1, sharex=True)
    for ax, (key, label) in zip(axes, _PANELS):
        for role, pool in sorted(pools.items()):
            points = [(t, v) for t, v in zip(times, pool[key]) if v is not None]
            if points:
                ax.plot(*zip(*points), label=role, linewidth=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper left")
    axes[-1].set_xlabel("seconds into the run")
    return _save(fig, path)
