"""The schema between the API process and an engine worker process.

Every message is a ``msgspec.Struct`` (or a dataclass of carpool's own,
field by field), encoded as MessagePack: explicit types on both ends, no
pickle, and a decoder that refuses what does not match. One message goes
each way per engine-loop round: the front's adds and aborts in, the
round's acceptances, refusals, outputs (one step's, of every request that
progressed) and, every so often, a stats snapshot and new step records out.

Times are ``time.monotonic()`` seconds, one clock for every process of a
machine; the front and its workers share the machine.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

from carpool.config import EngineConfig
from carpool.engine.outputs import TokenLogprob
from carpool.engine.stats import EngineStats
from carpool.engine.step_log import LoggedStep
from carpool.sampling_params import SamplingParams
from carpool.scheduler.kv_events import KvEventBatch

# A frame larger than this is refused by the decoder's reader (ZeroMQ's
# maxmsgsize): a prompt is at most max_model_len ints, stats a few KB.
MAX_FRAME_BYTES = 64 << 20


@dataclass(frozen=True)
class EngineInfo:
    """What the API side needs to know of an engine, fixed for its life."""

    max_model_len: int
    vocab_size: int  # the model's: prompt ids must be below it
    tokenizer: dict  # ``Tokenizer.describe()``
    cache_info: dict[str, str]  # vLLM's cache_config_info labels
    step_facts: dict  # ``step_log.step_facts``: /carpool/steps's record
    kv_num_blocks: int
    slo_text: str | None = None  # ``ServingSLO.describe()``; None: controller off


# -- front -> worker -----------------------------------------------------------------


class Launch(msgspec.Struct, tag=True, array_like=True):
    """The first message: what engine to build. ``profile`` and ``pinned``
    rebuild the ``ProfileSchedule`` (None: no time-of-day windows)."""

    config: EngineConfig
    slo_sources: dict[str, str] = {}
    profile: dict | None = None
    pinned: list[str] = []
    log_format: str | None = None  # the front's logging format and date format
    log_datefmt: str | None = None
    kv_events: bool = False  # send the prefix cache's stored / evicted block hashes


class Add(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    session_id: str | None = None
    deadline: float | None = None
    max_wait: float | None = None
    cache_salt: str | None = None
    arrival_time: float | None = None


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class DeliveryLagUpdate(msgspec.Struct, tag=True, array_like=True):
    """The front's measured first-token delivery lag, for admission."""

    seconds: float


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


ToWorker = Add | Abort | DeliveryLagUpdate | Shutdown | Launch


# -- worker -> front -----------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: EngineInfo
    stats: EngineStats  # the first snapshot
    pid: int


class LaunchFailed(msgspec.Struct, tag=True, array_like=True):
    """The engine could not be built: ``usage`` when the settings or the
    model are at fault (one line for the user), else a bug (the worker
    logged its traceback)."""

    error: str
    usage: bool = False


class Refusal(msgspec.Struct, array_like=True):
    """Why an add was refused: ``kind`` is ``invalid`` (ValueError),
    ``context`` (ContextLengthError) or ``rejected`` (admission; ``reason``
    and ``retry_after`` as ``RejectedError`` has them)."""

    request_id: str
    kind: str
    message: str
    reason: str = ""
    retry_after: float = 0.0


class Delta(msgspec.Struct, array_like=True):
    """What one request gained in one step (``RequestOutput``'s delta
    fields; the front keeps the cumulative ones)."""

    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    delta_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    reject_reason: str | None = None


class Progress(msgspec.Struct, tag=True, array_like=True):
    """One round of the worker's loop."""

    accepted: list[str] = []
    refused: list[Refusal] = []
    outputs: list[Delta] = []
    stats: EngineStats | None = None
    steps: list[LoggedStep] = []
    # The step's prefix-cache changes, when the front asked for them (Launch).
    kv_events: KvEventBatch | None = None


class Failed(msgspec.Struct, tag=True, array_like=True):
    """The engine loop died; the worker exits after sending this."""

    error: str


ToFront = Progress | Ready | LaunchFailed | Failed

to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
to_front_decoder = msgspec.msgpack.Decoder(ToFront)
