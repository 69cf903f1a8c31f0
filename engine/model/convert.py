"""A checkpoint's tensors -> the state dict of strata's decoder, checked name by name and shape by shape.

The layouts that model publishers release and strata's differ in three places:
* GPT-OSS MXFP4 experts: ``*_blocks`` + ``*_scales`` are dequantized (engine/model/mxfp4.py).
* Qwen3-MoE experts: one tensor per expert (``experts.{j}.gate_proj.weight`` ...) are stacked into
  strata's ``gate_up_proj`` [E, H, 2I] (gate and up interleaved) and ``down_proj`` [E, I, H], with
  zero biases; the router ``mlp.gate`` is ``mlp.router``.
* Tied embeddings: ``lm_head.weight`` absent from the file is the embedding.
A missing, extra or mis-shaped tensor is a ValueError naming it.
"""
from __future__ import annotations

import re

import torch

from engine.model import mxfp4
from engine.model.config import ModelConfig

# Buffers some exporters write that carry nothing strata needs (recomputed from the config).
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_EXPERT = re.compile(r"^(model\.layers\.(\d+)\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def _dequantize_mxfp4(sd: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    for name in [n for n in sd if n.endswith("_blocks")]:
        base = name[: -len("_blocks")]
        if base + "_scales" not in sd:
            raise ValueError(f"model: {name} has no matching {base}_scales")
        sd[base] = mxfp4.dequantize_weight(sd.pop(name), sd.pop(base + "_scales"), dtype, base)
    stray = [n for n in sd if n.endswith("_scales")]
    if stray:
        raise ValueError(f"model: {stray[0]} has no matching _blocks tensor")


def _stack_experts(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    per_layer: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name in [n for n in sd if _EXPERT.match(n)]:
        prefix, _, j, kind = _EXPERT.match(name).groups()
        per_layer.setdefault(prefix, {})[(int(j), kind)] = sd.pop(name)
    for prefix, parts in per_layer.items():
        e = cfg.num_local_experts
        missing = [f"{prefix}.experts.{j}.{k}_proj.weight" for j in range(e) for k in ("gate", "up", "down")
                   if (j, k) not in parts]
        extra = [f"{prefix}.experts.{j}.{k}_proj.weight" for (j, k) in parts if j >= e]
        if missing or extra:
            raise ValueError(f"model: expert tensors do not match num_experts={e} "
                             f"(missing {missing[:3]}, unexpected {extra[:3]})")
        gate = torch.stack([parts[(j, "gate")].t() for j in range(e)])      # [E, H, I]
        up = torch.stack([parts[(j, "up")].t() for j in range(e)])
        if gate.shape != up.shape:
            raise ValueError(f"model: {prefix}.experts gate_proj {tuple(gate.shape)} and up_proj "
                             f"{tuple(up.shape)} differ")
        sd[f"{prefix}.experts.gate_up_proj"] = torch.stack([gate, up], dim=-1).flatten(-2).contiguous()
        sd[f"{prefix}.experts.down_proj"] = torch.stack([parts[(j, "down")].t() for j in range(e)]).contiguous()
        sd.setdefault(f"{prefix}.experts.gate_up_proj_bias", gate.new_zeros(e, 2 * gate.shape[-1]))
        sd.setdefault(f"{prefix}.experts.down_proj_bias", gate.new_zeros(e, gate.shape[1]))
        if f"{prefix}.gate.weight" in sd:
            sd[f"{prefix}.router.weight"] = sd.pop(f"{prefix}.gate.weight")


def to_strata(sd: dict[str, torch.Tensor], cfg: ModelConfig, want: dict[str, torch.Tensor],
              dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> tensors named and shaped as ``want`` (the model's own state dict)."""
    sd = {n: t for n, t in sd.items() if not IGNORED.match(n)}
    _dequantize_mxfp4(sd, dtype)
    _stack_experts(sd, cfg)
    if "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd and (
            cfg.tie_word_embeddings or "lm_head.weight" in want):
        if not cfg.tie_word_embeddings:
            raise ValueError("model: lm_head.weight is missing and tie_word_embeddings is false")
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing = sorted(set(want) - set(sd))
    extra = sorted(set(sd) - set(want))
    if missing or extra:
        raise ValueError(f"model: the checkpoint does not match {cfg.architecture} "
                         f"(missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                         f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''})")
    for n, t in want.items():
        if tuple(sd[n].shape) != tuple(t.shape):
            raise ValueError(f"model: tensor {n} has shape {tuple(sd[n].shape)}, the config "
                             f"implies {tuple(t.shape)}")
        if not sd[n].is_floating_point():
            raise ValueError(f"model: tensor {n} has dtype {sd[n].dtype}, expected a float type")
    return sd
