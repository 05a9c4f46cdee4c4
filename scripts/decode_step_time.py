"""Time one sequence's decode steps offline (README: "Side by side with llama.cpp").

    python scripts/decode_step_time.py [int8|int4] [--runs 3] [--packed-decode auto|on|off]

Loads the default model (bf16, or with ``--quantization``), warms up, then
per run queues one request (a 128-token prompt, 300 tokens, ignore_eos) and
prints the mean wall time of its 299 decode steps (the prefill step is not
timed). Run it alone: any other process on a small machine skews it.
"""
from __future__ import annotations

import argparse
import time

from carpool.engine.llm import LLM
from carpool.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("quantization", nargs="?", choices=["int8", "int4", "w8a8"], default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--packed-decode", choices=["auto", "on", "off"], default="auto")
    args = parser.parse_args()
    settings = {"packed_decode": args.packed_decode}
    if args.quantization:
        settings["quantization"] = args.quantization
    llm = LLM(**settings)
    prompt = list(range(100, 228))
    llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    engine = llm.engine
    for _ in range(args.runs):
        engine.add_request(prompt, SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
        engine.step()  # the prefill
        started, steps = time.perf_counter(), 0
        while engine.has_unfinished:
            engine.step()
            steps += 1
        elapsed = (time.perf_counter() - started) / steps
        print(f"{args.quantization or 'bf16'} (packed {args.packed_decode}): {elapsed * 1000:.2f} ms per decode step "
              f"({steps} steps)", flush=True)


if __name__ == "__main__":
    main()
