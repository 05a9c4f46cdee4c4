"""What structured outputs cost a batch: output tokens per second of 32
requests decoded together, with 0%, 50% and 100% of them constrained by a
JSON schema (issue 44's measure), on the default model and engine.

    python scripts/structured_bench.py [--fractions 0,0.5,1] [--repeats 3]
        [--batch 32] [--max-tokens 64]

Every request makes exactly ``--max-tokens`` tokens: the free ones ignore
EOS, and the schema (an array of at least 40 small objects) cannot end
sooner, so each run's batch stays full and the runs differ only in how many
rows are masked. Runs are interleaved (fraction by fraction, ``--repeats``
rounds) after one warm-up each; prints each run and the median per
fraction as JSON lines. Run it alone on the machine. With ``--fractions
0`` it also runs on a carpool without structured outputs (to check that a
batch with no constrained row pays nothing: point PYTHONPATH at that tree).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0},
                                     "name": {"type": "string", "maxLength": 12},
                                     "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}


def _params(fraction: float, batch: int, max_tokens: int) -> list:
    from carpool import SamplingParams

    constrained = round(fraction * batch)
    params = []
    for i in range(batch):
        common = {"max_tokens": max_tokens, "temperature": 0.7, "seed": i}
        if i < constrained:
            from carpool.structured_output import StructuredOutput

            common["structured"] = StructuredOutput("json", json.dumps(SCHEMA))
        else:
            common["ignore_eos"] = True
        params.append(SamplingParams(**common))
    return params


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", default="0,0.5,1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    from carpool import LLM

    llm = LLM(max_num_seqs=args.batch)
    tokenizer = llm.engine.tokenizer
    prompts = [tokenizer.encode_chat([{"role": "user", "content": f"List {40 + i} users as a "
                                       "JSON array of objects with id, name and ok."}], True)
               for i in range(args.batch)]
    fractions = [float(f) for f in args.fractions.split(",")]
    runs: dict[float, list[float]] = {f: [] for f in fractions}
    for f in fractions:  # warm-up: kernels, shapes, grammar compile
        llm.generate(prompts, _params(f, args.batch, 8))
    for round_ in range(args.repeats):
        for f in fractions:
            params = _params(f, args.batch, args.max_tokens)
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            took = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            assert tokens == args.batch * args.max_tokens, tokens
            runs[f].append(tokens / took)
            print(json.dumps({"round": round_, "constrained": f, "tok_s": round(tokens / took,
                                                                                 1)}), flush=True)
    for f in fractions:
        print(json.dumps({"constrained": f, "median_tok_s": round(statistics.median(runs[f]), 1),
                          "runs": [round(r, 1) for r in runs[f]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
