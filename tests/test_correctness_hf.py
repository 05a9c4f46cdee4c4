"""Our engine vs HF transformers on the real default model (fp32).

16 prompts of different lengths run together in one continuous batch with
chunked prefill (a small token budget), prefix-cache hits (shared chat
preamble and a shared long document) and preemption (a deliberately tiny KV
pool). Greedy outputs must be token-identical to transformers' greedy
``generate`` for 32 tokens, and the logits of the first sampled position
within 1e-3.
"""
from __future__ import annotations

import pytest
import torch

from carpool import LLM, SamplingParams

pytestmark = pytest.mark.real_model

DOC = ("Carpooling lets several people share one car for a trip. It saves fuel, cuts traffic and "
       "costs less for everyone. Cities encourage it with dedicated lanes and parking. ") * 3
QUESTIONS = [
    "What is 2 + 2?", "Name three primary colours.", "Write a haiku about buses.",
    "Explain what a GPU is in one sentence.", "Translate 'good morning' into French.",
    "List the days of the week.", "Why is the sky blue?", "Give me a Python function that "
    "reverses a string, with a docstring and an example of how to call it.",
    "Summarise the plot of Romeo and Juliet in two sentences.", "What does HTTP stand for?",
]
NEW_TOKENS = 32
NEVER_GENERATED = 10**6


def build_prompts(tokenizer) -> list[list[int]]:
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    docs = [tokenizer.apply_chat_template([{"role": "user", "content": DOC + q}])
            for q in ("Summarise this.", "What are the benefits?", "Who encourages it?")]
    raw = ["Once upon a time", "The theory of relativity states that",
           "def fibonacci(n):\n    "]
    prompts = [tokenizer.encode(t) for t in chats + docs + raw]
    assert len(prompts) == 16
    return prompts


def test_greedy_tokens_and_logits_match_transformers(real_model_path, hf_reference):
    hf_model = hf_reference[0]
    # 40 blocks of 16 tokens (640 slots) for 16 requests needing ~1,900: preemption.
    llm = LLM(str(real_model_path), dtype="float32", num_blocks=40, block_size=16,
              max_num_batched_tokens=64, max_num_seqs=16)
    prompts = build_prompts(llm.tokenizer)
    assert max(len(p) for p in prompts) > 64, "one prompt must need several prefill chunks"

    first_logits: dict[tuple[int, ...], torch.Tensor] = {}
    sample = llm.engine.executor.sampler.sample

    def spy(logits, rows):
        for i, row in enumerate(rows):
            if row.step == 0:
                first_logits[tuple(row.prompt_token_ids)] = logits[i].clone()
        return sample(logits, rows)

    llm.engine.executor.sampler.sample = spy
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)

    assert llm.engine.scheduler.num_preemptions > 0
    stats = llm.engine.scheduler.kv.stats()
    assert stats.prefix_hits > 0 and stats.used_blocks == 0

    mismatches = []
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs):
            ids = torch.tensor([prompt])
            ref_logits = hf_model(ids).logits[0, -1]
            diff = (first_logits[tuple(prompt)] - ref_logits).abs().max().item()
            assert diff < 1e-3, f"first-position logits differ by {diff}"
            # An EOS id outside the vocabulary keeps generate going for all 32
            # tokens, like ignore_eos. The explicit mask matters: without it
            # transformers masks every prompt token equal to the pad id (the
            # chat template's <|im_end|>) once pad and EOS ids differ.
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                    max_new_tokens=NEW_TOKENS, do_sample=False,
                                    eos_token_id=NEVER_GENERATED, pad_token_id=2)
            ref = ref[0, len(prompt):].tolist()
            assert len(ref) == NEW_TOKENS
            if out.token_ids != ref:
                mismatches.append((llm.tokenizer.decode(prompt), out.token_ids, ref))
    assert not mismatches, f"{len(mismatches)} prompts differ from transformers: {mismatches[:2]}"
