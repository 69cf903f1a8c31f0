"""Mixture-of-experts blocks: GPT-OSS's (a biased top-k router, softmax over the chosen experts, clamped
SwiGLU experts with biases) and Qwen3-MoE's (softmax over every expert, top-k, optionally renormalised;
plain SiLU-gated experts). Both hold expert weights in one layout, gate and up interleaved in one
``gate_up_proj``, so expert slots, EPLB and the dispatch serve either."""
from __future__ import annotations

import torch
from torch import nn

from engine.model.moe_dispatch import Dispatch, TorchDispatch, activate


class TopKRouter(nn.Module):
    """``kind`` topk_softmax (GPT-OSS): softmax over the top-k logits. softmax_topk (Qwen3-MoE): softmax
    over all experts in fp32, then the top k, renormalised to sum 1 when ``norm_topk_prob``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, kind: str = "topk_softmax",
                 bias: bool = True, norm_topk_prob: bool = False) -> None:
        super().__init__()
        self.top_k, self.kind, self.norm_topk_prob = top_k, kind, norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (scores [T, k], indices [T, k])."""
        logits = nn.functional.linear(x, self.weight, self.bias)
        if self.kind == "topk_softmax":
            top_v, top_i = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top_v, dim=-1, dtype=top_v.dtype), top_i
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_v, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_v = top_v / top_v.sum(dim=-1, keepdim=True)
        return top_v.to(x.dtype), top_i


class Experts(nn.Module):
    """Weights by logical expert: gate_up_proj [E, hidden, 2I] (gate, up interleaved on the last dim),
    gate_up_proj_bias [E, 2I], down_proj [E, I, hidden], down_proj_bias [E, hidden]."""

    def __init__(self, hidden: int, inter: int, num_experts: int, limit: float, alpha: float,
                 act: str = "swiglu_clamped") -> None:
        super().__init__()
        self.num_experts = num_experts
        self.limit = limit
        self.alpha = alpha
        self.act = act
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Weight row e (a logical expert, or a physical slot once the layer has slots) on x [n, hidden]
        -> [n, hidden]."""
        gu = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        return activate(gu, self) @ self.down_proj[e] + self.down_proj_bias[e]


class MoE(nn.Module):
    """The MLP block. ``expert_counts`` [E] accumulates routed tokens per logical expert (cheap, always
    on) for the EPLB rebalancer. With ``slots`` (engine/model/moe_slots.py) the weights are held per
    physical slot and each choice goes to one replica of its expert; ``dispatch`` runs the experts."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, limit: float = 7.0,
                 alpha: float = 1.702, router: str = "topk_softmax", router_bias: bool = True,
                 norm_topk_prob: bool = False, act: str = "swiglu_clamped") -> None:
        super().__init__()
        self.router = TopKRouter(hidden, num_experts, top_k, router, router_bias, norm_topk_prob)
        self.experts = Experts(hidden, inter, num_experts, limit, alpha, act)
        self.num_logical = num_experts
        self.register_buffer("expert_counts", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.slots = None
        self.dispatch: Dispatch = TorchDispatch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        scores, idx = self.router(x)
        # In place: ``+=`` would also assign the buffer again through nn.Module.__setattr__ in every layer.
        self.expert_counts.add_(torch.bincount(idx.reshape(-1), minlength=self.num_logical))
        slot = idx if self.slots is None else self.slots.route(idx)
        return self.dispatch(x, slot, scores, self.experts)
