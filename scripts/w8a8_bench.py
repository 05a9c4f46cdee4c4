"""One decoder layer's four matmuls (the default model's shapes) at each row
count, on every CPU path: oneDNN's blocked bf16 (batched steps' default),
our packed bf16 (decode steps of a few rows) and W8A8 on VNNI
(``--quantization w8a8``). Where W8A8 pays against each: docs/numbers/cpu.md.

    python scripts/w8a8_bench.py [--rows 1,2,4,8,16,32,64,128,256] [--repeat 200]

Weights are in cache (L2/L3) across repeats, as a model's are not at one
row: the one-row figures understate what streaming half the bytes buys.
Run it alone: any other process on a small machine skews it.
"""
from __future__ import annotations

import argparse
import time

import torch

from carpool.model.cpu_kernels import load_cpu_ops
from carpool.model.packed_linear import pack_weight
from carpool.model.w8a8 import pack_int8

# SmolLM2-135M: hidden 576, 9 query + 3 KV heads of 64, MLP 1536 (fused q/k/v and gate/up).
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def _time_us(call, repeat: int) -> float:
    for _ in range(5):
        call()
    started = time.perf_counter()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - started) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    kernels = load_cpu_ops()
    torch.manual_seed(0)
    layers = []
    for out_features, in_features in SHAPES:
        weight = (torch.randn(out_features, in_features) * 0.05).bfloat16()
        layers.append((weight, torch.ops.mkldnn._reorder_linear_weight(weight),
                       pack_weight(weight), *pack_int8(weight)))
    print(f"{'rows':>5} {'blocked bf16 us':>16} {'packed bf16 us':>15} {'w8a8 us':>9} "
          f"{'vs blocked':>10} {'vs packed':>9}")
    for rows in (int(r) for r in args.rows.split(",")):
        totals = [0.0, 0.0, 0.0]
        for weight, blocked, packed, int8, scale in layers:
            x = torch.randn(rows, weight.shape[1]).bfloat16()
            repeat = max(10, args.repeat // max(1, rows // 16))
            totals[0] += _time_us(lambda: torch.ops.mkldnn._linear_pointwise(
                x, blocked, None, "none", [], ""), repeat)
            totals[1] += _time_us(lambda: kernels.packed_linear(x, packed, None), repeat)
            totals[2] += _time_us(lambda: kernels.w8a8_linear(x, int8, scale, None), repeat)
        blocked_us, packed_us, w8a8_us = totals
        print(f"{rows:>5} {blocked_us:>16.1f} {packed_us:>15.1f} {w8a8_us:>9.1f} "
              f"{blocked_us / w8a8_us:>9.2f}x {packed_us / w8a8_us:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
