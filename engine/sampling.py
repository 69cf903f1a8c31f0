"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, per-request seeds)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0           # 0 means greedy
    top_k: int = 0                     # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    return_logits: bool = False        # keep each step's next-token logits (tests, scoring)

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        stop = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stop):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def make_generator(seed: int | None, fallback: torch.Generator) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,), generator=fallback)))
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]) -> list[int]:
    """logits [B, vocab] fp32 -> one token id per row."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        # In float64, shifted so the top logit is 0: a tiny temperature (1e-300 is a valid one, and 0 in
        # float32) then gives -inf for the others instead of nan, which would fail every request's step.
        row = (logits[i].double() - logits[i].max().double()) / p.temperature
        if p.top_k and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            srt, idx = torch.sort(row, descending=True)
            probs = torch.softmax(srt, dim=-1)
            # Keep the smallest set whose mass reaches top_p (the first token always stays).
            drop = probs.cumsum(-1) - probs >= p.top_p
            row = row.clone()
            row[idx[drop]] = float("-inf")
        probs = torch.softmax(row, dim=-1)
        out[i] = int(torch.multinomial(probs, 1, generator=gens[i]).item())
    return out
