"""Per-request sampling parameters (OpenAI/vLLM-shaped) with validation."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# Temperatures below this sample greedily (as vLLM): dividing logits by a
# temperature that rounds to zero in float32 would give inf/NaN probabilities.
GREEDY_TEMPERATURE = 1e-5
# Dividing logits by a smaller repetition penalty could overflow float32.
MIN_REPETITION_PENALTY = 0.01
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    ``temperature == 0`` (or below ``GREEDY_TEMPERATURE``) means greedy. ``top_k <= 0`` disables top-k. ``seed``
    makes sampling reproducible regardless of which requests share the batch.
    ``logprobs = N`` returns the chosen token's logprob plus the top N (N <= 20).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field on bad input."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"invalid sampling parameter {name}: {why}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY}, 10], "
                                      f"got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                bad(name, f"must be in [-2, 2], got {value}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                bad("stop", f"each stop string must be 1..{MAX_STOP_STRING_CHARS} characters")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
