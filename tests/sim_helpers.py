"""Helpers shared by the simulator's tests."""
from __future__ import annotations


class ConstantCost:
    """Every step takes ``seconds``: timings a test can work out by hand."""

    kind = "measured"
    row_bucket = 1

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def step_seconds(self, shape) -> float:
        return self.seconds

    def decode_step_seconds(self, seqs: int, context_tokens: int) -> float:
        return self.seconds

    def extra_seconds(self, tokens: int, idle_s: float, new_shape: bool) -> float:
        return 0.0

    def describe(self) -> dict:
        return {"model_kind": self.kind, "constant_s": self.seconds}
