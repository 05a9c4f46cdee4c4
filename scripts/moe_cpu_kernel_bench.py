"""One Mixtral-shaped MoE layer (hidden 512, 8 experts of 1024, top-2) on CPU
bf16: oneDNN-blocked experts (the grouped path) against our fused kernel on
packed experts (carpool/model/moe_cpu.py), per forward, at several token
counts.

    python scripts/moe_cpu_kernel_bench.py [--tokens 1,8,64,128,2048]

Both layouts hold the same weights; each is timed after a warm-up, as the
mean of a few thousand tokens' worth of forwards. Run it alone.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

from carpool.model.cpu_kernels import load_cpu_ops
from carpool.model.moe import MoEBlock
from carpool.model.moe_spec import MoESpec


def _mean_ms(fn, runs: int) -> float:  # noqa: ANN001
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(runs):
        fn()
    return (time.perf_counter() - start) / runs * 1e3


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,64,128,2048")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    spec = MoESpec(num_experts=8, top_k=2, expert_intermediate_size=1024, family="mixtral")
    block = MoEBlock(spec, 512)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.02)
    block = block.to(torch.bfloat16)
    packed = copy.deepcopy(block)
    block.block_experts()
    packed.pack_experts(load_cpu_ops())
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, 512, dtype=torch.bfloat16)
            runs = max(5, 4000 // tokens)
            blocked_ms, packed_ms = _mean_ms(lambda: block(x), runs), _mean_ms(lambda: packed(x),
                                                                                runs)
            print(f"tokens {tokens}: blocked {blocked_ms:.3f} ms, packed kernel {packed_ms:.3f} "
                  f"ms ({blocked_ms / packed_ms:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
