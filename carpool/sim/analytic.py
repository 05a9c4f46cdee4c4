"""An analytic step-cost model from hardware specs and model shape.

For what-if studies of machines we cannot measure here (say an H100 serving
an 8B model), a step is priced with a roofline: the step takes as long as
the slower of its arithmetic (at a fraction of peak FLOP/s) and its memory
traffic (at a fraction of peak bandwidth), plus a fixed engine overhead.
Reports label it ``model_kind == "analytic"``, next to the measured kind of
carpool/sim/fitted.py. Pure Python: no torch.

Assumptions, all deliberately simple:

* Linear layers cost 2 FLOPs per weight per computed token; the LM head
  runs once per sequence (only the sampled position is projected).
* Attention costs 4 * layers * heads * head_dim FLOPs per (query, key)
  pair (scores plus the weighted sum of values). The pairs of a step are
  estimated as ``context_tokens + P * (P - 1) / 2`` for ``P`` prefill
  tokens: every KV entry of the step is read by at least one query (exact
  for decodes), and the prefill tokens add a causal block as if they were
  one chunk of a fresh prompt (exact for a fresh prompt alongside decodes).
  Shapes built from spans (``StepShape.of``) carry the exact
  ``attention_pairs`` and that is used instead. Without it, a chunk with a cached prefix
  is under-counted (its prefix is counted once, not once per chunk token)
  and several prefill chunks in one step are over-counted (as one block).
  The estimate never decreases when a field of the shape grows.
* Memory traffic is every weight read once per step (the embedding table
  only through its gathered rows, unless tied to the LM head) plus every
  KV entry of the step read once; activations are ignored.
* An empty step (no tokens) costs nothing: the engine does not run one.
"""
from __future__ import annotations

import types
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from carpool.executor.shapes import StepShape

if TYPE_CHECKING:
    from carpool.model.config import ModelConfig

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
HARDWARE = types.MappingProxyType({
    "h100-sxm": HardwareSpec("h100-sxm", 989e12, 3.35e12, memory_bytes=80e9),
    "h200": HardwareSpec("h200", 989e12, 4.8e12, memory_bytes=141e9),
    "a100-80gb": HardwareSpec("a100-80gb", 312e12, 2.039e12, memory_bytes=80e9),
    "l4": HardwareSpec("l4", 121e12, 300e9, memory_bytes=24e9),
})


@dataclass(frozen=True)
class ModelShape:
    """The shape of a Llama-family decoder (GQA attention, SwiGLU MLP).

    head_dim defaults to hidden // heads; qkv_bias adds the q/k/v biases
    of Qwen2 to the parameter count.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    head_dim: int = 0
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        sizes = (self.layers, self.hidden, self.heads, self.kv_heads, self.intermediate, self.vocab)
        if min(sizes) <= 0 or self.head_dim < 0:
            raise ValueError(f"{self.name}: model sizes must be positive")
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: heads ({self.heads}) must be a multiple of "
                             f"kv_heads ({self.kv_heads})")
        if not self.head_dim:
            if self.hidden % self.heads:
                raise ValueError(f"{self.name}: hidden ({self.hidden}) is not a multiple of "
                                 f"heads ({self.heads}); give head_dim")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @classmethod
    def from_config(cls, config: ModelConfig, name: str = "model") -> ModelShape:
        """The shape of a loaded ``carpool.model.config.ModelConfig``."""
        return cls(name=name, layers=config.num_layers, hidden=config.hidden_size,
                   heads=config.num_heads, kv_heads=config.num_kv_heads,
                   intermediate=config.intermediate_size, vocab=config.vocab_size,
                   tied_embeddings=config.tie_word_embeddings, head_dim=config.head_dim,
                   qkv_bias=config.attention_bias)

    @property
    def q_dim(self) -> int:
        """Width of the query projection: heads * head_dim."""
        return self.heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, MLP, two norms)."""
        kv_dim = self.kv_heads * self.head_dim
        attention = 2 * self.hidden * self.q_dim + 2 * self.hidden * kv_dim
        if self.qkv_bias:
            attention += self.q_dim + 2 * kv_dim
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def body_params(self) -> int:
        """Parameters every computed token passes through: the layers and
        the final norm (no embedding table, no LM head)."""
        return self.layers * self.layer_params + self.hidden

    @property
    def params(self) -> int:
        """All parameters, counting a tied embedding/LM head once."""
        table = self.vocab * self.hidden
        return self.body_params + table * (1 if self.tied_embeddings else 2)

    @property
    def streamed_params(self) -> int:
        """Parameters read in full by every step: the body and the LM head
        (the input embedding is only gathered row by row)."""
        return self.body_params + self.vocab * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """Bytes of K and V cached per token over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict that ``ModelShape(**d)`` rebuilds."""
        return asdict(self)


# Shapes from each model's published Hugging Face config.json.
MODELS = types.MappingProxyType({
    "llama-3-8b": ModelShape("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, False),
    "llama-3-70b": ModelShape("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, False),
    "qwen2-7b": ModelShape("qwen2-7b", 28, 3584, 28, 4, 18944, 152064, False, qkv_bias=True),
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 9, 3, 1536, 49152, True),
})


@dataclass(frozen=True)
class AnalyticCostModel:
    """Roofline step cost of ``model`` on ``hardware`` with weights and KV
    cache in ``dtype_bytes`` bytes per value (2 for bf16/fp16).

    step = step_overhead_s + max(flops / effective FLOP/s,
                                 bytes / effective bandwidth)
    """

    hardware: HardwareSpec
    model: ModelShape
    dtype_bytes: float = 2

    kind: ClassVar[str] = "analytic"
    row_bucket: ClassVar[int] = 1  # prices exact tokens

    def __post_init__(self) -> None:
        if self.dtype_bytes <= 0:
            raise ValueError(f"dtype_bytes must be positive, got {self.dtype_bytes}")
        m, hw = self.model, self.hardware
        # Per-step constants, computed once: a simulation prices millions of steps.
        constants = {"_token_flops": 2 * m.body_params, "_pair_flops": 4 * m.layers * m.q_dim,
                     "_seq_flops": 2 * m.hidden * m.vocab,
                     "_weight_bytes": m.streamed_params * self.dtype_bytes,
                     "_kv_bytes": m.kv_bytes_per_token(self.dtype_bytes),
                     "_flops_rate": hw.effective_flops, "_bytes_rate": hw.effective_bandwidth}
        for name, value in constants.items():
            object.__setattr__(self, name, value)

    def step_flops(self, shape: StepShape) -> float:
        """Arithmetic of one step (see the module docstring)."""
        _check(shape)
        return self._flops(shape.tokens, shape.seqs, _pairs(shape))

    def step_bytes(self, shape: StepShape) -> float:
        """Memory traffic of one step: the weights once, every KV entry once."""
        _check(shape)
        return self._bytes(shape.context_tokens)

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

    def _bytes(self, context_tokens: int) -> float:
        return self._weight_bytes + self._kv_bytes * context_tokens

    def _seconds(self, tokens: int, seqs: int, context_tokens: int, pairs: float) -> float:
        compute = self._flops(tokens, seqs, pairs) / self._flops_rate
        memory = self._bytes(context_tokens) / self._bytes_rate
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
        after the weights (all of them, embedding included); 0 when the
        capacity is unknown or the weights do not fit."""
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
            return cls(hardware, model, data.get("dtype_bytes", 2))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed analytic cost model: {exc!r}") from None


_FORM = ("step = step_overhead_s + max(flops / (peak_flops * flops_efficiency), "
         "bytes / (mem_bandwidth * bandwidth_efficiency)); "
         "flops = 2 * body_params * tokens + 4 * layers * heads * head_dim * "
         "(context_tokens + prefill_tokens * (prefill_tokens - 1) / 2) + 2 * hidden * vocab * seqs; "
         "bytes = (body_params + hidden * vocab) * dtype_bytes + kv_bytes_per_token * context_tokens; "
         "assumes the prefill tokens form one causal chunk of a fresh prompt, the LM head runs once "
         "per sequence, activations are free, and an empty step costs 0")


def _pairs(shape: StepShape) -> float:
    """Query x key pairs: exact when the shape came from spans, else the
    module docstring's estimate."""
    prefill = shape.prefill_tokens
    return shape.attention_pairs or shape.context_tokens + prefill * (prefill - 1) / 2


def _check(shape: StepShape) -> None:
    fields = (shape.prefill_tokens, shape.decode_seqs, shape.context_tokens, shape.seqs)
    if min(fields) < 0:
        raise ValueError(f"step shape has a negative field: {shape}")


def analytic_from_names(hardware: str, model: str, dtype_bytes: float = 2) -> AnalyticCostModel:
    """The analytic model of a preset model (``MODELS``) on a preset
    accelerator (``HARDWARE``); ValueError listing the choices otherwise."""
    if hardware not in HARDWARE:
        raise ValueError(f"unknown hardware {hardware!r}; choose one of {', '.join(sorted(HARDWARE))}")
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(sorted(MODELS))}")
    return AnalyticCostModel(HARDWARE[hardware], MODELS[model], dtype_bytes)
