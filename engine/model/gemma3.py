"""Gemma 3 text (``Gemma3ForCausalLM``, model_type ``gemma3_text``): five sliding layers to one global
(``sliding_window_pattern`` or ``layer_types``), local and global RoPE bases, q/k norms, norms that
scale by ``1 + weight``, pre/post feed-forward norms, embeddings times sqrt(hidden), attention scaled by
``query_pre_attn_scalar``, final-logit soft-capping when configured, tied embeddings.

Its config.json parser: engine/model/hf_config.py ``parse_gemma3`` (no torch there)."""
from __future__ import annotations

from engine.model.decoder import CausalLM


class Gemma3ForCausalLM(CausalLM):
    """The shared decoder with Gemma's norms, scaled embeddings and per-type RoPE."""
