"""Grammar libraries for structured outputs (issue 44): xgrammar against llguidance
on carpool's default vocabulary (SmolLM2-135M-Instruct, 49,152 byte-level BPE
tokens), measured on this machine.

For each library: the time to build its tokenizer info from the vocabulary;
then for every schema in tests/data/json_schemas: cold compile time (no cache),
whether it compiles at all (coverage, with the error when not), the first mask
after compiling, the per-request matcher cost; the per-step bitmask fill time
for B = 1, 32, 128 matchers (each first walked ~20 tokens into a valid
instance, then advanced one sampled token per step; the row-by-row call and
the library's batched/parallel call both timed, median over ``--steps``
steps); soundness: seeded constrained walks to completion whose output is
decoded, ``json.loads``-ed and validated with ``jsonschema`` (formats checked
where jsonschema can). Then the time to apply a [B, ceil(V/32)] int32 mask to
[B, V] float32 / bf16 logits on the CPU (each library's helper and a plain
torch shift-and-``masked_fill_``), how long compiling in a thread stalls the
calling (event-loop) thread, concurrent compiles from a thread pool, and a
smoke run of the other request kinds (any JSON, regex, choice, EBNF/Lark).

    pip install xgrammar llguidance
    python scripts/grammar_bench.py [--libs xgrammar,llguidance] [--steps 50]
        [--walks 3] [--json out.json]

Run it alone: on a 2-core machine any other process moves the numbers.
Both libraries are imported lazily; a missing one is a one-line error.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "json_schemas"
BATCHES = (1, 32, 128)
PREFIX_STEPS = 20
MAX_WALK = 400


def _require(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        sys.exit(f"grammar_bench: {name} is not installed (pip install xgrammar llguidance)")


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 4)


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


# --------------------------------------------------------------------------- vocabulary


class Vocab:
    """What both libraries need from carpool's tokenizer, plus the walk helpers."""

    def __init__(self) -> None:
        from carpool.model.hub import fetch_default_model
        from carpool.model.loader import load_tokenizer
        from carpool.paths import default_cache_dir

        self.tok = load_tokenizer(str(fetch_default_model(default_cache_dir())))
        self.size = self.tok.vocab_size
        self.eos = list(self.tok.eos_token_ids)
        self.special = set(self.tok.all_special_ids)
        # The tokens as the tokenizer spells them (byte-level: "Ġ" for a space), by id.
        encoded = [""] * self.size
        for text, idx in self.tok.backend.get_vocab(with_added_tokens=True).items():
            if idx < self.size:
                encoded[idx] = text
        self.encoded = encoded
        # Finishing a walk: prefer EOS, then a bare '"' (closes a string, or opens
        # the next key/value), then ']' and '}' (close containers).
        closers = [self.tok.token_to_id(c) for c in ('"', "]", "}")]
        self.finish_order = self.eos + [c for c in closers if c is not None]
        # Tokens that are only whitespace (byte-level spells \t \n \v \f \r space as
        # these code points): a finishing walk avoids them, or flexible-whitespace
        # grammars let it loop on whitespace until the token budget runs out.
        ws = set("\u0109\u010a\u010b\u010c\u010d\u0120")
        self.is_ws = np.array([bool(t) and set(t) <= ws and i not in self.special
                               for i, t in enumerate(encoded)])
        self.is_byte = np.array([len(t) == 1 and i not in self.special
                                 for i, t in enumerate(encoded)])
        self.width = (self.size + 31) // 32

    def allowed(self, row: torch.Tensor) -> np.ndarray:
        bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[: self.size]
        return np.flatnonzero(bits)

    def allowed_rows(self, mask: torch.Tensor) -> np.ndarray:
        return np.unpackbits(mask.numpy().view(np.uint8), axis=1,
                             bitorder="little")[:, : self.size]

    def pick(self, allowed: np.ndarray, rng: random.Random, finish: bool,
             allow_eos: bool = True) -> int | None:
        """A token from the allowed ids: uniform, or when ``finish``: 60% of
        the time the first of ``finish_order`` that is allowed, otherwise (or
        when none is) uniform over the allowed single-byte tokens that are not
        whitespace (else any non-whitespace, else any): short steps that close
        strings and containers soon, without looping on one closer inside a
        string that cannot end yet (an e-mail address before its '@')."""
        if not allow_eos:
            allowed = allowed[~np.isin(allowed, self.eos)]
        if allowed.size == 0:
            return None
        if finish:
            if rng.random() < 0.6:
                for t in self.finish_order:
                    if _contains(allowed, t):
                        return t
            solid = allowed[~self.is_ws[allowed]]
            short = solid[self.is_byte[solid]]
            allowed = short if short.size else solid if solid.size else allowed
        return int(allowed[rng.randrange(allowed.size)])


def _contains(sorted_ids: np.ndarray, t: int) -> bool:
    i = int(np.searchsorted(sorted_ids, t))
    return i < sorted_ids.size and int(sorted_ids[i]) == t


# --------------------------------------------------------------------------- backends


class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: Vocab, threads: int, flexible: bool) -> None:
        self.xgr = _require("xgrammar")
        self.flexible = flexible
        self.version = importlib.metadata.version("xgrammar")
        self.vocab = vocab
        self.threads = threads

    def build_tokenizer(self) -> None:
        xgr, v = self.xgr, self.vocab
        # Added special tokens (<|im_start|>, ...) go in as "": xgrammar then treats
        # them as special and never allows them; spelled out, they would be allowed
        # as literal text inside JSON strings.
        encoded = ["" if i in v.special else s for i, s in enumerate(v.encoded)]
        self.info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=v.size,
                                      stop_token_ids=v.eos, add_prefix_space=False)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=self.threads,
                                            cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=self.threads)

    def compile(self, schema_text: str) -> Any:
        return self.compile_in(self.compiler, schema_text)

    def compile_in(self, compiler: Any, schema_text: str) -> Any:
        return compiler.compile_json_schema(schema_text, any_whitespace=self.flexible)

    def fresh_compiler(self) -> Any:
        return self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def memory_bytes(self, compiled: Any) -> int | None:
        return int(compiled.memory_size_bytes)

    def fill(self, m: Any, mask: torch.Tensor, i: int) -> None:
        m.fill_next_token_bitmask(mask, i)

    def fill_batch(self, ms: list, mask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, mask)

    def accept(self, m: Any, t: int) -> bool:
        return m.accept_token(t)

    def done(self, m: Any) -> bool:
        return m.is_terminated()

    def reset(self, m: Any) -> None:
        m.reset()

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab.size)

    def smoke(self) -> dict[str, Any]:
        c = self.compiler
        return {"any_json": c.compile_builtin_json_grammar(),
                "json_object": self.compile('{"type": "object"}'),
                "regex": c.compile_regex(r"[A-Z]{3}-[0-9]{2,4}"),
                "choice": c.compile_grammar(self.xgr.Grammar.from_ebnf(
                    'root ::= "positive" | "negative" | "neutral"')),
                "ebnf": c.compile_grammar(
                    'root ::= expr\nexpr ::= term (("+" | "-") term)*\n'
                    'term ::= [0-9]+ | "(" expr ")"'),
                "lark": c.compile_lark('start: "yes" | "no"')}


class LLGuidance:
    name = "llguidance"

    def __init__(self, vocab: Vocab, threads: int, flexible: bool) -> None:
        self.llg = _require("llguidance")
        self.llt = importlib.import_module("llguidance.torch")
        self.version = importlib.metadata.version("llguidance")
        self.vocab = vocab
        self.threads = threads
        # whitespace_flexible is llguidance's any_whitespace (xgrammar's name)
        self.options = {"whitespace_flexible": flexible}

    def build_tokenizer(self) -> None:
        v = self.vocab
        # The tokenizers JSON itself: llguidance reads the vocabulary, merges and
        # added tokens (special ones are kept out of text) from it.
        self.tok = self.llg.LLTokenizer(v.tok.backend.to_str(), n_vocab=v.size, eos_token=v.eos)
        self.executor = self.llg.LLExecutor(num_threads=self.threads)

    def compile(self, schema_text: str, relaxed: bool = False) -> Any:
        options = dict(self.options)
        if relaxed:  # oneOf read as anyOf, unknown keywords ignored
            options.update(coerce_one_of=True, lenient=True)
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema_text, defaults=options)
        return self._matcher_of(grammar)

    def _matcher_of(self, grammar: str) -> Any:
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return (grammar, m)

    def compile_in(self, compiler: Any, schema_text: str) -> Any:
        return self.compile(schema_text)

    def fresh_compiler(self) -> Any:
        return None

    def matcher(self, compiled: Any) -> Any:
        return compiled[1].deep_copy()

    def memory_bytes(self, compiled: Any) -> int | None:
        return None

    def fill(self, m: Any, mask: torch.Tensor, i: int) -> None:
        self.llt.fill_next_token_bitmask(m, mask, i)

    def fill_batch(self, ms: list, mask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)],
                                             mask)

    def accept(self, m: Any, t: int) -> bool:
        return m.consume_token(t)

    def done(self, m: Any) -> bool:
        return m.is_stopped()

    def reset(self, m: Any) -> None:
        m.reset()

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self.llt.apply_token_bitmask_inplace(logits, mask)

    def smoke(self) -> dict[str, Any]:
        g = self.llg.grammar_from
        return {"any_json": self._matcher_of(g("json_schema", '{}')),
                "json_object": self.compile('{"type": "object"}'),
                "regex": self._matcher_of(g("regex", r"[A-Z]{3}-[0-9]{2,4}")),
                "choice": self._matcher_of(g("choice", ["positive", "negative", "neutral"])),
                "ebnf": self._matcher_of(g("grammar",
                                           'root ::= expr\nexpr ::= term (("+" | "-") term)*\n'
                                           'term ::= [0-9]+ | "(" expr ")"')),
                "lark": self._matcher_of(g("lark", 'start: "yes" | "no"'))}


LIBS = {"xgrammar": XGrammar, "llguidance": LLGuidance}


# --------------------------------------------------------------------------- walks


def walk(lib: Any, vocab: Vocab, m: Any, rng: random.Random, random_steps: int,
         max_tokens: int = MAX_WALK) -> dict[str, Any]:
    """Sample a whole output through matcher ``m``: uniform among the allowed
    tokens for ``random_steps`` steps, then finishing-biased (see Vocab.pick)."""
    mask = torch.full((1, vocab.width), -1, dtype=torch.int32)
    ids: list[int] = []
    ended, error = False, None
    for step in range(max_tokens):
        lib.fill(m, mask, 0)
        allowed = vocab.allowed(mask[0])
        t = vocab.pick(allowed, rng, finish=step >= random_steps)
        if t is None:
            error = "empty mask"
            break
        if t in vocab.eos:
            ended = lib.accept(m, t) or lib.done(m)
            if not ended:
                error = "EOS in mask but not accepted"
            break
        if not lib.accept(m, t):
            error = f"token {t} from the mask was rejected"
            break
        ids.append(t)
    return {"ids": ids, "ended": ended, "error": error}


def check_instance(vocab: Vocab, ids: list[int], validator: Any) -> dict[str, Any]:
    text = vocab.tok.decode(ids, skip_special_tokens=False)
    try:
        value = json.loads(text)
    except ValueError as e:
        return {"parsed": False, "valid": False, "why": f"json: {e}", "text": text[:300]}
    errors = [e.message for e in validator.iter_errors(value)]
    return {"parsed": True, "valid": not errors, "why": "; ".join(errors)[:300] or None,
            "text": text[:300]}


def advance(lib: Any, vocab: Vocab, m: Any, rng: random.Random, steps: int) -> None:
    """Walk a fresh matcher ``steps`` tokens into a valid prefix (never EOS)."""
    mask = torch.full((1, vocab.width), -1, dtype=torch.int32)
    uniform = rng.randrange(steps + 1)
    for step in range(steps):
        lib.fill(m, mask, 0)
        t = vocab.pick(vocab.allowed(mask[0]), rng, finish=step >= uniform, allow_eos=False)
        if t is None or not lib.accept(m, t):
            return


# --------------------------------------------------------------------------- measurements


def bench_schema(lib: Any, vocab: Vocab, name: str, schema: dict, args: Any) -> dict[str, Any]:
    text = json.dumps(schema)
    out: dict[str, Any] = {"schema": name}
    times = []
    compiled = None
    for rep in range(3):  # first is cold (no cache); the repeats show the spread
        gc.collect()
        t0 = time.perf_counter()
        try:
            compiled = lib.compile(text)
        except Exception as e:  # noqa: BLE001 - any failure is a coverage miss
            out.update(compiles=False, error=f"{type(e).__name__}: {e}"[:500])
            return out
        times.append(time.perf_counter() - t0)
    out.update(compiles=True, compile_ms=_ms(times[0]), compile_min_ms=_ms(min(times)),
               memory_bytes=lib.memory_bytes(compiled))
    # per-request matcher + its first mask (llguidance builds its lexer lazily)
    mask = torch.full((1, vocab.width), -1, dtype=torch.int32)
    t0 = time.perf_counter()
    m = lib.matcher(compiled)
    t1 = time.perf_counter()
    lib.fill(m, mask, 0)
    t2 = time.perf_counter()
    out.update(matcher_ms=_ms(t1 - t0), first_mask_ms=_ms(t2 - t1),
               compile_first_mask_ms=_ms(times[0] + t2 - t0))
    if lib.name == "llguidance":  # matcher straight from the grammar, no template copy
        t0 = time.perf_counter()
        lib.llg.LLMatcher(lib.tok, compiled[0], log_level=0)
        out["matcher_from_grammar_ms"] = _ms(time.perf_counter() - t0)

    # soundness: seeded walks to completion, then json.loads + jsonschema
    import jsonschema

    cls = jsonschema.validators.validator_for(schema)  # its draft's format checker
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    walks = []
    for seed in range(args.walks):
        rng = random.Random(1000 * seed + 7)
        # finishing-biased after a uniform stretch of 0..40 tokens
        res = walk(lib, vocab, lib.matcher(compiled), rng, random_steps=rng.randrange(41))
        res.update(kind="biased", seed=seed)
        walks.append(res)
    rng = random.Random(12345)
    res = walk(lib, vocab, lib.matcher(compiled), rng, random_steps=MAX_WALK)
    res.update(kind="uniform", seed=0)
    walks.append(res)
    for w in walks:
        w["tokens"] = len(w["ids"])
        if w["ended"]:
            w.update(check_instance(vocab, w["ids"], validator))
        else:  # where it was when the budget ran out
            w["text"] = vocab.tok.decode(w["ids"], skip_special_tokens=False)[-300:]
        del w["ids"]
    out["walks"] = walks

    # per-step fill time at B rows
    out["fill"] = {}
    for b in BATCHES:
        out["fill"][b] = bench_fill(lib, vocab, compiled, b, args.steps)
    return out


def bench_fill(lib: Any, vocab: Vocab, compiled: Any, b: int, steps: int) -> dict[str, float]:
    rng = random.Random(b)
    ms = [lib.matcher(compiled) for _ in range(b)]
    for m in ms:
        advance(lib, vocab, m, rng, PREFIX_STEPS)
    mask = torch.full((b, vocab.width), -1, dtype=torch.int32)
    loop_t, batch_t, accept_t = [], [], []
    resets, same = 0, True
    for step in range(steps + 2):  # two warm-up steps
        t0 = time.perf_counter()
        for i, m in enumerate(ms):
            lib.fill(m, mask, i)
        t1 = time.perf_counter()
        loop_mask = mask.clone()
        mask.fill_(0)
        t2 = time.perf_counter()
        lib.fill_batch(ms, mask)
        t3 = time.perf_counter()
        same = same and torch.equal(loop_mask, mask)
        rows = vocab.allowed_rows(mask)
        picks = []
        for i in range(b):
            allowed = np.flatnonzero(rows[i])
            picks.append(vocab.pick(allowed, rng, finish=rng.random() < 0.5, allow_eos=False))
        t4 = time.perf_counter()
        for m, t in zip(ms, picks):
            if t is not None:
                lib.accept(m, t)
        t5 = time.perf_counter()
        for i, (m, t) in enumerate(zip(ms, picks)):
            if t is None or lib.done(m):
                lib.reset(m)  # finished (only EOS left): start this row over
                resets += 1
        if step >= 2:
            loop_t.append(t1 - t0)
            batch_t.append(t3 - t2)
            accept_t.append(t5 - t4)
    return {"loop_ms": _ms(statistics.median(loop_t)), "batch_ms": _ms(statistics.median(batch_t)),
            "accept_ms": _ms(statistics.median(accept_t)), "resets": resets,
            "batch_matches_loop": same}


def plain_apply(logits: torch.Tensor, mask: torch.Tensor, shifts: torch.Tensor) -> None:
    """Unpack the mask's bytes with shifts (bit j of token word k is token
    32k + j; bytes in little-endian order, as on x86/ARM), then -inf where 0."""
    b, v = logits.shape
    bits = torch.bitwise_and(mask.view(torch.uint8).unsqueeze(-1) >> shifts, 1)  # [B, 4W, 8]
    logits.masked_fill_(bits.view(torch.bool).view(b, -1)[:, :v].logical_not(), float("-inf"))


def bench_apply(libs: list, vocab: Vocab, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    shifts = torch.arange(8, dtype=torch.uint8)
    impls: dict[str, Any] = {"torch_plain": lambda lg, mk: plain_apply(lg, mk, shifts)}
    for lib in libs:
        impls[lib.name] = lib.apply
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for b in BATCHES:
            mask = torch.randint(-2**31, 2**31 - 1, (b, vocab.width), dtype=torch.int32,
                                 generator=g)
            base = torch.randn(b, vocab.size, generator=g).to(dtype)
            ref = base.clone()  # reference: numpy's unpackbits, then -inf where 0
            ref.masked_fill_(torch.from_numpy(vocab.allowed_rows(mask)) == 0, float("-inf"))
            for name, fn in impls.items():
                key = f"{name}/{str(dtype).removeprefix('torch.')}/B={b}"
                logits = base.clone()
                try:
                    t0 = time.perf_counter()
                    fn(logits, mask)  # first call: torch.compile warm-up for llguidance
                    first = time.perf_counter() - t0
                    ok = torch.equal(logits, ref)
                    ts = []
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        fn(logits, mask)
                        ts.append(time.perf_counter() - t0)
                    out[key] = {"ms": _ms(statistics.median(ts)), "first_ms": _ms(first),
                                "matches_ref": ok}
                except Exception as e:  # noqa: BLE001
                    out[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


def stall_probe(fn: Any) -> dict[str, float]:
    """Run ``fn`` in a thread while this thread sleeps 1 ms at a time; the
    longest gap between wake-ups is how long an event loop would freeze."""
    done = threading.Event()
    took: list[float] = []

    def work() -> None:
        t0 = time.perf_counter()
        fn()
        took.append(time.perf_counter() - t0)
        done.set()

    th = threading.Thread(target=work)
    last = time.perf_counter()
    worst = 0.0
    th.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        worst = max(worst, now - last)
        last = now
    th.join()
    return {"compile_ms": _ms(took[0]), "max_main_thread_gap_ms": _ms(worst)}


def concurrency_probe(lib: Any, schemas: dict[str, dict], expect: dict[str, bool]
                      ) -> dict[str, Any]:
    """Compile every schema from 4 threads at once on one shared compiler /
    tokenizer: the same schemas must compile as serially, with no crash."""
    compiler = lib.fresh_compiler()

    def one(item: tuple[str, dict]) -> tuple[str, bool]:
        try:
            lib.compile_in(compiler, json.dumps(item[1]))
            return item[0], True
        except Exception:  # noqa: BLE001
            return item[0], False

    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        got = dict(pool.map(one, list(schemas.items()) * 2))
    return {"wall_ms": _ms(time.perf_counter() - t0), "compiles": 2 * len(schemas),
            "same_as_serial": got == expect}


def smoke_walks(lib: Any, vocab: Vocab) -> dict[str, Any]:
    out = {}
    for kind, compiled in lib.smoke().items():
        rng = random.Random(3)
        res = walk(lib, vocab, lib.matcher(compiled), rng, random_steps=3, max_tokens=60)
        out[kind] = {"text": vocab.tok.decode(res["ids"], skip_special_tokens=False)[:120],
                     "ended": res["ended"], "error": res["error"]}
    return out


# --------------------------------------------------------------------------- report


def summarize(lib_res: dict[str, Any], common: set[str]) -> dict[str, Any]:
    rows = [r for r in lib_res["schemas"] if r["compiles"]]
    rows_c = [r for r in rows if r["schema"] in common]

    def med_max(vals: list[float]) -> list[float]:
        return [round(statistics.median(vals), 3), round(max(vals), 3)] if vals else []

    walks = [w for r in rows for w in r["walks"]]
    biased = [w for w in walks if w["kind"] == "biased"]
    uniform = [w for w in walks if w["kind"] == "uniform"]

    def tally(ws: list[dict]) -> dict[str, int]:
        return {"walks": len(ws), "ended": sum(w["ended"] for w in ws),
                "parsed": sum(bool(w.get("parsed")) for w in ws),
                "valid": sum(bool(w.get("valid")) for w in ws),
                "errors": sum(w["error"] is not None for w in ws)}

    s = {"coverage": f"{len(rows)}/{len(lib_res['schemas'])}",
         "compile_ms_median_max": med_max([r["compile_ms"] for r in rows_c]),
         "compile_first_mask_ms_median_max": med_max([r["compile_first_mask_ms"] for r in rows_c]),
         "matcher_ms_median_max": med_max([r["matcher_ms"] for r in rows_c]),
         "validity_biased": tally(biased), "validity_uniform": tally(uniform), "fill": {}}
    mem = [r["memory_bytes"] for r in rows_c if r.get("memory_bytes") is not None]
    if mem:
        s["compiled_kib_median_max"] = med_max([m / 1024 for m in mem])
    for b in BATCHES:
        for k in ("loop_ms", "batch_ms", "accept_ms"):
            s["fill"][f"{k}/B={b}"] = med_max([r["fill"][b][k] for r in rows_c])
    return s


def markdown(result: dict[str, Any]) -> str:
    names = list(result["libraries"])
    libs = result["libraries"]
    head = "| | " + " | ".join(f"{n} {libs[n]['version']}" for n in names) + " |"
    lines = [head, "|---|" + "---|" * len(names)]

    def row(label: str, fn: Any) -> None:
        cells = []
        for n in names:
            try:
                cells.append(fn(libs[n]))
            except (KeyError, IndexError, TypeError):
                cells.append("-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    def mm(v: list[float]) -> str:
        return f"{v[0]:.3g} / {v[1]:.3g}"

    def tally(t: dict) -> str:
        return f"{t['valid']}/{t['walks']} valid ({t['ended']} ended, {t['parsed']} parsed)"

    row("tokenizer info (s)", lambda r: f"{r['tokenizer_s']:.3f}")
    row("coverage (compiles)", lambda r: r["summary"]["coverage"])
    row("coverage, llguidance coerce_one_of+lenient", lambda r: r["coverage_relaxed"])
    row("compile ms, cold (median / max)*", lambda r: mm(r["summary"]["compile_ms_median_max"]))
    row("compile + matcher + 1st mask ms*",
        lambda r: mm(r["summary"]["compile_first_mask_ms_median_max"]))
    row("new matcher per request ms*", lambda r: mm(r["summary"]["matcher_ms_median_max"]))
    row("compiled grammar KiB*", lambda r: mm(r["summary"]["compiled_kib_median_max"]))
    row("validity, finishing walks", lambda r: tally(r["summary"]["validity_biased"]))
    row("validity, uniform walks (<=400 tok)", lambda r: tally(r["summary"]["validity_uniform"]))
    for b in BATCHES:
        row(f"fill B={b}, row loop ms/step*", lambda r, b=b: mm(r["summary"]["fill"][f"loop_ms/B={b}"]))
        row(f"fill B={b}, batched API ms/step*",
            lambda r, b=b: mm(r["summary"]["fill"][f"batch_ms/B={b}"]))
        row(f"accept B={b} tokens ms/step*",
            lambda r, b=b: mm(r["summary"]["fill"][f"accept_ms/B={b}"]))
    apply = result["apply"]
    for dt in ("float32", "bfloat16"):
        row(f"apply mask {dt} ms, B=1/32/128",
            lambda r, dt=dt: " / ".join(_apply_cell(apply, r["name"], dt, b) for b in BATCHES))
    row("stall of caller while compiling in a thread",
        lambda r: f"{r['stall']['max_main_thread_gap_ms']:.1f} ms gap during a "
                  f"{r['stall']['compile_ms']:.0f} ms compile")
    row("4-thread concurrent compiles",
        lambda r: f"{r['concurrency']['compiles']} in {r['concurrency']['wall_ms']:.0f} ms, "
                  f"same as serial: {r['concurrency']['same_as_serial']}")
    lines.append("")
    lines.append("\\* median / max over the schemas both libraries compile "
                 f"({len(result['common_schemas'])}); fill/accept: per-schema median over "
                 f"{result['args']['steps']} steps.")
    plain = " / ".join(_apply_cell(apply, "torch_plain", "float32", b) for b in BATCHES)
    plain16 = " / ".join(_apply_cell(apply, "torch_plain", "bfloat16", b) for b in BATCHES)
    lines.append(f"Plain torch apply (shifts + masked_fill_), B=1/32/128: float32 {plain} ms; "
                 f"bf16 {plain16} ms.")
    lines.append("")
    lines.append("| schema | " + " | ".join(f"{n} compile ms" for n in names) + " |")
    lines.append("|---|" + "---|" * len(names))
    by_name = {n: {r["schema"]: r for r in libs[n]["schemas"]} for n in names}
    for schema in sorted(by_name[names[0]]):
        cells = []
        for n in names:
            r = by_name[n][schema]
            if r["compiles"]:
                bad = [w for w in r["walks"] if w["ended"] and not w.get("valid")]
                cells.append(f"{r['compile_ms']:.1f}" + (f" ({len(bad)} invalid walk)"
                                                         if bad else ""))
            else:
                cells.append("FAILS: " + r["error"][:90].replace("|", "/").replace("\n", " "))
        lines.append(f"| {schema} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _apply_cell(apply: dict, name: str, dt: str, b: int) -> str:
    r = apply.get(f"{name}/{dt}/B={b}", {})
    if "ms" not in r:
        return "err"
    return f"{r['ms']:.3g}" + ("" if r["matches_ref"] else "!")


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--libs", default="xgrammar,llguidance")
    ap.add_argument("--schemas", default=str(SCHEMA_DIR))
    ap.add_argument("--steps", type=int, default=50, help="timed fill steps per schema and B")
    ap.add_argument("--walks", type=int, default=3, help="finishing walks per schema")
    ap.add_argument("--apply-reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads for the libraries' compile/batched fill")
    ap.add_argument("--whitespace", choices=("flexible", "compact"), default="flexible",
                    help="JSON whitespace: any (both libraries' server default) or none")
    ap.add_argument("--json", default=None, help="write the full results here")
    args = ap.parse_args()

    schemas = {p.stem: json.loads(p.read_text()) for p in sorted(Path(args.schemas).glob("*.json"))}
    chosen = [n.strip() for n in args.libs.split(",") if n.strip()]
    for n in chosen:
        if n not in LIBS:
            sys.exit(f"grammar_bench: unknown library {n!r} (known: {', '.join(LIBS)})")
    torch.set_num_threads(args.threads)
    vocab = Vocab()
    result: dict[str, Any] = {
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "load_avg": os.getloadavg()},
        "vocab": {"size": vocab.size, "eos": vocab.eos}, "args": vars(args),
        "libraries": {}}
    libs = []
    for n in chosen:
        lib = LIBS[n](vocab, args.threads, args.whitespace == "flexible")
        libs.append(lib)
        rss0 = _rss_mb()
        t0 = time.perf_counter()
        lib.build_tokenizer()
        tok_s = time.perf_counter() - t0
        lib.compile('{"type": "object", "properties": {"a": {"type": "integer"}}}')  # warm-up
        print(f"{n} {lib.version}: tokenizer info {tok_s:.3f} s", file=sys.stderr)
        res: dict[str, Any] = {"name": n, "version": lib.version, "tokenizer_s": round(tok_s, 4),
                               "schemas": []}
        for name, schema in schemas.items():
            r = bench_schema(lib, vocab, name, schema, args)
            res["schemas"].append(r)
            msg = f"compile {r['compile_ms']:.1f} ms" if r["compiles"] else f"FAILS {r['error'][:80]}"
            print(f"  {name}: {msg}", file=sys.stderr)
        res["rss_growth_mb"] = round(_rss_mb() - rss0, 1)
        if n == "llguidance":
            relaxed = []
            for name, schema in schemas.items():
                try:
                    lib.compile(json.dumps(schema), relaxed=True)
                    relaxed.append(name)
                except Exception:  # noqa: BLE001
                    pass
            res["coverage_relaxed"] = f"{len(relaxed)}/{len(schemas)}"
        expect = {r["schema"]: r["compiles"] for r in res["schemas"]}
        slowest = max((r for r in res["schemas"] if r["compiles"]), key=lambda r: r["compile_ms"])
        slow_text = json.dumps(schemas[slowest["schema"]])
        comp = lib.fresh_compiler()
        res["stall"] = {"schema": slowest["schema"],
                        **stall_probe(lambda: lib.compile_in(comp, slow_text))}
        res["concurrency"] = concurrency_probe(lib, schemas, expect)
        res["smoke"] = smoke_walks(lib, vocab)
        result["libraries"][n] = res
    ok_sets = [{r["schema"] for r in result["libraries"][n]["schemas"] if r["compiles"]}
               for n in chosen]
    common = set.intersection(*ok_sets)
    result["common_schemas"] = sorted(common)
    for n in chosen:
        result["libraries"][n]["summary"] = summarize(result["libraries"][n], common)
    result["apply"] = bench_apply(libs, vocab, args.apply_reps)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    print(f"CPU: {result['machine']['cpu']}, {os.cpu_count()} cores; vocab {vocab.size}; "
          f"{len(schemas)} schemas")
    print(markdown(result))
    for n in chosen:
        print(f"\n{n} smoke (other request kinds):")
        for kind, r in result["libraries"][n]["smoke"].items():
            print(f"  {kind}: {r['text']!r} ended={r['ended']} error={r['error']}")
        bad = [(r["schema"], w) for r in result["libraries"][n]["schemas"] if r["compiles"]
               for w in r["walks"] if w["ended"] and not w.get("valid")]
        for schema, w in bad:
            print(f"  invalid {schema} ({w['kind']} seed {w['seed']}): {w['why']}: {w['text']!r}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
