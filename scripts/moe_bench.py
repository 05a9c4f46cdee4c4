"""One MoE MLP (carpool/model/moe.py) on the CPU: the grouped path (experts'
rows gathered once; its expert GEMMs as one ``torch._grouped_mm`` call, or
one mm per active expert) against the per-expert masked loop, at several
token counts, fp32 and bf16. Median milliseconds of
``--runs`` forwards each, the paths interleaved run by run so a noisy
neighbour slows all of them alike.

    python scripts/moe_bench.py [--tokens 1,8,64,512] [--runs 30] [--threads N]

Run it alone: on a 2-core machine any other process moves the numbers.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from carpool.model.moe import MoEBlock
from carpool.model.moe_spec import MoESpec

PATHS = {"loop": ("loop", "mm"), "grouped_mm": ("grouped", "grouped_mm"),
         "grouped_per_expert": ("grouped", "mm")}


def time_paths(block: MoEBlock, x: torch.Tensor, runs: int) -> dict[str, float]:
    """Median ms per path; also checks the paths agree on this input."""
    outputs, times = {}, {name: [] for name in PATHS}
    for name, (impl, gemm) in PATHS.items():  # warm up: first-touch, kernel choice
        block.impl, block.gemm = impl, gemm
        for _ in range(3):
            outputs[name] = block(x)
    # bf16 paths may differ by a rounding or two (see MoEBlock._grouped).
    tol = (1e-2 if x.dtype == torch.bfloat16 else 1e-5) * outputs["loop"].abs().max().item()
    for name in PATHS:
        torch.testing.assert_close(outputs[name], outputs["loop"], atol=tol, rtol=0)
    for _ in range(runs):
        for name, (impl, gemm) in PATHS.items():
            block.impl, block.gemm = impl, gemm
            started = time.perf_counter()
            block(x)
            times[name].append((time.perf_counter() - started) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,64,512")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: torch's default); 1 is steadier on a shared machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = MoESpec(num_experts=args.experts, top_k=args.top_k,
                   expert_intermediate_size=args.intermediate, family="mixtral")
    gen = torch.Generator().manual_seed(0)
    print(f"hidden {args.hidden}, {args.experts} experts top-{args.top_k}, expert "
          f"intermediate {args.intermediate}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.runs} runs")
    print("| dtype | tokens | loop (ms) | grouped, grouped_mm (ms) | grouped, mm per expert (ms) "
          "| loop / grouped_mm | default gemm |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        block = MoEBlock(spec, args.hidden)
        with torch.no_grad():
            for tensor in block.parameters():
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.02)
        block = block.to(dtype)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, args.hidden, generator=gen).to(dtype)
            with torch.inference_mode():
                ms = time_paths(block, x, args.runs)
            block.gemm = "auto"
            print(f"| {str(dtype).removeprefix('torch.')} | {tokens} | {ms['loop']:.3f} | "
                  f"{ms['grouped_mm']:.3f} | {ms['grouped_per_expert']:.3f} | "
                  f"{ms['loop'] / ms['grouped_mm']:.2f}x | {block._pick_gemm(x.device)} |")


if __name__ == "__main__":
    main()
