"""A probe on an engine's MoE routers, for tests that show what a top-k routing tie does to an answer:
it records every routing decision and can break one of them the other way.

Rows are counted per layer across the router's calls of one request, so for a single request alone in
the engine a row's ``position`` is its token position: prefill chunks cover 0..prompt_len-1 in order,
and decode step i (i >= 1) is position prompt_len + i - 1, whatever the chunking.

``STRATA_ROUTING_PROBE_SHAM=1`` disables the flip while still reporting it done (``flipped``): the tests
built on the probe must then fail, on every CPU, or they test the machine rather than the mechanism
(``STRATA_ROUTING_PROBE_SHAM=1 pytest -m numerics tests/unit/test_chunked_prefill_routing_tie.py
tests/reliability/test_verify.py`` is how that is checked)."""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.model.moe import TopKRouter


class Decision(NamedTuple):
    gap: float        # k-th minus (k+1)-th router logit: how close the decision was
    layer: int
    step: int         # the router's call in this probe (0: the first prefill chunk)
    row: int          # row in that call
    position: int     # rows of this layer before it, across calls


class RouterProbe:
    """``with RouterProbe(engine, flip=(layer, position)) as p: engine.generate(...)``: ``p.decisions``
    holds every decision, ``p.logits[layer]`` the router logits [rows, E] of all calls, and the decision
    at ``flip`` gets the (k+1)-th expert in place of the k-th (what a computation whose rounding broke
    that tie the other way does). The hooks are removed on exit."""

    def __init__(self, engine, flip: tuple[int, int] | None = None) -> None:
        self.routers = [m for m in engine.model.modules() if isinstance(m, TopKRouter)]
        self.flip = flip
        self.sham = os.environ.get("STRATA_ROUTING_PROBE_SHAM") == "1"
        self.flipped = False
        self.decisions: list[Decision] = []
        self._logits: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._chosen: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._handles = []

    def logits(self, layer: int) -> torch.Tensor:
        return torch.cat(self._logits[layer])

    def chosen(self, layer: int) -> torch.Tensor:
        """The experts each row was sent to [rows, k], as a set (sorted)."""
        return torch.cat(self._chosen[layer]).sort(-1).values

    def closest(self, n: int = 1, min_step: int = 0) -> list[Decision]:
        return sorted(d for d in self.decisions if d.step >= min_step)[:n]

    def _hook(self, layer: int):
        def hook(mod: TopKRouter, args, out):
            lg = F.linear(args[0], mod.weight, mod.bias)
            k, step, seen = mod.top_k, len(self._logits[layer]), sum(x.shape[0] for x in self._logits[layer])
            v, idx = lg.sort(-1, descending=True)
            gaps = (v[:, k - 1] - v[:, k]).tolist()
            self.decisions.extend(Decision(g, layer, step, r, seen + r) for r, g in enumerate(gaps))
            self._logits[layer].append(lg.detach().clone())
            scores, chosen = out
            if self.flip is not None and self.flip[0] == layer and seen <= self.flip[1] < seen + lg.shape[0]:
                self.flipped = True
                if not self.sham:
                    r = self.flip[1] - seen
                    chosen = idx[:, :k].clone()
                    chosen[r, -1] = idx[r, k]
                    scores = torch.softmax(lg.gather(-1, chosen), dim=-1, dtype=lg.dtype)
            self._chosen[layer].append(chosen.detach().clone())
            return scores, chosen
        return hook

    def __enter__(self) -> "RouterProbe":
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
