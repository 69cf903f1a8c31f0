"""Llama (``LlamaForCausalLM``): full attention in every layer, SiLU-gated MLP, RoPE with Llama 3's
scaling where configured, tied embeddings in the small Llama 3.2 models."""
from __future__ import annotations

from engine.model.config import FULL_ATTN, ModelConfig
from engine.model.decoder import CausalLM
from engine.model.hf_config import common


def parse(d: dict) -> ModelConfig:
    return common(d, "LlamaForCausalLM", 10000.0, mlp_bias=bool(d.get("mlp_bias", False)),
                  layer_types=(FULL_ATTN,) * d["num_hidden_layers"], rms_norm_eps=d.get("rms_norm_eps", 1e-6))


class LlamaForCausalLM(CausalLM):
    """The shared decoder with every optional block off."""
