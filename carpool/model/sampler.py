"""Batched token sampling: penalties, temperature, top-k/top-p/min-p, logprobs.

A row's randomness comes from a ``torch.Generator`` seeded with a 64-bit mix
of ``(seed, step)``, and tokens are drawn by inverse CDF over the kept tokens
in vocabulary order, with per-row reductions of fixed shape. A row's token
therefore depends only on its own logits, parameters, seed and step, never on
batch mates or its position in the batch.

Order (as vLLM): penalties, temperature, then min-p, top-k and top-p on the
tempered distribution, top-p measured against the mass min-p/top-k kept.
Filters cut by probability value, so tied tokens are kept or dropped together.
Sampling runs on the logits' device, in float32. Each row's uniforms are drawn
on the CPU, so they are the same numbers on any device. Off the CPU, row sums
and running sums are spelled out in a fixed order, so a row's token ignores
its batch there too; it may differ from the CPU's where rounding differs.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from carpool.model import row_reductions as rows_ops
from carpool.model.grammar import apply_token_bitmask, fill_bitmask, new_bitmask
from carpool.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
# Routes of a random row: from its top candidates, over the whole vocabulary,
# or by nucleus rejection.
_CANDIDATES, _FULL, _NUCLEUS = 0, 1, 2
# Below this top_p, rejection (acceptance >= top_p per try) is not tried first.
_CANDIDATE_TOP_P = 0.5


@dataclass(slots=True)
class SamplingRow:
    """One sequence to sample: ``seed`` is the effective seed (the engine draws one
    when ``params.seed`` is None), ``step`` the index of the output token drawn.
    ``prompt_token_ids`` matters only for ``repetition_penalty``."""

    params: SamplingParams
    seed: int
    step: int
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    # Structured outputs: the request's grammar state (carpool/model/grammar.py
    # ``Constraint``: ``fill(bitmask, row)``, ``accept(token)``), or None.
    constraint: Any = None
    # From ``params`` (fixed for a row's life), once: read per row per step,
    # where a property call costs (the engine keeps one row per request).
    penalized: bool = field(init=False)  # params.needs_penalties
    edited: bool = field(init=False)  # penalties or a constraint change its logits
    plain_greedy: bool = field(init=False)  # greedy, logits as they are

    def __post_init__(self) -> None:
        self.penalized = self.params.needs_penalties
        self.edited = self.penalized or self.constraint is not None
        self.plain_greedy = self.params.greedy and not self.edited


@dataclass
class SampleResult:
    """The drawn token; with ``logprobs`` asked, its raw logprob and the top N."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def _fmix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix_seed(seed: int, step: int) -> int:
    """Hash ``(seed, step)`` to a 64-bit generator seed (splitmix64 finalizer)."""
    return _fmix64((_fmix64(seed & _MASK64) + 0x9E3779B97F4A7C15 * (step + 1)) & _MASK64)


def _row_uniforms(seed: int, step: int, n: int) -> torch.Tensor:
    """A row's ``n`` float64 uniforms, always drawn on the CPU (even under a
    device context): the same numbers whatever device the logits are on."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(mix_seed(seed, step))
    return torch.rand(n, generator=gen, dtype=torch.float64, device="cpu")


def _host_f32(values: list[float]) -> torch.Tensor:
    """Per-row parameters as a float32 CPU tensor: checks on it need no device sync."""
    return torch.tensor(values, dtype=torch.float32, device="cpu")


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Make new tensors on ``device`` (no context where it is the default already:
    a device context adds overhead to every torch call)."""
    default = device == torch.get_default_device()
    return contextlib.nullcontext() if default else torch.device(device)


def _index(idx: list[int]) -> slice | torch.Tensor:
    """Rows ``idx`` as an index: a slice where consecutive (no tensor to copy to a device)."""
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return slice(idx[0], idx[0] + len(idx))
    return torch.tensor(idx, dtype=torch.long)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _argmax(x: torch.Tensor) -> torch.Tensor:
    # max(dim) gives the first maximal index like argmax, and is much faster on CPU.
    return x.max(dim=-1).indices


def _col(x: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """``x[r, j[r]]`` for every row r."""
    return x.gather(1, j.unsqueeze(1)).squeeze(1)


def _put(dst: list[int], idx: Sequence[int], values: Sequence[int]) -> None:
    for i, v in zip(idx, values):
        dst[i] = v


def _collect(acc: tuple[list[int], list[int], list[int]], row: int, ids: Sequence[int]) -> None:
    acc[0].extend(ids)
    acc[1].append(row)
    acc[2].append(len(ids))


def _first_route(params: SamplingParams) -> int:
    """Top-k rows and small top-p rows start from candidates (which may hand
    them on); other top-p rows go to rejection; the rest sample the whole
    vocabulary above their min-p floor. Depends on the row's own params only."""
    if params.top_k > 0 or params.top_p < _CANDIDATE_TOP_P:
        return _CANDIDATES
    return _NUCLEUS if params.top_p < 1.0 else _FULL


def _nucleus_cut(vals: torch.Tensor, floor: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """For rows of descending ``vals``: the value at which the running sum of
    those >= ``floor`` first reaches ``need`` (at most the last one kept)."""
    kept = vals * (vals >= floor.unsqueeze(1))
    cum = rows_ops.row_cumsum(kept)
    n_kept = (kept > 0).sum(dim=-1).clamp(min=1)
    j = torch.minimum((cum < need.unsqueeze(1)).sum(dim=-1), n_kept - 1)
    return torch.maximum(floor, _col(vals, j))


def _pick(cum: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: per row, the first index whose running mass ``cum`` exceeds
    ``unit * total``, clamped to the last index that adds mass (so the pick
    always has positive weight, even when the target rounds up)."""
    total = cum[:, -1:].contiguous()
    target = (unit.unsqueeze(1) * total.double()).to(cum.dtype)
    first = torch.searchsorted(cum, target, right=True)
    return torch.minimum(first, torch.searchsorted(cum, total)).squeeze(1)


class Sampler:
    """Draws one token per row of a ``[B, V]`` logits batch. ``candidates``: top
    tokens a small-top-p row is first resolved from; ``block``: the block size
    of the two-level inverse CDF. Fixed per sampler: no choice depends on batch mates."""

    ATTEMPTS = 32  # rejection tries before a row's nucleus is found by sorting
    CHUNK_ELEMENTS = 1 << 22  # float32 logits processed per chunk of rows
    DEVICE_CHUNK_ELEMENTS = 1 << 26  # the same off the CPU, where fewer calls pay

    def __init__(self, vocab_size: int, candidates: int = 256, block: int = 256) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.candidates = max(1, min(candidates, vocab_size))
        self.block = max(1, min(block, vocab_size))
        # An all-greedy batch's argmax over the model-dtype logits: our CPU
        # kernel's ``row_argmax`` when the executor has it (5x ATen's bf16
        # max on a 64 x 49k batch), else torch.max (the same indices).
        self.row_argmax: Callable[[torch.Tensor], torch.Tensor] = _argmax
        # Structured outputs' mask (logits [n, V] float32, bitmask [n, V/32]
        # int32, in place): our CPU kernel when the executor has it, else torch's.
        self.apply_bitmask: Callable[[torch.Tensor, torch.Tensor], None] = apply_token_bitmask

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampleResult]:
        """Sample one token per row; ``logits`` is ``[len(rows), >= vocab_size]``, any
        float dtype (math in float32), never modified; padding columns are ignored."""
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits shape {tuple(logits.shape)} does not fit {len(rows)} rows "
                             f"of vocab {self.vocab_size}")
        if not rows:
            return []
        logits = logits[:, :self.vocab_size]
        if all(r.plain_greedy and r.params.logprobs is None for r in rows):
            return [SampleResult(t) for t in self.row_argmax(logits).tolist()]
        with _on(logits.device):
            return self._sample(logits, rows)

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampleResult]:
        """``sample`` past its checks, with new tensors made on the logits' device."""
        x = logits.to(dtype=torch.float32).contiguous()
        aliased = _shares(x, logits)  # no copy was made: x must not be edited in place
        logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        tokens = [0] * len(rows)
        plain = [i for i, r in enumerate(rows) if r.plain_greedy]
        if plain:
            _put(tokens, plain, _argmax(self._take(x, plain)).tolist())
        work = [i for i, r in enumerate(rows) if not r.plain_greedy]
        if work:
            # Logprobs come from the raw logits: keep x untouched when they are asked.
            self._sample_work(x, aliased or bool(logprob_rows), work, rows, tokens)
        for i, row in enumerate(rows):  # the grammars follow the tokens drawn
            if row.constraint is not None:
                row.constraint.accept(tokens[i])
        return self._results(x, tokens, rows, logprob_rows)

    def _chunk_rows(self, x: torch.Tensor) -> int:
        chunk = self.DEVICE_CHUNK_ELEMENTS if rows_ops.off_cpu(x) else self.CHUNK_ELEMENTS
        return max(1, chunk // self.vocab_size)

    @staticmethod
    def _take(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
        # Consecutive rows come as a view, others as a copy.
        at = _index(idx)
        return x[at] if isinstance(at, slice) else x.index_select(0, at)

    def _sample_work(self, x: torch.Tensor, aliased: bool, work: list[int],
                     rows: Sequence[SamplingRow], tokens: list[int]) -> None:
        """Rows with penalties or temperature > 0, in chunks of CHUNK_ELEMENTS: the
        float32 temporaries stay cache-sized and below glibc's mmap threshold
        (off the CPU, DEVICE_CHUNK_ELEMENTS: only memory bounds them).
        Penalized rows are chunked apart, so only their chunks get copied."""
        step = self._chunk_rows(x)
        penal = [i for i in work if rows[i].edited]
        clean = [i for i in work if not rows[i].edited]
        for group in (penal, clean):
            for lo in range(0, len(group), step):
                part = group[lo:lo + step]
                z = self._take(x, part)
                owned = not (aliased and _shares(z, x))
                part_rows = [rows[i] for i in part]
                if group is penal:
                    z = z if owned else z.clone()
                    owned = True
                    self._edit(z, part_rows)
                greedy = [j for j, r in enumerate(part_rows) if r.params.greedy]
                if greedy:
                    _put(tokens, [part[j] for j in greedy], _argmax(self._take(z, greedy)).tolist())
                rand = [j for j, r in enumerate(part_rows) if not r.params.greedy]
                if rand:
                    zr = self._take(z, rand)
                    picked = self._sample_random(zr, owned or not _shares(zr, z),
                                                 [part_rows[j] for j in rand])
                    _put(tokens, [part[j] for j in rand], picked)

    def _results(self, x: torch.Tensor, tokens: list[int], rows: Sequence[SamplingRow],
                 logprob_rows: list[int]) -> list[SampleResult]:
        """Wrap tokens; add raw logprobs where asked (``x`` holds the raw logits)."""
        results = [SampleResult(t) for t in tokens]
        if not logprob_rows:
            return results
        n = min(max(rows[i].params.logprobs or 0 for i in logprob_rows), self.vocab_size)
        step = self._chunk_rows(x)
        for lo in range(0, len(logprob_rows), step):
            part = logprob_rows[lo:lo + step]
            z = self._take(x, part)
            lse = torch.logsumexp(z, dim=-1)
            chosen = (_col(z, torch.tensor([tokens[i] for i in part])) - lse).tolist()
            top_vals, top_ids = z.topk(n, dim=-1)
            top_vals, top_ids = (top_vals - lse.unsqueeze(1)).tolist(), top_ids.tolist()
            for k, i in enumerate(part):
                want = rows[i].params.logprobs or 0
                results[i].logprob = chosen[k]
                results[i].top_logprobs = list(zip(top_ids[k][:want], top_vals[k][:want]))
        return results

    def _edit(self, z: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Penalties, then each constrained row's mask of allowed tokens, in place."""
        penalized = [j for j, r in enumerate(rows) if r.penalized]
        if penalized:
            self._apply_penalties(z, [rows[j] for j in penalized], penalized)
        constrained = [j for j, r in enumerate(rows) if r.constraint is not None]
        if constrained:
            bitmask = new_bitmask(len(constrained), z.shape[1])
            fill_bitmask([rows[j].constraint for j in constrained], bitmask)
            if len(constrained) == len(rows):
                self.apply_bitmask(z, bitmask.to(z.device))
            else:
                at = torch.tensor(constrained, device=z.device)
                masked = z.index_select(0, at)
                self.apply_bitmask(masked, bitmask.to(z.device))
                z.index_copy_(0, at, masked)

    # -- penalties -------------------------------------------------------------------

    def apply_penalties(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """A float32 copy of ``logits[:, :vocab_size]`` with each row's penalties
        applied: what sampling sees before temperature (for inspection)."""
        z = logits[:, :self.vocab_size].to(torch.float32, copy=True).contiguous()
        pos = [j for j, r in enumerate(rows) if r.params.needs_penalties]
        if pos:
            with _on(z.device):
                self._apply_penalties(z, [rows[j] for j in pos], pos)
        return z

    def _token_keys(self, ids: list[int], owners: list[int], counts: list[int]) -> torch.Tensor:
        """Flat indices ``row * V + id`` into ``[n, V]``; out-of-vocab ids dropped."""
        t = torch.tensor(ids, dtype=torch.long)
        rows = torch.repeat_interleave(torch.tensor(owners), torch.tensor(counts))
        valid = (t >= 0) & (t < self.vocab_size)
        return (t + rows * self.vocab_size)[valid]

    def _apply_penalties(self, z: torch.Tensor, rows: list[SamplingRow], pos: list[int]) -> None:
        """Penalize rows ``pos`` of ``z`` in place, touching only tokens they have seen.

        Repetition (HF): over prompt + output tokens, positive logits are
        divided by the penalty, negative ones multiplied. Presence/frequency
        (OpenAI): over output tokens, ``logit -= count * freq + (count > 0) * pres``.
        """
        vocab, n = self.vocab_size, z.shape[0]
        rep, freq, pres = [1.0] * n, [0.0] * n, [0.0] * n
        # Token ids, their rows and per-row counts, gathered flat: one tensor each.
        rep_ids: tuple[list[int], list[int], list[int]] = ([], [], [])
        out_ids: tuple[list[int], list[int], list[int]] = ([], [], [])
        for j, row in zip(pos, rows):
            p = row.params
            if p.repetition_penalty != 1.0:
                rep[j] = p.repetition_penalty
                _collect(rep_ids, j, [*row.prompt_token_ids, *row.output_token_ids])
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                freq[j], pres[j] = p.frequency_penalty, p.presence_penalty
                _collect(out_ids, j, row.output_token_ids)
        flat = z.view(-1)
        if rep_ids[0]:
            keys = torch.unique(self._token_keys(*rep_ids))
            r, v = torch.tensor(rep)[keys // vocab], flat[keys]
            flat[keys] = torch.where(v > 0, v / r, v * r)
        if out_ids[0]:
            keys, counts = torch.unique(self._token_keys(*out_ids), return_counts=True)
            owner = keys // vocab
            penalty = counts * torch.tensor(freq)[owner] + torch.tensor(pres)[owner]
            flat[keys] = flat[keys] - penalty

    # -- random sampling ---------------------------------------------------------------

    def _sample_random(self, z: torch.Tensor, owned: bool, rows: list[SamplingRow]) -> list[int]:
        """Temperature > 0 rows: temper, filter, draw with each row's own randomness.
        (Row views of ``probs`` may get masked in place below a row's floor; that
        is harmless, as every later cut of a row is >= its floor.)"""
        temps = _host_f32([r.params.temperature for r in rows]).unsqueeze(1)
        if bool((temps != 1.0).any()):
            temps = temps.to(z.device)
            z = z.div_(temps) if owned else z / temps
        probs = rows_ops.softmax(z)
        n = len(rows)
        unit = torch.cat([_row_uniforms(r.seed, r.step, 1) for r in rows]).to(z.device)
        tokens, route = [0] * n, [_first_route(r.params) for r in rows]
        min_p = _host_f32([r.params.min_p for r in rows])
        # Per row, the probability below which tokens are dropped; min-p's to start.
        cut = (min_p.to(z.device) * probs.amax(dim=-1) if bool((min_p > 0).any())
               else torch.zeros(n))
        cand = [j for j in range(n) if route[j] == _CANDIDATES]
        if cand:
            idx = _index(cand)
            got, got_route, cut[idx] = self._sample_filtered(
                self._take(probs, cand), [rows[j].params for j in cand], unit[idx])
            _put(tokens, cand, got)
            _put(route, cand, got_route)
        full = [j for j in range(n) if route[j] == _FULL]
        if full:
            idx = _index(full)
            _put(tokens, full, self._sample_full(self._take(probs, full), cut[idx],
                                                 unit[idx]).tolist())
        deep = [j for j in range(n) if route[j] == _NUCLEUS]
        if deep:
            got = self._sample_nucleus(self._take(probs, deep), cut[_index(deep)],
                                       [rows[j] for j in deep])
            _put(tokens, deep, got)
        return tokens

    def _sample_filtered(self, probs: torch.Tensor, params: list[SamplingParams],
                         unit: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
        """Resolve filters from each row's top candidates; draw where those hold
        every kept token. Returns the tokens (valid on ``_CANDIDATES`` rows), each
        row's route, and its cut-off (the min-p/top-k floor on ``_NUCLEUS`` rows)."""
        vocab = self.vocab_size
        # top_k + 1 candidates show whether ties straddle the k-th place.
        ks = [min(vocab, p.top_k + 1 if p.top_k > 0 else self.candidates) for p in params]
        k_row = torch.tensor(ks)
        vals, ids = probs.topk(max(ks), dim=-1)
        top_k = torch.tensor([min(p.top_k, vocab) for p in params])
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        top_p = _host_f32([p.top_p for p in params])
        kth = torch.where(top_k > 0, _col(vals, (top_k - 1).clamp(min=0)), 0.0)
        thr = torch.maximum(kth, min_p * vals[:, 0])
        last = _col(vals, k_row - 1)
        deep = torch.zeros(len(params), dtype=torch.bool)
        if bool((top_p < 1.0).any()):
            thr, deep = self._nucleus_thresholds(probs, vals, thr, k_row, last,
                                                 top_p.to(probs.device))
        covered = (k_row == vocab) | (last < thr)
        tokens = self._pick_candidates(vals, ids, thr, unit)
        route = torch.where(deep, _NUCLEUS, torch.where(covered, _CANDIDATES, _FULL))
        return tokens, route.tolist(), thr

    def _nucleus_thresholds(self, probs: torch.Tensor, vals: torch.Tensor, floor: torch.Tensor,
                            k_row: torch.Tensor, last: torch.Tensor, top_p: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Raise ``floor`` (the top-k/min-p cut) to the top-p cut where top_p < 1: the
        nucleus is the shortest run of the highest kept probabilities reaching
        ``top_p`` of the kept mass. Also flags rows whose nucleus outgrew the
        candidates (left at ``floor``, for rejection)."""
        cum = rows_ops.row_cumsum(vals * (vals >= floor.unsqueeze(1)))
        mass = _col(cum, k_row - 1)
        inside = (k_row == self.vocab_size) | (last < floor)
        wide = ((top_p < 1.0) & ~inside).nonzero().flatten().tolist()
        if wide:
            # The kept set reaches past the candidates: its mass needs the whole row.
            idx = _index(wide)
            mass[idx] = rows_ops.row_sum(self._block_sums(self._take(probs, wide), floor[idx]))
        need = top_p * mass
        fits = inside | (_col(cum, k_row - 1) >= need)
        nucleus = top_p < 1.0
        return (torch.where(nucleus & fits, _nucleus_cut(vals, floor, need), floor),
                nucleus & ~fits)

    def _sample_nucleus(self, probs: torch.Tensor, floor: torch.Tensor,
                        rows: list[SamplingRow]) -> list[int]:
        """Top-p by rejection, for rows whose nucleus outgrew the candidates: draw
        from the kept (min-p/top-k) distribution, accept when the mass strictly
        above the token's probability is below ``top_p`` of the kept mass (it is
        in the nucleus). Accepted draws are exact nucleus samples; P(accept) >= top_p."""
        sums = self._block_sums(probs, floor)
        top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32)
        need = top_p * rows_ops.row_sum(sums)
        units = torch.stack([_row_uniforms(r.seed, r.step, max(1, self.ATTEMPTS))
                             for r in rows]).to(probs.device)
        tokens, pending = [0] * len(rows), list(range(len(rows)))
        for attempt in range(self.ATTEMPTS):
            idx = _index(pending)
            q = self._take(probs, pending)
            picked = self._sample_full(q, floor[idx], units[idx, attempt], sums[idx])
            value = q.gather(1, picked.unsqueeze(1))
            accept = (self._mass_above(q, value) < need[idx]).tolist()
            _put(tokens, pending, [t if ok else 0 for t, ok in zip(picked.tolist(), accept)])
            pending = [j for j, ok in zip(pending, accept) if not ok]
            if not pending:
                return tokens
        # Still unlucky (or ATTEMPTS == 0): the exact cut-off by sorting, slow but rare.
        idx = _index(pending)
        rest = self._take(probs, pending)
        cut = _nucleus_cut(rest.sort(dim=-1, descending=True).values, floor[idx], need[idx])
        _put(tokens, pending, self._sample_full(rest, cut, units[idx, 0]).tolist())
        return tokens

    def _mass_above(self, probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Per row, the sum of probabilities strictly above ``value`` ([n, 1]), as
        sum(relu(p - v)) + v * count(p > v): plain float passes, cheap on CPU. (The
        count is exact in any order.)"""
        excess = torch.sub(probs, value).clamp_(min=0.0)
        over = rows_ops.row_sum(self._block_sums(excess))
        count = excess.sign_().sum(dim=-1)
        return over + value.squeeze(1) * count

    def _block_sums(self, probs: torch.Tensor, thr: torch.Tensor | None = None) -> torch.Tensor:
        """Per-row sums over fixed vocabulary blocks; zeroes ``probs`` below ``thr``
        in place first. Fixed blocks keep a row's sums bit-identical for any
        batch size (a whole-row sum of a single row may be split across threads).
        Off the CPU the mask is applied unchecked (a no-op where ``thr <= 0``): no sync."""
        if thr is not None and (rows_ops.off_cpu(probs) or bool((thr > 0).any())):
            probs.masked_fill_(probs < thr.unsqueeze(1), 0.0)
        n, block = probs.shape[0], self.block
        nb, tail = divmod(self.vocab_size, block)
        sums = rows_ops.row_sum(probs.as_strided((n, nb, block), (probs.stride(0), block, 1)))
        if tail:
            sums = torch.cat([sums, rows_ops.row_sum(probs[:, nb * block:]).unsqueeze(1)], dim=1)
        return sums

    def _pick_candidates(self, vals: torch.Tensor, ids: torch.Tensor, thr: torch.Tensor,
                         unit: torch.Tensor) -> list[int]:
        """Inverse CDF over the candidates kept by ``thr``, in token-id order."""
        keep = vals >= thr.unsqueeze(1)
        # Token-id order (not topk's, which may shuffle ties) makes the draw canonical.
        order = ids.masked_fill(~keep, self.vocab_size).argsort(dim=-1)
        at = _pick(rows_ops.row_cumsum((vals * keep).gather(1, order)), unit)
        return _col(ids, _col(order, at)).tolist()

    def _sample_full(self, probs: torch.Tensor, thr: torch.Tensor, unit: torch.Tensor,
                     sums: torch.Tensor | None = None) -> torch.Tensor:
        """Two-level inverse CDF over the whole vocabulary: a block by its sum,
        then a token inside it. ``probs`` is masked in place below ``thr``
        unless the block ``sums`` are given (then it must be masked already)."""
        vocab, block = self.vocab_size, self.block
        sums = self._block_sums(probs, thr) if sums is None else sums
        cum = rows_ops.row_cumsum(sums)
        b = _pick(cum, unit)
        before = torch.where(b > 0, _col(cum, (b - 1).clamp(min=0)), 0.0).double()
        rest = ((unit * cum[:, -1].double() - before) / _col(sums, b).double())
        cols = b.unsqueeze(1) * block + torch.arange(block)
        inner = probs.gather(1, cols.clamp(max=vocab - 1)) * (cols < vocab)
        return b * block + _pick(rows_ops.row_cumsum(inner), rest.clamp(0.0, 1.0 - 2 ** -53))
