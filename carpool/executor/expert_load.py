"""How a mixture-of-experts model's tokens spread over its experts: the
(token, expert) pairs each expert took, summed over the MoE layers and the
steps so far, and how uneven each step was (``/metrics``:
``carpool:moe_expert_tokens_total``, ``carpool:moe_expert_imbalance``)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from carpool.model.moe import MoEBlock


class ExpertLoad:
    """Reads each MoE block's ``last_expert_counts`` after a step's forward.

    Imbalance of one layer in one step: its busiest expert's tokens over the
    mean per expert (1 = perfectly even; ``num_experts / top_k`` at worst,
    all of a token's picks on the same few experts). A step's value is the
    mean over its MoE layers; ``imbalance`` is the last step's and
    ``imbalance_mean`` the mean over every step so far."""

    def __init__(self, blocks: Sequence[MoEBlock]) -> None:
        self.blocks = list(blocks)
        self.tokens = torch.zeros(self.blocks[0].spec.num_experts, dtype=torch.int64)
        self.steps = 0
        self.imbalance = 0.0
        self._imbalance_sum = 0.0
        # Expert parallel (--enable-expert-parallel): the ranks holding the
        # experts, E / ranks each in order; 1: every expert in one place.
        self.ranks = 1

    def record(self) -> None:
        counts = torch.stack([block.last_expert_counts for block in self.blocks])  # [L, E]
        self.tokens += counts.sum(0)
        mean = counts.float().mean(1)
        busy = mean > 0
        if not bool(busy.any()):
            return
        self.imbalance = float((counts.max(1).values[busy] / mean[busy]).mean())
        self._imbalance_sum += self.imbalance
        self.steps += 1

    def stats_fields(self) -> dict:
        """``EngineStats``' expert fields."""
        per_rank = (tuple(int(n) for n in self.tokens.view(self.ranks, -1).sum(1).tolist())
                    if self.ranks > 1 else ())
        dispatches = [block.dispatch for block in self.blocks
                      if block.dispatch is not None and block.dispatch.capacity_factor > 0]
        dropped = (tuple(sum(column) for column in zip(*(d.rank_dropped for d in dispatches)))
                   if dispatches else ())
        return {"expert_tokens": tuple(int(n) for n in self.tokens.tolist()),
                "expert_rank_tokens": per_rank, "expert_rank_dropped": dropped,
                "expert_imbalance": self.imbalance,
                "expert_imbalance_mean": self._imbalance_sum / self.steps if self.steps else 0.0}
