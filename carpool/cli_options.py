"""The flags of ``carpool generate`` and ``carpool chat`` besides the
engine's: the one request's sampling and its prompt, declared once on
``GenerateOptions`` (``settings_fields``)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from carpool.sampling_params import SamplingParams
from carpool.settings_fields import add_setting_args, setting


@dataclass
class GenerateOptions:
    """One prompt's sampling (``SamplingParams``) and how it is sent."""

    max_tokens: int = setting(256, "--max-tokens", "N", "most tokens to generate", parse=int)
    temperature: float = setting(0.0, "--temperature", "T", "0 = greedy", parse=float)
    top_p: float = setting(1.0, "--top-p", "P", "nucleus sampling", parse=float)
    top_k: int = setting(0, "--top-k", "K", "0 = off", parse=int)
    min_p: float = setting(
        0.0, "--min-p", "P", "drop tokens below this share of the top one's probability",
        parse=float)
    # Not SamplingParams' 1.0: a 135M model's greedy reply loops without it.
    repetition_penalty: float = setting(
        1.1, "--repetition-penalty", "X",
        "1 = off; the mild default keeps a small model's greedy reply from looping until "
        "--max-tokens (carpool serve's requests: 1)", parse=float)
    sample_seed: int | None = setting(None, "--sample-seed", "N", "per-request seed", parse=int)
    stop: list[str] = setting([], "--stop", "TEXT", "stop string (repeatable)", nargs="append")
    raw: bool = setting(
        False, "--raw", None,
        "send the prompt as is instead of through the chat template", parse=bool)
    system: str | None = setting(None, "--system", None, "system prompt")

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, seed=self.sample_seed,
                              stop=self.stop)


SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
            "sample_seed", "stop")


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    add_setting_args(parser.add_argument_group("sampling"), GenerateOptions, only=SAMPLING)


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return GenerateOptions(**{name: getattr(args, name) for name in SAMPLING}).sampling()
