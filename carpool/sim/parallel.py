"""One simulated replica over several GPUs: tensor (TP) and expert (EP)
parallelism, the links between the GPUs, and what a step's communication
costs with and without two micro-batches. Pure Python: no torch.

The layout (``ParallelShape``): a replica spans ``gpus = max(TP, EP)``
GPUs. Attention, the dense MLPs, the shared experts and the LM head are
tensor-parallel over ``TP`` ranks and data-parallel over ``gpus / TP``
groups (DeepSeek's "DP attention": each group holds its own sequences and
their KV cache). The routed experts are sharded over ``EP`` ranks
(``EP == gpus``), or with ``EP == 1`` every expert is sliced over the
``TP`` ranks. The scheduler sees one replica, one batch, one KV pool.

Communication a step moves, per GPU (``comm_bytes``), assuming sequences
spread evenly over the groups and tokens pick experts uniformly:

* TP > 1: two all-reduces a layer (after attention and after the MLP) of
  the group's tokens x hidden activations (bf16). A ring all-reduce sends
  and receives ``2 (TP - 1) / TP`` of the buffer per GPU in ``2 (TP - 1)``
  hops; over NVLink when the TP group fits a node, else over RDMA.
* EP > 1: per MoE layer an all-to-all dispatch (each token to its top_k
  experts' GPUs; FP8 when weights are 1 byte, as DeepSeek dispatches,
  else bf16) and a combine back (bf16), moved as DeepEP moves them
  (``alltoall_bytes``): a token crosses to each other node it needs once
  over RDMA and reaches each expert's GPU there over NVLink, so with
  ``n`` nodes it crosses ``(n - 1) (1 - (1 - 1/n)^top_k)`` times and takes
  ``top_k (g - 1) / g`` NVLink hops (``g`` GPUs of a node). Both links run
  at once: an all-to-all takes the slower one. The busiest rank's load
  (``expert_imbalance``) scales the bytes, as it scales the experts'
  compute. Routing is uniform: DeepSeek's node-limited routing (at most 4
  nodes a token) only matters past 4 nodes and is not modelled.

Each operation costs ``bytes / link bandwidth + hops x link latency``
(``Link.seconds``); an all-to-all that crosses nodes is two hops (RDMA,
then NVLink within the node), one that stays in a node one.

Two micro-batches (``micro_batches``): the step's batch is split in two
halves; each half computes at the roofline of half the tokens (every
weight is still read once per half: what the split costs) and moves half
the bytes (the latency is paid per half). Micro-batch A's communication
runs while B computes and the other way round, a two-stage pipeline over
the layers (``overlapped_seconds``):

    step = max(2 C_half, 2 M_half) + min(C_half, M_half) / layers

the last term one layer's fill. The exposed communication is what the
step spends beyond the halves' compute. ``auto`` takes the split only
where it is faster (the adaptive controller's choice); ``on`` always
splits a step of at least two tokens.
"""
from __future__ import annotations

import math
import types
from dataclasses import dataclass

from carpool.settings_fields import setting
from carpool.workload.flag_types import arg_type

MICRO_BATCH_CHOICES = ("off", "on", "auto")


def parse_micro_batches(text: str) -> str:
    """``off``/``1``, ``on``/``2`` or ``auto``, as off/on/auto."""
    value = {"1": "off", "2": "on"}.get(text.strip().lower(), text.strip().lower())
    if value not in MICRO_BATCH_CHOICES:
        raise ValueError(f"micro batches are off (1), on (2) or auto; got {text!r}")
    return value


@dataclass(frozen=True)
class Link:
    """A GPU's link of one kind, per direction.

    bandwidth: peak bytes/s; efficiency: the share an all-to-all or
    all-reduce reaches; latency_s: seconds per hop (launch, signalling).
    """

    name: str
    bandwidth: float
    efficiency: float
    latency_s: float

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or not 0 < self.efficiency <= 1 or self.latency_s < 0:
            raise ValueError(f"{self.name}: need bandwidth > 0, efficiency in (0, 1], "
                             "latency >= 0")

    def seconds(self, nbytes: float, hops: int = 1) -> float:
        """``nbytes`` over this link in ``hops`` hops; 0 for nothing to move."""
        if nbytes <= 0:
            return 0.0
        return nbytes / (self.bandwidth * self.efficiency) + hops * self.latency_s


@dataclass(frozen=True)
class Interconnect:
    """The links of a node kind: NVLink (or PCIe) within a node of
    ``gpus_per_node`` GPUs, RDMA across nodes (one NIC per GPU)."""

    name: str
    gpus_per_node: int
    intra: Link
    inter: Link


# H800 SXM (DeepEP's README, github.com/deepseek-ai/DeepEP, measured on
# H800 nodes: "~160 GB/s NVLink maximum bandwidth", "CX7 InfiniBand 400
# Gb/s RDMA network card (~50 GB/s maximum bandwidth)" per GPU; its normal
# kernels reach 153-158 GB/s over NVLink and 43-58 GB/s over RDMA, hence
# the efficiencies). The per-hop latencies (5 us NVLink, 10 us RDMA) are
# assumptions of kernel launch and signalling, not measurements. H100/H200:
# NVLink 4 at 450 GB/s a direction, the same 400 Gb/s NICs.
_RDMA_400G = Link("rdma-400g", 50e9, 0.9, 10e-6)
INTERCONNECTS = types.MappingProxyType({
    "h800": Interconnect("h800", 8, Link("nvlink-h800", 160e9, 0.95, 5e-6), _RDMA_400G),
    "h100": Interconnect("h100", 8, Link("nvlink4", 450e9, 0.8, 5e-6), _RDMA_400G),
    "a100": Interconnect("a100", 8, Link("nvlink3", 300e9, 0.8, 5e-6), _RDMA_400G),
    "pcie": Interconnect("pcie", 8, Link("pcie4", 32e9, 0.8, 10e-6), _RDMA_400G),
})
# Which node a ``--hardware`` preset sits in.
NODE_OF_HARDWARE = types.MappingProxyType({
    "h800": "h800", "h800-fp8": "h800", "h100-sxm": "h100", "h200": "h100",
    "a100-80gb": "a100", "l4": "pcie"})


@dataclass(frozen=True)
class ParallelShape:
    """How one simulated replica is sliced (module docstring). The field
    names are those the engine's settings will take (tensor_parallel_size,
    expert_parallel_size, micro_batches); the flags are the simulator's."""

    tensor_parallel_size: int = setting(
        1, "--sim-tensor-parallel-size", "N",
        "analytic model: tensor-parallel ranks of a simulated replica (default 1)", parse=int)
    expert_parallel_size: int = setting(
        1, "--sim-expert-parallel-size", "N",
        "analytic model, MoE presets: GPUs the routed experts are sharded over, 1 or the "
        "replica's GPUs (a multiple of the TP size; attention is data-parallel over "
        "EP / TP groups); default 1", parse=int)
    micro_batches: str = setting(
        "off", "--sim-micro-batches", "off|on|auto",
        "analytic model: split each step in two micro-batches whose communication overlaps "
        "the other's compute (on), never (off, default), or where it pays (auto)",
        parse=arg_type(parse_micro_batches))

    def __post_init__(self) -> None:
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if tp < 1 or ep < 1:
            raise ValueError(f"parallel sizes must be >= 1, got TP {tp}, EP {ep}")
        if ep > 1 and ep % tp:
            raise ValueError(f"the expert-parallel size ({ep}) must be a multiple of the "
                             f"tensor-parallel size ({tp})")
        object.__setattr__(self, "micro_batches", parse_micro_batches(self.micro_batches))

    @property
    def gpus(self) -> int:
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    @property
    def attention_groups(self) -> int:
        """Data-parallel attention groups (each TP ranks wide)."""
        return self.gpus // self.tensor_parallel_size

    @property
    def trivial(self) -> bool:
        """One GPU, no split: today's single-device cost model."""
        return self.gpus == 1 and self.micro_batches == "off"

    def nodes(self, gpus_per_node: int) -> int:
        return math.ceil(self.gpus / gpus_per_node)


@dataclass(frozen=True)
class CommPlan:
    """The communication of one step (or micro-batch), per GPU: bytes over
    each link and the seconds they take (``Interconnect`` links)."""

    intra_bytes: float = 0.0
    inter_bytes: float = 0.0
    seconds: float = 0.0


def allreduce_seconds(nbytes: float, ranks: int, link: Link) -> float:
    """A ring all-reduce of an ``nbytes`` buffer over ``ranks`` ranks: each
    sends ``2 (ranks - 1) / ranks`` of it in ``2 (ranks - 1)`` hops."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return link.seconds(2 * (ranks - 1) / ranks * nbytes, 2 * (ranks - 1))


def alltoall_bytes(token_bytes: float, copies: int, ranks: int,
                   gpus_per_node: int) -> tuple[float, float]:
    """(NVLink bytes, RDMA bytes) a token of ``token_bytes`` costs in an
    all-to-all that sends it to ``copies`` ranks of ``ranks`` picked
    uniformly (its top_k experts' GPUs), as DeepEP moves it: once over RDMA
    to each other node it needs, then over NVLink to each GPU there (and
    to the GPUs of its own node): ``(nodes - 1) (1 - (1 - 1/nodes)^copies)``
    node crossings and ``copies (local - 1) / local`` NVLink hops, ``local``
    the GPUs of a node it spans."""
    if ranks <= 1 or token_bytes <= 0:
        return 0.0, 0.0
    local = min(gpus_per_node, ranks)
    nodes = math.ceil(ranks / gpus_per_node)
    crossings = (nodes - 1) * (1 - (1 - 1 / nodes) ** copies) if nodes > 1 else 0.0
    return token_bytes * copies * (local - 1) / local, token_bytes * crossings


def alltoall_seconds(intra: float, inter: float, net: Interconnect) -> float:
    """Both links at once: the slower sets the time; crossing nodes is two
    hops (RDMA, then NVLink to the GPU)."""
    if inter > 0:
        return max(net.intra.seconds(intra, 0), net.inter.seconds(inter, 0)) \
            + net.inter.latency_s + net.intra.latency_s
    return net.intra.seconds(intra, 1)


def overlapped_seconds(compute_half: float, comm_half: float, layers: int) -> float:
    """Two micro-batches of ``compute_half`` and ``comm_half`` seconds each,
    pipelined over ``layers`` layers (module docstring)."""
    return (max(2 * compute_half, 2 * comm_half)
            + min(compute_half, comm_half) / max(layers, 1))
