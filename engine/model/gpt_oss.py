"""The GPT-OSS architecture over paged KV pools.

Module and parameter names follow transformers' ``GptOssForCausalLM`` so a Hugging Face checkpoint's
state dict loads as is (``model.layers.{i}.self_attn.sinks``, ``model.layers.{i}.mlp.experts.gate_up_proj``).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.model.attention import BatchMeta, paged_attention
from engine.model.config import SLIDING, ModelConfig
from engine.model.layers import RMSNorm, Rotary
from engine.model.moe import MoE
from storage.pools import KVPools


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.window = cfg.sliding_window if cfg.layer_types[layer_id] == SLIDING else None
        self.scale = self.d ** -0.5
        b = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.hq * self.d, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=b)
        self.o_proj = nn.Linear(self.hq * self.d, cfg.hidden_size, bias=b)
        self.sinks = nn.Parameter(torch.zeros(self.hq))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: BatchMeta,
                pools: KVPools) -> torch.Tensor:
        t = x.shape[0]
        q = Rotary.apply(self.q_proj(x).view(t, self.hq, self.d), cos, sin)
        k = Rotary.apply(self.k_proj(x).view(t, self.hkv, self.d), cos, sin)
        v = self.v_proj(x).view(t, self.hkv, self.d)
        pool = pools.swa if self.window is not None else pools.full
        o = paged_attention(self.layer_id, q, k, v, meta, pool, self.sinks, self.scale, self.window)
        return self.o_proj(o)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts,
                       cfg.num_experts_per_tok, cfg.swiglu_limit, cfg.swiglu_alpha)

    def forward(self, x, cos, sin, meta, pools):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, pools)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GptOssForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rope, cfg.head_dim)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMeta, pools: KVPools) -> torch.Tensor:
        """input_ids [T] -> logits [len(meta.logit_idx), vocab] in fp32."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(meta.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, meta, pools)
        h = self.model.norm(x[meta.logit_idx])
        return self.lm_head(h).float()

    def expert_counts(self) -> torch.Tensor:
        """[layers, experts] routed tokens since the last reset."""
        return torch.stack([l.mlp.expert_counts for l in self.model.layers])

    def reset_expert_counts(self) -> None:
        for l in self.model.layers:
            l.mlp.expert_counts.zero_()
