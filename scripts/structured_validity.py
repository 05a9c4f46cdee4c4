"""Do structured outputs hold? Every JSON schema of tests/data/json_schemas
through carpool's engine on the default model: the share of outputs that
parse and validate against their schema (issue 44's measure).

    python scripts/structured_validity.py [--samples 3] [--max-tokens 768]
        [--repetition-penalty 1.0]

Per schema: one greedy output and ``--samples - 1`` sampled ones
(temperature 0.8, seeds 1..), all batched together, each asked in a chat
turn to fill the schema. A schema llguidance refuses to compile is counted
apart (the server answers it with a 400). An output cut by ``--max-tokens``
counts as invalid. Prints one JSON line per schema and a summary.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SCHEMAS = Path(__file__).resolve().parents[1] / "tests" / "data" / "json_schemas"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=768)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    args = parser.parse_args(argv)
    import jsonschema

    from carpool import LLM, SamplingParams
    from carpool.structured_output import StructuredOutput

    llm = LLM()
    tokenizer = llm.engine.tokenizer
    compiler = llm.engine.grammars()
    prompts, params, owners, refused = [], [], [], {}
    for path in sorted(SCHEMAS.glob("*.json")):
        schema = json.loads(path.read_text())
        spec = StructuredOutput("json", json.dumps(schema, sort_keys=True))
        try:
            compiler.compile(spec)
        except ValueError as exc:
            refused[path.stem] = str(exc)
            continue
        ask = f"Write one JSON document for this schema:\n{json.dumps(schema)}"
        prompt = tokenizer.encode_chat([{"role": "user", "content": ask}], True)
        for sample in range(args.samples):
            temperature = 0.0 if sample == 0 else 0.8
            params.append(SamplingParams(max_tokens=args.max_tokens, temperature=temperature,
                                         seed=sample, structured=spec,
                                         repetition_penalty=args.repetition_penalty))
            prompts.append(prompt)
            owners.append((path.stem, schema))
    outputs = llm.generate(prompts, params)
    valid = 0
    for (name, schema), out in zip(owners, outputs):
        try:
            jsonschema.validate(json.loads(out.text), schema,
                                format_checker=jsonschema.FormatChecker())
            ok, why = True, ""
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            ok, why = False, str(exc).splitlines()[0][:160]
        valid += ok
        print(json.dumps({"schema": name, "valid": ok, "finish": out.finish_reason,
                          "tokens": len(out.token_ids), "why": why}), flush=True)
    for name, why in refused.items():
        print(json.dumps({"schema": name, "refused": why[:160]}))
    print(json.dumps({"schemas": len(list(SCHEMAS.glob("*.json"))), "refused": len(refused),
                      "outputs": len(outputs), "valid": valid}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
