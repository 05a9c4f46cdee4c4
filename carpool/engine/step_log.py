"""The live engine's recent steps: what each computed and how long it took.

Every step ``LLMEngine.step`` runs on a ragged batch is logged here: its
``StepShape`` (what the simulator's cost models price), its whole wall time
(scheduling, the model and detokenizing, as ``carpool measure`` times a
step) and when it began. A bounded ring, so a long-running server holds
the last ``capacity`` steps and no more. ``GET /carpool/steps`` serves it
and ``carpool measure --from URL`` fits the simulator's cost model on it:
the shapes real traffic produces, timed on the machine serving it, right
now (a profile measured an hour earlier had drifted by 25-70%).

Written by the engine thread, read by the HTTP server's: a lock keeps a
read from seeing the ring mid-append.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass
from typing import NamedTuple

from carpool.executor.shapes import DEFAULT_ROW_BUCKET, ShapeMemory, StepShape

STEP_LOG_CAPACITY = 8192  # steps kept (~1 MB as JSON; minutes of a busy server)


@dataclass(frozen=True)
class LoggedStep:
    """One step: its shape, its wall seconds, its start on the engine's
    clock (monotonic seconds; only differences mean anything), whether
    its token count was new to the process (``ShapeMemory``: it then paid
    for building matrix kernels), and the replica that ran it (a fleet's
    front tags the steps it mirrors; None for a single engine)."""

    shape: StepShape
    seconds: float
    started: float
    new_shape: bool = False
    replica: str | None = None

    def as_dict(self) -> dict:
        row = {**asdict(self.shape), "seconds": self.seconds, "started": self.started,
               "new_shape": self.new_shape}
        if self.replica is not None:
            row["replica"] = self.replica
        return row


class StepPhases(NamedTuple):
    """Where one step's wall seconds went, in the order the engine runs
    them (``LLMEngine.last_phases``; ``carpool bench engine`` reports them):
    schedule (the scheduler, expired requests' outputs); batch (the
    executor's batch items and sampling rows); execute (the executor);
    commit (committing the step, stop checks and detokenizing, finishing);
    outputs (each progressed request's ``RequestOutput``); log (counters
    and the step log)."""

    schedule: float
    batch: float
    execute: float
    commit: float
    outputs: float
    log: float

    @property
    def total(self) -> float:
        return sum(self)


class StepLog:
    """A thread-safe ring of the last ``capacity`` steps, and a count of all."""

    def __init__(self, capacity: int = STEP_LOG_CAPACITY,
                 row_bucket: int = DEFAULT_ROW_BUCKET) -> None:
        if capacity < 1:
            raise ValueError(f"step log capacity must be >= 1, got {capacity}")
        self._steps: deque[LoggedStep] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.total = 0  # steps ever logged (those beyond the ring were dropped)
        self._shapes = ShapeMemory(row_bucket=row_bucket)

    def record(self, shape: StepShape, seconds: float, started: float) -> None:
        with self._lock:
            new = self._shapes.see(shape.tokens)
            self._steps.append(LoggedStep(shape, seconds, started, new))
            self.total += 1

    def append(self, step: LoggedStep) -> None:
        """Log a step another process's log recorded (a worker's, mirrored
        by the front: ``EngineClient``, which tags it with its replica)."""
        with self._lock:
            self._steps.append(step)
            self.total += 1

    def since(self, total_seen: int) -> list[LoggedStep]:
        """The steps logged after the first ``total_seen`` (those still in
        the ring), oldest first; cheap when few: read from the ring's end."""
        with self._lock:
            count = min(self.total - total_seen, len(self._steps))
            return [self._steps[-i] for i in range(count, 0, -1)]

    def snapshot(self, limit: int | None = None) -> tuple[list[LoggedStep], int]:
        """(the last ``limit`` logged steps, oldest first; steps ever logged)."""
        with self._lock:
            steps = list(self._steps)
            total = self.total
        if limit is not None:
            steps = steps[-limit:] if limit > 0 else []
        return steps, total


def kv_bytes_per_token(engine) -> int:
    """K and V of every layer for one token, in the engine's dtype (what
    the simulator sizes a pool from ``--kv-cache-memory`` with)."""
    config = engine.model_config
    return (2 * config.num_layers * config.num_kv_heads * config.head_dim
            * engine.executor.dtype.itemsize)


def step_facts(engine) -> dict:
    """What a cost model fitted on ``engine``'s steps must record: the
    machine, model, dtype, KV bytes and limits (``carpool measure``'s record);
    fixed for the engine's life, so an engine in a worker process sends them
    once."""
    from carpool.machine import machine_identity

    device = str(getattr(engine.executor, "device", "cpu"))
    scheduler = engine.config.scheduler
    return {"machine": machine_identity(device),
            "model": engine.config.model.model or "default (SmolLM2-135M-Instruct)",
            "dtype": str(engine.executor.dtype).replace("torch.", ""),
            "kv_bytes_per_token": kv_bytes_per_token(engine),
            "max_model_len": engine.max_model_len,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "max_num_seqs": scheduler.max_num_seqs, "batching": scheduler.batching,
            "row_bucket": engine.config.model.row_bucket,
            # The CPU kernel plan this machine kind chose (carpool/kernel_plan.py); None off a CPU.
            "kernels": (plan.labels() if (plan := getattr(engine.executor, "kernel_plan", None))
                        is not None else None)}


def steps_document(step_log: StepLog, facts: dict, limit: int | None = None) -> dict:
    """What ``GET /carpool/steps`` answers: the last ``limit`` steps of
    ``step_log`` and the ``step_facts`` of the engine that ran them."""
    steps, total = step_log.snapshot(limit)
    return {**facts, "total_steps": total, "steps": [step.as_dict() for step in steps]}
