"""Output tokens per second of carpool's engine against transformers' own
``generate`` on one random-weight model of each shape, side by side in one
sitting (issue 43's measure).

    python scripts/family_bench.py [--shape mixtral|deepseek|qwen3] [--batches 1,64]
        [--prompt-len 128] [--output-len 128] [--dtype auto|float32|bfloat16]

For each batch size B: B prompts of ``--prompt-len`` random token ids,
greedy, exactly ``--output-len`` tokens each (no EOS stop). carpool runs
``LLM.generate`` (continuous batching, paged KV; the dtype ``carpool
serve`` picks under ``auto``); transformers runs ``generate`` on the same
batch (left-padded to one length, which these prompts already are) in the
same dtype. Each is timed after a warm-up of one short run. Prints the
tokens per second of both and the ratio. The model: ``SHAPES`` (moderate
sizes: hidden 512, 8 experts top-2 for the MoE shapes), the vocabulary and
tokenizer of the default model (SmolLM2's, 49,152 tokens).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

COMMON = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 2, "intermediate_size": 1024, "max_position_embeddings": 1024,
          "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "vocab_size": 49152,
          "tie_word_embeddings": False}
SHAPES = {
    "mixtral": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen3-moe": ("qwen3_moe", {"head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 1024, "norm_topk_prob": True}),
    "deepseek": ("deepseek_v3", {"num_key_value_heads": 8, "kv_lora_rank": 128,
                                 "q_lora_rank": 256, "qk_nope_head_dim": 64,
                                 "qk_rope_head_dim": 32, "v_head_dim": 64,
                                 "n_routed_experts": 8, "n_group": 1, "topk_group": 1,
                                 "num_experts_per_tok": 2, "moe_intermediate_size": 1024,
                                 "n_shared_experts": 1, "first_k_dense_replace": 1}),
    "qwen3": ("qwen3", {"head_dim": 64}),
}


def build(path: Path, shape: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    from carpool.model.hub import fetch_default_model
    from carpool.model.loader import load_tokenizer
    from carpool.paths import default_cache_dir

    model_type, extra = SHAPES[shape]
    config = AutoConfig.for_model(model_type, **{**COMMON, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    gguf = fetch_default_model(default_cache_dir())
    load_tokenizer(str(gguf))  # checks it loads; carpool reads it by --tokenizer
    return model, str(gguf)


def timed(run) -> float:  # noqa: ANN001
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    from carpool import LLM, SamplingParams
    from carpool.executor.torch_executor import resolve_device, resolve_dtype

    dtype = resolve_dtype(args.dtype, resolve_device("auto"))
    with tempfile.TemporaryDirectory() as tmp:
        reference, tokenizer = build(Path(tmp), args.shape)
        reference.to(dtype)
        llm = LLM(tmp, dtype=str(dtype).removeprefix("torch."), tokenizer=tokenizer,
                  max_num_seqs=max(int(b) for b in args.batches.split(",")))
        rows = []
        for batch in (int(b) for b in args.batches.split(",")):
            gen = torch.Generator().manual_seed(batch)
            prompts = torch.randint(3, COMMON["vocab_size"], (batch, args.prompt_len),
                                    generator=gen)
            params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
            warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            llm.generate(prompts[:, :16].tolist(), warm)
            ours = timed(lambda: llm.generate(prompts.tolist(), params))

            def hf_generate(n: int, cut: int = args.prompt_len) -> None:
                with torch.inference_mode():
                    reference.generate(prompts[:, :cut], attention_mask=torch.ones_like(
                        prompts[:, :cut]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        pad_token_id=0)
            hf_generate(4, 16)
            theirs = timed(lambda: hf_generate(args.output_len))
            tokens = batch * args.output_len
            rows.append({"shape": args.shape, "batch": batch, "dtype": str(dtype),
                         "carpool_tok_s": round(tokens / ours, 1),
                         "transformers_tok_s": round(tokens / theirs, 1),
                         "ratio": round(theirs / ours, 2)})
            print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
