"""Small building blocks of the decoders: RMSNorm (plain, or Gemma's ``1 + weight``) and RoPE (default,
YaRN, linear and Llama 3 scaling)."""
from __future__ import annotations

import math

import torch
from torch import nn

from engine.model.config import RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.offset = offset    # Gemma stores w and scales by (1 + w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the activation dtype: bf16 variance loses too much. The casts and
        # the offset are made only where they change something: a small model's step runs this several times
        # a layer, and each no-op call costs a few microseconds.
        dtype, f32 = x.dtype, torch.float32
        h = x if dtype == f32 else x.to(f32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight if self.weight.dtype == f32 else self.weight.to(f32)
        if self.offset:
            w = w + self.offset
        return w * h if dtype == f32 else (w * h).to(dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the cos/sin scale (YaRN's attention factor)."""
    dim = head_dim
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope.rope_type == "linear":
        return 1.0 / (pos_freqs * rope.factor), 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(1.0 / pos_freqs, rope), 1.0
    factor = rope.factor
    att = rope.attention_factor
    if att is None:
        att = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

    def correction_dim(rotations: float) -> float:
        # The rotary dimension that completes `rotations` turns over the original context.
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # high-frequency dims keep their original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(att)


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than the original context / low_freq_factor are slowed by
    ``factor``, shorter than context / high_freq_factor kept, and the band between interpolated."""
    ctx = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = ctx / rope.low_freq_factor, ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """cos/sin tables by position; rotation of the two halves of each head (the transformers convention
    of every supported family)."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        inv_freq, self.scale = rope_inv_freq(rope, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, head_dim // 2]."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return ((freqs.cos() * self.scale).to(dtype)[:, None, :],
                (freqs.sin() * self.scale).to(dtype)[:, None, :])

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated by cos/sin [T, 1, head_dim // 2]."""
        a, b = torch.chunk(x, 2, dim=-1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
