"""The default model's linear layers (30 layers x qkv, o, gate_up, down,
plus the tied LM head; distinct random bf16 weights, so they stream from
memory as in a step) through ``F.linear`` on plain weights and through
oneDNN on weights reordered once (``carpool/model/blocked_linear.py``),
side by side at several row counts, with the largest difference seen.

    python scripts/blocked_linear_bench.py [--rows 1,4,8,16,32,64,128,256]

Run it alone: on a 2-core machine any other process moves the numbers.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from carpool.model.blocked_linear import BlockedLinear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # fused qkv, o, gate_up, down


def best_ms(run, inputs: dict, repeats: int) -> float:
    run(inputs)
    best = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        for _ in range(repeats):
            run(inputs)
        best = min(best, (time.perf_counter() - started) / repeats * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,32,64,128,256")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen).bfloat16() * 0.02
               for _ in range(30) for (o, i) in SHAPES]
    weights.append(torch.randn(49152, 576, generator=gen).bfloat16() * 0.02)
    blocked = [BlockedLinear(w, None) for w in weights]

    def plain(xs: dict) -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    def reordered(xs: dict) -> None:
        for layer in blocked:
            layer(xs[layer.in_features])

    print("| rows | F.linear (ms) | blocked (ms) | speed-up | max abs difference |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {n: torch.randn(rows, n, generator=gen).bfloat16() for n in (576, 1536)}
        diff = max((layer(xs[layer.in_features]) - F.linear(xs[w.shape[1]], w)).abs().max().item()
                   for layer, w in zip(blocked[:4], weights[:4]))
        repeats = 5 if rows > 64 else 10
        a, b = best_ms(plain, xs, repeats), best_ms(reordered, xs, repeats)
        print(f"| {rows} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {diff} |", flush=True)


if __name__ == "__main__":
    main()
