"""Incremental detokenization with stop strings, one token at a time.

Each new token decodes a short window of recent tokens, never the whole
output. ``done`` counts the characters of the window's decoded text already
turned into output; only text past it is new. The window keeps a few earlier
tokens as context so that decoders which treat the first token specially
(SentencePiece's leading-space strip, orphaned UTF-8 continuation bytes)
only affect text that was already produced.

A byte-level decode of an incomplete UTF-8 sequence ends in one U+FFFD; that
last character is held until a later token completes it (or ``flush``
releases it). Text that could be the start of a stop string is held as well.

Fast path (``token_pieces``): with a byte-level BPE tokenizer, whose decode
is the UTF-8 decoding of its tokens' bytes concatenated, a token whose own
bytes are complete UTF-8 appends exactly its own text to text that ended
complete. Such a token skips the decode: the detokenizer's state moves as
the decode would have moved it, so the text is identical; any other token
(an added token, part of a character, after an unfinished one) decodes.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import tokenizers

from carpool.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"


class DecodingTokenizer(Protocol):
    """The part of a tokenizer the detokenizer uses."""

    all_special_ids: Sequence[int]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def token_pieces(tokenizer: DecodingTokenizer) -> tuple[str | None, ...] | None:
    """Per token id, the text it appends after text that ended complete, or
    None where that takes a decode (added tokens; tokens that are part of
    a character or decode to U+FFFD). None for a tokenizer whose decode is
    not plain byte-level (a SentencePiece decoder strips a leading space,
    say), or that does not show its backend: every token decodes then."""
    backend = getattr(tokenizer, "backend", None)
    if not isinstance(getattr(backend, "decoder", None), tokenizers.decoders.ByteLevel):
        return None
    added = backend.get_added_tokens_decoder()
    size = backend.get_vocab_size(with_added_tokens=True)
    texts = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    return tuple(None if i in added or not text or _REPLACEMENT in text else text
                 for i, text in enumerate(texts))


def _stable_len(text: str) -> int:
    """Length of ``text`` that later tokens cannot change (all but a trailing U+FFFD)."""
    return len(text) - 1 if text.endswith(_REPLACEMENT) else len(text)


class IncrementalDetokenizer:
    """Turns a request's output tokens into text deltas, honouring ``params.stop``.

    ``add_token(id) -> (delta, stopped)``; ``flush()`` releases what is held
    when the request ends for another reason. ``output_text`` is everything
    emitted so far; ``stop_reason`` the stop string that ended the text, if any.
    """

    # The context must cover an unfinished UTF-8 sequence (at most 3 bytes, so
    # at most 3 tokens of at least one byte each) with room to spare.
    CONTEXT_TOKENS = 8
    WINDOW_TOKENS = 32

    def __init__(self, tokenizer: DecodingTokenizer, prompt_token_ids: Sequence[int],
                 params: SamplingParams, pieces: Sequence[str | None] | None = None) -> None:
        """``pieces``: ``token_pieces(tokenizer)``, shared by every request
        of the tokenizer (None: every token decodes)."""
        self._tokenizer = tokenizer
        self._pieces = pieces or ()
        self._skip = params.skip_special_tokens
        self._special = frozenset(tokenizer.all_special_ids) if self._skip else frozenset()
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        context = [t for t in list(prompt_token_ids[-self.CONTEXT_TOKENS:])
                   if t not in self._special]
        self._ids: list[int] = context
        # All prompt text counts as produced, even an unfinished last character:
        # the output never repeats (or completes) what belongs to the prompt.
        self._done = len(self._decode(context)) if context else 0
        self._unsettled = ""  # trailing U+FFFD of output text awaiting more bytes
        self._pending = ""  # settled text held back as a possible stop-string start
        self._emitted: list[str] = []
        self.stopped = False
        self.stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add_token(self, token_id: int) -> tuple[str, bool]:
        """Take one output token; return (text safe to emit now, stopped)."""
        if self.stopped:
            return "", True
        if token_id in self._special:
            return "", False
        self._ids.append(token_id)
        pieces = self._pieces
        piece = pieces[token_id] if 0 <= token_id < len(pieces) else None
        if piece is not None and not self._unsettled:
            # The window's text so far ended complete (nothing unsettled), so
            # its decode now is that text + piece: what the decode below gives.
            self._done += len(piece)
            if len(self._ids) > self.WINDOW_TOKENS:
                self._slide()
            if not self._stops:  # _emit's first case, without the call
                self._emitted.append(piece)
                return piece, False
            return self._emit(piece, final=False)
        text = self._decode(self._ids)
        stable = _stable_len(text)
        new = text[self._done:stable] if stable > self._done else ""
        self._done = max(self._done, stable)
        self._unsettled = text[self._done:]
        if len(self._ids) > self.WINDOW_TOKENS:
            self._slide()
        return self._emit(new, final=False)

    def _slide(self) -> None:
        """Drop all but the last CONTEXT_TOKENS tokens from the window."""
        self._ids = self._ids[-self.CONTEXT_TOKENS:]
        # Everything but an unfinished trailing sequence has been produced, and
        # that sequence lies within the kept tokens.
        self._done = _stable_len(self._decode(self._ids))

    def flush(self) -> str:
        """Release held-back text (the request ended without a stop string)."""
        if self.stopped:
            return ""
        tail, self._unsettled = self._unsettled, ""
        delta, _ = self._emit(tail, final=True)
        return delta

    def _emit(self, new: str, final: bool) -> tuple[str, bool]:
        """Append settled text; cut at a stop string or hold a possible stop prefix."""
        if not self._stops:
            self._emitted.append(new)
            return new, False
        text = self._pending + new
        hit = self._find_stop(text)
        if hit is not None:
            start, end, stop = hit
            out = text[:end] if self._include_stop else text[:start]
            self._pending, self.stopped, self.stop_reason = "", True, stop
            self._emitted.append(out)
            return out, True
        hold = 0 if final else self._held_suffix(text)
        out, self._pending = text[:len(text) - hold], text[len(text) - hold:]
        self._emitted.append(out)
        return out, False

    def _find_stop(self, text: str) -> tuple[int, int, str] | None:
        """The stop occurrence in ``text`` that completes first (the longest on a tie).

        Ending earliest is what a token-by-token stream sees first, so the cut
        does not depend on how the text was split into tokens.
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or end < best[1] or (end == best[1] and start < best[0]):
                best = (start, end, stop)
        return best

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            lo = len(text) - min(len(stop) - 1, len(text))
            # Only suffixes longer than the best so far can matter.
            i = text.find(stop[0], lo, len(text) - longest)
            while i >= 0:
                if stop.startswith(text[i:]):
                    longest = len(text) - i
                    break
                i = text.find(stop[0], i + 1, len(text) - longest)
        return longest
