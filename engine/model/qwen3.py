"""Qwen3 (``Qwen3ForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``): RMSNorm on q and k per head
before RoPE, no attention bias, full attention (sliding layers only with ``use_sliding_window``).
Qwen3-MoE: softmax over every expert, top-k, renormalised when ``norm_topk_prob``; dense MLPs in
``mlp_only_layers`` and between sparse steps.

Its config.json parser: engine/model/hf_config.py ``parse_qwen3`` and ``parse_qwen3_moe`` (no torch there)."""
from __future__ import annotations

from engine.model.decoder import CausalLM


class Qwen3ForCausalLM(CausalLM):
    """The shared decoder with q/k norms."""


class Qwen3MoeForCausalLM(CausalLM):
    """The shared decoder with q/k norms and Qwen's MoE router; experts stacked by convert.py."""
