"""What ``carpool bench regimes`` prints: a line per regime as it finishes,
then the comparison table (markdown) with ratios to the first regime, and,
for a schedule with surges, the excess load it is measured against
(``excess_share``; ``regimes.surge_summary`` measures the capacity)."""
from __future__ import annotations

import argparse


def excess_share(offsets: list[float], capacity: float, max_delay: float) -> float:
    """The share of arrivals an ideal server must turn away to start every
    admitted one within ``max_delay``: a FIFO fluid queue serving
    ``capacity`` requests per second that rejects an arrival whose wait would
    exceed ``max_delay``. It is the load in excess of capacity."""
    free_at, rejected = 0.0, 0
    for t in offsets:
        start = max(t, free_at)
        if start - t > max_delay:
            rejected += 1
            continue
        free_at = start + 1.0 / capacity
    return rejected / len(offsets) if offsets else 0.0


def print_row(row: dict, first: dict, with_peak: bool) -> None:
    """One regime's line as soon as it has run (the header before the first)."""
    if row is first:
        print(f"{'regime':<11} {'padding':<7} {'out tok/s':>9} {'vs first':>8} {'eff tok/s':>9} "
              f"{'fill':>5} {'busy':>5} {'TTFT mean':>9} {'p99':>7} {'TPOT p99':>8} "
              f"{'E2E mean':>8} {'p99':>7} {'rej':>5}" + (f" {'peak':>6}" if with_peak else ""))
    ratio = row["output_tok_s"] / first["output_tok_s"]
    peak = row.get("peak_rate_under_slo")
    print(f"{row['regime']:<11} {row['padding']:<7} {row['output_tok_s']:>9.1f} {ratio:>7.2f}x "
          f"{row['effective_tok_s']:>9.1f} {row['fill_rate']:>5.2f} {row['busy']:>5.0%} "
          f"{row['ttft_mean']:>9.2f} {row['ttft_p99']:>7.2f} {row['tpot_p99']:>8.3f} "
          f"{row['e2e_mean']:>8.2f} {row['e2e_p99']:>7.2f} {row['rejected_share']:>5.0%}"
          + (f" {'-' if peak is None else f'{peak:g}':>6}" if with_peak else ""), flush=True)


def print_table(rows: list[dict], args: argparse.Namespace, workload: dict) -> None:
    """The comparison table in markdown, ratios against the first regime."""
    first = rows[0]
    slo = ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in args.slo.items()) or "none"
    print(f"\nworkload: {workload['name']} ({workload['num_requests']} requests, token counts "
          f"x{workload['token_scale']:g}, time x{workload['time_scale']:g}, arrivals "
          f"{workload['process']}, offered {_rate(workload['offered_rate'])} req/s); "
          f"SLO: {slo}; peak rate = the highest of --rates "
          f"{args.rates or '(none given)'} with >= {args.attainment:.0%} of requests in SLO")
    print(f"| regime | output tok/s | vs {first['regime']} | busy | TTFT mean / p99 (s) | "
          f"TPOT p99 (s) | E2E mean / p99 (s) | p99 E2E vs {first['regime']} | rejected | "
          f"peak rate under SLO (req/s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        peak = row.get("peak_rate_under_slo")
        print(f"| {row['regime']} | {row['output_tok_s']:.1f} | "
              f"{row['output_tok_s'] / first['output_tok_s']:.2f}x | {row['busy']:.0%} | "
              f"{row['ttft_mean']:.2f} / {row['ttft_p99']:.2f} | {row['tpot_p99']:.3f} | "
              f"{row['e2e_mean']:.2f} / {row['e2e_p99']:.2f} | "
              f"{row['e2e_p99'] / first['e2e_p99']:.2f}x | {row['rejected_share']:.0%} | "
              f"{'-' if peak is None else f'{peak:g}'} |")


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
