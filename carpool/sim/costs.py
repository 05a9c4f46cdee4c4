"""Cost models of one engine step, shared by the simulator and the planner.

A step is described by its shape only (what the scheduler decided), never
by tensors, so the simulator can price a step without a model:
``StepShape(prefill_tokens, decode_seqs, context_tokens, seqs)``. Two kinds
of model price it: ``measured`` (fitted to this machine by ``carpool
measure``, carpool/measure/costs.py) and ``analytic`` (hardware specs and model
shape, carpool/sim/analytic.py, for machines we cannot measure). Reports
name the kind they used. Pure Python.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from carpool.executor.shapes import StepShape
from carpool.machine import identity_mismatch
from carpool.sim.analytic import AnalyticCostModel
from carpool.sim.fitted import FittedCostModel

COST_MODEL_KIND = "carpool-cost-model"
COST_MODEL_VERSION = 1


class CostModel(Protocol):
    """Seconds one step of a given shape takes."""

    kind: str  # "measured" or "analytic"
    # The rows a step's tokens were padded to where it was measured
    # (``carpool.executor.shapes.padded_rows``; 1: exact): the simulated
    # executor's ``ShapeMemory`` counts new shapes as that process did.
    row_bucket: int

    def step_seconds(self, shape: StepShape) -> float: ...

    def decode_step_seconds(self, seqs: int, context_tokens: int) -> float:
        """Exactly ``step_seconds(StepShape(0, seqs, context_tokens, seqs,
        context_tokens))``: a step of ``seqs`` one-token decodes."""
        ...

    def extra_seconds(self, tokens: int, idle_s: float, new_shape: bool) -> float:
        """What a step of ``tokens`` costs more in its circumstances: after
        the engine idled ``idle_s``, and when its token count is new to the
        process (``carpool.executor.shapes.ShapeMemory``)."""
        ...

    def describe(self) -> dict: ...


def kv_bytes_per_token(cost: CostModel) -> float | None:
    """KV cache bytes one token takes under ``cost`` (an analytic model's
    shape, a measured one's record), or None when it does not say."""
    if cost.kind == "analytic":
        return cost.model.kv_bytes_per_token(cost.dtype_bytes)
    return getattr(cost, "meta", {}).get("kv_bytes_per_token") or None


def machine_warning(cost: CostModel) -> str | None:
    """Why a measured ``cost`` may not describe this machine (it was
    measured on another, or recorded none), or None. Analytic models price
    the hardware they name on purpose: never a warning."""
    if cost.kind != "measured":
        return None
    meta = getattr(cost, "meta", {}) or {}
    differences = identity_mismatch(meta.get("machine"))
    if not differences:
        return None
    where = meta.get("note") or f"measured {meta.get('created_at', 'at an unknown date')}"
    return (f"this cost model may not describe this machine: {'; '.join(differences)}. "
            f"It says: {where}. Step times can differ by 2x or more between machines "
            f"of one name; run `carpool measure --out cost-model.json` here and pass "
            f"--cost-model cost-model.json")


def warn_if_elsewhere(cost: CostModel) -> str | None:
    """Print ``machine_warning(cost)`` loudly to stderr; return it."""
    import sys

    warning = machine_warning(cost)
    if warning is not None:
        print(f"carpool: WARNING: {warning}", file=sys.stderr)
    return warning


def save_cost_model(model: CostModel, path: str | Path) -> Path:
    """Write ``model.describe()`` (which must round-trip through
    ``load_cost_model``) as JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"kind": COST_MODEL_KIND, "version": COST_MODEL_VERSION,
                                **model.describe()}, indent=2))
    return path


def load_cost_model(path: str | Path) -> CostModel:
    """A cost model saved by ``save_cost_model``; ValueError naming the file
    when it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read cost model {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("kind") != COST_MODEL_KIND:
        raise ValueError(f"{path} is not a carpool cost model (kind {COST_MODEL_KIND!r})")
    if data.get("version") != COST_MODEL_VERSION:
        raise ValueError(f"{path}: cost model version {data.get('version')!r} is not "
                         f"{COST_MODEL_VERSION}")
    if data.get("model_kind") == "measured":

        return FittedCostModel.from_dict(data)
    if data.get("model_kind") == "analytic":
        if "parallel" in data:  # a replica over several GPUs (parallel_cost.py)
            from carpool.sim.parallel_cost import ParallelCostModel

            return ParallelCostModel.from_dict(data)
        return AnalyticCostModel.from_dict(data)
    raise ValueError(f"{path}: unknown model_kind {data.get('model_kind')!r}")
