"""GPT-OSS (``GptOssForCausalLM``): alternating sliding (window 128) and full layers, per-head attention
sinks, biased attention, YaRN RoPE, MoE with a biased top-k router and clamped SwiGLU experts. Released
checkpoints store the experts as MXFP4 (dequantized by engine/model/convert.py at load)."""
from __future__ import annotations

from engine.model.config import ModelConfig
from engine.model.decoder import CausalLM
from engine.model.hf_config import common, layer_types


def parse(d: dict) -> ModelConfig:
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


class GptOssForCausalLM(CausalLM):
    """The shared decoder with GPT-OSS's switches on (sinks, biases, MoE in every layer)."""
