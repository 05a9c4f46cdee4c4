"""Structured outputs' grammars (xgrammar): a ``StructuredOutput`` compiled
against the model's vocabulary, and one matcher per request that gives the
sampler each step's allowed tokens as a bitmask and follows the tokens drawn.

Compiling is CPU work that a client's schema sets: it runs on a small pool
of threads with a time limit (``GrammarCompiler.compile``), compiled
grammars are cached by their spec (xgrammar's cache, bounded in bytes), and
a request's matcher is dropped with the request (nothing else holds it).
"""
from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from typing import Any

import torch

from carpool.structured_output import StructuredOutput

COMPILE_TIMEOUT_S = 10.0
CACHE_LIMIT_BYTES = 256 * 2**20
_REGEX_SPECIAL = re.compile(r"([\\^$.|?*+()\[\]{}/])")
_LARK_START = re.compile(r"^\s*[?!]?start\s*:", re.MULTILINE)
# xgrammar's errors start with a log stamp and a C++ source position.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def _vocab_type(backend_json: dict[str, Any]) -> tuple[str, bool]:
    """(xgrammar vocab type name, add_prefix_space) from tokenizer.json's decoder."""
    decoder = backend_json.get("decoder") or {}
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {step.get("type") for step in steps if isinstance(step, dict)}
    if "ByteLevel" in types:
        return "BYTE_LEVEL", False
    if "ByteFallback" in types:
        prefix = any(step.get("type") == "Strip" and step.get("start") for step in steps)
        return "BYTE_FALLBACK", prefix
    return "RAW", False


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of ``choices`` (each escaped literally)."""
    return "(" + "|".join(_REGEX_SPECIAL.sub(r"\\\1", choice) for choice in choices) + ")"


class Constraint:
    """One request's grammar state: ``fill`` writes the tokens allowed next
    into a bitmask row, ``accept`` advances past the token drawn."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """False when the grammar cannot take ``token_id`` (it is left as it was)."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class GrammarCompiler:
    """Compiles ``StructuredOutput`` specs for one tokenizer and vocabulary
    size (the model's: its logits' width). Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, timeout_s: float = COMPILE_TIMEOUT_S,  # noqa: ANN001
                 workers: int = 2) -> None:
        self.tokenizer, self.vocab_size, self.timeout_s = tokenizer, vocab_size, timeout_s
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "carpool-grammar")

    def _xgr_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                backend = self.tokenizer.backend
                vocab_type, prefix = _vocab_type(json.loads(backend.to_str()))
                size = backend.get_vocab_size(with_added_tokens=True)
                encoded = [backend.id_to_token(i) or "" for i in range(size)]
                info = xgr.TokenizerInfo(encoded, getattr(xgr.VocabType, vocab_type),
                                         vocab_size=max(self.vocab_size, size),
                                         stop_token_ids=list(self.tokenizer.eos_token_ids),
                                         add_prefix_space=prefix)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1,
                                                     cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler

    def _compile_now(self, spec: StructuredOutput) -> Any:
        compiler = self._xgr_compiler()
        # Compact JSON (no free whitespace): a small model may otherwise
        # spend its whole budget on spaces between tokens.
        if spec.kind == "json":
            return compiler.compile_json_schema(spec.value, any_whitespace=False)
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            return compiler.compile_regex(choice_regex(json.loads(spec.value)))
        if _LARK_START.search(spec.value):
            return compiler.compile_lark(spec.value)
        return compiler.compile_grammar(spec.value)

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar; ValueError naming the problem when the spec
        is invalid or takes over ``timeout_s`` to compile."""
        future = self._pool.submit(self._compile_now, spec)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise ValueError(f"the {spec.kind} constraint took over {self.timeout_s:g} s to "
                             "compile") from None
        except (RuntimeError, ValueError, TypeError) as exc:
            first = _LOG_PREFIX.sub("", (str(exc).strip().splitlines() or [type(exc).__name__])[0])
            raise ValueError(f"invalid {spec.kind} constraint: {first[:300]}") from None

    def constraint(self, spec: StructuredOutput) -> Constraint:
        import xgrammar as xgr

        return Constraint(xgr.GrammarMatcher(self.compile(spec)))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every column of ``logits`` [n, V] whose bit in
    ``bitmask`` [n, ceil(V / 32)] int32 is clear (bit j of word w: token 32w + j)."""
    n, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(n, -1)[:, :vocab]
    logits.masked_fill_(allowed.to(logits.device) == 0, float("-inf"))


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 bitmask for ``rows`` rows (CPU, as the matchers fill it)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
