"""An analytic step-cost model from hardware specs and model shape.

For what-if studies of machines we cannot measure here (say an H100 serving
an 8B model), a step is priced with a roofline: the step takes as long as
the slower of its arithmetic (at a fraction of peak FLOP/s) and its memory
traffic (at a fraction of peak bandwidth), plus a fixed engine overhead.
Reports label it ``model_kind == "analytic"``, next to the measured kind of
carpool/sim/fitted.py. The model's sizes are a ``ModelShape``
(carpool/sim/model_shapes.py, re-exported here with the presets
``MODELS``). Pure Python: no torch.

Assumptions, all deliberately simple:

* Linear layers cost 2 FLOPs per weight per computed token; the LM head
  runs once per sequence (only the sampled position is projected). A
  mixture-of-experts layer computes only the weights a token is routed
  through (``active_body_params``: top_k experts, the shared experts, the
  router); MLA's absorbed up-projections are its ``kv_b_proj`` weights.
* Attention costs ``ModelShape.pair_flops`` per (query, key) pair: 4 *
  layers * heads * head_dim (scores plus the weighted sum of values); with
  MLA 2 * layers * heads * (2 * kv_lora_rank + qk_rope_head_dim) (absorbed
  attention: every head scores the whole latent row and sums latents). The pairs of a step are
  estimated as ``context_tokens + P * (P - 1) / 2`` for ``P`` prefill
  tokens: every KV entry of the step is read by at least one query (exact
  for decodes), and the prefill tokens add a causal block as if they were
  one chunk of a fresh prompt (exact for a fresh prompt alongside decodes).
  Shapes built from spans (``StepShape.of``) carry the exact
  ``attention_pairs`` and that is used instead. Without it, a chunk with a cached prefix
  is under-counted (its prefix is counted once, not once per chunk token)
  and several prefill chunks in one step are over-counted (as one block).
  The estimate never decreases when a field of the shape grows.
* Memory traffic is every weight a step uses read once (the embedding table
  only through its gathered rows, unless tied to the LM head) plus every
  KV entry of the step read once; activations are ignored. Of the routed
  experts only those the step's tokens reach are read: with ``T`` tokens
  each picking top_k of ``E`` experts uniformly at random, ``E * (1 - (1 -
  k/E) ** T)`` per MoE layer in expectation (all of them for a large
  batch). Real routing is skewed, which touches fewer: an upper bound.
* Expert load imbalance: a grouped MoE GEMM runs as long as its busiest
  expert, so the routed experts' FLOPs are scaled by ``expert_imbalance``
  (the busiest expert's tokens over the mean; 1.0: balanced), at most
  ``E / k`` (no expert takes more than every token).
* An empty step (no tokens) costs nothing: the engine does not run one.
* Memory planning (``max_kv_tokens``) holds every weight, all experts
  included; only compute uses the active ones.
"""
from __future__ import annotations

import types
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from carpool.executor.shapes import StepShape
from carpool.sim.model_shapes import MODELS, ModelShape

__all__ = ["HARDWARE", "MODELS", "AnalyticCostModel", "HardwareSpec", "ModelShape",
           "analytic_from_names"]

# Engineering assumptions, not datasheet values: large bf16 GEMMs reach about
# half of dense peak end to end, streaming reads about 80% of peak HBM
# bandwidth, and a Python engine step spends a couple of ms on scheduling,
# input preparation and sampling outside the GPU kernels.
DEFAULT_FLOPS_EFFICIENCY = 0.55
DEFAULT_BANDWIDTH_EFFICIENCY = 0.8
DEFAULT_STEP_OVERHEAD_S = 0.002


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator, as the roofline sees it.

    peak_flops: dense FLOP/s for the dtype in use (no sparsity);
    mem_bandwidth: peak memory bandwidth in bytes/s;
    flops_efficiency, bandwidth_efficiency: the fractions of those peaks a
        step actually reaches (assumptions, see the module docstring);
    step_overhead_s: fixed seconds per step outside compute and memory;
    memory_bytes: device memory capacity (0 when unknown).
    """

    name: str
    peak_flops: float
    mem_bandwidth: float
    flops_efficiency: float = DEFAULT_FLOPS_EFFICIENCY
    bandwidth_efficiency: float = DEFAULT_BANDWIDTH_EFFICIENCY
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S
    memory_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.peak_flops <= 0 or self.mem_bandwidth <= 0:
            raise ValueError(f"{self.name}: peak_flops and mem_bandwidth must be positive")
        for field in ("flops_efficiency", "bandwidth_efficiency"):
            value = getattr(self, field)
            if not 0 < value <= 1:
                raise ValueError(f"{self.name}: {field} must be in (0, 1], got {value}")
        if self.step_overhead_s < 0 or self.memory_bytes < 0:
            raise ValueError(f"{self.name}: step_overhead_s and memory_bytes must be >= 0")

    @property
    def effective_flops(self) -> float:
        """FLOP/s a step actually gets."""
        return self.peak_flops * self.flops_efficiency

    @property
    def effective_bandwidth(self) -> float:
        """Bytes/s a step actually gets."""
        return self.mem_bandwidth * self.bandwidth_efficiency


# Dense bf16 tensor-core FLOP/s, HBM/GDDR bandwidth and capacity (decimal
# bytes), from the NVIDIA datasheets of each part (SXM form factor where
# there is a choice; the datasheets quote sparsity FLOP/s at twice these).
# The 8x presets are one replica over a whole 8-GPU node (models such as
# DeepSeek-V3 fit nowhere less): eight times each figure, as if tensor or
# expert parallelism split every step evenly and its communication were
# free; an optimistic bound.
HARDWARE = types.MappingProxyType({
    "h100-sxm": HardwareSpec("h100-sxm", 989e12, 3.35e12, memory_bytes=80e9),
    "h200": HardwareSpec("h200", 989e12, 4.8e12, memory_bytes=141e9),
    "a100-80gb": HardwareSpec("a100-80gb", 312e12, 2.039e12, memory_bytes=80e9),
    "l4": HardwareSpec("l4", 121e12, 300e9, memory_bytes=24e9),
    # H800 SXM: an H100 SXM's compute and HBM3 (80 GB, 3.35 TB/s) with NVLink
    # cut to 400 GB/s (carpool/sim/parallel.py has its links); h800-fp8 is the
    # same part at its dense FP8 peak (1,979 TFLOP/s), for FP8 weights
    # (--dtype-bytes 1) as DeepSeek serves V3.
    "h800": HardwareSpec("h800", 989e12, 3.35e12, memory_bytes=80e9),
    "h800-fp8": HardwareSpec("h800-fp8", 1979e12, 3.35e12, memory_bytes=80e9),
    "8xh100-sxm": HardwareSpec("8xh100-sxm", 8 * 989e12, 8 * 3.35e12, memory_bytes=8 * 80e9),
    "8xh200": HardwareSpec("8xh200", 8 * 989e12, 8 * 4.8e12, memory_bytes=8 * 141e9),
})


@dataclass(frozen=True)
class AnalyticCostModel:
    """Roofline step cost of ``model`` on ``hardware`` with weights and KV
    cache in ``dtype_bytes`` bytes per value (2 for bf16/fp16).
    ``expert_imbalance`` (>= 1; MoE only): the busiest expert's tokens over
    the mean, which scales the routed experts' FLOPs (module docstring).

    step = step_overhead_s + max(flops / effective FLOP/s,
                                 bytes / effective bandwidth)
    """

    hardware: HardwareSpec
    model: ModelShape
    dtype_bytes: float = 2
    expert_imbalance: float = 1.0

    kind: ClassVar[str] = "analytic"
    row_bucket: ClassVar[int] = 1  # prices exact tokens

    def __post_init__(self) -> None:
        if self.dtype_bytes <= 0:
            raise ValueError(f"dtype_bytes must be positive, got {self.dtype_bytes}")
        if not 1 <= self.expert_imbalance < float("inf"):
            raise ValueError("expert_imbalance must be finite and >= 1, "
                             f"got {self.expert_imbalance}")
        m, hw, size = self.model, self.hardware, self.dtype_bytes
        # No expert takes more than every token: the factor stops at E / k.
        imbalance = min(self.expert_imbalance, m.experts / m.top_k) if m.is_moe else 1.0
        routed = m.active_routed_params
        # Per-step constants, computed once: a simulation prices millions of steps.
        constants = {"_token_flops": 2 * (m.active_body_params - routed + routed * imbalance),
                     "_pair_flops": m.pair_flops, "_seq_flops": 2 * m.hidden * m.vocab,
                     "_weight_bytes": (m.streamed_params - m.routed_params) * size,
                     "_expert_bytes": m.moe_layers * m.expert_params * size,
                     "_kv_bytes": m.kv_bytes_per_token(size),
                     "_flops_rate": hw.effective_flops, "_bytes_rate": hw.effective_bandwidth}
        for name, value in constants.items():
            object.__setattr__(self, name, value)

    def step_flops(self, shape: StepShape) -> float:
        """Arithmetic of one step (see the module docstring)."""
        _check(shape)
        return self._flops(shape.tokens, shape.seqs, _pairs(shape))

    def step_bytes(self, shape: StepShape) -> float:
        """Memory traffic of one step: the weights it uses once (the routed
        experts its tokens reach), every KV entry once."""
        _check(shape)
        return self._bytes(shape.tokens, shape.context_tokens)

    def compute_seconds(self, shape: StepShape) -> float:
        """Seconds the arithmetic alone would take."""
        return self.step_flops(shape) / self._flops_rate

    def memory_seconds(self, shape: StepShape) -> float:
        """Seconds the memory traffic alone would take."""
        return self.step_bytes(shape) / self._bytes_rate

    def step_seconds(self, shape: StepShape) -> float:
        """Seconds one step of this shape takes; 0 for a step with no tokens."""
        _check(shape)
        if shape.tokens == 0:
            return 0.0
        return self._seconds(shape.tokens, shape.seqs, shape.context_tokens, _pairs(shape))

    def decode_step_seconds(self, seqs: int, context_tokens: int) -> float:
        """``step_seconds`` of ``seqs`` decodes holding ``context_tokens`` in
        all, without building the shape (the simulator's hot path)."""
        return self._seconds(seqs, seqs, context_tokens, context_tokens)

    def extra_seconds(self, tokens: int, idle_s: float, new_shape: bool) -> float:
        """0: hardware specs say nothing of what idling or a new shape costs
        (a measured model's terms do)."""
        return 0.0

    def _flops(self, tokens: int, seqs: int, pairs: float) -> float:
        return self._token_flops * tokens + self._pair_flops * pairs + self._seq_flops * seqs

    def _bytes(self, tokens: int, context_tokens: int) -> float:
        weights = self._weight_bytes
        if self._expert_bytes:  # an MoE model: the experts the tokens reach
            weights += self._expert_bytes * self.model.touched_experts(tokens)
        return weights + self._kv_bytes * context_tokens

    def _seconds(self, tokens: int, seqs: int, context_tokens: int, pairs: float) -> float:
        compute = self._flops(tokens, seqs, pairs) / self._flops_rate
        memory = self._bytes(tokens, context_tokens) / self._bytes_rate
        return self.hardware.step_overhead_s + max(compute, memory)

    def decode_tokens_per_second(self, batch: int, context: int) -> float:
        """Generated tokens/s of ``batch`` sequences decoding together, each
        attending to ``context`` tokens."""
        if batch <= 0 or context <= 0:
            raise ValueError("batch and context must be positive")
        shape = StepShape(prefill_tokens=0, decode_seqs=batch, context_tokens=batch * context, seqs=batch)
        return batch / self.step_seconds(shape)

    def max_kv_tokens(self, memory_fraction: float = 0.9) -> int:
        """KV-cache tokens that fit in ``memory_fraction`` of device memory
        after the weights (all of them: every expert, the embedding; only
        compute uses the active ones); 0 when the capacity is unknown or the
        weights do not fit."""
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        free = self.hardware.memory_bytes * memory_fraction - self.model.params * self.dtype_bytes
        return max(0, int(free // self.model.kv_bytes_per_token(self.dtype_bytes)))

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description that ``from_dict`` rebuilds."""
        return {
            "model_kind": self.kind,
            "hardware": asdict(self.hardware),
            "model": self.model.to_dict(),
            "dtype_bytes": self.dtype_bytes,
            "expert_imbalance": self.expert_imbalance,
            "form": _FORM,
        }

    @classmethod
    def from_dict(cls, data: dict) -> AnalyticCostModel:
        """Rebuild from ``describe()`` output (extra keys are ignored);
        ValueError when it is not an analytic cost model."""
        if data.get("model_kind") != cls.kind:
            raise ValueError(f"not an analytic cost model: model_kind {data.get('model_kind')!r}")
        try:
            hardware = HardwareSpec(**data["hardware"])
            model = ModelShape(**data["model"])
            return cls(hardware, model, data.get("dtype_bytes", 2),
                       data.get("expert_imbalance", 1.0))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed analytic cost model: {exc!r}") from None


_FORM = ("step = step_overhead_s + max(flops / (peak_flops * flops_efficiency), "
         "bytes / (mem_bandwidth * bandwidth_efficiency)); "
         "flops = 2 * (active_body_params + (imbalance - 1) * active_routed_params) * tokens "
         "+ pair_flops * (context_tokens + prefill_tokens * (prefill_tokens - 1) / 2) "
         "+ 2 * hidden * vocab * seqs; "
         "bytes = (body_params - routed_params + hidden * vocab "
         "+ moe_layers * expert_params * experts * (1 - (1 - top_k / experts) ** tokens)) "
         "* dtype_bytes "
         "+ kv_bytes_per_token * context_tokens; "
         "assumes the prefill tokens form one causal chunk of a fresh prompt, the LM head runs once "
         "per sequence, tokens pick experts uniformly for the weights a step reads, the busiest "
         "expert sets the routed experts' compute (imbalance = min(expert_imbalance, "
         "experts / top_k)), "
         "activations are free, and an empty step costs 0")


def _pairs(shape: StepShape) -> float:
    """Query x key pairs: exact when the shape came from spans, else the
    module docstring's estimate."""
    prefill = shape.prefill_tokens
    return shape.attention_pairs or shape.context_tokens + prefill * (prefill - 1) / 2


def _check(shape: StepShape) -> None:
    fields = (shape.prefill_tokens, shape.decode_seqs, shape.context_tokens, shape.seqs)
    if min(fields) < 0:
        raise ValueError(f"step shape has a negative field: {shape}")


def analytic_from_names(hardware: str, model: str, dtype_bytes: float = 2,
                        expert_imbalance: float = 1.0) -> AnalyticCostModel:
    """The analytic model of a preset model (``MODELS``) on a preset
    accelerator (``HARDWARE``); ValueError listing the choices otherwise."""
    if hardware not in HARDWARE:
        raise ValueError(f"unknown hardware {hardware!r}; choose one of {', '.join(sorted(HARDWARE))}")
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(sorted(MODELS))}")
    return AnalyticCostModel(HARDWARE[hardware], MODELS[model], dtype_bytes, expert_imbalance)
