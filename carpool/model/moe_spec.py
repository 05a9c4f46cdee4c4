"""What a mixture-of-experts MLP is (``MoESpec``) and the Hugging Face tensor
names and shapes of one, in one place: ``MoEBlock.load_hf_weights``
(carpool/model/moe.py) reads a checkpoint by ``moe_weight_names`` and a
loader can check one against ``expected_moe_shapes``, so the two cannot
disagree. Plain Python: no torch.

Two checkpoint layouts (what transformers 5.25 does, checked by
tests/test_moe_block.py):

* ``per_expert``: hub checkpoints, and what ``save_pretrained`` writes (it
  converts its fused parameters back to these names). Mixtral:
  ``{prefix}block_sparse_moe.gate.weight`` [E, H] and
  ``{prefix}block_sparse_moe.experts.{e}.w1/w3/w2.weight`` (w1 gate [I, H],
  w3 up [I, H], w2 down [H, I]). Qwen3-MoE and DeepSeek-V3:
  ``{prefix}mlp.gate.weight`` [E, H] and
  ``{prefix}mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``; DeepSeek-V3
  also ``{prefix}mlp.gate.e_score_correction_bias`` [E] and
  ``{prefix}mlp.shared_experts.gate_proj/up_proj/down_proj.weight``
  ([S, H], [S, H], [H, S], S = n_shared_experts * moe_intermediate_size).
* ``fused``: transformers' in-memory ``state_dict()`` (all three families,
  Mixtral included, under ``{prefix}mlp.``): ``mlp.experts.gate_up_proj``
  [E, 2I, H] (gate rows, then up rows) and ``mlp.experts.down_proj`` [E, H, I];
  router, bias and shared experts named as in ``per_expert`` but under ``mlp.``.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
PER_EXPERT, FUSED = "per_expert", "fused"
LAYOUTS = (PER_EXPERT, FUSED)


@dataclass(frozen=True)
class MoESpec:
    """One MoE MLP. ``family`` picks the checkpoint names and two numerics
    details transformers has per family (see ``router_fp32`` and
    ``weights_in_model_dtype``); routing is given by the other fields."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    scoring: str = "softmax"          # "softmax" | "sigmoid"
    renormalize: bool = True          # scale the top-k weights to sum to 1
    n_group: int = 1                  # expert groups; 1 = no group limit
    topk_group: int = 1               # groups a token may pick experts from
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False     # e_score_correction_bias: selection only
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0  # the one fused shared MLP's intermediate size
    hidden_act: str = "silu"
    family: str = "qwen3_moe"

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ValueError("invalid MoESpec: " + "; ".join(problems))

    def _problems(self) -> Iterable[str]:
        e, k = self.num_experts, self.top_k
        if e < 1 or self.expert_intermediate_size < 1:
            yield f"num_experts ({e}) and expert_intermediate_size " \
                  f"({self.expert_intermediate_size}) must be >= 1"
        if not 1 <= k <= e:
            yield f"top_k ({k}) must be between 1 and num_experts ({e})"
        if self.scoring not in ("softmax", "sigmoid"):
            yield f"scoring {self.scoring!r} is not 'softmax' or 'sigmoid'"
        if self.hidden_act != "silu":
            yield f"hidden_act {self.hidden_act!r} unsupported (only 'silu')"
        if self.family not in FAMILIES:
            yield f"family {self.family!r} is not one of {FAMILIES}"
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            yield f"routed_scaling_factor ({self.routed_scaling_factor}) must be finite and > 0"
        yield from self._group_problems()
        if self.num_shared_experts < 0 or (self.num_shared_experts > 0) != (
                self.shared_intermediate_size > 0):
            yield (f"num_shared_experts ({self.num_shared_experts}) and "
                   f"shared_intermediate_size ({self.shared_intermediate_size}) must both be 0 "
                   "or both be > 0")

    def _group_problems(self) -> Iterable[str]:
        e, g = self.num_experts, self.n_group
        if g < 1 or e % g:
            yield f"n_group ({g}) must be >= 1 and divide num_experts ({e})"
            return
        if not 1 <= self.topk_group <= g:
            yield f"topk_group ({self.topk_group}) must be between 1 and n_group ({g})"
        if g == 1:
            return
        if self.scoring != "sigmoid":
            # Group limiting here is DeepSeek-V3's (groups scored by the sum of
            # their top-2 sigmoid scores); V2's softmax/max variant differs.
            yield "group-limited routing (n_group > 1) needs scoring='sigmoid'"
        if e // g < 2:
            yield f"each of the {g} groups needs >= 2 experts (a group scores its top 2)"
        if self.top_k > self.topk_group * (e // g):
            yield (f"top_k ({self.top_k}) exceeds the experts of topk_group "
                   f"({self.topk_group}) groups of {e // g}")

    # Numerics that differ by family in transformers 5.25.
    @property
    def router_fp32(self) -> bool:
        """DeepSeek-V3 computes router logits in fp32 from an fp32 router weight
        (``_keep_in_fp32_modules_strict``); Mixtral and Qwen3-MoE in the model's dtype."""
        return self.family == "deepseek_v3"

    @property
    def weights_in_model_dtype(self) -> bool:
        """Qwen3-MoE rounds the routing weights to the model's dtype before
        scaling expert outputs; Mixtral and DeepSeek-V3 scale by fp32 weights."""
        return self.family == "qwen3_moe"

    def active_params_per_token(self, hidden: int) -> int:
        """Weights one token reads: the router (all of it, with its bias), top_k
        experts and the shared experts."""
        return self._router_params(hidden) + self.top_k * self._expert_params(hidden) + \
            self._shared_params(hidden)

    def total_params(self, hidden: int) -> int:
        """Every weight of the MoE MLP: router, bias, all experts, shared experts."""
        return self._router_params(hidden) + self.num_experts * self._expert_params(hidden) + \
            self._shared_params(hidden)

    def _router_params(self, hidden: int) -> int:
        return self.num_experts * hidden + (self.num_experts if self.correction_bias else 0)

    def _expert_params(self, hidden: int) -> int:
        return 3 * self.expert_intermediate_size * hidden

    def _shared_params(self, hidden: int) -> int:
        return 3 * self.shared_intermediate_size * hidden

    # Constructors from HF config dicts (config.json / PretrainedConfig.to_dict()).
    @classmethod
    def from_mixtral(cls, d: Mapping[str, Any]) -> MoESpec:
        """Mixtral: softmax over all experts, top-k always renormalised."""
        return cls(num_experts=_first(d, "num_local_experts", "num_experts"),
                   top_k=_need(d, "num_experts_per_tok"),
                   expert_intermediate_size=_need(d, "intermediate_size"),
                   scoring="softmax", renormalize=True,
                   hidden_act=d.get("hidden_act", "silu"), family="mixtral")

    @classmethod
    def from_qwen3_moe(cls, d: Mapping[str, Any]) -> MoESpec:
        """Qwen3-MoE: softmax, renormalised only when ``norm_topk_prob``
        (transformers' default: False). Hub configs say ``num_experts``;
        transformers 5.25's ``to_dict`` says ``num_local_experts``."""
        return cls(num_experts=_first(d, "num_experts", "num_local_experts"),
                   top_k=_need(d, "num_experts_per_tok"),
                   expert_intermediate_size=_need(d, "moe_intermediate_size"),
                   scoring="softmax", renormalize=bool(d.get("norm_topk_prob", False)),
                   hidden_act=d.get("hidden_act", "silu"), family="qwen3_moe")

    @classmethod
    def from_deepseek_v3(cls, d: Mapping[str, Any]) -> MoESpec:
        """DeepSeek-V3: sigmoid scores, a correction bias for choosing experts
        only, group-limited top-k, scaled weights, shared experts. Absent keys
        take transformers' DeepseekV3Config defaults."""
        inter = _need(d, "moe_intermediate_size")
        shared = int(d.get("n_shared_experts", 1) or 0)
        n_group = int(d.get("n_group", 8) or 1)  # None in a config: no group limit
        return cls(num_experts=_first(d, "n_routed_experts", "num_local_experts"),
                   top_k=_need(d, "num_experts_per_tok"), expert_intermediate_size=inter,
                   scoring="sigmoid", renormalize=bool(d.get("norm_topk_prob", True)),
                   n_group=n_group, topk_group=int(d.get("topk_group", 4) or n_group),
                   routed_scaling_factor=float(d.get("routed_scaling_factor", 2.5)),
                   correction_bias=True, num_shared_experts=shared,
                   shared_intermediate_size=shared * inter,
                   hidden_act=d.get("hidden_act", "silu"), family="deepseek_v3")


def _need(d: Mapping[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise ValueError(f"MoE config lacks {key!r}")
    return d[key]


def _first(d: Mapping[str, Any], *keys: str) -> Any:
    """The first of ``keys`` present; configs name the expert count differently."""
    for key in keys:
        if d.get(key) is not None:
            return d[key]
    raise ValueError(f"MoE config lacks the expert count (one of {keys})")


def moe_weight_names(spec: MoESpec, prefix: str, layout: str = PER_EXPERT) -> dict[str, str]:
    """The MoE MLP's tensor names by role. ``prefix``: the decoder layer's,
    e.g. ``"model.layers.3."``. Roles: ``router``; ``bias`` (with a correction
    bias); ``shared_gate``/``shared_up``/``shared_down`` (with shared experts);
    per_expert: ``gate.{e}``/``up.{e}``/``down.{e}``; fused: ``gate_up``, ``down``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    mixtral_hub = spec.family == "mixtral" and layout == PER_EXPERT
    block = prefix + ("block_sparse_moe." if mixtral_hub else "mlp.")
    names = {"router": block + "gate.weight"}
    if spec.correction_bias:
        names["bias"] = block + "gate.e_score_correction_bias"
    if spec.num_shared_experts:
        names.update({f"shared_{p}": f"{block}shared_experts.{p}_proj.weight"
                      for p in ("gate", "up", "down")})
    if layout == FUSED:
        names.update(gate_up=block + "experts.gate_up_proj", down=block + "experts.down_proj")
        return names
    parts = ("w1", "w3", "w2") if mixtral_hub else ("gate_proj", "up_proj", "down_proj")
    for e in range(spec.num_experts):
        for role, part in zip(("gate", "up", "down"), parts):
            names[f"{role}.{e}"] = f"{block}experts.{e}.{part}.weight"
    return names


def expected_moe_shapes(spec: MoESpec, hidden: int, prefix: str,
                        layout: str = PER_EXPERT) -> dict[str, tuple[int, ...]]:
    """The names and shapes a checkpoint in ``layout`` must hold for this MoE MLP."""
    e, i, s = spec.num_experts, spec.expert_intermediate_size, spec.shared_intermediate_size
    shapes_by_role = {"router": (e, hidden), "bias": (e,), "shared_gate": (s, hidden),
                      "shared_up": (s, hidden), "shared_down": (hidden, s),
                      "gate_up": (e, 2 * i, hidden), "down": (e, hidden, i)}
    per_expert = {"gate": (i, hidden), "up": (i, hidden), "down": (hidden, i)}
    shapes = {}
    for role, name in moe_weight_names(spec, prefix, layout).items():
        base = role.split(".")[0]
        shapes[name] = per_expert[base] if "." in role else shapes_by_role[role]
    return shapes


def detect_layout(names: Iterable[str], spec: MoESpec, prefix: str) -> str:
    """Which layout a checkpoint's tensor ``names`` use for this layer's MoE MLP:
    ``fused`` when its stacked expert tensor is there, else ``per_expert``."""
    fused = moe_weight_names(spec, prefix, FUSED)["gate_up"]
    return FUSED if fused in set(names) else PER_EXPERT
