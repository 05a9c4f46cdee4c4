"""Structured outputs' per-step mask fill: the batch's rows filled one by one
against one batched call on llguidance's threads (``fill_bitmask``), each
row's grammar mid-way through a real schema, on the default model's
vocabulary. Alone on the machine, medians of 30 calls:

    python scripts/mask_fill_bench.py [--rows 1 32 128]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SCHEMA = Path(__file__).resolve().parents[1] / "tests/data/json_schemas/01_address_book.json"
PREFIX = '{"contacts": [{"address": {"city": "Lon'


def _median_ms(call, repeats: int = 30) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128])
    args = parser.parse_args(argv)
    from carpool.model.grammar import GrammarCompiler, fill_bitmask, new_bitmask
    from carpool.model.loader import load_tokenizer
    from carpool.structured_output import StructuredOutput

    tokenizer = load_tokenizer(None)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    spec = StructuredOutput("json", SCHEMA.read_text())
    for rows in args.rows:
        constraints = []
        for _ in range(rows):
            constraint = compiler.constraint(spec)
            for token in tokenizer.encode(PREFIX):
                constraint.accept(token)
            constraints.append(constraint)
        bitmask = new_bitmask(rows, tokenizer.vocab_size)

        def one_by_one() -> None:
            for row, constraint in enumerate(constraints):
                constraint.fill(bitmask, row)

        batched = _median_ms(lambda: fill_bitmask(constraints, bitmask))
        print(json.dumps({"rows": rows, "one_by_one_ms": round(_median_ms(one_by_one), 3),
                          "batched_ms": round(batched, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
