"""Mixture of experts of GPT-OSS: a biased top-k router, softmax over the chosen experts, and clamped
SwiGLU experts whose gate and up projections are interleaved in one ``gate_up_proj``."""
from __future__ import annotations

import torch
from torch import nn

from engine.model.moe_dispatch import Dispatch, TorchDispatch, swiglu


class TopKRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (scores [T, k] softmaxed over the chosen, indices [T, k])."""
        logits = nn.functional.linear(x, self.weight, self.bias)
        top_v, top_i = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top_v, dim=-1, dtype=top_v.dtype), top_i


class Experts(nn.Module):
    """Weights by logical expert: gate_up_proj [E, hidden, 2I] (gate, up interleaved on the last dim),
    gate_up_proj_bias [E, 2I], down_proj [E, I, hidden], down_proj_bias [E, hidden]."""

    def __init__(self, hidden: int, inter: int, num_experts: int, limit: float, alpha: float) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.limit = limit
        self.alpha = alpha
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Weight row e (a logical expert, or a physical slot once the layer has slots) on x [n, hidden]
        -> [n, hidden]."""
        gu = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        return swiglu(gu, self.limit, self.alpha) @ self.down_proj[e] + self.down_proj_bias[e]


class MoE(nn.Module):
    """The MLP block. ``expert_counts`` [E] accumulates routed tokens per logical expert (cheap, always
    on) for the EPLB rebalancer. With ``slots`` (engine/model/moe_slots.py) the weights are held per
    physical slot and each choice goes to one replica of its expert; ``dispatch`` runs the experts."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, limit: float,
                 alpha: float) -> None:
        super().__init__()
        self.router = TopKRouter(hidden, num_experts, top_k)
        self.experts = Experts(hidden, inter, num_experts, limit, alpha)
        self.num_logical = num_experts
        self.register_buffer("expert_counts", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.slots = None
        self.dispatch: Dispatch = TorchDispatch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        scores, idx = self.router(x)
        self.expert_counts += torch.bincount(idx.reshape(-1), minlength=self.num_logical)
        slot = idx if self.slots is None else self.slots.route(idx)
        return self.dispatch(x, slot, scores, self.experts)
