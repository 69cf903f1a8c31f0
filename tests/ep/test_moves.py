"""Pure parts of expert parallelism, no Ray: the move planner (engine/model/moe_ep.py) and the
migration-aware placement (engine/eplb.py align_placement) against the reference policy's plain output."""
from __future__ import annotations

import pytest
import torch

from engine.eplb import (Placement, align_placement, balancedness, identity_placement, moved_slots, rebalance)
from engine.model.moe_ep import Move, plan_moves


def zipf_load(layers: int, experts: int, s: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** s
    return torch.stack([torch.bincount(torch.multinomial(p, 20000, True, generator=g), minlength=experts)
                        [torch.randperm(experts, generator=g)] for _ in range(layers)])


def apply(cur: torch.Tensor, moves: list[Move]) -> torch.Tensor:
    out = cur.clone()
    for m in moves:
        out[m.layer, m.dst] = cur[m.layer, m.src]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_moves_copies_only_changed_slots_from_current_replicas(seed):
    E, R, red, L = 16, 4, 4, 3
    cur = identity_placement(L, E, R, red // R).phy2log
    w = zipf_load(L, E, 1.2, seed)
    new = align_placement(cur, rebalance(w, E + red, 1, 1, R)[0], R)
    moves = plan_moves(cur, new, R)
    assert len(moves) == moved_slots(cur, new) > 0
    assert torch.equal(apply(cur, moves), new)
    S = (E + red) // R
    for m in moves:
        assert cur[m.layer, m.dst] != new[m.layer, m.dst] and cur[m.layer, m.src] == new[m.layer, m.dst]
        local = [s for s in range(E + red) if cur[m.layer, s] == new[m.layer, m.dst] and s // S == m.dst // S]
        if local:                                        # a replica on the destination rank: a local copy
            assert m.src // S == m.dst // S
    assert plan_moves(cur, cur, R) == []
    with pytest.raises(ValueError):
        plan_moves(cur, new[:, :-1], R)


def test_plan_moves_spreads_sends_over_replicas():
    # Expert 0 has a replica on ranks 0 and 1; two slots elsewhere want it: one copy from each.
    cur = torch.tensor([[0, 1, 0, 2, 3, 4, 5, 6]])
    new = torch.tensor([[0, 1, 0, 2, 0, 4, 0, 6]])
    moves = plan_moves(cur, new, 4)
    assert sorted(m.src // 2 for m in moves) == [0, 1]


@pytest.mark.parametrize("E,R,red,G,N", [(16, 4, 4, 1, 1), (32, 8, 8, 1, 1), (32, 8, 8, 4, 2), (64, 8, 0, 1, 1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_migration_aware_same_balancedness_fewer_moves(E, R, red, G, N, seed):
    L = 4
    w0, w1 = zipf_load(L, E, 1.2, seed), zipf_load(L, E, 1.2, seed + 100)
    cur = Placement(*rebalance(w0, E + red, G, N, R))                 # serving a placement for an old load
    ref = Placement(*rebalance(w1, E + red, G, N, R))                 # the reference's plain output
    aware = Placement.from_phy2log(align_placement(cur.phy2log, ref.phy2log, R, N), E).check()
    b_ref = balancedness(w1, ref.phy2log, ref.logcnt, R)
    b_aware = balancedness(w1, aware.phy2log, aware.logcnt, R)
    assert (b_ref - b_aware).abs().max() <= 0.01
    assert moved_slots(cur.phy2log, aware.phy2log) < moved_slots(cur.phy2log, ref.phy2log)
    # Ranks never change node: each node's set of experts is one of the reference's nodes' sets.
    S = (E + red) // R
    for layer in range(L):
        ref_nodes = sorted(sorted(set(x.tolist())) for x in ref.phy2log[layer].view(N, -1))
        got_nodes = sorted(sorted(set(x.tolist())) for x in aware.phy2log[layer].view(N, -1))
        assert got_nodes == ref_nodes
        ref_ranks = sorted(sorted(x.tolist()) for x in ref.phy2log[layer].view(R, S))
        assert sorted(sorted(x.tolist()) for x in aware.phy2log[layer].view(R, S)) == ref_ranks
