"""MXFP4 expert weights in GPT-OSS's released layout, dequantized at load.

OCP microscaling FP4: each block of 32 values shares one E8M0 scale byte (2 ** (s - 127)); each value
is FP4 E2M1 (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte, the
low nibble first. On disk, for a weight used as x @ W with W [E, K, N]:

    <name>_blocks  uint8 [E, N, K / 32, 16]
    <name>_scales  uint8 [E, N, K / 32]

strata dequantizes once at load into the engine dtype (``dequantize``), so the forward pass is the
plain expert path; bench/mxfp4.py measures what that costs in memory and gains in speed against a
per-step dequantizing path. ``quantize`` (round to nearest, scale from the block's largest magnitude)
writes such checkpoints for the tests.
"""
from __future__ import annotations

import torch

BLOCK = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def check_packed(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} / {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                         f"{tuple(scales.shape)} (want blocks = scales + [{BLOCK // 2}])")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
               name: str = "mxfp4") -> torch.Tensor:
    """blocks [*P, G, 16], scales [*P, G] -> values [*P, G * 32] (the last dim is K, the reduced one)."""
    check_packed(name, blocks, scales)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    lo, hi = (blocks & 0x0F).long(), (blocks >> 4).long()
    vals = torch.stack([lut[lo], lut[hi]], dim=-1).flatten(-2)          # [*P, G, 32]
    exp = scales.to(torch.int32) - SCALE_BIAS
    vals = torch.ldexp(vals, exp[..., None].to(torch.float32))
    return vals.flatten(-2).to(dtype)


def dequantize_weight(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                      name: str = "mxfp4") -> torch.Tensor:
    """The expert weight [E, K, N] of x @ W from its on-disk blocks [E, N, K/32, 16] and scales."""
    return dequantize(blocks, scales, dtype, name).transpose(1, 2).contiguous()


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [*P, K] (K a multiple of 32) -> (blocks [*P, K/32, 16] uint8, scales [*P, K/32] uint8)."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"mxfp4: the last dim ({w.shape[-1]}) must be a multiple of {BLOCK}")
    x = w.float().reshape(*w.shape[:-1], -1, BLOCK)
    amax = x.abs().amax(-1).clamp(min=2.0 ** -126)
    # The largest E2M1 magnitude is 6 = 1.5 * 2**2: pick 2**e so that amax / 2**e <= 6.
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, 127)
    q = x / torch.ldexp(torch.ones_like(e), e.to(torch.int32))[..., None]
    mags = torch.tensor(FP4_VALUES[:8])
    idx = (q.abs()[..., None] - mags).abs().argmin(-1)                    # nearest magnitude
    idx = idx + 8 * (q < 0).long() * (idx > 0).long()
    nib = idx.to(torch.uint8).reshape(*x.shape[:-1], BLOCK // 2, 2)
    blocks = nib[..., 0] | (nib[..., 1] << 4)
    return blocks.contiguous(), (e + SCALE_BIAS).to(torch.uint8).contiguous()


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert weight [E, K, N] of x @ W -> its on-disk (blocks [E, N, K/32, 16], scales [E, N, K/32])."""
    return quantize(w.transpose(1, 2))
