"""Readers for the public request traces carpool replays, and where to find them.

Every reader returns a list of `TraceRequest` in arrival order, arrivals in
seconds from the trace's first request (None for length-only files). Three
formats: the Azure LLM inference trace 2023 (CSV: TIMESTAMP, ContextTokens,
GeneratedTokens), the Mooncake traces (JSONL: timestamp in ms,
input_length, output_length, hash_ids) and lengths files (CSV:
num_prefill_tokens, num_decode_tokens); any of them may be gzipped
(``.gz``).

A short name (`TRACE_FILES`) is looked up, in this order, in
``$CARPOOL_TRACES`` (when set, only there), the user's cache
(``~/.cache/carpool/traces``, filled by ``carpool traces download``), the
team's ``../shared/traces`` (from the current directory, or beside the
repository) and last in the excerpts packaged with carpool
(``carpool/workload/excerpts``: the first minutes of each trace, with the
licence texts), so every command and test works from a bare install. See
``carpool/workload/excerpts/README.md`` for sources, licences and the
attribution reports must carry.
"""
from __future__ import annotations

import csv
import gzip
import itertools
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path
from types import MappingProxyType

from carpool.paths import default_cache_dir

# One Mooncake hash id covers this many prompt tokens (the last block may be partial).
MOONCAKE_BLOCK_TOKENS = 512

TRACES_ENV = "CARPOOL_TRACES"

_AZURE = "Azure LLM inference trace 2023 (Microsoft, Splitwise, ISCA'24; CC-BY-4.0)"
_MOONCAKE = "Mooncake traces (Moonshot AI / Kimi, FAST'25; Apache-2.0)"

# Short name -> (path relative to the traces dir, format, attribution to quote).
TRACE_FILES: MappingProxyType[str, tuple[str, str, str]] = MappingProxyType({
    "azure-conv": ("azure2023/AzureLLMInferenceTrace_conv.csv", "azure", _AZURE),
    "azure-code": ("azure2023/AzureLLMInferenceTrace_code.csv", "azure", _AZURE),
    "mooncake-conv": ("mooncake/conversation_trace.jsonl", "mooncake", _MOONCAKE),
    "mooncake-synthetic": ("mooncake/synthetic_trace.jsonl", "mooncake", _MOONCAKE),
    "sharegpt": ("lengths/sharegpt_8k_filtered_stats_llama2_tokenizer.csv", "lengths",
                 "ShareGPT lengths from the Sarathi-Serve project (Microsoft; Apache-2.0)"),
    "arxiv": ("lengths/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv", "lengths",
              "arXiv summarisation lengths from the Vidur project (Microsoft; MIT)"),
})

# Excerpts of every trace, gzipped, with their licences (made by
# scripts/make_trace_excerpts.py).
EXCERPTS_DIR = Path(__file__).resolve().parent / "excerpts"

_TIMESTAMP = re.compile(r"\s*(\d{4}-\d{2}-\d{2})[ T](\d{1,2}):(\d{2}):(\d{2}(?:\.\d*)?)\s*")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it came (seconds from the first, or None)
    and how many prompt and output tokens it had; ``hash_ids`` name its
    prompt's prefix blocks (Mooncake only; equal ids = equal blocks)."""

    arrival: float | None
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


def trace_dirs() -> list[Path]:
    """The folders searched for whole traces, in order: ``$CARPOOL_TRACES``
    alone when it is set (an explicit choice: nothing else is searched),
    else the cache that ``carpool traces download`` fills, ``../shared/traces``
    from the current directory and ``shared/traces`` beside the repository.
    """
    env = os.environ.get(TRACES_ENV)
    if env:
        return [Path(env).expanduser()]
    return [default_cache_dir() / "traces", Path.cwd().parent / "shared" / "traces",
            Path(__file__).resolve().parents[3] / "shared" / "traces"]


def traces_dir() -> Path:
    """The first folder of `trace_dirs` that exists, else the last one."""
    dirs = trace_dirs()
    return next((d for d in dirs if d.is_dir()), dirs[-1])


def whole_trace(name: str) -> Path | None:
    """The whole trace ``name`` (a key of `TRACE_FILES`) from the first
    folder of `trace_dirs` holding it, or None (no excerpt in its place)."""
    relative = TRACE_FILES[name][0]
    return next((folder / relative for folder in trace_dirs()
                 if (folder / relative).is_file()), None)


def excerpt_path(name: str) -> Path:
    """The packaged excerpt of trace ``name`` (a key of `TRACE_FILES`)."""
    return EXCERPTS_DIR / (TRACE_FILES[name][0] + ".gz")


def excerpt_note(path: Path) -> str | None:
    """For a packaged excerpt: what it holds and how to get the whole trace
    (to print beside results); None for any other file."""
    for name in TRACE_FILES:
        if Path(path) == excerpt_path(name):
            info = json.loads((EXCERPTS_DIR / "manifest.json").read_text())[name]
            span = f"the first {info['span_s']:.0f} s, " if info.get("span_s") else "the first "
            return (f"{name} is the excerpt packaged with carpool ({span}{info['rows']:,} of "
                    f"{info['of']:,} requests); `carpool traces download {name}` fetches the "
                    f"whole trace")
    return None


def resolve_trace(name_or_path: str | os.PathLike) -> Path:
    """The file of a short trace name (see `TRACE_FILES`) or a path.

    A name is looked up in `trace_dirs`, then in the packaged excerpts
    (unless ``$CARPOOL_TRACES`` is set). Raises FileNotFoundError saying
    what to do when it is not there.
    """
    text = str(name_or_path)
    if text in TRACE_FILES:
        whole = whole_trace(text)
        if whole is not None:
            return whole
        if os.environ.get(TRACES_ENV):
            path = trace_dirs()[0] / TRACE_FILES[text][0]
            raise FileNotFoundError(
                f"trace {text!r}: {path} not found; set ${TRACES_ENV} to the folder holding the "
                f"traces (azure2023/, mooncake/, lengths/), unset it to use the cache or the "
                f"packaged excerpt, or pass the file's path")
        return excerpt_path(text)
    path = Path(text).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"trace {text!r} is neither a known name ({', '.join(TRACE_FILES)}) nor an existing "
            f"file; pass one of those names or the path of a trace file")
    return path


def trace_format(path: Path) -> str:
    """``azure``, ``mooncake`` or ``lengths``, from the file's name or header."""
    known = _registered(path)
    if known is not None:
        return known[1]
    if _plain_name(path).endswith(".jsonl"):
        return "mooncake"
    with _open_text(path) as f:
        header = f.readline()
    if "TIMESTAMP" in header:
        return "azure"
    if "num_prefill_tokens" in header:
        return "lengths"
    raise ValueError(f"{path}: unknown trace format; expected an Azure CSV (TIMESTAMP, "
                     f"ContextTokens, GeneratedTokens), a Mooncake JSONL or a lengths CSV "
                     f"(num_prefill_tokens, num_decode_tokens)")


def trace_attribution(path: Path) -> str | None:
    """The credit a report must carry for results on this shared trace file."""
    known = _registered(path)
    return None if known is None else known[2]


def _plain_name(path: Path) -> str:
    """The path without a ``.gz`` ending, as text."""
    return Path(path).as_posix().removesuffix(".gz")


def _registered(path: Path) -> tuple[str, str, str] | None:
    """The `TRACE_FILES` entry a path is a copy (or an excerpt) of, if any."""
    plain = _plain_name(path)
    return next((entry for entry in TRACE_FILES.values() if plain.endswith(entry[0])), None)


def _open_text(path: Path, newline: str | None = None):
    """A text file, gunzipped on the fly when its name ends in ``.gz``."""
    if Path(path).name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline=newline)
    return open(path, encoding="utf-8", newline=newline)


def load_trace(name_or_path: str | os.PathLike) -> list[TraceRequest]:
    """Read a trace given by short name or path, whatever its format."""
    path = resolve_trace(name_or_path)
    readers = {"azure": read_azure_csv, "mooncake": read_mooncake_jsonl,
               "lengths": read_lengths_csv}
    return readers[trace_format(path)](path)


def read_azure_csv(path: str | os.PathLike) -> list[TraceRequest]:
    """Azure LLM inference trace 2023: TIMESTAMP, ContextTokens, GeneratedTokens."""
    path = Path(path)
    rows = _csv_columns(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    day_ordinals: dict[str, int] = {}
    parsed = [(_day_and_seconds(stamp, day_ordinals, path, line),
               _count(context, path, line), _count(generated, path, line))
              for line, (stamp, context, generated) in rows]
    # Seconds from the first day, so the float keeps sub-microsecond precision.
    first_day = min(day_ordinals.values(), default=0)
    return _rebased([((day - first_day) * 86400.0 + seconds, context, generated)
                     for (day, seconds), context, generated in parsed])


def read_mooncake_jsonl(path: str | os.PathLike) -> list[TraceRequest]:
    """Mooncake trace: timestamp (ms), input_length, output_length, hash_ids."""
    path = Path(path)
    stamped = []
    with _open_text(path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
                stamp = float(record["timestamp"]) / 1000.0
                ids = tuple(int(i) for i in record.get("hash_ids", ()))
                fields = (record["input_length"], record["output_length"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line}: not a Mooncake record ({exc!r})") from None
            stamped.append((stamp, _count(fields[0], path, line),
                            _count(fields[1], path, line), ids))
    return _rebased(stamped)


def read_lengths_csv(path: str | os.PathLike) -> list[TraceRequest]:
    """Lengths only: num_prefill_tokens, num_decode_tokens (arrival is None)."""
    path = Path(path)
    rows = _csv_columns(path, ("num_prefill_tokens", "num_decode_tokens"))
    return [TraceRequest(None, _count(prefill, path, line), _count(decode, path, line))
            for line, (prefill, decode) in rows]


def has_arrivals(requests: Sequence[TraceRequest]) -> bool:
    """Whether the requests carry arrival times (not a length-only file)."""
    return bool(requests) and requests[0].arrival is not None


def select_window(requests: Sequence[TraceRequest], start_s: float = 0.0,
                  duration_s: float | None = None,
                  max_requests: int | None = None) -> list[TraceRequest]:
    """Requests arriving in ``[start_s, start_s + duration_s)``, at most
    ``max_requests``, with arrivals re-based to 0 at ``start_s``.

    For length-only requests the window is by position: ``start_s`` is
    ignored and only ``max_requests`` applies.
    """
    if start_s < 0 or (duration_s is not None and duration_s <= 0):
        raise ValueError(f"window start must be >= 0 and duration > 0, got {start_s}, "
                         f"{duration_s}")
    if not has_arrivals(requests):
        return list(requests[:max_requests] if max_requests is not None else requests)
    end = float("inf") if duration_s is None else start_s + duration_s
    chosen = []
    for request in requests:
        if max_requests is not None and len(chosen) >= max_requests:
            break
        if start_s <= request.arrival < end:
            chosen.append(replace(request, arrival=request.arrival - start_s))
    return chosen


def loop_window(requests: Sequence[TraceRequest], count: int) -> list[TraceRequest]:
    """``count`` requests from a timed window replayed back to back: copy
    ``k`` arrives ``k`` periods later (period = the window's span plus one
    mean gap), and Mooncake hash ids are shifted per copy so that copies
    (other users) share no prefix the original did not share within itself."""
    if not requests:
        raise ValueError("cannot loop an empty trace window")
    first, last = requests[0].arrival, requests[-1].arrival
    gap = (last - first) / (len(requests) - 1) if len(requests) > 1 else 1.0
    period = last - first + gap
    id_stride = 1 + max((max(r.hash_ids, default=-1) for r in requests), default=-1)
    out = []
    for index in range(count):
        copy, request = divmod(index, len(requests))
        request = requests[request]
        shift = copy * id_stride
        ids = tuple(h + shift for h in request.hash_ids) if request.hash_ids and shift else \
            request.hash_ids
        out.append(TraceRequest(request.arrival + copy * period, request.input_len,
                                request.output_len, ids))
    return out


def scale_tokens(requests: Sequence[TraceRequest], token_scale: float = 1.0,
                 max_input_len: int | None = None,
                 max_output_len: int | None = None) -> list[TraceRequest]:
    """Token counts times ``token_scale``, rounded, at least 1 and at most the
    caps; arrivals and hash ids are kept."""
    if token_scale <= 0:
        raise ValueError(f"token scale must be > 0, got {token_scale}")
    # Built directly, not with dataclasses.replace: simulations scale
    # hundreds of thousands of requests.
    return [TraceRequest(r.arrival, scale_count(r.input_len, token_scale, max_input_len),
                         scale_count(r.output_len, token_scale, max_output_len), r.hash_ids)
            for r in requests]


def scale_count(value: int, factor: float, cap: int | None = None) -> int:
    """``round(value * factor)`` clamped to ``[1, cap]``."""
    scaled = max(1, round(value * factor))
    return scaled if cap is None else max(1, min(cap, scaled))


def _csv_columns(path: Path, names: tuple[str, ...]) -> list[tuple[int, list[str]]]:
    """(line number, the named columns' cells) for every data row."""
    with _open_text(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}:1: empty file; expected a header with {', '.join(names)}")
        header = [h.strip().lstrip("\ufeff") for h in header]
        missing = [n for n in names if n not in header]
        if missing:
            raise ValueError(f"{path}:1: header lacks {', '.join(missing)}")
        index = [header.index(n) for n in names]
        width = max(index) + 1
        rows = []
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) < width:
                raise ValueError(f"{path}:{line}: expected {len(header)} columns, got {len(row)}")
            rows.append((line, [row[i] for i in index]))
    return rows


def _count(value: object, path: Path, line: int) -> int:
    try:
        count = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{path}:{line}: token count {value!r} is not an integer") from None
    if count < 0:
        raise ValueError(f"{path}:{line}: token count {count} is negative")
    return count


def _day_and_seconds(stamp: str, day_ordinals: dict[str, int], path: Path,
                     line: int) -> tuple[int, float]:
    """(date ordinal, seconds into that day); any number of fraction digits."""
    match = _TIMESTAMP.fullmatch(stamp)
    if not match:
        raise ValueError(f"{path}:{line}: cannot parse timestamp {stamp!r}; expected "
                         f"YYYY-MM-DD HH:MM:SS[.fraction]")
    day, hours, minutes, seconds = match.groups()
    if day not in day_ordinals:
        try:
            day_ordinals[day] = date.fromisoformat(day).toordinal()
        except ValueError:
            raise ValueError(f"{path}:{line}: bad date in {stamp!r}") from None
    return day_ordinals[day], int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def _rebased(stamped: list[tuple]) -> list[TraceRequest]:
    """Sort by time (stable) and measure arrivals from the first request."""
    if any(a[0] > b[0] for a, b in itertools.pairwise(stamped)):
        stamped = sorted(stamped, key=lambda row: row[0])
    if not stamped:
        return []
    first = stamped[0][0]
    return [TraceRequest(row[0] - first, *row[1:]) for row in stamped]
