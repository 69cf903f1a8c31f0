"""What every family's ``config.json`` parser shares (the parsers are in the family files, chosen by
engine/model/registry.py).

Both the layouts that transformers 5 writes (``rope_parameters``, per layer type for Gemma 3) and the
older ones that released checkpoints carry (``rope_theta`` + ``rope_scaling``, Gemma 3's
``rope_local_base_freq`` and ``sliding_window_pattern``) are read.
"""
from __future__ import annotations

from typing import Callable

from engine.model.config import FULL_ATTN, SLIDING, ModelConfig, RopeConfig


def rope(rp: dict | None, theta: float, max_pos: int) -> RopeConfig:
    """One RoPE from a ``rope_parameters`` / ``rope_scaling`` dict (None: default RoPE at ``theta``)."""
    rp = dict(rp or {})
    kind = rp.get("rope_type", rp.get("type", "default")) or "default"
    return RopeConfig(
        theta=float(rp.get("rope_theta", theta)), rope_type=kind,
        factor=float(rp.get("factor", 1.0) or 1.0),
        beta_fast=float(rp.get("beta_fast") or 32.0), beta_slow=float(rp.get("beta_slow") or 1.0),
        original_max_position_embeddings=int(rp.get("original_max_position_embeddings") or max_pos),
        truncate=bool(rp.get("truncate", True)), attention_factor=rp.get("attention_factor"),
        low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rp.get("high_freq_factor", 4.0)))


def ropes(d: dict, default_theta: float) -> tuple[RopeConfig, RopeConfig | None]:
    """(full layers' RoPE, sliding layers' RoPE or None when the same)."""
    max_pos = d.get("max_position_embeddings", 4096)
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and (FULL_ATTN in rp or SLIDING in rp):
        full = rope(rp.get(FULL_ATTN), default_theta, max_pos)
        local = rope(rp[SLIDING], default_theta, max_pos) if SLIDING in rp else None
        return full, local
    theta = float((rp or {}).get("rope_theta", d.get("rope_theta", default_theta)))
    full = rope(rp or d.get("rope_scaling"), theta, max_pos)
    local = None
    if d.get("rope_local_base_freq") is not None:     # released Gemma 3 layout
        local = RopeConfig(theta=float(d["rope_local_base_freq"]))
    return full, local


def eos_ids(d: dict) -> tuple[int, ...]:
    eos = d.get("eos_token_id")
    return () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),))


def common(d: dict, arch: str, default_theta: float, **extra) -> ModelConfig:
    n_heads = d["num_attention_heads"]
    full, local = ropes(d, default_theta)
    base = dict(
        architecture=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d.get("intermediate_size") or d.get("moe_intermediate_size") or 1,
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=n_heads,
        num_key_value_heads=d.get("num_key_value_heads") or n_heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6), tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        eos_token_id=eos_ids(d), pad_token_id=d.get("pad_token_id"),
        torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
        hidden_act=d.get("hidden_act") or d.get("hidden_activation") or "silu",
        attention_bias=bool(d.get("attention_bias", False)), attention_sinks=False,
        num_local_experts=0, router_bias=False, expert_bias=False, rope=full, rope_local=local,
    )
    base.update(extra)
    return ModelConfig(**base)


def layer_types(d: dict, default_sliding: Callable[[int], bool]) -> tuple[str, ...]:
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    return tuple(SLIDING if default_sliding(i) else FULL_ATTN for i in range(d["num_hidden_layers"]))
