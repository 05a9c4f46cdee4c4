"""Batched token sampling on CPU: penalties, temperature, top-k/top-p/min-p, logprobs.

Every random draw of a row comes from one uniform number produced by a
``torch.Generator`` seeded with a 64-bit mix of ``(seed, step)``; the token is
picked by inverse-CDF over the row's kept tokens in vocabulary order. A row's
token therefore depends only on its own logits, parameters, seed and step,
never on batch mates or its position in the batch.

Filtering order (as vLLM): penalties, temperature, then min-p, top-k and top-p
on the tempered distribution, top-p measured against the mass min-p/top-k
kept. Filters keep every token whose probability reaches the row's cut-off
value, so tied tokens are kept or dropped together.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from carpool.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
# Routes of a random row: drawn from its top candidates, over the whole
# vocabulary, or by nucleus rejection.
_CANDIDATES, _FULL, _NUCLEUS = 0, 1, 2
# Below this top_p, rejection (acceptance >= top_p per try) is not tried first.
_CANDIDATE_TOP_P = 0.5


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence being sampled.

    ``seed`` is the effective seed (the engine draws one when ``params.seed`` is
    None) and ``step`` the index of the output token being drawn.
    ``prompt_token_ids`` matters only for ``repetition_penalty``.
    """

    params: SamplingParams
    seed: int
    step: int
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()


@dataclass
class SampleResult:
    """The drawn token; with ``logprobs`` requested, its raw logprob and the top N."""

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
    """``n`` float64 uniforms in [0, 1) from a generator owned by ``(seed, step)``."""
    gen = torch.Generator()
    gen.manual_seed(mix_seed(seed, step))
    return torch.rand(n, generator=gen, dtype=torch.float64)


def _is_plain_greedy(params: SamplingParams) -> bool:
    return params.greedy and not params.needs_penalties


def _first_route(params: SamplingParams) -> int:
    """How a temperature > 0 row is drawn; depends on its own parameters only.

    Top-k, and top-p small enough that rejection would retry a lot, start
    from candidates (which may hand the row on); other top-p rows go to
    rejection, the rest sample the whole vocabulary above their min-p floor.
    """
    if params.top_k > 0 or params.top_p < _CANDIDATE_TOP_P:
        return _CANDIDATES
    return _NUCLEUS if params.top_p < 1.0 else _FULL


def _pick(cum: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over rows of non-decreasing ``cum`` with one uniform per row.

    Returns, per row, the first index whose cumulative mass exceeds
    ``unit * total``; clamped to the last index that adds mass, so the chosen
    index always has positive weight (a rounding-up target can't pick a zero).
    """
    total = cum[:, -1:].contiguous()
    target = (unit.unsqueeze(1) * total.double()).to(cum.dtype)
    first = torch.searchsorted(cum, target, right=True)
    last = torch.searchsorted(cum, total)
    return torch.minimum(first, last).squeeze(1)


class Sampler:
    """Draws one token per row of a ``[B, V]`` logits batch.

    ``candidates`` is how many top tokens a filtered row (top-k/top-p/min-p)
    is resolved from before falling back to the full vocabulary; it is fixed
    per sampler so that the choice never depends on batch mates.
    """

    ATTEMPTS = 32

    def __init__(self, vocab_size: int, candidates: int = 256, block: int = 256) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.candidates = max(1, min(candidates, vocab_size))
        self.block = max(1, min(block, vocab_size))

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampleResult]:
        """Sample one token for each row; ``logits`` is ``[len(rows), >= vocab_size]``.

        Logit columns past ``vocab_size`` (padding) are ignored. Any float dtype
        is accepted; the math runs in float32. ``logits`` is never modified.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits shape {tuple(logits.shape)} does not fit {len(rows)} rows "
                             f"of vocab {self.vocab_size}")
        if not rows:
            return []
        logits = logits[:, :self.vocab_size]
        if all(_is_plain_greedy(r.params) and r.params.logprobs is None for r in rows):
            return [SampleResult(t) for t in logits.argmax(dim=-1).tolist()]
        x = logits.to(torch.float32).contiguous()
        aliased = x.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
        # Logprobs are taken from the raw logits, so before any penalty touches them.
        logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        logprobs = self._raw_logprobs(x, logprob_rows, rows) if logprob_rows else None
        tokens = [0] * len(rows)
        plain = [i for i, r in enumerate(rows) if _is_plain_greedy(r.params)]
        if plain:
            picked = self._take(x, plain).argmax(dim=-1).tolist()
            for i, t in zip(plain, picked):
                tokens[i] = t
        work = [i for i, r in enumerate(rows) if not _is_plain_greedy(r.params)]
        if work:
            self._sample_work(x, aliased, work, rows, tokens)
        return self._results(tokens, rows, logprob_rows, logprobs)

    # -- row groups ----------------------------------------------------------------

    @staticmethod
    def _take(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
        """Rows ``idx`` of ``x``: ``x`` itself when that is every row in order."""
        if len(idx) == x.shape[0]:
            return x
        return x.index_select(0, torch.tensor(idx, dtype=torch.long))

    def _sample_work(self, x: torch.Tensor, aliased: bool, work: list[int],
                     rows: Sequence[SamplingRow], tokens: list[int]) -> None:
        """Rows with penalties and/or temperature > 0; fills ``tokens`` in place."""
        z = self._take(x, work)
        owned = not (z is x and aliased)
        sub_rows = [rows[i] for i in work]
        penal = [j for j, r in enumerate(sub_rows) if r.params.needs_penalties]
        if penal:
            if not owned:
                z, owned = z.clone(), True
            self._apply_penalties(z, [sub_rows[j] for j in penal], penal)
        greedy = [j for j, r in enumerate(sub_rows) if r.params.greedy]
        if greedy:
            for j, t in zip(greedy, self._take(z, greedy).argmax(dim=-1).tolist()):
                tokens[work[j]] = t
        rand = [j for j, r in enumerate(sub_rows) if not r.params.greedy]
        if rand:
            zr = self._take(z, rand)
            owned_r = owned or zr is not z
            picked = self._sample_random(zr, owned_r, [sub_rows[j] for j in rand])
            for j, t in zip(rand, picked):
                tokens[work[j]] = t

    def _results(self, tokens: list[int], rows: Sequence[SamplingRow], logprob_rows: list[int],
                 logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
                 ) -> list[SampleResult]:
        results = [SampleResult(t) for t in tokens]
        if logprobs is None:
            return results
        lp, top_vals, top_ids = logprobs
        chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in logprob_rows])).squeeze(1)
        vals, ids = top_vals.tolist(), top_ids.tolist()
        for k, (i, c) in enumerate(zip(logprob_rows, chosen.tolist())):
            n = rows[i].params.logprobs or 0
            results[i].logprob = c
            results[i].top_logprobs = list(zip(ids[k][:n], vals[k][:n]))
        return results

    def _raw_logprobs(self, x: torch.Tensor, idx: list[int], rows: Sequence[SamplingRow]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-softmax of the raw rows ``idx`` and their top-N (N = the largest asked)."""
        lp = torch.log_softmax(self._take(x, idx), dim=-1)
        n = min(max(rows[i].params.logprobs or 0 for i in idx), self.vocab_size)
        top_vals, top_ids = lp.topk(n, dim=-1)
        return lp, top_vals, top_ids

    # -- penalties -------------------------------------------------------------------

    def apply_penalties(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """A float32 copy of ``logits[:, :vocab_size]`` with each row's penalties applied.

        This is what sampling sees before temperature; exposed for inspection.
        """
        z = logits[:, :self.vocab_size].to(torch.float32, copy=True).contiguous()
        pos = [j for j, r in enumerate(rows) if r.params.needs_penalties]
        if pos:
            self._apply_penalties(z, [rows[j] for j in pos], pos)
        return z

    def _token_keys(self, ids: Sequence[int] | torch.Tensor, row: int) -> torch.Tensor:
        """Flat indices ``row * V + id`` into a ``[n, V]`` tensor; out-of-vocab ids dropped."""
        t = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.vocab_size):
            t = t[(t >= 0) & (t < self.vocab_size)]
        return t + row * self.vocab_size

    def _apply_penalties(self, z: torch.Tensor, rows: list[SamplingRow], pos: list[int]) -> None:
        """Penalize rows ``pos`` of ``z`` in place, touching only the tokens they have seen.

        repetition (HF): over prompt + output tokens, positive logits are divided
        by the penalty and negative ones multiplied. presence/frequency
        (OpenAI): over output tokens, ``logit -= count * freq + (count > 0) * pres``.
        """
        vocab = self.vocab_size
        rep = torch.ones(z.shape[0])
        freq = torch.zeros(z.shape[0])
        pres = torch.zeros(z.shape[0])
        rep_keys: list[torch.Tensor] = []
        out_keys: list[torch.Tensor] = []
        for j, row in zip(pos, rows):
            p = row.params
            out = self._token_keys(row.output_token_ids, j)
            if p.repetition_penalty != 1.0:
                rep[j] = p.repetition_penalty
                rep_keys += [out, self._token_keys(row.prompt_token_ids, j)]
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                freq[j], pres[j] = p.frequency_penalty, p.presence_penalty
                out_keys.append(out)
        flat = z.view(-1)
        if rep_keys:
            keys = torch.unique(torch.cat(rep_keys))
            r = rep[keys // vocab]
            v = flat[keys]
            flat[keys] = torch.where(v > 0, v / r, v * r)
        if out_keys:
            keys, counts = torch.unique(torch.cat(out_keys), return_counts=True)
            owner = keys // vocab
            flat[keys] = flat[keys] - (counts.to(torch.float32) * freq[owner] + pres[owner])

    # -- random sampling ---------------------------------------------------------------

    def _sample_random(self, z: torch.Tensor, owned: bool, rows: list[SamplingRow]) -> list[int]:
        """Temperature > 0 rows: temper, filter, and draw with each row's own randomness."""
        temps = torch.tensor([[r.params.temperature] for r in rows], dtype=torch.float32)
        if bool((temps != 1.0).any()):
            z = z.div_(temps) if owned else z / temps
        probs = torch.softmax(z, dim=-1)
        del z
        n = len(rows)
        unit = torch.cat([_row_uniforms(r.seed, r.step, 1) for r in rows])
        tokens, route = [0] * n, [_first_route(r.params) for r in rows]
        min_p = torch.tensor([r.params.min_p for r in rows], dtype=torch.float32)
        # The cut-off below which a row's probabilities are dropped; min-p's to start.
        cut = min_p * probs.amax(dim=-1) if bool((min_p > 0).any()) else torch.zeros(n)
        cand = [j for j in range(n) if route[j] == _CANDIDATES]
        if cand:
            idx = torch.tensor(cand)
            got, got_route, cut[idx] = self._sample_filtered(
                self._take(probs, cand), [rows[j].params for j in cand], unit[idx])
            for j, t, how in zip(cand, got, got_route):
                tokens[j], route[j] = t, how
        full = [j for j in range(n) if route[j] == _FULL]
        if full:
            idx = torch.tensor(full)
            for j, t in zip(full, self._sample_full(self._take(probs, full), cut[idx], unit[idx])):
                tokens[j] = t
        deep = [j for j in range(n) if route[j] == _NUCLEUS]
        if deep:
            got = self._sample_nucleus(self._take(probs, deep), cut[torch.tensor(deep)],
                                       [rows[j] for j in deep])
            for j, t in zip(deep, got):
                tokens[j] = t
        return tokens

    def _sample_filtered(self, probs: torch.Tensor, params: list[SamplingParams],
                         unit: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
        """Resolve filters from each row's top candidates; draw where they hold the kept set.

        Returns the tokens (meaningful for ``_CANDIDATES`` rows), each row's route,
        and its cut-off probability (for ``_NUCLEUS`` rows: the min-p/top-k floor).
        May zero probabilities below a row's floor in ``probs`` in place.
        """
        vocab = self.vocab_size
        # A row's candidate count depends on its own top_k only, never on batch mates.
        k_row = torch.tensor([min(vocab, max(self.candidates, p.top_k)) for p in params])
        vals, ids = probs.topk(int(k_row.max()), dim=-1)
        top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params])
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        kth = vals.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        thr = torch.maximum(torch.where(top_k > 0, kth, 0.0), min_p * vals[:, 0])
        last = vals.gather(1, (k_row - 1).unsqueeze(1)).squeeze(1)
        deep = torch.zeros(len(params), dtype=torch.bool)
        if bool((top_p < 1.0).any()):
            thr, deep = self._nucleus_thresholds(probs, vals, thr, k_row, last, top_p)
        covered = (k_row == vocab) | (last < thr)
        tokens = self._pick_candidates(vals, ids, thr, unit)
        route = torch.where(deep, _NUCLEUS, torch.where(covered, _CANDIDATES, _FULL))
        return tokens, route.tolist(), thr

    def _nucleus_thresholds(self, probs: torch.Tensor, vals: torch.Tensor, floor: torch.Tensor,
                            k_row: torch.Tensor, last: torch.Tensor, top_p: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Raise ``floor`` (the top-k/min-p cut) to the top-p cut on rows with top_p < 1.

        The nucleus is the shortest run of the highest kept probabilities whose
        mass reaches ``top_p`` times the kept mass. Returns the cut-offs and a
        mask of rows whose nucleus is longer than their candidates ("deep"
        rows, left at ``floor`` and sampled by rejection).
        """
        kept = vals * (vals >= floor.unsqueeze(1))
        cum = kept.cumsum(dim=-1)
        mass = cum.gather(1, (k_row - 1).unsqueeze(1)).squeeze(1)
        inside = (k_row == self.vocab_size) | (last < floor)
        wide = ((top_p < 1.0) & ~inside).nonzero().flatten().tolist()
        if wide:
            # The kept set reaches past the candidates: its mass needs the whole row.
            # Masking below the floor in place is harmless, every later cut is >= floor.
            idx = torch.tensor(wide)
            mass[idx] = self._block_sums(self._take(probs, wide), floor[idx]).sum(dim=-1)
        need = (top_p * mass).unsqueeze(1)
        fits = inside | (cum.gather(1, (k_row - 1).unsqueeze(1)) >= need).squeeze(1)
        n_kept = (kept > 0).sum(dim=-1).clamp(min=1)
        j = torch.minimum((cum < need).sum(dim=-1), n_kept - 1)
        cut = torch.maximum(floor, vals.gather(1, j.unsqueeze(1)).squeeze(1))
        nucleus = top_p < 1.0
        return torch.where(nucleus & fits, cut, floor), nucleus & ~fits

    def _sample_nucleus(self, probs: torch.Tensor, floor: torch.Tensor,
                        rows: list[SamplingRow]) -> list[int]:
        """Top-p sampling by rejection for rows whose nucleus outgrew the candidates.

        Draw from the kept (min-p/top-k) distribution and accept the token when
        the mass strictly above its probability is below ``top_p`` times the
        kept mass, i.e. when it lies in the nucleus: an accepted draw is exactly
        a nucleus sample, and each try succeeds with probability >= top_p. Rows
        still unlucky after ``ATTEMPTS`` tries get the exact cut-off by sorting.
        """
        sums = self._block_sums(probs, floor)
        top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32)
        need = top_p * sums.sum(dim=-1)
        units = torch.stack([_row_uniforms(r.seed, r.step, max(1, self.ATTEMPTS)) for r in rows])
        tokens = [0] * len(rows)
        pending = list(range(len(rows)))
        for attempt in range(self.ATTEMPTS):
            idx = torch.tensor(pending)
            q = self._take(probs, pending)
            picked = self._pick_blocks(q, sums[idx], units[idx, attempt])
            value = q.gather(1, picked.unsqueeze(1))
            accept = (self._mass_above(q, value) < need[idx]).tolist()
            for j, t, ok in zip(pending, picked.tolist(), accept):
                if ok:
                    tokens[j] = t
            pending = [j for j, ok in zip(pending, accept) if not ok]
            if not pending:
                return tokens
        idx = torch.tensor(pending)
        rest = self._take(probs, pending)
        cut = self._sorted_nucleus_cut(rest, floor[idx], top_p[idx])
        for j, t in zip(pending, self._sample_full(rest, cut, units[idx, 0])):
            tokens[j] = t
        return tokens

    def _mass_above(self, probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Per row, the total of probabilities strictly above ``value`` ([n, 1]).

        Computed as sum(relu(p - v)) + v * count(p > v): plain float passes,
        cheaper on CPU than a masked select.
        """
        excess = torch.sub(probs, value).clamp_(min=0.0)
        over = self._block_sums(excess).sum(dim=-1)
        count = self._block_sums(excess.sign_()).sum(dim=-1)
        return over + value.squeeze(1) * count

    @staticmethod
    def _sorted_nucleus_cut(probs: torch.Tensor, floor: torch.Tensor,
                            top_p: torch.Tensor) -> torch.Tensor:
        """Exact top-p cut-off by sorting whole rows (slow; a last resort)."""
        vals = probs.sort(dim=-1, descending=True).values
        kept = vals * (vals >= floor.unsqueeze(1))
        cum = kept.cumsum(dim=-1)
        need = (top_p * cum[:, -1]).unsqueeze(1)
        n_kept = (kept > 0).sum(dim=-1).clamp(min=1)
        j = torch.minimum((cum < need).sum(dim=-1), n_kept - 1)
        return torch.maximum(floor, vals.gather(1, j.unsqueeze(1)).squeeze(1))

    def _block_sums(self, probs: torch.Tensor, thr: torch.Tensor | None = None) -> torch.Tensor:
        """Per-row sums over fixed vocabulary blocks of ``probs`` (masked below ``thr``).

        Summing fixed blocks keeps a row's sums bit-identical however many rows
        the batch has (a whole-row reduction of a single row may be split
        across threads). Masks ``probs`` in place when ``thr`` is given.
        """
        if thr is not None and bool((thr > 0).any()):
            probs.masked_fill_(probs < thr.unsqueeze(1), 0.0)
        n, block = probs.shape[0], self.block
        nb, tail = divmod(self.vocab_size, block)
        sums = probs.as_strided((n, nb, block), (probs.stride(0), block, 1)).sum(dim=-1)
        if tail:
            sums = torch.cat([sums, probs[:, nb * block:].sum(dim=-1, keepdim=True)], dim=1)
        return sums

    def _pick_candidates(self, vals: torch.Tensor, ids: torch.Tensor, thr: torch.Tensor,
                         unit: torch.Tensor) -> list[int]:
        """Inverse CDF over candidates kept by ``thr``, walked in token-id order."""
        keep = vals >= thr.unsqueeze(1)
        # Token-id order (not topk's order, which may shuffle ties) makes the draw canonical.
        order = ids.masked_fill(~keep, self.vocab_size).argsort(dim=-1)
        weights = (vals * keep).gather(1, order)
        at = _pick(weights.cumsum(dim=-1), unit)
        return ids.gather(1, order.gather(1, at.unsqueeze(1))).squeeze(1).tolist()

    def _sample_full(self, probs: torch.Tensor, thr: torch.Tensor, unit: torch.Tensor) -> list[int]:
        """Inverse CDF over the whole vocabulary of ``probs`` masked (in place) below ``thr``."""
        return self._pick_blocks(probs, self._block_sums(probs, thr), unit).tolist()

    def _pick_blocks(self, probs: torch.Tensor, sums: torch.Tensor,
                     unit: torch.Tensor) -> torch.Tensor:
        """Two-level inverse CDF: pick a block by its sum, then a token inside it."""
        vocab, block = self.vocab_size, self.block
        cum = sums.cumsum(dim=-1)
        b = _pick(cum, unit)
        before = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
        rest = ((unit * cum[:, -1].double() - before.double())
                / sums.gather(1, b.unsqueeze(1)).squeeze(1).double()).clamp(0.0, 1.0 - 2 ** -53)
        cols = b.unsqueeze(1) * block + torch.arange(block)
        inner = probs.gather(1, cols.clamp(max=vocab - 1)) * (cols < vocab)
        return b * block + _pick(inner.cumsum(dim=-1), rest)
