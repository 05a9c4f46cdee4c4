"""``carpool evaluate autoscale``'s tables: every day run, each policy's
cheapest run at the SLO reactive meets, and the per-request check."""
from __future__ import annotations


def equal_attainment_rows(rows: list[dict]) -> list[dict]:
    """Per start-up and policy, its cheapest run (over the target
    utilisations) that kept every hour within the goal, else the one with
    the fewest hours under it; each with its replica-hours over
    reactive's own such run: what a policy pays for the SLO reactive meets."""
    best: dict[tuple[float, str], dict] = {}
    for row in rows:
        key = (row["startup_s"], row["policy"])
        rank = (row["hours_missing_slo"], row["replica_hours"])
        if key not in best or rank < (best[key]["hours_missing_slo"],
                                      best[key]["replica_hours"]):
            best[key] = row
    out = []
    for (startup, policy), row in best.items():
        reactive = best.get((startup, "reactive"))
        out.append({"startup_s": startup, "policy": policy,
                    "target_utilization": row["target_utilization"],
                    "replica_hours": row["replica_hours"],
                    "hours_missing_slo": row["hours_missing_slo"],
                    "slo_attainment": row["slo_attainment"],
                    "worst_hour_attainment": row["worst_hour_attainment"],
                    "vs_reactive": (row["replica_hours"] / reactive["replica_hours"]
                                    if reactive else None)})
    return out


def _ratio(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def format_equal_table(rows: list[dict]) -> str:
    lines = ["| start-up | policy | cheapest target meeting every hour | replica-hours | "
             "vs reactive | in SLO (day) | hours under goal | worst hour |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['startup_s']:g} s | {row['policy']} | {row['target_utilization']:g} | "
            f"{row['replica_hours']:.0f} | {_ratio(row['vs_reactive'])} | "
            f"{row['slo_attainment']:.2%} | {row['hours_missing_slo']} | "
            f"{row['worst_hour_attainment']:.1%} |")
    return "\n".join(lines)


def format_day_table(rows: list[dict], price: float) -> str:
    lines = [f"| start-up | target util | policy | replica-hours | $ at ${price:g}/h | "
             "vs oracle | vs static | in SLO (day) | hours under goal | worst hour | "
             "scale events | replicas | wall |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratio = _ratio
    for row in rows:
        lines.append(
            f"| {row['startup_s']:g} s | {row['target_utilization']:g} | {row['policy']} | "
            f"{row['replica_hours']:.0f} | "
            f"{row['cost']:.0f} | "
            f"{ratio(row['vs_oracle'])} | {ratio(row['vs_static'])} | "
            f"{row['slo_attainment']:.2%} | {row['hours_missing_slo']} | "
            f"{row['worst_hour_attainment']:.1%} | {row['scale_events']} | "
            f"{row['min_replicas']}-{row['peak_replicas']} | {row['wall_s']:.1f} s |")
    return "\n".join(lines)


def format_check_row(row: dict) -> str:
    measured, fluid = row["per_request"], row["fluid"]
    return (f"  {row['policy']:<11} per-request: {measured['replica_seconds'] / 60:.1f} "
            f"replica-min, {measured['slo_attainment']:.2%} in SLO, "
            f"{measured['scale_events']} scale events ({measured['wall_s']:.0f} s wall, "
            f"{row['requests']} requests); fluid: {fluid['replica_seconds'] / 60:.1f} "
            f"replica-min, {fluid['slo_attainment']:.2%} in SLO, {fluid['scale_events']} events")
