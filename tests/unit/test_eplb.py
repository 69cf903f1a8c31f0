"""EPLB placement algorithm (engine/eplb.py): invariants on random and adversarial loads, balance quality,
the hierarchical policy's node locality, the config, the load window and input validation."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.eplb import (EplbConfig, LoadWindow, Placement, _balanced_packing, _replicate, balancedness,
                         identity_placement, interval_counts, rank_loads, rebalance, rebalance_placement,
                         should_rebalance)
from tests import numerics

FAST = settings(max_examples=60, deadline=None)


def zipf(L: int, E: int, s: float, seed: int, tokens: float = 1e6) -> torch.Tensor:
    """[L, E] expected token counts, Zipf(s) over a random expert order per layer."""
    g = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
    return torch.stack([base[torch.randperm(E, generator=g)] for _ in range(L)]) * tokens / base.sum()


@st.composite
def problems(draw, hierarchical: bool | None = None):
    """(weight [L, E] int64, P, G, N, R) with valid divisibility for the requested policy."""
    N = draw(st.sampled_from([1, 2, 4]))
    ranks_per_node = draw(st.integers(1, 3))
    R = N * ranks_per_node
    if hierarchical is False:
        G = draw(st.sampled_from([g for g in (3, 5, 6, 7) if g % N])) if N > 1 else 1
    else:
        G = N * draw(st.integers(1, 3))
    gs = draw(st.integers(1, 4))
    E = G * gs
    slots_per_rank = draw(st.integers(-(-E // R), -(-E // R) + 3))
    P = R * slots_per_rank
    L = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["random", "zero", "one_hot", "equal", "zipf"]))
    if kind == "random":
        w = torch.tensor(draw(st.lists(st.integers(0, 10_000), min_size=L * E, max_size=L * E))).view(L, E)
    elif kind == "zero":
        w = torch.zeros(L, E, dtype=torch.int64)
    elif kind == "one_hot":
        w = torch.zeros(L, E, dtype=torch.int64)
        w[:, draw(st.integers(0, E - 1))] = 1_000_000
    elif kind == "equal":
        w = torch.full((L, E), 7, dtype=torch.int64)
    else:
        w = zipf(L, E, 1.2, draw(st.integers(0, 1000))).round().to(torch.int64)
    return w, P, G, N, R


# ---------------------------------------------------------------------------------------------- invariants

@FAST
@given(problems())
def test_placement_is_consistent(prob):
    w, P, G, N, R = prob
    phy2log, log2phy, logcnt = rebalance(w, P, G, N, R)
    L, E = w.shape
    assert phy2log.shape == (L, P) and logcnt.shape == (L, E) and log2phy.shape == (L, E, P - E + 1)
    Placement(phy2log, log2phy, logcnt).check()
    assert (logcnt >= 1).all() and (logcnt.sum(1) == P).all()
    # Load is only moved between ranks, never lost or created.
    loads = rank_loads(w, phy2log, logcnt, R)
    assert loads.shape == (L, R)
    numerics.assert_close(loads.sum(1), w.sum(1).to(torch.float64), n=P, depth=2, dtype=w.dtype
                          if w.dtype.is_floating_point else torch.float64, what="load moved between ranks")


@FAST
@given(problems(hierarchical=False))
def test_global_fallback_is_consistent_and_equals_one_group_one_node(prob):
    w, P, G, N, R = prob
    out = rebalance(w, P, G, N, R)
    Placement(*out).check()
    for a, b in zip(out, rebalance(w, P, 1, 1, R)):
        assert torch.equal(a, b)


@FAST
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_balanced_packing_fills_every_pack_exactly(X, packs, per_pack, seed):
    w = torch.rand(X, packs * per_pack, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    pack, pos = _balanced_packing(w, packs)
    slot = pack * per_pack + pos
    # Every (pack, position) used exactly once: equal slot counts per rank, no collisions.
    assert torch.equal(slot.sort(1).values, torch.arange(packs * per_pack).expand(X, -1))


@FAST
@given(st.lists(st.integers(0, 50), min_size=1, max_size=4), st.integers(0, 4))
def test_replication_minimises_the_largest_per_replica_load(loads, extra):
    w = torch.tensor([loads], dtype=torch.float64)
    m = len(loads)
    phy2log, cnt = _replicate(w, m + extra)
    assert torch.equal(torch.bincount(phy2log[0], minlength=m), cnt[0])
    best = min(max(l / (1 + a) for l, a in zip(loads, alloc))
               for alloc in itertools.product(range(extra + 1), repeat=m) if sum(alloc) == extra)
    assert (w / cnt).max().item() == pytest.approx(best)


def test_identity_placement_layout():
    p = identity_placement(2, 8, 4, redundant_per_rank=1).check()
    assert p.num_physical == 12 and p.num_logical == 8 and p.num_layers == 2
    assert p.phy2log[0].tolist() == [0, 1, 0, 2, 3, 1, 4, 5, 2, 6, 7, 3]
    assert p.logcnt[1].tolist() == [2, 2, 2, 2, 1, 1, 1, 1]
    assert p.log2phy[0, 0].tolist() == [0, 2, -1, -1, -1]
    assert torch.equal(identity_placement(1, 6, 3).phy2log[0], torch.arange(6))


# ---------------------------------------------------------------------------------------------- quality

@FAST
@given(st.sampled_from([(16, 4), (32, 8), (64, 8)]), st.sampled_from([0, 1, 2]),
       st.floats(1.0, 2.0), st.integers(0, 10_000), st.sampled_from([(1, 1), (4, 2)]))
def test_rebalance_beats_identity_on_skewed_loads(shape, red_per_rank, s, seed, groups_nodes):
    E, R = shape
    G, N = groups_nodes
    if N > 1:
        # The hierarchical policy never replicates across nodes, while identity's redundant slots do:
        # with redundancy the two solve different problems (and on few nodes identity can win). Without
        # it identity is itself group-local, so the comparison is fair.
        red_per_rank = 0
    w = zipf(3, E, s, seed)
    ident = identity_placement(3, E, R, red_per_rank)
    phy2log, _, logcnt = rebalance(w, ident.num_physical, G, N, R)
    after = balancedness(w, phy2log, logcnt, R)
    before = balancedness(w, ident.phy2log, ident.logcnt, R)
    # balancedness is a ratio in [0, 1] of sums over the slots: equal placements may round apart
    assert (after >= before - numerics.tolerance(torch.float64, ident.num_physical, 1.0, 2)).all(), (before, after)


@pytest.mark.parametrize("E,R,L", [(64, 8, 24), (128, 16, 24), (256, 32, 4)])
def test_zipf_with_25pct_redundancy_is_within_90pct_of_ideal(E, R, L):
    w = zipf(L, E, 1.0, seed=E)
    P = E + E // 4
    phy2log, _, logcnt = rebalance(w, P, 1, 1, R)
    got = balancedness(w, phy2log, logcnt, R)
    # A lower bound on any placement's max rank load: the mean, and the largest per-replica load, which
    # greedy replication minimises over all ways to spend the redundant slots.
    mean = w.sum(1) / R
    ideal = mean / torch.maximum(mean, (w / logcnt).max(1).values)
    assert (got >= 0.9 * ideal).all(), (got.min(), ideal.min())
    assert got.mean() > 0.95


def test_perfect_balance_where_loads_permit():
    w = torch.full((2, 16), 5)
    assert torch.equal(balancedness(w, *rebalance(w, 16, 1, 1, 4)[::2], 4), torch.ones(2, dtype=torch.float64))
    w = torch.tensor([[3, 1, 2, 2]])
    assert balancedness(w, *rebalance(w, 4, 1, 1, 2)[::2], 2).item() == 1.0
    # A hot expert spread over four ranks by replication.
    w = torch.tensor([[12, 4, 4, 4]])
    phy2log, _, logcnt = rebalance(w, 8, 1, 1, 4)
    assert logcnt.tolist() == [[4, 2, 1, 1]]
    assert balancedness(w, phy2log, logcnt, 4).item() == 1.0
    # No load at all is not an imbalance.
    z = torch.zeros(1, 8)
    assert balancedness(z, *rebalance(z, 8, 1, 1, 2)[::2], 2).item() == 1.0


@FAST
@given(problems(hierarchical=True))
def test_hierarchical_keeps_each_group_within_one_node(prob):
    w, P, G, N, R = prob
    phy2log, _, _ = rebalance(w, P, G, N, R)
    L, E = w.shape
    node_of_slot = torch.arange(P) // (P // N)
    for layer in range(L):
        group_of_slot = phy2log[layer] // (E // G)
        nodes_of_group = [set(node_of_slot[group_of_slot == g].tolist()) for g in range(G)]
        assert all(len(n) == 1 for n in nodes_of_group), nodes_of_group
        # Each node holds G / N whole groups.
        per_node = torch.bincount(torch.tensor([n.pop() for n in nodes_of_group]), minlength=N)
        assert (per_node == G // N).all()


def test_deterministic_and_dtype_independent():
    w = zipf(4, 32, 1.1, seed=3).round()
    runs = [rebalance(x, 40, 4, 2, 4) for x in (w, w.clone(), w.to(torch.int64), w.to(torch.float32))]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("args,match", [
    ((torch.ones(8), 8, 1, 1, 2), "weight"),
    ((torch.ones(0, 8), 8, 1, 1, 2), "weight"),
    ((torch.ones(2, 8), 6, 1, 1, 2), "num_replicas"),
    ((torch.ones(2, 8), 9, 1, 1, 2), "multiple of num_ranks"),
    ((-torch.ones(2, 8), 8, 1, 1, 2), "negative"),
    ((torch.full((2, 8), float("nan")), 8, 1, 1, 2), "NaN"),
    ((torch.ones(2, 8), 8, 3, 1, 2), "num_groups"),
    ((torch.ones(2, 8), 8, 4, 2, 3), "num_ranks"),
    ((torch.ones(2, 8), 8, 1, 1, 0), "num_ranks"),
    ((torch.ones(2, 8), 8, 0, 1, 2), "num_groups"),
])
def test_bad_input_raises(args, match):
    with pytest.raises(ValueError, match=match):
        rebalance(*args)


def _corrupt(p: Placement, **kw) -> Placement:
    return dataclasses.replace(p, **{k: v(getattr(p, k).clone()) for k, v in kw.items()})


def _set(idx, value):
    def f(t):
        t[idx] = value
        return t
    return f


@pytest.mark.parametrize("kw", [
    dict(phy2log=_set((0, 0), 1)),                                    # expert 0 loses its only replica
    dict(phy2log=_set((0, 0), 99)),
    dict(logcnt=lambda t: t + torch.eye(*t.shape, dtype=t.dtype)),
    dict(log2phy=_set((0, 0, 0), 1)),                                 # points at another expert's slot
    dict(log2phy=_set((0, 0, 1), 5)),                                 # more entries than logcnt
    dict(log2phy=lambda t: t[..., :-1]),
    dict(phy2log=lambda t: t[:1]),
])
def test_check_rejects_inconsistent_placements(kw):
    p = Placement(*rebalance(zipf(2, 8, 1.0, 0), 10, 1, 1, 2)).check()
    with pytest.raises(ValueError):
        _corrupt(p, **kw).check()


def test_check_rejects_duplicate_slot_in_log2phy():
    p = identity_placement(1, 4, 2, redundant_per_rank=1)               # expert 0 in slots 0 and 2
    l2p = p.log2phy.clone()
    l2p[0, 0, 1] = 0
    with pytest.raises(ValueError):
        Placement(p.phy2log, l2p, p.logcnt).check()


def test_identity_placement_errors():
    with pytest.raises(ValueError, match="multiple of num_ranks"):
        identity_placement(1, 6, 4)
    with pytest.raises(ValueError, match="redundant_per_rank"):
        identity_placement(1, 8, 4, -1)


# ------------------------------------------------------------------------------- policy, config, window

def test_should_rebalance():
    assert should_rebalance(0.5, 0.9, 0.8)
    assert not should_rebalance(0.85, 0.99, 0.8)                       # already good enough
    assert not should_rebalance(0.5, 0.5, 0.8)                         # no improvement
    assert not should_rebalance(0.5, 0.4, 0.8)
    assert should_rebalance(torch.tensor([0.5, 0.7]), torch.tensor([0.9, 0.95]), 0.8)
    with pytest.raises(ValueError, match="threshold"):
        should_rebalance(0.5, 0.9, 0.0)


def test_config_defaults_and_validation():
    cfg = EplbConfig()
    assert cfg.num_replicas(32) == 32 and 0 < cfg.threshold <= 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.window = 3
    for field, bad in [("num_redundant_experts", -1), ("num_ranks", 0), ("num_groups", 0), ("num_nodes", 3),
                       ("window", 0), ("interval_seconds", -1.0), ("interval_steps", -2), ("threshold", 1.5),
                       ("threshold", 0.0), ("num_redundant_experts", 3)]:
        kw = {"num_ranks": 2} if field in ("num_nodes", "num_redundant_experts") else {}
        with pytest.raises(ValueError, match=field):
            EplbConfig(**kw, **{field: bad})
    with pytest.raises(ValueError, match="interval"):
        EplbConfig(interval_seconds=0, interval_steps=0)


def test_config_schedule_and_placement():
    cfg = EplbConfig(num_redundant_experts=4, num_ranks=4, interval_seconds=10, interval_steps=100)
    assert not cfg.is_due(now=15.0, step=150, last_time=10.0, last_step=100)
    assert cfg.is_due(now=20.0, step=150, last_time=10.0, last_step=100)
    assert cfg.is_due(now=11.0, step=200, last_time=10.0, last_step=100)
    assert not EplbConfig(interval_seconds=0, interval_steps=5).is_due(1e9, 4, 0.0, 0)
    p = rebalance_placement(zipf(2, 16, 1.0, 1), cfg).check()
    assert p.num_physical == 20


@FAST
@given(st.integers(1, 5), st.lists(st.integers(0, 100), min_size=1, max_size=12))
def test_load_window_sums_the_last_intervals(window, values):
    w = LoadWindow(window)
    states = [w]
    for t, v in enumerate(values):
        states.append(states[-1].push(torch.full((2, 3), v), now=float(t)))
    last = states[-1]
    assert len(last) == min(window, len(values))
    assert torch.equal(last.total(), torch.full((2, 3), sum(values[-window:])))
    assert last.span() == (float(len(values) - len(last)), float(len(values) - 1))
    assert len(states[0]) == 0 and len(states[1]) == 1                 # older states untouched


def test_load_window_copies_and_validates():
    live = torch.tensor([[1, 2]])
    w = LoadWindow(2).push(live, 0.0)
    live += 10                                                          # the worker's counter keeps counting
    assert w.total().tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="shape"):
        w.push(torch.ones(1, 3), 1.0)
    with pytest.raises(ValueError, match="backwards"):
        w.push(torch.ones(1, 2), -1.0)
    with pytest.raises(ValueError, match="negative"):
        w.push(-torch.ones(1, 2), 1.0)
    with pytest.raises(ValueError, match="empty"):
        LoadWindow(3).total()
    with pytest.raises(ValueError, match="window"):
        LoadWindow(0)


def test_interval_counts():
    assert interval_counts(torch.tensor([[5, 1]]), torch.tensor([[7, 4]])).tolist() == [[2, 3]]
    # After a restart the counters start from zero: every current value is new.
    assert interval_counts(torch.tensor([[5, 1]]), torch.tensor([[2, 3]])).tolist() == [[2, 3]]
    with pytest.raises(ValueError):
        interval_counts(torch.zeros(1, 2), torch.zeros(2, 1))
