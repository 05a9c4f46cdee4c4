"""The limits of every per-request value a client controls, defined once.

The HTTP request models (pydantic ``Field`` constraints, hence also the
OpenAPI document), `SamplingParams.validate` and the server's header parsing
all read them from here, so the offline API and the server accept exactly
the same requests. Pure Python, no dependencies.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bound:
    """A closed or half-open numeric range ``lo .. hi`` (either may be None)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is not allowed
    hi_open: bool = False

    def contains(self, value: float) -> bool:
        if value != value:  # NaN is in no range
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def describe(self) -> str:
        """``[0, 2]``, ``(0, 1]``, ``>= 1`` ..."""
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {_number(self.lo)}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '<='} {_number(self.hi)}"
        return (f"{'(' if self.lo_open else '['}{_number(self.lo)}, {_number(self.hi)}"
                f"{')' if self.hi_open else ']'}")

    def field(self) -> dict[str, float]:
        """The same range as pydantic ``Field`` keyword arguments."""
        kwargs = {}
        if self.lo is not None:
            kwargs["gt" if self.lo_open else "ge"] = self.lo
        if self.hi is not None:
            kwargs["lt" if self.hi_open else "le"] = self.hi
        return kwargs


def _number(value: float) -> str:
    """86400000, not 8.64e+07; 0.01 as 0.01."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


# Every integer a client sends is bounded: one beyond 64 bits cannot even
# reach the engine (its wire format is msgpack), and none needs more than 31.
MAX_INT32 = 2**31 - 1
# A token id (prompts, stop_token_ids, logit_bias keys, /detokenize); the
# model's vocabulary bounds prompt ids further.
TOKEN_ID = Bound(0, MAX_INT32)

# Sampling (OpenAI's ranges where OpenAI has one).
MAX_TOKENS = Bound(1, MAX_INT32)  # the context length caps it further
# The engine takes more than OpenAI's 2, as vLLM does (some users sample
# very flat on purpose); the OpenAI-compatible API keeps OpenAI's range.
TEMPERATURE = Bound(0.0, 100.0)
API_TEMPERATURE = Bound(0.0, 2.0)
TOP_P = Bound(0.0, 1.0, lo_open=True)
TOP_K = Bound(-1, MAX_INT32)  # -1 and 0: off; more than the vocabulary: all of it
MIN_P = Bound(0.0, 1.0)
# Dividing logits by a smaller repetition penalty could overflow float32.
REPETITION_PENALTY = Bound(0.01, 10.0)
PRESENCE_PENALTY = Bound(-2.0, 2.0)
FREQUENCY_PENALTY = Bound(-2.0, 2.0)
SEED = Bound(-(2**63), 2**63, hi_open=True)
LOGPROBS = Bound(0, 20)  # the chosen token's logprob plus the top N
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# logit_bias: OpenAI's range and count (carpool refuses a non-empty one, but
# checks it first, so a bad key is named).
LOGIT_BIAS = Bound(-100.0, 100.0)
MAX_LOGIT_BIAS = 300

# carpool's extensions.
MAX_SESSION_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 256
DEADLINE_MS = Bound(0, 86_400_000, lo_open=True)  # up to a day
MAX_WAIT_MS = Bound(0, 60_000)
N = Bound(1, MAX_INT32)  # the server's max_n caps it further (also best_of)
