"""Mixture of experts of GPT-OSS: a biased top-k router, softmax over the chosen experts, and clamped
SwiGLU experts whose gate and up projections are interleaved in one ``gate_up_proj``."""
from __future__ import annotations

import torch
from torch import nn


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
        """One expert on x [n, hidden] -> [n, hidden]."""
        gu = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        gate = gu[..., ::2].clamp(max=self.limit)
        up = gu[..., 1::2].clamp(min=-self.limit, max=self.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return h @ self.down_proj[e] + self.down_proj_bias[e]


# Below this many expert weight elements (all experts) every expert runs on every token in three
# batched ops: for tiny models per-expert dispatch costs far more in op overhead than the wasted FLOPs.
DENSE_MAX_ELEMS = 1 << 21


class MoE(nn.Module):
    """The MLP block. ``expert_counts`` [E] accumulates routed tokens per expert (cheap, always on)
    for the EPLB rebalancer."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, limit: float,
                 alpha: float) -> None:
        super().__init__()
        self.router = TopKRouter(hidden, num_experts, top_k)
        self.experts = Experts(hidden, inter, num_experts, limit, alpha)
        self.register_buffer("expert_counts", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        scores, idx = self.router(x)
        flat_idx = idx.reshape(-1)
        counts = torch.bincount(flat_idx, minlength=self.experts.num_experts)
        self.expert_counts += counts
        if self.experts.gate_up_proj.numel() + self.experts.down_proj.numel() <= DENSE_MAX_ELEMS:
            return self._dense(x, scores, idx)
        # Group (token, slot) pairs by expert so each expert runs once on its tokens.
        order = torch.argsort(flat_idx, stable=True)
        tok = order // idx.shape[1]
        w = scores.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            t = tok[start:start + n]
            y = self.experts.expert(e, x[t]) * w[start:start + n, None]
            out.index_add_(0, t, y.to(x.dtype))
            start += n
        return out

    def _dense(self, x: torch.Tensor, scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by the router (0 for experts not chosen)."""
        ex = self.experts
        gu = torch.einsum("th,ehi->eti", x, ex.gate_up_proj) + ex.gate_up_proj_bias[:, None, :]
        gate = gu[..., ::2].clamp(max=ex.limit)
        up = gu[..., 1::2].clamp(min=-ex.limit, max=ex.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * ex.alpha))
        y = torch.einsum("eti,eih->eth", h, ex.down_proj) + ex.down_proj_bias[:, None, :]
        w = torch.zeros(x.shape[0], ex.num_experts, dtype=y.dtype, device=x.device)
        w.scatter_(1, idx, scores.to(y.dtype))
        return torch.einsum("te,eth->th", w, y).to(x.dtype)
