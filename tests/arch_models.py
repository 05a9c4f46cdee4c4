"""Small random-weight models of each architecture, saved by transformers as
HF directories (with the tiny test tokenizer), for checking carpool's
forward against transformers' own."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}


def save_random_model(path: Path, tokenizer_dir: Path, model_type: str, extra: dict,
                      seed: int = 0, std: float = 0.3):
    """A ``model_type`` model of ``BASE`` updated by ``extra``, weights drawn
    N(0, ``std``) (larger than HF's init: decisive argmaxes, no near-ties),
    saved to ``path``; returns transformers' model (fp32, eval)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    config = AutoConfig.for_model(model_type, vocab_size=vocab, **{**BASE, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, std)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return model


def greedy_reference(model, prompt_ids: list[int], max_tokens: int) -> list[int]:  # noqa: ANN001
    """transformers' own greedy ``generate`` (no EOS stop)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens,
                             do_sample=False, min_new_tokens=max_tokens, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt_ids),
                                                                       dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def reference_logprobs(model, prompt_ids: list[int], token_ids: list[int]) -> list[float]:  # noqa: ANN001
    """transformers' log-probability of each of ``token_ids`` following
    ``prompt_ids`` (one forward over the whole sequence)."""
    ids = list(prompt_ids) + list(token_ids)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    start = len(prompt_ids) - 1
    return [logprobs[start + i, t].item() for i, t in enumerate(token_ids)]
