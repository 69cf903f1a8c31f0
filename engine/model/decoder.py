"""One decoder-only transformer over paged KV pools, configured per family by ``ModelConfig``.

GPT-OSS (sinks, biased attention, MoE with clamped SwiGLU), Llama, Qwen3 (q/k RMSNorm), Qwen3-MoE and
Gemma 3 (``1 + weight`` norms, pre/post feed-forward norms, scaled embeddings, per-type RoPE,
final soft-capping) differ only in the blocks ``ModelConfig`` switches on. Module and parameter names follow
transformers' so a checkpoint's state dict loads as is, once engine/model/convert.py has mapped the
layouts that differ (Qwen3-MoE's per-expert tensors, GPT-OSS's MXFP4 blocks).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.model.attention import BatchMeta, paged_attention
from engine.model.config import FULL_ATTN, SLIDING, ModelConfig
from engine.model.layers import RMSNorm, Rotary
from engine.model.moe import MoE
from storage.pools import KVPools


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.layer_type = cfg.layer_types[layer_id]
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.window = cfg.sliding_window if self.layer_type == SLIDING else None
        self.scale = (cfg.query_pre_attn_scalar or self.d) ** -0.5
        b = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.hq * self.d, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=b)
        self.o_proj = nn.Linear(self.hq * self.d, cfg.hidden_size, bias=b)
        self.sinks = nn.Parameter(torch.zeros(self.hq)) if cfg.attention_sinks else None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, cfg.norm_offset)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: BatchMeta,
                pools: KVPools) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.hq, self.d)
        k = self.k_proj(x).view(t, self.hkv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
        v = self.v_proj(x).view(t, self.hkv, self.d)
        pool = pools.swa if self.window is not None else pools.full
        o = paged_attention(self.layer_id, q, k, v, meta, pool, self.sinks, self.scale, self.window)
        return self.o_proj(o)


class DenseMLP(nn.Module):
    """act(gate_proj(x)) * up_proj(x) -> down_proj."""

    def __init__(self, hidden: int, inter: int, act: str, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate_proj(x)
        g = nn.functional.gelu(g, approximate="tanh") if self.act == "gelu_pytorch_tanh" else nn.functional.silu(g)
        return self.down_proj(g * self.up_proj(x))


def make_mlp(cfg: ModelConfig, layer_id: int) -> nn.Module:
    if not cfg.is_moe_layer(layer_id):
        return DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)
    return MoE(cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok,
               cfg.swiglu_limit, cfg.swiglu_alpha, cfg.router, cfg.router_bias, cfg.norm_topk_prob,
               cfg.expert_act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        eps, off = cfg.rms_norm_eps, cfg.norm_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, off)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, off)
        self.sandwich = cfg.sandwich_norm
        if self.sandwich:   # Gemma: post_attention_layernorm closes the attention branch
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, off)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, off)
        self.mlp = make_mlp(cfg, layer_id)

    def forward(self, x, cos, sin, meta, pools):
        a = self.self_attn(self.input_layernorm(x), cos, sin, meta, pools)
        if not self.sandwich:
            x = x + a
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(a)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rope, cfg.head_dim)
        self.rotary_local = Rotary(cfg.rope_local, cfg.head_dim) if cfg.rope_local is not None else None

    @property
    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMeta, pools: KVPools) -> torch.Tensor:
        """input_ids [T] -> logits [len(meta.logit_idx), vocab] in fp32."""
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale is not None:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        rope = {FULL_ATTN: self.rotary.cos_sin(meta.positions, x.dtype)}
        rope[SLIDING] = rope[FULL_ATTN] if self.rotary_local is None else \
            self.rotary_local.cos_sin(meta.positions, x.dtype)
        for layer in self.model.layers:
            cos, sin = rope[layer.self_attn.layer_type]
            x = layer(x, cos, sin, meta, pools)
        h = self.model.norm(x[meta.logit_idx])
        logits = self.lm_head(h).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def expert_counts(self) -> torch.Tensor:
        """[MoE layers, experts] routed tokens since the last reset."""
        return torch.stack([m.expert_counts for m in self.moe_layers])

    def reset_expert_counts(self) -> None:
        for m in self.moe_layers:
            m.expert_counts.zero_()
