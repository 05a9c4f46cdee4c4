"""Structured outputs' grammars (llguidance): a ``StructuredOutput`` compiled
against the model's tokenizer, and one matcher per request that gives the
sampler each step's allowed tokens as a bitmask and follows the tokens drawn.

Why llguidance (measured against xgrammar on 36 real-world schemas, on a
2-core AMD EPYC: ``scripts/grammar_bench.py``): it compiles a schema in
1.4 ms (median; 3.2 ms worst) against 14 ms (92-818 ms worst), refuses what
it does not implement (a 400) where xgrammar silently drops ``allOf`` or
``minLength`` beside a ``pattern`` and let raw control characters into
strings, and it reads the tokenizer's own JSON, so special tokens
(``<|im_start|>``...) never count as text inside a constrained string.

Compiling runs on a small pool of threads with a time limit
(``GrammarCompiler.compile``; llguidance releases the GIL), each spec's
first matcher is kept (an LRU of ``CACHE_ENTRIES``) and a request's
matcher is a copy of it (microseconds), dropped with the request.
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import threading
import types
from typing import Any

import torch

from carpool.structured_output import StructuredOutput

COMPILE_TIMEOUT_S = 10.0
CACHE_ENTRIES = 512
# JSON as models write it (", " and ": "), and no other free whitespace: a
# small model may otherwise spend its whole budget on spaces between tokens.
_JSON_OPTIONS = types.MappingProxyType({"whitespace_flexible": False, "item_separator": ", ",
                                        "key_separator": ": "})


class Constraint:
    """One request's grammar state: ``fill`` writes the tokens allowed next
    into a bitmask row, ``accept`` advances past the token drawn."""

    def __init__(self, matcher: Any, executor: Any = None) -> None:
        self._matcher = matcher
        self.executor = executor  # llguidance's thread pool for batched fills

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, bitmask, row)

    def accept(self, token_id: int) -> bool:
        """False when the grammar cannot take ``token_id`` (the matcher then
        stays in its error state)."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_stopped())


# The thought before a constrained answer (``StructuredOutput.reasoning``):
# free text up to and including the close tag, then a little whitespace
# (bounded: a small model could spend its budget on blank lines), then the
# answer's own grammar (``@answer``: the first grammar of its set).
_THOUGHT = 'thought[suffix="</think>"]: /(.|\\n)*/\nGAP: /[ \\t\\r\\n]{0,8}/\n'
_REASONING_STARTS = types.MappingProxyType({
    "optional": 'start: ("<think>" thought GAP)? @answer\n',
    "inside": 'start: "<think>"? thought GAP @answer\n',
})


def _after_reasoning(answer: str, mode: str) -> str:
    """The grammar set ``answer`` (llguidance's JSON form, or Lark text)
    behind a thought, as ``mode`` opens it."""
    grammars = json.loads(answer) if answer.lstrip().startswith("{") else {
        "grammars": [{"lark_grammar": answer}]}
    grammars["grammars"][0]["name"] = "answer"
    outer = {"name": "reasoning", "lark_grammar": _REASONING_STARTS[mode] + _THOUGHT}
    grammars["grammars"].insert(0, outer)
    return json.dumps(grammars)


def _grammar_text(spec: StructuredOutput) -> str:
    answer = _answer_text(spec)
    return _after_reasoning(answer, spec.reasoning) if spec.reasoning else answer


def _answer_text(spec: StructuredOutput) -> str:
    import llguidance

    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=dict(_JSON_OPTIONS))
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                             defaults=dict(_JSON_OPTIONS))
    if spec.kind == "regex":
        return llguidance.grammar_from("regex", spec.value)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", json.loads(spec.value))
    # EBNF (GBNF) is converted to Lark; a Lark grammar (a start rule) is taken as is.
    lark = "start:" in spec.value or "start :" in spec.value
    return llguidance.grammar_from("lark" if lark else "grammar", spec.value)


class GrammarCompiler:
    """Compiles ``StructuredOutput`` specs for one tokenizer and vocabulary
    size (the model's: its logits' width). Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, timeout_s: float = COMPILE_TIMEOUT_S,  # noqa: ANN001
                 workers: int = 2) -> None:
        self.tokenizer, self.vocab_size, self.timeout_s = tokenizer, vocab_size, timeout_s
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()
        self._templates: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "carpool-grammar")
        self._executor: Any = None

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                backend = self.tokenizer.backend
                self._ll_tokenizer = llguidance.LLTokenizer(
                    backend.to_str(), n_vocab=max(self.vocab_size, backend.get_vocab_size()),
                    eos_token=list(self.tokenizer.eos_token_ids))
            return self._ll_tokenizer

    def _compile_now(self, spec: StructuredOutput) -> Any:
        import llguidance

        try:
            grammar = _grammar_text(spec)
        except (ValueError, TypeError) as exc:
            raise ValueError(str(exc)) from None
        tokenizer = self._tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(error)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def compile(self, spec: StructuredOutput) -> Any:
        """A matcher at the grammar's start (a template: copy it per request);
        ValueError naming the problem when the spec is invalid or takes over
        ``timeout_s`` to compile."""
        with self._lock:
            template = self._templates.get(spec.key)
            if template is not None:
                self._templates.move_to_end(spec.key)
                return template
        future = self._pool.submit(self._compile_and_keep, spec)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self.timed_out(spec) from None
        except (RuntimeError, ValueError, TypeError) as exc:
            raise self.refusal(spec, exc) from None

    def compile_later(self, spec: StructuredOutput) -> concurrent.futures.Future | None:
        """Compile ``spec`` on this compiler's threads, its template kept in
        the cache when done: the future of it, or None when cached already
        (so an engine thread never compiles: it waits for this first)."""
        with self._lock:
            if spec.key in self._templates:
                return None
        return self._pool.submit(self._compile_and_keep, spec)

    def timed_out(self, spec: StructuredOutput) -> ValueError:
        return ValueError(f"the {spec.kind} constraint took over {self.timeout_s:g} s to compile")

    def refusal(self, spec: StructuredOutput, exc: BaseException) -> ValueError:
        if isinstance(exc, ValueError) and str(exc).startswith("invalid "):
            return exc
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return ValueError(f"invalid {spec.kind} constraint: {first[:300]}")

    def prepare(self) -> None:
        """Build the tokenizer's grammar side now (a quarter second for a
        50k vocabulary), not on the first constrained request."""
        self._tokenizer()
        self._new_executor()

    def _compile_and_keep(self, spec: StructuredOutput) -> Any:
        template = self._compile_now(spec)
        with self._lock:
            self._templates[spec.key] = template
            while len(self._templates) > CACHE_ENTRIES:
                self._templates.popitem(last=False)
        return template

    def _new_executor(self) -> Any:
        with self._lock:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            return self._executor

    def constraint(self, spec: StructuredOutput) -> Constraint:
        template = self.compile(spec)
        return Constraint(template.deep_copy(), self._new_executor())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def fill_bitmask(constraints: list[Any], bitmask: torch.Tensor) -> None:
    """Row k of ``bitmask``: the tokens ``constraints[k]`` allows next. One
    call for the batch where they share an executor (llguidance's threads,
    the GIL released: 0.96 ms against 2.3 ms row by row at 128 rows)."""
    executor = getattr(constraints[0], "executor", None)
    if len(constraints) == 1 or executor is None or any(
            not isinstance(c, Constraint) or c.executor is not executor for c in constraints):
        for k, constraint in enumerate(constraints):
            constraint.fill(bitmask, k)
        return
    from llguidance.torch import fill_next_token_bitmask_par

    fill_next_token_bitmask_par(executor, [(c._matcher, k) for k, c in enumerate(constraints)],
                                bitmask)


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
