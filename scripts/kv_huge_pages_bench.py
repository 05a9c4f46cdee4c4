"""Paged decode attention over 30 layers with the KV blocks in sequence
order or scattered over a large cache, the cache on ordinary 4 KiB pages
or on transparent huge pages (``carpool/model/huge_pages.py``).

    python scripts/kv_huge_pages_bench.py [--seqs 64] [--context 280]

The default model's shapes (9 query heads, 3 KV heads, head size 64,
16-token blocks); a 2,900-block cache per layer, as a 1 GiB pool has.
Run it alone: on a 2-core machine any other process moves the numbers.
"""
from __future__ import annotations

import argparse
import time

import torch

from carpool.model import huge_pages
from carpool.model.cpu_kernels import load_cpu_ops

HEADS, KV_HEADS, DIM, BLOCK, LAYERS, CACHE_BLOCKS = 9, 3, 64, 16, 30, 2900


def step_ms(ops, caches: list, tables: torch.Tensor, lens: torch.Tensor, query: torch.Tensor) -> float:
    """Best of three timings of one decode step's attention over all layers."""
    def step() -> None:
        for k, v in caches:
            ops.paged_decode_attention(query, k, v, tables, lens, DIM ** -0.5)

    step()
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(5):
            step()
        best = min(best, (time.perf_counter() - started) / 5 * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=280)
    args = parser.parse_args()
    ops = load_cpu_ops()
    per_seq = -(-args.context // BLOCK)
    if args.seqs * per_seq > CACHE_BLOCKS:
        parser.error(f"{args.seqs} x {per_seq} blocks do not fit {CACHE_BLOCKS}")
    gen = torch.Generator().manual_seed(0)
    layouts = {"in order": torch.arange(args.seqs * per_seq),
               "scattered": torch.randperm(CACHE_BLOCKS, generator=gen)[:args.seqs * per_seq]}
    query = torch.randn(args.seqs, HEADS, DIM, generator=gen).bfloat16()
    lens = torch.full((args.seqs,), args.context, dtype=torch.long)
    print("| pages | blocks | attention, 30 layers (ms) |")
    print("|---|---|---|")
    for pages, make in (("4 KiB", lambda s: torch.zeros(s, dtype=torch.bfloat16)),
                        ("huge", lambda s: huge_pages.zeros(s, torch.bfloat16))):
        caches = [(make((KV_HEADS, CACHE_BLOCKS, DIM, BLOCK)).normal_(generator=gen),
                   make((KV_HEADS, CACHE_BLOCKS, BLOCK, DIM)).normal_(generator=gen))
                  for _ in range(LAYERS)]
        for name, order in layouts.items():
            tables = order.view(args.seqs, per_seq).long().contiguous()
            print(f"| {pages} | {name} | {step_ms(ops, caches, tables, lens, query):.1f} |")
        del caches


if __name__ == "__main__":
    main()
