"""Gemma 3 text (``Gemma3ForCausalLM``, model_type ``gemma3_text``): five sliding layers to one global
(``sliding_window_pattern`` or ``layer_types``), local and global RoPE bases, q/k norms, norms that
scale by ``1 + weight``, pre/post feed-forward norms, embeddings times sqrt(hidden), attention scaled by
``query_pre_attn_scalar``, final-logit soft-capping when configured, tied embeddings."""
from __future__ import annotations

from engine.model.config import ModelConfig
from engine.model.decoder import CausalLM
from engine.model.hf_config import common, eos_ids, layer_types


def parse(d: dict) -> ModelConfig:
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


class Gemma3ForCausalLM(CausalLM):
    """The shared decoder with Gemma's norms, scaled embeddings and per-type RoPE."""
