"""The decoder's building blocks: RMSNorm (Llama's and Gemma's), rotary
embeddings (with Llama 3 / linear rope scaling) and the step kind the
decode-only linear layers read."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class StepKind:
    """What the step now running is, set by ``DecoderModel.forward`` before
    its first layer and read by the decode-only linear layers (packed bf16,
    INT8/INT4: carpool/model/packed_linear.py, quant.py).

    Why only decode-only steps: their kernels round differently from the
    bf16 matrix kernel, and a prefill's rows depend on how much of the
    prompt the prefix cache already held. Were short prefills to take
    the other kernel, one seeded request would sample differently the
    second time it came. (A prefill gains nothing from them anyway: they
    win only up to a few rows.)"""

    decode_only: bool = False


class RMSNorm(nn.Module):
    """``style`` "llama": normalise in fp32, cast back, then times the weight
    (in the model's dtype), as Llama's reference does; "gemma": times ``1 +
    weight`` in fp32, then cast (Gemma's weights are stored as offsets from
    one). Both normalise over the last dimension of any shape."""

    def __init__(self, size: int, eps: float, style: str = "llama") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size) if style == "llama" else torch.zeros(size))
        self.eps = eps
        self.gemma = style == "gemma"

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:  # noqa: ANN001
        if ops is not None and not self.gemma and x.dim() == 2:
            return ops.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse rotary frequencies, with the rope scaling applied (yarn's
    attention factor is ``rope_attention_factor``'s)."""
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling).float()
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"unsupported rope scaling type {kind!r} "
                     "(supported: default, linear, llama3, yarn)")


def _yarn_factor(scaling: dict) -> float:
    factor = scaling.get("factor")
    if factor is None:  # DeepSeek: the context's growth over the pretrained one
        factor = scaling["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    return float(factor)


def rope_attention_factor(scaling: dict | None) -> float:
    """What yarn multiplies cos and sin by (1 for every other rope)."""
    scaling = scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    from carpool.model.config import yarn_mscale

    factor = _yarn_factor(scaling)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _yarn_inv_freq(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    # Frequencies that turn fewer than beta_slow times over the pretrained
    # context are interpolated (divided by factor), those over beta_fast
    # kept, with a linear ramp between (YaRN's "NTK-by-parts").
    factor = _yarn_factor(scaling)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the unscaled frequency (fp32, as transformers)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band
    # between is interpolated smoothly (Llama 3.1's recipe).
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    smooth = (old_len / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, interpolated, out)


class Rotary(nn.Module):
    """cos / sin tables of one rope (base and scaling) for every position."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None,
                 max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        factor = rope_attention_factor(scaling)
        self.register_buffer("cos", freqs.cos() * factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * factor, persistent=False)

    @classmethod
    def of(cls, config, max_positions: int, local: bool = False) -> "Rotary":  # noqa: ANN001
        """The rope of ``config``'s full layers, or (``local``) its sliding ones'."""
        if local:
            return cls(config.head_dim, config.local_rope_theta, config.local_rope_scaling,
                       max_positions)
        return cls(config.head_dim, config.rope_theta, config.rope_scaling, max_positions)

    def tables(self, positions: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the step's positions, [T, 1, D/2]; built once per step."""
        return (self.cos[positions][:, None, :].to(dtype),
                self.sin[positions][:, None, :].to(dtype))

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] rotated by the half-split convention."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
