"""Physical expert slots of a MoE layer, for expert-parallel load balancing (EPLB).

A layer with slots holds its expert weights per physical slot: ``num_ranks`` ranks x ``P / num_ranks``
slots, P = logical experts + redundant slots; slot s lives on rank ``s // (P / num_ranks)``. The
placement (``phy2log`` [P]: the logical expert in each slot) says which expert each slot holds; hot
experts get several slots (replicas). A token routed to logical expert e goes to one of e's
replicas in turn (round robin per expert, continued across batches), so replicas share e's load evenly
even when every step has one token. Replicas hold identical weights and
the dispatch combines choices in choice order, so the layer's output is the same whatever the placement.

Changing the placement (``stage`` then ``commit``, both between steps): staging copies the weights of
every slot whose expert changes from a current replica of its new expert; committing writes them into
the slots and switches the mapping, all layers in one call, so no forward sees a half-applied placement.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.eplb import Placement

WEIGHTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _placement(row: torch.Tensor, num_logical: int) -> Placement:
    """phy2log [P] of one layer -> a checked one-layer Placement; ValueError when it is not one."""
    row = row.reshape(1, -1).to(torch.int64).cpu()
    if ((row < 0) | (row >= num_logical)).any():
        raise ValueError(f"phy2log holds an expert id outside [0, {num_logical})")
    missing = (torch.bincount(row[0], minlength=num_logical) == 0).nonzero().flatten().tolist()
    if missing:
        raise ValueError(f"phy2log gives logical experts {missing[:8]} no slot")
    return Placement.from_phy2log(row, num_logical).check()


class ExpertSlots(nn.Module):
    """The placement of one layer and its counters. Buffers (int64): phy2log [P], log2phy [E, P - E + 1]
    (-1 padded), logcnt [E], slot_counts [P] (tokens served per slot since the last reset), turn [E] (the
replica of each expert that serves next)."""

    def __init__(self, phy2log: torch.Tensor, num_logical: int, num_ranks: int) -> None:
        super().__init__()
        p = _placement(phy2log, num_logical)
        if p.num_physical % num_ranks:
            raise ValueError(f"num_ranks ({num_ranks}) must divide the {p.num_physical} physical slots")
        self.num_logical, self.num_ranks = num_logical, num_ranks
        self.register_buffer("phy2log", p.phy2log[0].clone(), persistent=False)
        self.register_buffer("log2phy", p.log2phy[0].clone(), persistent=False)
        self.register_buffer("logcnt", p.logcnt[0].clone(), persistent=False)
        self.register_buffer("slot_counts", torch.zeros(p.num_physical, dtype=torch.int64), persistent=False)
        self.register_buffer("turn", torch.zeros(num_logical, dtype=torch.int64), persistent=False)

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[0]

    def route(self, idx: torch.Tensor) -> torch.Tensor:
        """Logical choices idx [T, K] -> physical slots [T, K]; counts the tokens per slot.

        Round robin per expert: the n-th pair routed to e (in batch order, continuing from earlier
        batches through ``turn``) goes to replica n % logcnt[e], so replicas differ by at most one."""
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        e = flat[order]
        counts = torch.bincount(flat, minlength=self.num_logical)
        nth = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(counts, 0) - counts)[e]
        cnt = self.logcnt[e]
        slot = torch.empty_like(flat)
        slot[order] = self.log2phy[e, (nth + self.turn[e]) % cnt]
        self.turn.add_(counts).remainder_(self.logcnt)
        self.slot_counts += torch.bincount(slot, minlength=self.num_physical)
        return slot.view_as(idx)

    def rank_counts(self) -> torch.Tensor:
        """Tokens served per rank [R] since the last reset."""
        return self.slot_counts.view(self.num_ranks, -1).sum(1)


def to_slots(moe: nn.Module, phy2log: torch.Tensor, num_ranks: int) -> None:
    """Turns a MoE layer with logical weights [E, ...] into one with slot weights [P, ...] placed by
    phy2log [P] (slot s gets a copy of logical expert phy2log[s])."""
    if getattr(moe, "slots", None) is not None:
        raise ValueError("the MoE layer already has expert slots")
    ex = moe.experts
    slots = ExpertSlots(phy2log.to(ex.gate_up_proj.device), ex.num_experts, num_ranks)
    with torch.no_grad():
        for name in WEIGHTS:
            w = getattr(ex, name)
            setattr(ex, name, nn.Parameter(w.data.index_select(0, slots.phy2log).contiguous(),
                                           requires_grad=False))
    ex.num_experts = slots.num_physical
    moe.slots = slots


@dataclass
class Staged:
    """One layer's pending placement: the new mapping and the weights of the slots that change."""
    moe: nn.Module
    placement: Placement
    changed: torch.Tensor                  # [C] slots whose expert changes
    weights: dict[str, torch.Tensor]       # name -> [C, ...] copies of their new experts' weights

    def commit(self) -> None:
        ex, s, p = self.moe.experts, self.moe.slots, self.placement
        with torch.no_grad():
            for name, w in self.weights.items():
                getattr(ex, name).data.index_copy_(0, self.changed, w)
        s.phy2log.copy_(p.phy2log[0])
        s.log2phy.copy_(p.log2phy[0])
        s.logcnt.copy_(p.logcnt[0])


def stage(moe: nn.Module, phy2log: torch.Tensor) -> Staged:
    """Copies, for one layer, the weights every changing slot needs (from a current replica of its new
    expert) without touching the layer; ``commit`` applies them. Raises ValueError on a bad phy2log."""
    s = moe.slots
    if s is None:
        raise ValueError("the MoE layer has no expert slots (EngineConfig.eplb is not set)")
    if phy2log.shape != s.phy2log.shape:
        raise ValueError(f"phy2log has {tuple(phy2log.shape)} slots per layer, the layer has {s.num_physical}")
    new = _placement(phy2log, s.num_logical)
    row = new.phy2log[0].to(s.phy2log.device)
    changed = (row != s.phy2log).nonzero().squeeze(1)
    src = s.log2phy[row[changed], 0]        # every logical expert has a replica now: copy from it
    weights = {name: getattr(moe.experts, name).data.index_select(0, src) for name in WEIGHTS}
    dev = s.phy2log.device
    placed = Placement(new.phy2log.to(dev), new.log2phy.to(dev), new.logcnt.to(dev))
    return Staged(moe, placed, changed, weights)


def apply_placement(moes: list[nn.Module], phy2log: torch.Tensor) -> int:
    """Applies phy2log [L, P] to the layers (all staged first, then all committed); returns the number
    of slots whose expert changed. On a bad phy2log raises ValueError and changes nothing."""
    if not isinstance(phy2log, torch.Tensor) or phy2log.dim() != 2 or phy2log.shape[0] != len(moes):
        raise ValueError(f"phy2log must be a [layers={len(moes)}, slots] tensor, got "
                         f"{tuple(phy2log.shape) if isinstance(phy2log, torch.Tensor) else type(phy2log).__name__}")
    if phy2log.dtype.is_floating_point or phy2log.dtype == torch.bool:
        raise ValueError(f"phy2log must hold integer expert ids, got {phy2log.dtype}")
    staged = [stage(m, row) for m, row in zip(moes, phy2log)]
    for st in staged:
        st.commit()
    return sum(int(st.changed.numel()) for st in staged)


def enable_slots(moes: list[nn.Module], num_ranks: int, num_redundant: int, dispatch) -> Placement:
    """Gives every layer ``num_ranks`` x (E + num_redundant) / num_ranks slots in the identity placement
    (engine/eplb.py ``identity_placement``) and the dispatch; returns that placement."""
    from engine.eplb import identity_placement
    E = moes[0].num_logical
    if E % num_ranks:
        raise ValueError(f"eplb.num_ranks ({num_ranks}) must divide the model's {E} experts")
    if num_redundant % num_ranks:
        raise ValueError(f"eplb.num_redundant_experts ({num_redundant}) must be a multiple of num_ranks")
    p = identity_placement(len(moes), E, num_ranks, num_redundant // num_ranks)
    for moe, row in zip(moes, p.phy2log):
        to_slots(moe, row, num_ranks)
        moe.dispatch = dispatch
    return p
