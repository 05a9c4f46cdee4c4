#!/usr/bin/env python
"""Whole generations through a sliced replica: ``--micro-batches`` off, on
and auto (the live choice), and one process, side by side.

    python scripts/tp_generate_bench.py                    # 16 sequences x 64 tokens
    python scripts/tp_generate_bench.py --sequences 32 --rounds 3

A random-weight Llama-shaped model (hidden 512, 8 heads, 4 KV heads, MLP
1536, 8 layers, vocab 32768, bf16; saved once under ``--dir``) served by
``LLM`` (the engine ``carpool serve`` runs, in this process; ranks 1.. are
follower processes). Each round runs every setting once, in turn, on the
same prompts (128 tokens each, greedy, ``--tokens`` out); prints the median
wall time per setting, output tokens per second, and, for auto, the choice
it came to per step shape. Greedy outputs must agree across settings (they
are checked).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SETTINGS = [("tp1", 1, "off"), ("tp2-off", 2, "off"), ("tp2-on", 2, "on"), ("tp2-auto", 2, "auto")]


def _model_dir(path: Path) -> Path:
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=32768,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    _save_tokenizer(path, config.vocab_size)  # prompts are token ids: any vocabulary does
    return path


def _save_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, "t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1",
                                                            "bos_token": "t0"}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/carpool-tp-bench-model"))
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from carpool import LLM, SamplingParams

    model = _model_dir(args.dir)
    prompts = [[(i * (7 + s)) % 30000 + 5 for i in range(128)] for s in range(args.sequences)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name, _, _ in SETTINGS}
    outputs, choices = {}, {}
    for _ in range(args.rounds):
        for name, size, mode in SETTINGS:
            with LLM(str(model), dtype="bfloat16",
                     tensor_parallel_size=size, micro_batches=mode,
                     kv_cache_memory="256MiB") as llm:
                llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm
                start = time.perf_counter()
                done = llm.generate(prompts, params)
                times[name].append(time.perf_counter() - start)
                outputs.setdefault(name, [o.token_ids for o in done])
                if mode == "auto":
                    choices = llm.engine.executor.choice.summary()
    report = {name: {"median_s": round(statistics.median(t), 3),
                     "tok_s": round(args.sequences * args.tokens / statistics.median(t), 1),
                     "runs_s": [round(x, 3) for x in t]} for name, t in times.items()}
    print(json.dumps({"settings": report, "auto_choices": choices,
                      "same_tokens": {name: out == outputs["tp2-off"]
                                      for name, out in outputs.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
