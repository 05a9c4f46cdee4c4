"""Where a decode step of many sequences goes, and how close it is to the
matmuls alone (the speed issue's concurrency-64 goal).

    python scripts/decode_batch_profile.py [--seqs 64] [--steps 20] [--context 192]

Loads the default model (bf16), starts ``--seqs`` requests of a 128-token
prompt and lets them decode together; then (1) times ``--steps`` decode
steps of the engine, (2) profiles them with ``torch.profiler`` (top ops by
self CPU time), and (3) times the model's own linear layers alone at the
same row count as the model holds them (plain or blocked weights, bf16), the
floor those steps cannot go under with these matmuls. Run it alone.
"""
from __future__ import annotations

import argparse
import time

import torch

from carpool.engine.llm import LLM
from carpool.model.blocked_linear import BlockedLinear
from carpool.sampling_params import SamplingParams


def linear_floor_ms(model, rows: int, repeats: int = 20) -> tuple[float, float]:
    """(ms, GFLOP/s) of every linear layer of ``model`` applied to ``rows``
    rows once (the LM head included), bf16, as the model holds them: plain
    weights through ATen's ``F.linear``, blocked ones (``--blocked-weights``,
    carpool/model/blocked_linear.py) through oneDNN on the blocked layout."""
    products = []  # (product of rows x in_features, in_features, out_features)
    for module in model.modules():
        if isinstance(module, BlockedLinear):
            products.append((module, module.in_features, module.out_features))
        weight = getattr(module, "weight", None)
        if (not hasattr(module, "dense") and isinstance(weight, torch.Tensor)
                and weight.dim() == 2 and weight.dtype == torch.bfloat16):
            products.append((lambda x, w=weight: torch.nn.functional.linear(x, w),
                             weight.shape[1], weight.shape[0]))
    xs = {inputs: torch.randn(rows, inputs, dtype=torch.bfloat16) for _, inputs, _ in products}
    flops = sum(2 * rows * inputs * outputs for _, inputs, outputs in products)
    for product, inputs, _ in products:  # warm-up: oneDNN builds its kernels per shape
        product(xs[inputs])
    started = time.perf_counter()
    for _ in range(repeats):
        for product, inputs, _ in products:
            product(xs[inputs])
    seconds = (time.perf_counter() - started) / repeats
    return 1000 * seconds, flops / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--context", type=int, default=192, help="prompt + tokens decoded "
                        "before the timed steps")
    parser.add_argument("--blocked-weights", default="auto", choices=("auto", "on", "off"))
    args = parser.parse_args()
    llm = LLM(max_num_seqs=max(args.seqs, 16), blocked_weights=args.blocked_weights)
    engine = llm.engine
    prompt_len = 128
    params = SamplingParams(max_tokens=args.context - prompt_len + 2 * args.steps + 8,
                            temperature=0, ignore_eos=True)
    for i in range(args.seqs):
        engine.add_request([100 + (i * 7 + j) % 20000 for j in range(prompt_len)], params)
    while engine.step_log.snapshot(1)[0] == [] or \
            engine.step_log.snapshot(1)[0][-1].shape.decode_seqs < args.seqs or \
            engine.step_log.snapshot(1)[0][-1].shape.prefill_tokens:
        engine.step()
    while engine.scheduler.running[0].num_tokens < args.context:
        engine.step()
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = 1000 * (time.perf_counter() - started) / args.steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    model = engine.executor.model
    floor_ms, gflops = linear_floor_ms(model, args.seqs)
    print(f"{args.seqs} sequences decoding, context ~{args.context}: {step_ms:.2f} ms per step "
          f"({1000 * args.seqs / step_ms:.0f} tok/s)")
    print(f"the linear layers alone at {args.seqs} rows: {floor_ms:.2f} ms "
          f"({gflops:.0f} GFLOP/s)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
