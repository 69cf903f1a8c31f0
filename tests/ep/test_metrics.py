"""The rebalancer's logic fed an EP group's reading (measured per-rank loads and MoE seconds) uses those
rank loads, and /metrics renders them per rank (no Ray: the plain classes and the gauge function)."""
from __future__ import annotations

import torch

from actors.eplb import EplbRebalancer
from actors.ingress import eplb_gauges
from actors.metrics import Metrics
from engine.eplb import EplbConfig, ExpertLoad, identity_placement


def reading(rank_counts: torch.Tensor, steps: int, secs: list[float]) -> ExpertLoad:
    L, R = rank_counts.shape
    p = identity_placement(L, 8, R, 1)
    # Cumulative logical counts consistent with the ranks': layer 0's experts 0 and 1 (rank 0) are hot.
    hot = torch.tensor([40, 40, 5, 5, 5, 5, 5, 5]) * int(rank_counts[0].sum()) // 120
    logical = torch.stack([hot, torch.full((8,), int(rank_counts[1].sum()) // 8)])
    return ExpertLoad(logical, torch.zeros(L, 12, dtype=torch.int64), p.phy2log, R, steps, rank_counts=rank_counts,
                      rank_moe_seconds=secs)


def test_measured_rank_loads_drive_balancedness_and_metrics():
    cfg = EplbConfig(num_ranks=4, num_redundant_experts=4, interval_steps=1)
    logic = EplbRebalancer(cfg, 2, 8, 0.0)
    logic.observe({"ep": reading(torch.zeros(2, 4, dtype=torch.int64), 0, [0.0] * 4)}, 1.0)
    counts = torch.tensor([[90, 10, 10, 10], [30, 30, 30, 30]])
    logic.observe({"ep": reading(counts, 5, [0.9, 0.1, 0.1, 0.1])}, 2.0)
    # Measured: layer 0 is mean/max = 30/90, layer 1 is even (the slot counters, all zero, are not used).
    assert torch.allclose(logic.current_balancedness(), torch.tensor([30 / 90, 1.0], dtype=torch.float64))
    d = logic.plan(3.0, force=True)
    assert d.apply and d.planned_moves <= d.reference_moves
    logic.applied(d, 0.1, 0.01, d.planned_moves, 1)
    text = Metrics().render(eplb_gauges(logic.status()))
    assert 'strata_ep_rank_tokens_last{rank="0"} 120' in text
    assert 'strata_ep_rank_moe_seconds_total{worker="ep",rank="0"} 0.9' in text
    assert "strata_eplb_last_moved_slots" in text and "strata_eplb_last_reference_moves" in text
