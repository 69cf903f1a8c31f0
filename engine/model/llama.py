"""Llama (``LlamaForCausalLM``): full attention in every layer, SiLU-gated MLP, RoPE with Llama 3's
scaling where configured, tied embeddings in the small Llama 3.2 models.

Its config.json parser: engine/model/hf_config.py ``parse_llama`` (no torch there)."""
from __future__ import annotations

from engine.model.decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    """The shared decoder with every optional block off."""
