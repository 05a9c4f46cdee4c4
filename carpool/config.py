"""Typed configuration: dataclasses with defaults that work on a laptop CPU,
loadable from YAML, each knob also a CLI flag (see ``carpool.cli``).

Pure Python (no torch): the scheduler and the future simulator import it.
"""
from __future__ import annotations

import dataclasses
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

# ModelSettings and the CUDA graph sizes live in carpool.model_settings;
# importers keep their carpool.config names.
from carpool.model_settings import (  # noqa: F401 - re-exported
    CUDA_GRAPH_SIZES,
    DTYPE_ALIASES,
    ModelSettings,
    capture_sizes,
)
from carpool.settings_fields import flag_bool, flag_bool_or_auto, setting
from carpool.slo import AUTO, FALLBACK_TPOT, FALLBACK_TTFT, parse_target, parse_targets

# Padded execution of static / dynamic batches: where a row's pad tokens sit.
PADDINGS = ("none", "left", "right", "center")

_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: int | float | str) -> int:
    """Parse a byte size such as ``1GiB``, ``512MB`` or ``1073741824``."""
    if isinstance(value, (int, float)):
        return int(value)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse size {value!r} (examples: 512MiB, 2GiB, 1e9)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


# Where the block-hash secret comes from when ``CacheConfig.block_hash_key`` is unset.
BLOCK_HASH_KEY_ENV = "CARPOOL_BLOCK_HASH_KEY"


@dataclass
class CacheConfig:
    """Paged KV cache: one preallocated pool of fixed-size blocks."""

    block_size: int = setting(
        16, "--block-size", "N",
        "tokens per KV block", parse=int)
    # budget for the whole pool, all layers, K and V
    kv_cache_memory: str = setting(
        "1GiB", "--kv-cache-memory", "SIZE",
        "KV pool budget, e.g. 512MiB, 2GiB (unless --gpu-memory-utilization or --num-blocks "
        "is given)")
    # vLLM's --gpu-memory-utilization: the pool is this fraction of the memory
    # free once the weights are loaded (CUDA: mem_get_info; CPU: MemAvailable),
    # and kv_cache_memory is unused (see carpool.cli for the layers' precedence).
    gpu_memory_utilization: float | None = setting(
        None, "--gpu-memory-utilization", "FRACTION",
        "size the KV pool as this fraction (0 < f <= 1) of the memory free once the weights "
        "are loaded (CUDA: free device memory; CPU: MemAvailable); instead of "
        "--kv-cache-memory (default: unset)", parse=float)
    # overrides kv_cache_memory and gpu_memory_utilization
    num_blocks: int | None = setting(
        None, "--num-blocks", "N",
        "KV pool size in blocks (overrides --kv-cache-memory and --gpu-memory-utilization)",
        parse=int)
    enable_prefix_caching: bool = setting(
        True, "--enable-prefix-caching", None,
        "reuse cached KV blocks of shared prefixes", parse=bool, aliases=("--prefix-caching",))
    # Free blocks kept back when admitting new requests, as a fraction of the
    # pool: admitting into the last few blocks only to preempt next step thrashes.
    watermark: float = setting(
        0.01, "--watermark", "FRACTION",
        "fraction of blocks kept free when admitting", parse=float)
    # Operator-pinned prefixes (POST /carpool/prefixes): the share of the
    # pool all of them may hold together, and how many there may be (each
    # is a metric label: this bounds the label set).
    pinned_prefix_share: float = setting(
        0.25, "--pinned-prefix-share", "FRACTION",
        "share of the KV pool all operator-pinned prefixes (POST /carpool/prefixes) may hold "
        "together (0: pinning off)", parse=float)
    max_pinned_prefixes: int = setting(
        32, "--max-pinned-prefixes", "N",
        "most prefixes pinned at once (each one a label of the pinned_prefix_* metrics)", parse=int)
    # Secret key, hex (16 to 64 bytes), of the KV blocks' chained hashes
    # (keyed blake2b): every replica and router of a fleet given the same key
    # names the same prefix by the same hashes, and clients, who do not know
    # it, cannot craft collisions. Unset: the CARPOOL_BLOCK_HASH_KEY
    # environment variable, else a random key per engine (nothing outside
    # it agrees). A secret: settings file or environment only, never a
    # command-line flag (ps shows those), kept out of repr and of metrics.
    block_hash_key: str | None = field(default=None, repr=False)
    # A shared KV store (carpool/kv_transfer): full prompt blocks are written
    # through, and on a local prefix miss the blocks it holds are loaded
    # instead of computed. local (a fleet's front serves one to its
    # replicas over TCP on 127.0.0.1; one replica: memory) | shm (the same
    # in shared memory: only keys cross the socket) | memory (this process)
    # | tcp://HOST:PORT | shm://HOST:PORT/ARENA | redis://HOST:PORT[/DB]; None: off. Replicas share blocks only with
    # one block_hash_key (a fleet's).
    kv_store: str | None = setting(
        None, "--kv-store", "URL",
        "a shared KV store for prompt blocks: local (with --replicas or --prefill/--decode: a"
        " TCP store the API process serves its replicas) | shm (the same in shared memory) | "
        "memory | tcp://HOST:PORT | shm://HOST:PORT/ARENA | redis://HOST:PORT[/DB] (default: "
        "none)")
    # seconds a block stays after its last use
    kv_store_ttl: float = setting(
        1800.0, "--kv-store-ttl", "SECONDS",
        "seconds a stored block stays after its last use", parse=float)
    # the memory store's (Redis: its maxmemory)
    kv_store_capacity: str = setting(
        "1GiB", "--kv-store-capacity", "SIZE",
        "the memory KV store's capacity, e.g. 1GiB (Redis: set its maxmemory)")
    # blocks being written; more are dropped
    kv_store_max_inflight: str = setting(
        "256MiB", "--kv-store-max-inflight", "SIZE",
        "KV blocks being written to the store at most; more are dropped")
    # A session's checkpoint: with a KV store, a session request's output
    # blocks go to the store too (a prompt's always do), at most every N of
    # its batches as blocks fill and at its end, so its next turn on another
    # replica (its home one died) loads them; 0: prompts only.
    kv_session_checkpoint_batches: int = setting(
        5, "--kv-session-checkpoint-batches", "N",
        "with --kv-store: save a session's generated KV blocks to the store at most every N of "
        "its batches and at each turn's end, so its next turn survives its replica "
        "(0: prompt blocks only)", parse=int)

    # Fields never to show (metrics labels, logs, config dumps).
    SECRET_FIELDS: ClassVar[tuple[str, ...]] = ("block_hash_key",)

    def block_hash_secret(self) -> bytes:
        """The block-hash secret: ``block_hash_key``, else the environment's
        ``CARPOOL_BLOCK_HASH_KEY``, else 32 fresh random bytes (each call:
        call it once per engine, at its start). ``ValueError`` unless hex of
        16 to 64 bytes; the message names the source, never the value."""
        text, source = self.block_hash_key, "block_hash_key"
        if text is None:
            text, source = os.environ.get(BLOCK_HASH_KEY_ENV) or None, BLOCK_HASH_KEY_ENV
            if text is None:
                return secrets.token_bytes(32)
        if not isinstance(text, str):
            raise ValueError(f"{source} must be a hex string (quote it in YAML), "
                             f"got a {type(text).__name__}")
        try:
            secret = bytes.fromhex(text.strip())
        except ValueError:
            raise ValueError(f"{source} must be hexadecimal digits") from None
        if not 16 <= len(secret) <= 64:  # blake2b takes keys of up to 64 bytes
            raise ValueError(f"{source} must be 16 to 64 bytes (32 to 128 hex digits), "
                             f"got {len(secret)} bytes")
        return secret

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 <= self.watermark < 0.5:
            raise ValueError(f"watermark must be in [0, 0.5), got {self.watermark}")
        if not 0.0 <= self.pinned_prefix_share <= 0.9:  # also rejects NaN
            raise ValueError(f"pinned_prefix_share must be in [0, 0.9], got "
                             f"{self.pinned_prefix_share}")
        if not 0 <= self.max_pinned_prefixes <= 1024:
            raise ValueError(f"max_pinned_prefixes must be in [0, 1024], got "
                             f"{self.max_pinned_prefixes}")
        fraction = self.gpu_memory_utilization
        if fraction is not None and (isinstance(fraction, bool) or
                                     not isinstance(fraction, (int, float)) or
                                     not 0.0 < fraction <= 1.0):  # also rejects NaN
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction!r}")
        parse_size(self.kv_cache_memory)
        parse_size(self.kv_store_capacity)
        parse_size(self.kv_store_max_inflight)
        if self.kv_session_checkpoint_batches < 0:
            raise ValueError(f"kv_session_checkpoint_batches must be >= 0, got "
                             f"{self.kv_session_checkpoint_batches}")
        if not self.kv_store_ttl > 0:
            raise ValueError(f"kv_store_ttl must be > 0 seconds, got {self.kv_store_ttl}")
        if self.kv_store is not None and not (
                self.kv_store in ("memory", "local", "shm") or self.kv_store.startswith(
                    ("tcp://", "shm://", "redis://", "rediss://", "unix://"))):
            raise ValueError(f"kv_store must be local, shm, memory, tcp://HOST:PORT, "
                             f"shm://HOST:PORT/ARENA or redis://HOST:PORT[/DB], got "
                             f"{self.kv_store!r}")
        self.block_hash_secret()  # raises on a malformed key (the value is dropped)


@dataclass
class SchedulerConfig:
    """One token-budget loop per step (see ``carpool.scheduler.Scheduler``)."""

    max_num_seqs: int = setting(
        128, "--max-num-seqs", "N",
        "most requests running at once", parse=int)
    max_num_batched_tokens: int = setting(
        1024, "--max-num-batched-tokens", "N",
        "token budget of one step", parse=int)
    # fcfs | priority
    policy: str = setting(
        "fcfs", "--scheduling-policy", "POLICY",
        "fcfs | priority")
    # Admission control, per replica: a new request that would push the
    # waiting queue past either bound is turned away with a retry-after
    # estimate instead of queueing without limit. Requeued (preempted)
    # requests never count as arrivals.
    # waiting requests; must be >= 1
    max_queue_requests: int = setting(
        200, "--max-queue-requests", "N",
        "waiting requests beyond which new ones are rejected (HTTP 429)", parse=int)
    # prompt tokens waiting; None = unbounded
    max_queue_tokens: int | None = setting(
        None, "--max-queue-tokens", "N",
        "waiting prompt tokens beyond which new requests are rejected (default: unbounded)",
        parse=int)
    # Seconds a request may wait before it is first scheduled; past that it is
    # rejected with reason "queue_timeout". None = wait forever.
    queue_timeout: float | None = setting(
        None, "--queue-timeout", "SECONDS",
        "seconds a request may wait to start before it is rejected (default: no limit)",
        parse=float)
    # Seconds a session's cached prefix stays protected from eviction after
    # its latest request finished; 0 = no protection (order is still kept).
    session_ttl: float = setting(
        1800.0, "--session-ttl", "SECONDS",
        "seconds a session's prefix stays preferred in the KV cache", parse=float)
    # Unfinished requests one session may hold (they run one at a time); more
    # are rejected ("session_full"), so one session cannot fill the queue.
    max_session_requests: int = setting(
        8, "--max-session-requests", "N",
        "unfinished requests one session may hold (more get 429 session_full)", parse=int)
    # policy priority: a waiting request's effective priority improves by one
    # class per aging_interval seconds waited, so low classes cannot starve.
    # None = no aging.
    aging_interval: float | None = setting(
        30.0, "--aging-interval", "SECONDS",
        "policy priority: seconds of waiting that raise a request one priority class (null in"
        " a config file: no aging)", parse=float)
    # Dual queue (both policies): prompts longer than long_prompt_threshold
    # tokens get together at most long_prefill_share of the step's token
    # budget for prefill while short requests wait or prefill; 1 = no cap.
    long_prompt_threshold: int = setting(
        512, "--long-prompt-threshold", "N",
        "prompts longer than this many tokens share the long-prefill allowance", parse=int)
    long_prefill_share: float = setting(
        0.5, "--long-prefill-share", "FRACTION",
        "fraction of the step token budget long prompts get for prefill while short requests "
        "wait (1 = no cap)", parse=float)
    # Batching regime: continuous (iteration-level), or the request-level
    # baselines static (batches of exactly preferred_batch_size, or fewer
    # after max_wait) and dynamic (length buckets of +-bucket_tolerance,
    # dispatched at preferred_batch_size, at most max_batch_size, or after
    # max_wait); a static or dynamic batch runs to completion, nobody joins.
    batching: str = setting(
        "continuous", "--batching", "MODE",
        "continuous | static | dynamic (request-level baselines)")
    preferred_batch_size: int = setting(
        8, "--preferred-batch-size", "N",
        "static: the batch size; dynamic: dispatch when a length bucket holds this many", parse=int)
    max_batch_size: int = setting(
        16, "--max-batch-size", "N",
        "dynamic: most requests in one batch", parse=int)
    # seconds; None = wait for a full batch
    max_wait: float | None = setting(
        0.05, "--max-wait", "SECONDS",
        "static/dynamic: seconds the oldest request waits before a partial batch goes", parse=float)
    bucket_tolerance: float = setting(
        0.1, "--bucket-tolerance", "FRACTION",
        "dynamic: a length bucket holds prompts within this fraction of its length", parse=float)
    # static / dynamic: the dual queue's long lane. Prompts over
    # long_prompt_threshold tokens form their own batches of at most
    # long_batch_size (sooner once the oldest waited long_max_wait), so a
    # long prompt never pads or holds back a batch of short ones; short ones
    # keep preferred_batch_size / max_wait. None: one queue for all.
    long_batch_size: int | None = setting(
        2, "--long-batch-size", "N",
        "static/dynamic: prompts over --long-prompt-threshold form their own batches of at "
        "most this many (null in a config file: one queue for all)", parse=int)
    # seconds; None: wait for a full batch
    long_max_wait: float | None = setting(
        0.2, "--long-max-wait", "SECONDS",
        "static/dynamic: seconds the oldest long prompt waits before a partial long batch "
        "goes", parse=float)
    # static / dynamic: run each step of a batch as a padded rectangle, as a
    # real request-level batcher does: rows = the batch's size at dispatch
    # (finished members keep their row), cols = the step's longest span;
    # none | left | right | center says where each row's pad tokens sit (none:
    # ragged, no padding). Continuous batching never pads. None (the default)
    # = right under static / dynamic and none under continuous, so the
    # request-level baselines pay their padding cost unless asked not to.
    padding: str | None = setting(
        None, "--padding", "MODE",
        "static/dynamic: pad each step to a rectangle: none | left | right | center (default:"
        " right under static/dynamic, else none)")
    # Reject at arrival a request with a deadline that the online step-cost
    # model predicts cannot get its first token in time.
    predictive_shedding: bool = setting(
        True, "--predictive-shedding", "BOOL",
        "reject at arrival a request predicted to miss its deadline or TTFT target",
        parse=flag_bool)
    # Under an operator's TTFT target: admission also holds first tokens
    # within this multiple of the live calm TTFT p99 (``shedding.CalmTTFT``:
    # requests that arrived away from any rejection), so a surge's queue
    # stays as short as keeps the engine busy: at saturation a longer one
    # serves no more requests, it delays all of them up to the target.
    # None: the target alone.
    surge_ttft_factor: float | None = setting(
        1.6, "--surge-ttft-factor", "X",
        "under an operator's TTFT target, also hold first tokens within X times the live calm"
        " TTFT p99, so a surge's queue stays short (null in a settings file: the target "
        "alone)", parse=float)
    # Emergency switch (``scheduler.control.overload``): after emergency_sustain
    # seconds with any breaker over its threshold (the queue at
    # emergency_queue_share of max_queue_requests, the engine busier than
    # emergency_busy, the host CPUs busier than emergency_host_cpu), degrade
    # mode sheds the lowest priorities first; each further emergency_sustain
    # of overload goes one step deeper: static batching, then the response
    # cache for identical deterministic requests.
    emergency_switch: bool = setting(
        False, "--emergency-switch", "BOOL",
        "under sustained overload degrade in steps: shed the lowest priorities first, then "
        "static batching, then answer repeated deterministic requests from a cache",
        parse=flag_bool)
    emergency_queue_share: float = setting(
        0.8, "--emergency-queue-share", "FRACTION",
        "emergency switch: a queue at this share of --max-queue-requests is overload", parse=float)
    emergency_busy: float = setting(
        0.9, "--emergency-busy", "FRACTION",
        "emergency switch: the engine busier than this share of the time is overload", parse=float)
    # None: no CPU breaker
    emergency_host_cpu: float | None = setting(
        0.9, "--emergency-host-cpu", "FRACTION",
        "emergency switch: the host's CPUs busier than this is overload (null in a config "
        "file: no CPU breaker)", parse=float)
    # seconds
    emergency_sustain: float = setting(
        5.0, "--emergency-sustain", "SECONDS",
        "emergency switch: seconds of overload before degrading, and before each further step",
        parse=float)

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_queue_requests < 1:
            raise ValueError(f"max_queue_requests must be >= 1 (an unbounded queue is not "
                             f"supported), got {self.max_queue_requests}")
        if self.max_queue_tokens is not None and self.max_queue_tokens < 1:
            raise ValueError(f"max_queue_tokens must be >= 1 or null (unbounded), "
                             f"got {self.max_queue_tokens}")
        if self.queue_timeout is not None and not self.queue_timeout > 0:
            raise ValueError(f"queue_timeout must be > 0 seconds or null (wait forever), "
                             f"got {self.queue_timeout}")
        if self.max_session_requests < 1:
            raise ValueError(f"max_session_requests must be >= 1, "
                             f"got {self.max_session_requests}")
        if not self.session_ttl >= 0:  # also rejects NaN
            raise ValueError(f"session_ttl must be >= 0 seconds, got {self.session_ttl}")
        if self.aging_interval is not None and not self.aging_interval > 0:
            raise ValueError(f"aging_interval must be > 0 seconds or null (no aging), "
                             f"got {self.aging_interval}")
        if self.long_prompt_threshold < 1:
            raise ValueError(f"long_prompt_threshold must be >= 1 token, "
                             f"got {self.long_prompt_threshold}")
        self._validate_batching()
        self._validate_emergency()
        if not 0.0 < self.long_prefill_share <= 1.0:  # also rejects NaN
            raise ValueError(f"long_prefill_share must be in (0, 1], got {self.long_prefill_share}")

    @property
    def padding_mode(self) -> str:
        """The padding in effect: ``padding``, or when that is None, ``right``
        under static / dynamic batching and ``none`` under continuous."""
        if self.padding is not None:
            return self.padding
        return "none" if self.batching == "continuous" else "right"

    def _validate_emergency(self) -> None:
        if self.surge_ttft_factor is not None and not self.surge_ttft_factor >= 1.0:
            raise ValueError(f"surge_ttft_factor must be >= 1 or null, "
                             f"got {self.surge_ttft_factor}")
        if not 0.0 < self.emergency_queue_share <= 1.0:
            raise ValueError(f"emergency_queue_share must be in (0, 1], "
                             f"got {self.emergency_queue_share}")
        if not 0.0 < self.emergency_busy <= 1.0:
            raise ValueError(f"emergency_busy must be in (0, 1], got {self.emergency_busy}")
        if self.emergency_host_cpu is not None and not 0.0 < self.emergency_host_cpu <= 1.0:
            raise ValueError(f"emergency_host_cpu must be in (0, 1] or null (no CPU breaker), "
                             f"got {self.emergency_host_cpu}")
        if not self.emergency_sustain > 0:
            raise ValueError(f"emergency_sustain must be > 0 seconds, "
                             f"got {self.emergency_sustain}")

    def _validate_batching(self) -> None:
        if self.batching not in ("static", "dynamic", "continuous"):
            raise ValueError(f"batching must be static|dynamic|continuous, got {self.batching!r}")
        if self.padding is not None and self.padding not in PADDINGS:
            raise ValueError(f"padding must be none|left|right|center, got {self.padding!r}")
        if self.batching == "continuous" and self.padding_mode != "none":
            raise ValueError(f"padding {self.padding!r} needs static or dynamic batching; "
                             f"continuous batching never pads (padding: none)")
        if not 1 <= self.preferred_batch_size <= self.max_batch_size:
            raise ValueError(f"need 1 <= preferred_batch_size ({self.preferred_batch_size}) "
                             f"<= max_batch_size ({self.max_batch_size})")
        if self.max_wait is not None and not self.max_wait >= 0:
            raise ValueError(f"max_wait must be >= 0 seconds or null, got {self.max_wait}")
        if self.long_batch_size is not None and self.long_batch_size < 1:
            raise ValueError(f"long_batch_size must be >= 1 or null (one queue), "
                             f"got {self.long_batch_size}")
        if self.long_max_wait is not None and not self.long_max_wait >= 0:
            raise ValueError(f"long_max_wait must be >= 0 seconds or null, "
                             f"got {self.long_max_wait}")
        if not 0.0 < self.bucket_tolerance < 1.0:
            raise ValueError(f"bucket_tolerance must be in (0, 1), got {self.bucket_tolerance}")


@dataclass
class ControllerConfig:
    """The adaptive controller (``carpool.scheduler.control.controller``) and the
    latency targets it serves.

    ``adaptive``: None (the default) means on under ``carpool serve`` and off
    everywhere else (offline generation, benchmarks of fixed settings, the
    simulator), resolved once by ``resolve_adaptive``. Targets are seconds,
    ``"auto"`` (measured at serve start-up, see ``carpool.slo``; elsewhere
    the fallbacks) or None (no target).
    """

    adaptive: bool | None = setting(
        None, "--adaptive", "BOOL",
        "the adaptive controller and SLO admission (default: on for serve, off elsewhere); "
        "false: plain batching at the configured knobs", parse=flag_bool)
    # seconds between regular decisions; >= 0.1
    controller_interval: float = setting(
        1.0, "--controller-interval", "SECONDS",
        "adaptive: seconds between regular controller decisions (>= 0.1; events tick sooner)",
        parse=float)
    # seconds of metrics the slow signals read
    controller_window: float = setting(
        30.0, "--controller-window", "SECONDS",
        "adaptive: seconds of live metrics the slow signals read", parse=float)
    # Seconds of metrics the fast signals read (step times, recent arrivals):
    # what lets a surge be acted on within a second or two. At most
    # controller_window (a longer value is cut to it).
    controller_fast_window: float = setting(
        2.0, "--controller-fast-window", "SECONDS",
        "adaptive: seconds of live metrics the fast signals (step times, arrivals) read",
        parse=float)
    # auto | latency | balanced | throughput (pinned)
    controller_mode: str = setting(
        "auto", "--controller-mode", "MODE",
        "adaptive: auto | latency | balanced | throughput (a fixed mode)")
    # seconds, p99 of admitted requests
    ttft_target: float | str | None = setting(
        AUTO, "--ttft-target", "TIME",
        "adaptive: p99 time-to-first-token target (0.5, 500ms or auto: measured at serve "
        "start-up); admission sheds predicted misses", parse=parse_target)
    # seconds, p99 of admitted requests
    tpot_target: float | str | None = setting(
        AUTO, "--tpot-target", "TIME",
        "adaptive: p99 time-per-output-token target (0.1, 100ms or auto)", parse=parse_target)
    # Seconds, p99 end-to-end of admitted requests; None: no target. Never
    # measured (it depends on the output lengths clients ask for): set by an
    # operator (``--slo e2e=1.5s``), it caps the batch at the step time that
    # lets the long outputs of recent requests finish within it.
    e2e_target: float | None = setting(
        None, "--e2e-target", "TIME",
        "adaptive: p99 end-to-end target (1.5, 1500ms); caps the batch so the long outputs of"
        " recent requests finish within it (default: none)", parse=parse_target)
    # carpool serve: measure the unloaded TTFT / TPOT at start-up for "auto"
    # targets; false: "auto" means FALLBACK_TTFT / FALLBACK_TPOT.
    calibrate: bool = setting(
        True, "--calibrate", "BOOL",
        "serve: measure the unloaded TTFT/TPOT at start-up for auto targets (false: auto "
        "targets are 2 s / 200 ms)", parse=flag_bool)
    # Share of the KV pool the batch limit leaves free for growth (the by_memory term).
    memory_headroom: float = setting(
        0.2, "--memory-headroom", "FRACTION",
        "adaptive: share of the KV pool the batch limit keeps free", parse=float)
    # How alpha (the batch limit's headroom over peak demand: request-level
    # batching, and continuous under an operator's TPOT/E2E target) moves:
    # rule (x1.25 for late first tokens, x0.8 for late tokens) or bandit
    # (``scheduler.control.alpha_policy``: learned online from the goodput each move
    # earned).
    alpha_policy: str = setting(
        "rule", "--alpha-policy", "POLICY",
        "adaptive, static/dynamic batching: how alpha (the batch limit's headroom over peak "
        "demand) moves: rule (x1.25 / x0.8 by which target is missed) | bandit (learned "
        "online from the goodput each move earned)")
    # scheduler steps a knob change is spread over (1..3)
    transition_steps: int = setting(
        3, "--transition-steps", "N",
        "adaptive: scheduler steps a knob change is spread over (1..3)", parse=int)
    # ticks in a row wanting a new mode before it switches
    hysteresis_ticks: int = setting(
        2, "--hysteresis-ticks", "N",
        "adaptive: ticks in a row asking for a change before mode, alpha or correction move",
        parse=int)
    # Adaptive only: reject at arrival a request the cost model predicts
    # cannot get its first token within its share of ttft_target (as
    # predictive shedding does for explicit deadlines). "auto": only when an
    # operator set the TTFT target (flag, settings file, profile); a target
    # measured at start-up (or its fallback) steers the controller but never
    # turns work away: without an operator's SLO the server queues what fits
    # its queue bounds, as vLLM does. ``resolve_levers`` decides it once.
    shed_on_ttft_target: bool | str = setting(
        AUTO, "--shed-on-ttft-target", "BOOL|auto",
        "adaptive: reject at arrival what is predicted to miss the TTFT target; auto: only "
        "when the operator set that target (--slo, --ttft-target, a settings file), never for"
        " a measured one", parse=flag_bool_or_auto)
    # Adaptive only: the batch limit's by_latency term, the largest batch
    # whose steps the cost model puts within the TPOT target. "auto": only
    # when an operator set the TPOT target. A measured target caps nothing:
    # with requests waiting, a smaller batch only drains the queue slower
    # (a 64-request burst took 3.6x as long under the measured cap).
    batch_limit_by_tpot: bool | str = setting(
        AUTO, "--batch-limit-by-tpot", "BOOL|auto",
        "adaptive: cap the batch at the largest whose steps keep the TPOT target; auto: only "
        "when the operator set that target", parse=flag_bool_or_auto)

    def validate(self) -> None:
        if self.adaptive not in (None, True, False):
            raise ValueError(f"adaptive must be true, false or null (on for serve), "
                             f"got {self.adaptive!r}")
        if not self.controller_interval >= 0.1:
            raise ValueError(f"controller_interval must be >= 0.1 s, got {self.controller_interval}")
        if not self.controller_window >= self.controller_interval:
            raise ValueError(f"controller_window ({self.controller_window}) must be >= "
                             f"controller_interval ({self.controller_interval})")
        if not self.controller_fast_window >= 0.1:  # a longer one is cut to controller_window
            raise ValueError(f"controller_fast_window must be >= 0.1 s, "
                             f"got {self.controller_fast_window}")
        if self.controller_mode not in ("auto", "latency", "balanced", "throughput"):
            raise ValueError(f"controller_mode must be auto|latency|balanced|throughput, "
                             f"got {self.controller_mode!r}")
        for name in ("ttft_target", "tpot_target"):
            value = getattr(self, name)
            if value == AUTO or value is None:
                continue
            if isinstance(value, str) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, auto or null, got {value!r}")
        if self.e2e_target is not None and (isinstance(self.e2e_target, (str, bool))
                                            or not self.e2e_target > 0):
            raise ValueError(f"e2e_target must be > 0 seconds or null, got {self.e2e_target!r}")
        for name in ("shed_on_ttft_target", "batch_limit_by_tpot"):
            if getattr(self, name) not in (True, False, AUTO):
                raise ValueError(f"{name} must be true, false or auto, "
                                 f"got {getattr(self, name)!r}")
        if self.alpha_policy not in ("rule", "bandit"):
            raise ValueError(f"alpha_policy must be rule or bandit, got {self.alpha_policy!r}")
        if not 0.0 <= self.memory_headroom < 1.0:
            raise ValueError(f"memory_headroom must be in [0, 1), got {self.memory_headroom}")
        if not 1 <= self.transition_steps <= 3:
            raise ValueError(f"transition_steps must be 1..3, got {self.transition_steps}")
        if self.hysteresis_ticks < 1:
            raise ValueError(f"hysteresis_ticks must be >= 1, got {self.hysteresis_ticks}")

    def resolve_adaptive(self, serving: bool) -> None:
        """The one place ``adaptive: null`` is decided: on when serving."""
        if self.adaptive is None:
            self.adaptive = serving

    def resolve_levers(self) -> None:
        """The one place ``shed_on_ttft_target`` and ``batch_limit_by_tpot``
        set to ``auto`` are decided: each on when its target is the
        operator's (not ``auto``, not None). Called before measured targets
        replace ``auto`` (``carpool.engine.calibrate``) and by ``concrete``;
        idempotent."""
        if self.shed_on_ttft_target == AUTO:
            self.shed_on_ttft_target = self.ttft_target not in (AUTO, None)
        if self.batch_limit_by_tpot == AUTO:
            self.batch_limit_by_tpot = self.tpot_target not in (AUTO, None)

    @property
    def regime(self) -> str:
        """``slo``: admission sheds predicted TTFT misses (an operator's
        target); ``queue``: it only enforces the queue bounds and deadlines.
        Meaningful once ``resolve_levers`` ran."""
        return "slo" if self.adaptive and self.shed_on_ttft_target is True else "queue"

    @property
    def auto_targets(self) -> tuple[str, ...]:
        """The metrics (``ttft``, ``tpot``) whose target is still ``auto``."""
        return tuple(m for m in ("ttft", "tpot") if getattr(self, f"{m}_target") == AUTO)

    def concrete(self) -> "ControllerConfig":
        """A copy the scheduler can run: ``adaptive`` a bool, every ``auto``
        target replaced by its fallback (measured targets are set before this)."""
        fallback = {"ttft_target": FALLBACK_TTFT, "tpot_target": FALLBACK_TPOT}
        changes = {name: value for name, value in fallback.items()
                   if getattr(self, name) == AUTO}
        copy = dataclasses.replace(self, adaptive=bool(self.adaptive))
        copy.resolve_levers()  # before the fallbacks replace "auto"
        return dataclasses.replace(copy, **changes)


@dataclass
class EngineConfig:
    """Everything an engine needs; nested sections mirror the YAML layout."""

    model: ModelSettings = field(default_factory=ModelSettings)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)

    def validate(self) -> "EngineConfig":
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.controller.validate()
        return self

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineConfig":
        """Build from a nested dict (as YAML gives) or flat knob names."""
        config = cls()
        config.update(data)
        return config

    @classmethod
    def from_yaml(cls, path: str | Path) -> "EngineConfig":
        """Engine settings from a YAML file (its ``server:`` section is ignored)."""
        data = read_yaml(path)
        data.pop("server", None)
        return cls.from_dict(data)

    def update(self, data: dict[str, Any]) -> None:
        """Apply nested (``{"cache": {"block_size": 32}}``) or flat
        (``{"block_size": 32}``) overrides; unknown keys raise ``ValueError``."""
        sections = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key, value in data.items():
            key = _ALIASES.get(key, key)
            if key in sections and isinstance(value, dict):
                for sub_key, sub_value in value.items():
                    _set_field(sections[key], sub_key, sub_value, f"{key}.{sub_key}")
                continue
            if key == "slo":  # shorthand for the controller's targets
                _set_field(self.controller, key, value, key)
                continue
            if key == DESIGN_SECTION:
                self.update(design_section(value))
                continue
            owners = [s for s in sections.values() if key in _field_names(s)]
            if not owners:
                raise ValueError(f"unknown config key {key!r}")
            _set_field(owners[0], key, value, key)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML settings file as a dict; a clear ``ValueError`` if it is not a mapping."""
    import yaml

    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


# Other names for knobs: the seeds call the step token budget max_batch_tokens.
_ALIASES = {"max_batch_tokens": "max_num_batched_tokens"}
# The design's configuration template loads as written:
#   dynamic_batching: {max_tokens: 4096, preferred_batch_size: 8,
#                      max_wait_time: 0.15, emergency_switch: true}
# Its keys, by carpool's names; the section picks no batching regime (the
# design's "dynamic batching" is the adaptive system as a whole).
DESIGN_SECTION = "dynamic_batching"
_DESIGN_KEYS = {"max_tokens": "max_num_batched_tokens",
                "preferred_batch_size": "preferred_batch_size",
                "max_batch_size": "max_batch_size", "max_wait_time": "max_wait",
                "emergency_switch": "emergency_switch"}


def design_section(value: Any) -> dict[str, Any]:
    """The ``dynamic_batching:`` section as carpool's flat keys."""
    if not isinstance(value, dict):
        raise ValueError(f"{DESIGN_SECTION} must be a mapping, got {value!r}")
    unknown = sorted(set(value) - set(_DESIGN_KEYS))
    if unknown:
        raise ValueError(f"unknown config key {DESIGN_SECTION}.{unknown[0]} (known: "
                         f"{', '.join(sorted(_DESIGN_KEYS))})")
    return {_DESIGN_KEYS[key]: item for key, item in value.items()}


def _field_names(obj: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(obj)}


def _set_field(obj: Any, name: str, value: Any, label: str) -> None:
    name = _ALIASES.get(name, name)
    if name == "slo" and isinstance(obj, ControllerConfig):
        for target, seconds in _slo_targets(value, label).items():
            setattr(obj, target, seconds)
        return
    if name not in _field_names(obj):
        raise ValueError(f"unknown config key {label!r}")
    setattr(obj, name, value)


def _slo_targets(value: Any, label: str) -> dict[str, float]:
    """``slo:`` as ``"ttft=500ms,tpot=100ms"`` or ``{ttft: 0.5, tpot: 100ms}``
    (numbers are seconds) -> the controller's target fields."""
    if isinstance(value, str):
        return parse_targets(value)
    if not isinstance(value, dict):
        raise ValueError(f"{label} must be a string like ttft=500ms,tpot=100ms or a mapping, "
                         f"got {value!r}")
    text = ",".join(f"{k}={f'{v}s' if isinstance(v, (int, float)) else v}"
                    for k, v in value.items())
    return parse_targets(text)
