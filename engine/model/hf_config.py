"""Each family's ``config.json`` parser, and what they share (engine/model/registry.py picks one by
``architectures``). Plain Python, no torch: the launcher reads a checkpoint's layer spec here without
loading the families' model modules (engine/model/<family>.py).

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


# ---- the families -------------------------------------------------------------------------------------
def parse_gpt_oss(d: dict) -> ModelConfig:
    """GPT-OSS: alternating sliding (window 128) and full layers, sinks, biased attention, YaRN RoPE, MoE
    with a biased top-k router and clamped SwiGLU experts (engine/model/gpt_oss.py)."""
    if "num_local_experts" not in d:
        raise KeyError("num_local_experts")
    return common(
        d, "GptOssForCausalLM", 150000.0,
        intermediate_size=d["intermediate_size"], num_local_experts=d["num_local_experts"],
        num_experts_per_tok=d["num_experts_per_tok"], sliding_window=d.get("sliding_window") or 0,
        layer_types=layer_types(d, lambda i: i % 2 == 0),
        max_position_embeddings=d.get("max_position_embeddings", 131072),
        rms_norm_eps=d.get("rms_norm_eps", 1e-5), swiglu_limit=d.get("swiglu_limit", 7.0),
        swiglu_alpha=d.get("swiglu_alpha", 1.702), attention_bias=d.get("attention_bias", True),
        attention_sinks=True, router_bias=True, expert_bias=True, router="topk_softmax",
        expert_act="swiglu_clamped", hidden_act="silu")


def parse_llama(d: dict) -> ModelConfig:
    """Llama: full attention in every layer (engine/model/llama.py)."""
    return common(d, "LlamaForCausalLM", 10000.0, mlp_bias=bool(d.get("mlp_bias", False)),
                  layer_types=(FULL_ATTN,) * d["num_hidden_layers"], rms_norm_eps=d.get("rms_norm_eps", 1e-6))


def _qwen3_layers(d: dict) -> tuple[tuple[str, ...], int]:
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    mwl = d.get("max_window_layers", d["num_hidden_layers"])
    if d.get("layer_types") and not window:
        return tuple(FULL_ATTN for _ in d["layer_types"]), 0
    return layer_types(d, lambda i: bool(window) and i >= mwl), window or 0


def parse_qwen3(d: dict) -> ModelConfig:
    """Qwen3: q/k norms, full attention (sliding layers only with ``use_sliding_window``;
    engine/model/qwen3.py)."""
    types, window = _qwen3_layers(d)
    return common(d, "Qwen3ForCausalLM", 10000.0, qk_norm=True, layer_types=types, sliding_window=window)


def parse_qwen3_moe(d: dict) -> ModelConfig:
    """Qwen3-MoE: Qwen3's attention, softmax top-k experts, dense MLPs in ``mlp_only_layers`` and between
    sparse steps (engine/model/qwen3.py)."""
    types, window = _qwen3_layers(d)
    return common(
        d, "Qwen3MoeForCausalLM", 10000.0, qk_norm=True, layer_types=types, sliding_window=window,
        # Released configs say num_experts; transformers 5 writes num_local_experts.
        num_local_experts=d["num_experts"] if "num_experts" in d else d["num_local_experts"],
        num_experts_per_tok=d["num_experts_per_tok"],
        moe_intermediate_size=d["moe_intermediate_size"], norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        mlp_only_layers=tuple(d.get("mlp_only_layers") or ()), decoder_sparse_step=d.get("decoder_sparse_step", 1),
        router="softmax_topk", expert_act="silu")


def parse_gemma3(d: dict) -> ModelConfig:
    """Gemma 3 text: five sliding layers to one global, local and global RoPE bases (engine/model/gemma3.py)."""
    if d.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention=true (an encoder) is not supported")
    # attn_logit_softcapping is read by transformers' Gemma 3 but never applied (Gemma 3 replaced it
    # with q/k norms; released configs say null): strata follows transformers and ignores it too.
    pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
    return common(
        d, "Gemma3ForCausalLM", 1000000.0,
        head_dim=d.get("head_dim") or 256,
        hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        layer_types=layer_types(d, lambda i: (i + 1) % pattern != 0),
        sliding_window=d.get("sliding_window") or 4096,
        qk_norm=True, query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or 256),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        norm_offset=1.0, sandwich_norm=True, embed_scale=float(d["hidden_size"]) ** 0.5,
        max_position_embeddings=d.get("max_position_embeddings", 131072),
        eos_token_id=eos_ids(d) or (1,), pad_token_id=d.get("pad_token_id", 0))
