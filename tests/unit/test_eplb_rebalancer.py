"""The EPLB rebalancer's logic (actors/eplb.py EplbRebalancer) with time passed in: the schedule, skipping
under the threshold, acting above it, restarts, re-pushing to stale workers, and its status."""
from __future__ import annotations

import pytest
import torch

from actors.eplb import EplbRebalancer
from actors.ingress import eplb_gauges
from engine.eplb import EplbConfig, ExpertLoad, identity_placement
from tests import numerics

L, E, R, RED = 2, 8, 4, 4
SKEW = torch.tensor([[400, 10, 10, 10, 10, 10, 10, 10], [10, 10, 10, 10, 10, 10, 300, 200]])
EVEN = torch.full((L, E), 50)


class FakeWorker:
    """Cumulative counters as a worker's expert_load() reports them (a plain data source, no engine)."""

    def __init__(self) -> None:
        self.logical = torch.zeros(L, E, dtype=torch.int64)
        self.slots = torch.zeros(L, E + RED, dtype=torch.int64)
        self.phy2log = identity_placement(L, E, R, RED // R).phy2log
        self.steps = 0

    def run(self, load: torch.Tensor, steps: int = 1) -> "FakeWorker":
        self.logical += load
        # Each expert's load split evenly over its replicas in this worker's placement.
        cnt = torch.zeros(L, E, dtype=torch.int64).scatter_add_(1, self.phy2log, torch.ones_like(self.phy2log))
        self.slots += (load / cnt).gather(1, self.phy2log).round().to(torch.int64)
        self.steps += steps
        return self

    def reading(self) -> ExpertLoad:
        return ExpertLoad(self.logical.clone(), self.slots.clone(), self.phy2log.clone(), R, self.steps)


def cfg(**kw) -> EplbConfig:
    base = dict(num_ranks=R, num_redundant_experts=RED, window=3, interval_seconds=10.0, threshold=0.9)
    return EplbConfig(**{**base, **kw})


def test_schedule_skips_balanced_load_and_acts_on_skew():
    # Identity puts one redundant replica of experts 0..3 on the ranks: 0.8 balanced on an even load.
    rb = EplbRebalancer(cfg(threshold=0.75), L, E, now=0.0)
    w = FakeWorker()
    assert rb.plan(0.0).reason.startswith("no expert load")
    for t in (1.0, 2.0):
        assert rb.observe({"a": w.run(EVEN).reading()}, t) == []
    assert not rb.due(5.0) and rb.due(10.0)
    d = rb.plan(10.0)
    assert not d.apply and "balanced enough" in d.reason
    assert rb.skip(d)["applied"] is False and rb.skipped == 1
    assert not rb.due(15.0)               # the evaluation restarted the schedule
    for t in (16.0, 17.0, 18.0):          # the window (3) now holds only the skewed intervals
        rb.observe({"a": w.run(SKEW).reading()}, t)
    assert rb.due(20.0)
    d = rb.plan(20.0)
    assert d.apply and float(d.after.mean()) > float(d.before.mean()) and float(d.before.mean()) < 0.75
    assert int((d.placement.phy2log[0] == 0).sum()) > 1 and int((d.placement.phy2log[1] == 6).sum()) > 1
    rep = rb.applied(d, seconds=0.02, apply_seconds=0.005, moved=6, workers=1)
    assert rep["applied"] and rep["moved_slots"] == 6 and rb.rebalances == 1
    st = rb.status()
    assert st["balancedness"] == pytest.approx(d.after.tolist())
    assert st["rebalances"] == 1 and st["skipped"] == 1 and st["last_seconds"] == 0.02
    # The worker still runs the old placement: the next collection names it for a re-push.
    measured_before = rb.status()["measured_balancedness_last"]
    assert measured_before == pytest.approx(d.before.tolist(), abs=0.02)
    assert rb.observe({"a": w.run(SKEW).reading()}, 21.0) == ["a"]
    w.phy2log = d.placement.phy2log.clone()
    assert rb.observe({"a": w.run(SKEW).reading()}, 22.0) == []
    # The measured per-rank load of the last interval is what the placement promised.
    assert rb.status()["measured_balancedness_last"] == pytest.approx(d.after.tolist(), abs=0.02)
    st = rb.status()       # over the window (3): two intervals on the old placement, one on the new
    assert torch.equal(torch.tensor(st["rank_load"]), rb.rank_window.total())
    assert st["measured_balancedness"] != st["measured_balancedness_last"]
    g = eplb_gauges(rb.status())
    assert g["strata_eplb_rebalances_total"] == 1 and 'strata_eplb_rank_load|{rank="3"}' in g
    assert g['strata_eplb_balancedness|{layer="1"}'] == pytest.approx(float(d.after[1]))


def test_interval_steps_summed_over_workers_and_restarts():
    rb = EplbRebalancer(cfg(interval_seconds=0.0, interval_steps=10), L, E, now=0.0)
    a, b = FakeWorker(), FakeWorker()
    rb.observe({"a": a.run(SKEW, steps=4).reading(), "b": b.run(SKEW, steps=4).reading()}, 1.0)
    assert rb.steps == 8 and not rb.due(1e9)
    restarted = FakeWorker().run(SKEW, steps=3)          # b restarted: its counters start over
    rb.observe({"a": a.run(SKEW, steps=0).reading(), "b": restarted.reading()}, 2.0)
    assert rb.steps == 11 and rb.due(2.0)
    # Interval loads: a's delta plus the restarted worker's whole count, never a negative one.
    assert torch.equal(rb.window.entries[-1][1], SKEW * 2)
    assert rb.plan(2.0).apply


def test_a_worker_scaled_in_and_its_id_added_again_counts_from_zero():
    rb = EplbRebalancer(cfg(), L, E, now=0.0)
    a, b = FakeWorker(), FakeWorker()
    rb.observe({"a": a.run(SKEW, steps=50).reading(), "b": b.run(EVEN, steps=50).reading()}, 1.0)
    rb.forget({"b"})
    assert set(rb.prev) == {"a"}
    # a new worker under b's id that has counted more steps than the old one had: not forgotten, it would
    # read as the old one going on (its interval EVEN, 10 steps)
    b2 = FakeWorker().run(EVEN * 2, steps=60)
    rb.observe({"a": a.run(SKEW, steps=1).reading(), "b": b2.reading()}, 2.0)
    assert torch.equal(rb.window.entries[-1][1], SKEW + EVEN * 2) and rb.steps == 100 + 1 + 60
    rb.forget({"nobody"})


def test_manual_trigger_when_auto_is_off():
    rb = EplbRebalancer(cfg(auto=False, interval_seconds=0.001), L, E, now=0.0)
    w = FakeWorker()
    rb.observe({"a": w.run(SKEW).reading()}, 100.0)
    assert not rb.due(1e9)
    d = rb.plan(100.0, force=True)
    assert d.apply
    rb.applied(d, 0.0, 0.0, 0, 1)
    again = rb.plan(101.0, force=True)   # nothing better than the placement it just applied
    assert not again.apply and "no better placement" in again.reason


def test_bad_readings_and_config():
    rb = EplbRebalancer(cfg(), L, E, now=0.0)
    r = FakeWorker().run(SKEW).reading()
    with pytest.raises(ValueError, match="counters"):
        rb.observe({"a": r._replace(logical=r.logical[:, :4])}, 1.0)
    with pytest.raises(ValueError, match="must be an ExpertLoad, got dict"):
        rb.observe({"a": r._asdict()}, 1.0)
    with pytest.raises(ValueError, match="num_ranks"):
        EplbRebalancer(cfg(num_ranks=3, num_redundant_experts=3), L, E, now=0.0)
    for bad in (dict(collect_seconds=0), dict(auto="yes"), dict(dispatch="nccl")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            cfg(**bad)


def test_cluster_yaml_maps_engine_eplb():
    from cluster.config import from_text, load_config
    c = load_config("cluster/configs/eplb.yaml").engine.eplb
    assert isinstance(c, EplbConfig) and c.num_ranks == 4 and c.num_redundant_experts == 4
    assert from_text("engine: {eplb: {num_ranks: 2, auto: false}}").engine.eplb == EplbConfig(num_ranks=2, auto=False)
    assert from_text("engine: {model: strata-tiny}").engine.eplb is None
    with pytest.raises(ValueError, match="config.engine.eplb.*threshold"):
        from_text("engine: {eplb: {threshold: 2}}")
    with pytest.raises(ValueError, match="unknown keys.*ranks"):
        from_text("engine: {eplb: {ranks: 2}}")


def test_cli_rebalance_without_a_cluster(monkeypatch, capsys):
    import ray

    from cluster import cli
    assert not ray.is_initialized()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cli.main(["rebalance"]) == 2
    assert "no cluster to talk to" in capsys.readouterr().err
    assert not ray.is_initialized()


@pytest.mark.parametrize("seed", range(6))
def test_align_placement_keeps_rank_loads_and_moves_less(seed):
    from engine.eplb import Placement, align_placement, rank_loads, rebalance
    g = torch.Generator().manual_seed(seed)
    Lx, Ex, Rx, P = 3, 16, 4, 24
    cur = rebalance(torch.rand(Lx, Ex, generator=g) ** 4, P, 1, 1, Rx)[0]
    w = torch.rand(Lx, Ex, generator=g) ** 4
    new, _, cnt = rebalance(w, P, 1, 1, Rx)
    got = align_placement(cur, new, Rx)
    p = Placement.from_phy2log(got, Ex).check()
    assert torch.equal(p.logcnt, cnt)
    sort = lambda x: x.sort(-1).values  # noqa: E731
    # the same per-rank loads, summed over the slots in another order
    numerics.assert_close(sort(rank_loads(w, got, cnt, Rx)), sort(rank_loads(w, new, cnt, Rx)), n=P, depth=2,
                          dtype=w.dtype, what="rank loads")
    assert int((got != cur).sum()) <= int((new != cur).sum())
    assert torch.equal(align_placement(cur, cur, Rx), cur)         # nothing to move
    with pytest.raises(ValueError, match="shapes"):
        align_placement(cur, new[:, :20], Rx)
