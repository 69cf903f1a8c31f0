"""Qwen3 (``Qwen3ForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``): RMSNorm on q and k per head
before RoPE, no attention bias, full attention (sliding layers only with ``use_sliding_window``).
Qwen3-MoE: softmax over every expert, top-k, renormalised when ``norm_topk_prob``; dense MLPs in
``mlp_only_layers`` and between sparse steps."""
from __future__ import annotations

from engine.model.config import FULL_ATTN, ModelConfig
from engine.model.decoder import CausalLM
from engine.model.hf_config import common, layer_types


def _layers(d: dict) -> tuple[tuple[str, ...], int]:
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    mwl = d.get("max_window_layers", d["num_hidden_layers"])
    if d.get("layer_types") and not window:
        return tuple(FULL_ATTN for _ in d["layer_types"]), 0
    return layer_types(d, lambda i: bool(window) and i >= mwl), window or 0


def parse(d: dict) -> ModelConfig:
    types, window = _layers(d)
    return common(d, "Qwen3ForCausalLM", 10000.0, qk_norm=True, layer_types=types, sliding_window=window)


def parse_moe(d: dict) -> ModelConfig:
    types, window = _layers(d)
    return common(
        d, "Qwen3MoeForCausalLM", 10000.0, qk_norm=True, layer_types=types, sliding_window=window,
        # Released configs say num_experts; transformers 5 writes num_local_experts.
        num_local_experts=d["num_experts"] if "num_experts" in d else d["num_local_experts"],
        num_experts_per_tok=d["num_experts_per_tok"],
        moe_intermediate_size=d["moe_intermediate_size"], norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        mlp_only_layers=tuple(d.get("mlp_only_layers") or ()), decoder_sparse_step=d.get("decoder_sparse_step", 1),
        router="softmax_topk", expert_act="silu")


class Qwen3ForCausalLM(CausalLM):
    """The shared decoder with q/k norms."""


class Qwen3MoeForCausalLM(CausalLM):
    """The shared decoder with q/k norms and Qwen's MoE router; experts stacked by convert.py."""
