"""One MoE layer on a GPU: the fused Triton kernels (carpool/model/triton_moe.py)
against MoEBlock's grouped torch path (one mm per active expert, and
torch._grouped_mm where it runs), at the expert shapes of Mixtral-8x7B,
Qwen3-30B-A3B and DeepSeek-V3 (random weights, bf16), from decode-sized
batches to prefill-sized ones.

    python scripts/moe_triton_bench.py [--models qwen3_30b,mixtral_8x7b]
        [--tokens 1,8,64,512,4096] [--runs 20] [--sweep] [--out moe.json]

Per (model, tokens): median ms of a whole MoEBlock forward per path (the
paths interleaved run by run), the Triton path's speedup over the best
torch one, and its weight bandwidth: the bytes of the experts the batch
touches over the Triton time (decode is bound by these bytes; an H100
SXM reads ~3.35 TB/s, an H200 ~4.8). Before timing, each shape checks
that the Triton output agrees with the grouped one (bf16: two ulps at the
output's scale). ``--sweep`` also times a few tile sizes and reports the
best, to tune ``pick_blocks``. ``--dry-run``: tiny shapes on the CPU in
Triton's interpreter, to prove the script before a GPU is spent on it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

MODELS = {  # hidden, experts, top_k, expert intermediate
    "mixtral_8x7b": (4096, 8, 2, 14336),
    "qwen3_30b": (2048, 128, 8, 768),
    "deepseek_v3": (7168, 256, 8, 2048),
    "tiny": (40, 6, 2, 24),
}
PATHS = {"mm": ("grouped", "mm"), "grouped_mm": ("grouped", "grouped_mm"),
         "triton": ("triton", "auto")}


def _block(model: str, device, dtype):  # noqa: ANN001, ANN202
    import torch

    from carpool.model.moe import MoEBlock
    from carpool.model.moe_spec import MoESpec

    hidden, experts, top_k, inter = MODELS[model]
    spec = MoESpec(num_experts=experts, top_k=top_k, expert_intermediate_size=inter,
                   family="mixtral")
    block = MoEBlock(spec, hidden).to(device, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=dtype) * 0.02)
    return block


def _timed(block, x, runs: int, paths: dict, sync) -> dict[str, float]:  # noqa: ANN001
    """Median ms per path of ``paths`` (name -> (impl, gemm, tile sizes))."""
    times = {name: [] for name in paths}
    for _ in range(runs):
        for name, (impl, gemm, tiles) in paths.items():
            block.impl, block.gemm, block.triton_blocks = impl, gemm, tiles
            sync()
            started = time.perf_counter()
            block(x)
            sync()
            times[name].append((time.perf_counter() - started) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _working_paths(block, x, dtype) -> dict:  # noqa: ANN001
    """The paths that run here, after checking Triton against grouped mm."""
    import torch

    outs, paths = {}, {}
    block.gemm = "auto"
    grouped_mm_runs = block._pick_gemm(x.device) == "grouped_mm"  # probes it once
    for name, (impl, gemm) in PATHS.items():
        if name == "grouped_mm" and not grouped_mm_runs:
            continue
        block.impl, block.gemm, block.triton_blocks = impl, gemm, None
        outs[name], paths[name] = block(x), (impl, gemm, None)
    tol = (2 * 2**-7 if dtype == torch.bfloat16 else 1e-4) * outs["mm"].abs().max().item()
    torch.testing.assert_close(outs["triton"], outs["mm"], atol=tol, rtol=0)
    return paths


def _sweep_tiles(block, x, runs: int, sync) -> tuple[str, float]:  # noqa: ANN001
    from carpool.model.triton_moe import BlockSizes

    grid = [BlockSizes(m, n, k, w) for m, n, k, w in itertools.product(
        (16, 32, 64), (64, 128), (64, 128), (4, 8))]
    ms = _timed(block, x, runs, {f"m{t.block_m} n{t.block_n} k{t.block_k} w{t.num_warps}":
                                 ("triton", "auto", t) for t in grid}, sync)
    best = min(ms, key=ms.get)
    return best, ms[best]


def bench_model(model: str, tokens: list[int], args, device, dtype) -> list[dict]:  # noqa: ANN001
    import torch

    block = _block(model, device, dtype)
    hidden, _, _, inter = MODELS[model]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for count in tokens:
        x = torch.randn(count, hidden, device=device, dtype=dtype)
        with torch.inference_mode():
            paths = _working_paths(block, x, dtype)
            active = int((block.last_expert_counts > 0).sum())
            ms = _timed(block, x, args.runs, paths, sync)
            best = _sweep_tiles(block, x, max(3, args.runs // 4), sync) if args.sweep else None
        weight_bytes = active * 3 * hidden * inter * x.element_size()
        torch_best = min(v for k, v in ms.items() if k != "triton")
        row = dict(model=model, tokens=count, active_experts=active, ms=ms,
                   speedup=torch_best / ms["triton"],
                   triton_weight_gb_s=weight_bytes / ms["triton"] / 1e6,
                   best_tiles=best and {"tiles": best[0], "ms": best[1]})
        rows.append(row)
        print(f"| {model} | {count} | {active} | " + " | ".join(
            f"{ms.get(n, float('nan')):.3f}" for n in PATHS) +
            f" | {row['speedup']:.2f}x | {row['triton_weight_gb_s']:.0f} |"
            + (f" {best[0]} {best[1]:.3f} |" if best else ""), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3_30b,mixtral_8x7b,deepseek_v3")
    parser.add_argument("--tokens", default="1,8,64,512,4096")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tile sizes")
    parser.add_argument("--out", default="", help="write the rows as JSON here")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on the CPU in Triton's interpreter")
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton_moe is imported
        args.models, args.tokens, args.runs = "tiny", "1,40", 2
    import torch

    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}, {dtype}; median of {args.runs} forwards")
    print("| model | tokens | active experts | " + " | ".join(f"{n} (ms)" for n in PATHS)
          + " | triton vs best torch | triton weight GB/s |" + (" best tiles |" if args.sweep
                                                                  else ""))
    rows = []
    for model in args.models.split(","):
        rows += bench_model(model, [int(t) for t in args.tokens.split(",")], args, device, dtype)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
