"""The analytic cost model of a replica over several GPUs
(``ParallelCostModel``): the roofline of carpool/sim/analytic.py per GPU,
plus the communication and the two-micro-batch overlap of
carpool/sim/parallel.py. Pure Python: no torch.

Per GPU of a replica of ``gpus`` GPUs (``ParallelShape``):

* FLOPs: the step's FLOPs / gpus (tokens spread over the attention groups,
  each split TP ways; the routed experts over EP ranks or TP slices);
* bytes: the dense weights / TP (each group holds them), the routed experts
  the step's tokens reach / gpus, the KV cache / (attention groups x
  min(TP, cache heads)): a KV head, or MLA's one latent, is replicated over
  the TP ranks that share it;
* compute = max(FLOPs / effective FLOP/s, bytes / effective bandwidth);
* communication: ``comm_seconds`` (the TP all-reduces and the EP
  all-to-alls of the step's tokens);
* the step: overhead + compute + communication, or with the split the
  overlapped form (``parallel.overlapped_seconds``).

At one GPU without a split every term is today's ``AnalyticCostModel``'s,
to the bit. The KV pool (``max_kv_tokens``) is the replica's memory after
every weight it holds (the dense ones once per attention group).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from carpool.sim.analytic import HARDWARE, MODELS, AnalyticCostModel
from carpool.sim.parallel import (
    INTERCONNECTS,
    NODE_OF_HARDWARE,
    Interconnect,
    Link,
    ParallelShape,
    allreduce_seconds,
    alltoall_bytes,
    alltoall_seconds,
    overlapped_seconds,
)

ACTIVATION_BYTES = 2  # bf16 activations: all-reduces and the all-to-all's combine


@dataclass(frozen=True)
class StepCost:
    """One step, per GPU: ``seconds`` in all (overhead included);
    ``compute_s`` the unsplit step's roofline; ``comm_s`` its
    communication; ``exposed_s`` the communication the step did not hide;
    ``split`` whether it ran as two micro-batches."""

    seconds: float
    compute_s: float
    comm_s: float
    exposed_s: float
    split: bool


@dataclass(frozen=True)
class ParallelCostModel(AnalyticCostModel):
    """``AnalyticCostModel`` of a replica sliced as ``parallel`` over GPUs
    linked by ``interconnect`` (module docstring)."""

    parallel: ParallelShape = field(default_factory=ParallelShape)
    interconnect: Interconnect = INTERCONNECTS["h800"]

    def __post_init__(self) -> None:
        super().__post_init__()
        p, m = self.parallel, self.model
        if p.expert_parallel_size > 1 and not m.is_moe:
            raise ValueError(f"{m.name} has no experts to shard (expert_parallel_size "
                             f"{p.expert_parallel_size})")
        tp, gpus = p.tensor_parallel_size, p.gpus
        imbalance = min(self.expert_imbalance, m.experts / m.top_k) if m.is_moe else 1.0
        dispatch = 1 if self.dtype_bytes <= 1 else ACTIVATION_BYTES  # FP8 dispatch
        net = self.interconnect
        constants = {
            "_gpus": gpus, "_tp": tp, "_groups": p.attention_groups,
            "_kv_div": p.attention_groups * min(tp, m.cache_heads),
            "_tp_link": net.intra if tp <= net.gpus_per_node else net.inter,
            # all-reduces a step: after attention every layer; after the MLP
            # where it is TP-sliced (every layer without EP, dense layers with)
            "_allreduces": m.layers + (m.layers - m.moe_layers
                                       if p.expert_parallel_size > 1 else m.layers),
            # (NVLink, RDMA) bytes a token costs to reach its experts and come
            # back, the busiest rank's share
            "_alltoalls": tuple(
                tuple(imbalance * b for b in alltoall_bytes(
                    m.hidden * size, m.top_k, p.expert_parallel_size, net.gpus_per_node))
                for size in (dispatch, ACTIVATION_BYTES)) if m.is_moe else ()}
        for name, value in constants.items():
            object.__setattr__(self, name, value)

    # -- per GPU ---------------------------------------------------------------

    def _compute(self, tokens: float, seqs: float, context: float, pairs: float) -> float:
        """Roofline seconds of one GPU's share of the step."""
        flops = self._flops(tokens, seqs, pairs) / self._gpus
        weights = self._weight_bytes / self._tp
        if self._expert_bytes:
            weights += self._expert_bytes * self.model.touched_experts(tokens) / self._gpus
        nbytes = weights + self._kv_bytes * context / self._kv_div
        return max(flops / self._flops_rate, nbytes / self._bytes_rate)

    def comm_seconds(self, tokens: float) -> float:
        """Communication seconds of a step (or micro-batch) of ``tokens``."""
        seconds = 0.0
        if self._tp > 1:
            buffer = tokens / self._groups * self.model.hidden * ACTIVATION_BYTES
            seconds += self._allreduces * allreduce_seconds(buffer, self._tp, self._tp_link)
        if self.parallel.expert_parallel_size > 1:
            mine = tokens / self._gpus
            for intra, inter in self._alltoalls:
                seconds += self.model.moe_layers * alltoall_seconds(
                    mine * intra, mine * inter, self.interconnect)
        return seconds

    def comm_bytes(self, tokens: float) -> tuple[float, float]:
        """(NVLink bytes, RDMA bytes) one GPU sends in a step of ``tokens``."""
        intra = inter = 0.0
        if self._tp > 1:
            buffer = tokens / self._groups * self.model.hidden * ACTIVATION_BYTES
            moved = self._allreduces * 2 * (self._tp - 1) / self._tp * buffer
            if self._tp_link is self.interconnect.intra:
                intra += moved
            else:
                inter += moved
        if self.parallel.expert_parallel_size > 1:
            mine = tokens / self._gpus
            for a, b in self._alltoalls:
                intra += self.model.moe_layers * mine * a
                inter += self.model.moe_layers * mine * b
        return intra, inter

    def breakdown(self, tokens: float, seqs: float, context: float, pairs: float) -> StepCost:
        """The step's seconds and their parts (module docstring)."""
        overhead = self.hardware.step_overhead_s
        compute = self._compute(tokens, seqs, context, pairs)
        comm = self.comm_seconds(tokens) if self._gpus > 1 else 0.0
        plain = StepCost(overhead + compute + comm, compute, comm, comm, False)
        mode = self.parallel.micro_batches
        if mode == "off" or comm == 0 or tokens < 2:
            return plain
        half = self._compute(tokens / 2, seqs / 2, context / 2, pairs / 2)
        overlapped = overlapped_seconds(half, self.comm_seconds(tokens / 2), self.model.layers)
        if mode == "auto" and overhead + overlapped >= plain.seconds:
            return plain
        return StepCost(overhead + overlapped, compute, comm, overlapped - 2 * half, True)

    def _seconds(self, tokens: int, seqs: int, context_tokens: int, pairs: float) -> float:
        return self.breakdown(tokens, seqs, context_tokens, pairs).seconds

    # -- the replica ------------------------------------------------------------

    def max_kv_tokens(self, memory_fraction: float = 0.9) -> int:
        """KV tokens in ``memory_fraction`` of the replica's GPUs after the
        weights they hold (the dense ones once per attention group); a
        token's cache counts once per TP rank that replicates it."""
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        m, size = self.model, self.dtype_bytes
        held = (m.params - m.routed_params) * self._groups + m.routed_params
        free = self.hardware.memory_bytes * memory_fraction * self._gpus - held * size
        per_token = m.kv_bytes_per_token(size) * (self._tp / min(self._tp, m.cache_heads))
        return max(0, int(free // per_token))

    @property
    def gpus(self) -> int:
        return self._gpus

    def describe(self) -> dict[str, Any]:
        data = super().describe()
        data.update(parallel=asdict(self.parallel), interconnect=asdict(self.interconnect),
                    parallel_form=_PARALLEL_FORM)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ParallelCostModel:
        """Rebuild from ``describe()`` output; ValueError when malformed."""
        base = AnalyticCostModel.from_dict(data)
        try:
            net = dict(data["interconnect"])
            net["intra"], net["inter"] = Link(**net["intra"]), Link(**net["inter"])
            return cls(base.hardware, base.model, base.dtype_bytes, base.expert_imbalance,
                       ParallelShape(**data["parallel"]), Interconnect(**net))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed parallel cost model: {exc!r}") from None


_PARALLEL_FORM = (
    "per GPU of max(TP, EP): compute = max(flops / gpus / flops_rate, (dense weight bytes / TP "
    "+ touched expert bytes / gpus + kv bytes / (gpus / TP * min(TP, cache heads))) / "
    "bandwidth); comm = TP all-reduces (ring: 2 (TP-1)/TP of tokens/groups x hidden x 2 bytes, "
    "2 (TP-1) hops, a layer after attention and after TP-sliced MLPs) + EP all-to-alls (a MoE "
    "layer: dispatch hidden x (1 byte FP8 | 2) and combine x 2 bytes a token, over RDMA once "
    "to each other node it reaches ((n-1)(1-(1-1/n)^top_k)), over NVLink top_k (g-1)/g "
    "times, both links at once, + latency per hop); step = overhead + compute "
    "+ comm, or with two micro-batches overhead + max(2 C_half, 2 M_half) + min(C_half, "
    "M_half) / layers (auto: the faster)")


def parallel_from_names(hardware: str, model: str, parallel: ParallelShape,
                        dtype_bytes: float = 2,
                        expert_imbalance: float = 1.0) -> AnalyticCostModel:
    """The analytic model of presets sliced as ``parallel``: today's
    ``AnalyticCostModel`` itself when ``parallel`` is one GPU without a
    split; ValueError for the 8x presets (already a node as one device)."""
    from carpool.sim.analytic import analytic_from_names

    if parallel.trivial:
        return analytic_from_names(hardware, model, dtype_bytes, expert_imbalance)
    if hardware not in HARDWARE or model not in MODELS:
        analytic_from_names(hardware, model, dtype_bytes, expert_imbalance)  # its ValueError
    if hardware not in NODE_OF_HARDWARE:
        raise ValueError(f"{hardware} is a whole node as one device; slice a replica over "
                         f"one of {', '.join(sorted(NODE_OF_HARDWARE))}")
    return ParallelCostModel(HARDWARE[hardware], MODELS[model], dtype_bytes, expert_imbalance,
                             parallel, INTERCONNECTS[NODE_OF_HARDWARE[hardware]])

