"""Per-request sampling parameters (OpenAI/vLLM-shaped) with validation.

The limits are ``carpool.limits``, the same ones the HTTP API's request
models declare. A `SamplingParams` is checked once, when it is made, and is
immutable after (``dataclasses.replace`` makes a checked copy), so the
engine takes it as it is.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from carpool import limits
from carpool.structured_output import StructuredOutput

# Temperatures below this sample greedily (as vLLM): dividing logits by a
# temperature that rounds to zero in float32 would give inf/NaN probabilities.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
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
    # What the output must match (a JSON schema, a regex, ...): None for free text.
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Frozen: normalise through object.__setattr__, once, before the check.
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))
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

        def within(name: str, bound: limits.Bound, integer: bool = False) -> None:
            value = getattr(self, name)
            if integer and (not isinstance(value, int) or isinstance(value, bool)):
                bad(name, f"must be an integer {bound.describe()}, got {value!r}")
            if not isinstance(value, (int, float)) or not bound.contains(value):
                bad(name, f"must be {'in ' if bound.hi is not None else ''}"
                          f"{bound.describe()}, got {value!r}")

        within("max_tokens", limits.MAX_TOKENS, integer=True)
        for name, bound in (("temperature", limits.TEMPERATURE), ("top_p", limits.TOP_P),
                            ("min_p", limits.MIN_P),
                            ("repetition_penalty", limits.REPETITION_PENALTY),
                            ("presence_penalty", limits.PRESENCE_PENALTY),
                            ("frequency_penalty", limits.FREQUENCY_PENALTY)):
            within(name, bound)
        within("top_k", limits.TOP_K, integer=True)
        if self.seed is not None:
            within("seed", limits.SEED, integer=True)
        if len(self.stop) > limits.MAX_STOP_STRINGS:
            bad("stop", f"at most {limits.MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > limits.MAX_STOP_STRING_CHARS:
                bad("stop", f"each stop string must be 1..{limits.MAX_STOP_STRING_CHARS} "
                            f"characters")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.logprobs is not None:
            within("logprobs", limits.LOGPROBS, integer=True)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            bad("structured", "must be a StructuredOutput")
