"""The EPLB rebalancer's logic: ``EplbRebalancer`` (no Ray, time passed in). Its Ray shell,
``EplbRebalancerActor`` (named ``strata-eplb``), is actors/eplb_actor.py.

Every ``collect_seconds`` the shell reads each worker's cumulative expert counters; the logic turns two
reads into one interval's load (``interval_counts``: a worker restart resets its counters), sums the
workers and keeps the last ``window`` intervals (``LoadWindow``). When a rebalance is due (every
``interval_seconds`` or ``interval_steps`` forward passes summed over workers, if ``auto``) or asked for
(``trigger``, i.e. ``strata rebalance``), it computes a placement on the window's load and applies it
only when the current balancedness is under ``threshold`` and the new one is better; the shell then
pushes it to every worker, which swaps weights between two steps. A worker whose placement differs from
the current one (it restarted) gets the current placement again at the next collection.

Shapes: L layers, E logical experts, P physical slots, R ranks (EplbConfig.num_ranks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.eplb import (EplbConfig, ExpertLoad, LoadWindow, Placement, align_placement, balancedness,
                         identity_placement, interval_counts, moved_slots, rebalance_placement,
                         should_rebalance)


@dataclass
class Decision:
    """One evaluation: whether to apply ``placement``; balancedness per layer [L] of the current
    placement (before) and of the new one (after) on the window's load."""
    apply: bool
    reason: str
    placement: Placement | None
    before: torch.Tensor
    after: torch.Tensor
    planned_moves: int = 0         # slots this placement changes
    reference_moves: int = 0       # ... and those the placement algorithm's plain output would change

    def report(self, seconds: float = 0.0, moved_slots: int = 0, workers: int = 0) -> dict:
        return {"applied": self.apply, "reason": self.reason, "before": self.before.tolist(),
                "after": self.after.tolist(), "seconds": seconds, "moved_slots": moved_slots,
                "workers": workers, "planned_moves": self.planned_moves,
                "reference_moves": self.reference_moves}


@dataclass
class _Prev:
    logical: torch.Tensor
    slots: torch.Tensor
    steps: int
    ranks: torch.Tensor | None = None


@dataclass
class EplbRebalancer:
    """The rebalancer's state and decisions; every method takes ``now`` (seconds, caller's clock)."""
    cfg: EplbConfig
    num_layers: int
    num_logical: int
    now: float
    placement: Placement = field(init=False)
    window: LoadWindow = field(init=False)

    def __post_init__(self) -> None:
        c = self.cfg
        if self.num_logical % c.num_ranks:
            raise ValueError(f"eplb.num_ranks ({c.num_ranks}) must divide the model's {self.num_logical} experts")
        self.placement = identity_placement(self.num_layers, self.num_logical, c.num_ranks,
                                            c.num_redundant_experts // c.num_ranks)
        self.window = LoadWindow(c.window)
        self.prev: dict[str, _Prev] = {}
        self.steps = 0                         # forward passes, summed over workers
        self.last_time, self.last_step = float(self.now), 0
        R = c.num_ranks
        self.rank_load = torch.zeros(self.num_layers, R, dtype=torch.int64)   # last interval, measured
        self.rank_window = LoadWindow(c.window)                                # ... and the last window
        self.rank_moe_seconds: dict[str, list[float]] = {}     # EP groups: expert seconds per rank
        self.measured = False                                    # rank loads measured by EP ranks
        self.rebalances = self.skipped = 0
        self.last_seconds = self.total_seconds = self.last_apply_seconds = 0.0
        self.last: dict | None = None
        self.last_applied: dict | None = None

    # ---- observing -----------------------------------------------------------------------------
    def observe(self, readings: dict[str, ExpertLoad], now: float) -> list[str]:
        """Adds one interval from the workers' readings (engine/eplb.py ``ExpertLoad``, cumulative); returns
        the workers whose placement is not the current one (to push it again). Where an expert-parallel
        group's reading carries what its ranks measured (``rank_counts``, ``rank_moe_seconds``), those are
        the rank loads, not the slot counters."""
        L, E, P = self.num_layers, self.num_logical, self.placement.num_physical
        load = torch.zeros(L, E, dtype=torch.int64)
        slots = torch.zeros(L, P, dtype=torch.int64)
        measured = torch.zeros(L, self.cfg.num_ranks, dtype=torch.int64)
        has_measured = False
        stale = []
        for w, r in sorted(readings.items()):
            if not isinstance(r, ExpertLoad):
                raise ValueError(f"worker {w}: a reading must be an ExpertLoad, got {type(r).__name__}")
            cur = _Prev(torch.as_tensor(r.logical).to(torch.int64), torch.as_tensor(r.slot_counts).to(torch.int64),
                        int(r.steps))
            if cur.logical.shape != (L, E) or cur.slots.shape != (L, P):
                raise ValueError(f"worker {w}: counters {tuple(cur.logical.shape)}/{tuple(cur.slots.shape)}, "
                                 f"expected {(L, E)}/{(L, P)}")
            if r.rank_counts is not None:
                cur.ranks = torch.as_tensor(r.rank_counts).to(torch.int64)
                if cur.ranks.shape != (L, self.cfg.num_ranks):
                    raise ValueError(f"worker {w}: rank_counts {tuple(cur.ranks.shape)}, expected "
                                     f"{(L, self.cfg.num_ranks)}")
                self.rank_moe_seconds[w] = [float(x) for x in r.rank_moe_seconds or []]
            prev = self.prev.get(w)
            if prev is None or cur.steps < prev.steps:   # new, or restarted: it counted all since start
                prev = _Prev(torch.zeros_like(cur.logical), torch.zeros_like(cur.slots), 0)
            if cur.ranks is not None:
                has_measured = True
                measured += interval_counts(prev.ranks if prev.ranks is not None else torch.zeros_like(cur.ranks),
                                            cur.ranks)
            load += interval_counts(prev.logical, cur.logical)
            slots += interval_counts(prev.slots, cur.slots)
            self.steps += cur.steps - prev.steps
            self.prev[w] = cur
            if not torch.equal(torch.as_tensor(r.phy2log).to(torch.int64), self.placement.phy2log):
                stale.append(w)
        self.window = self.window.push(load, now)
        self.measured = has_measured
        self.rank_load = measured if has_measured else slots.view(L, self.cfg.num_ranks, -1).sum(-1)
        self.rank_window = self.rank_window.push(self.rank_load, now)
        return stale

    def forget(self, workers: set[str]) -> None:
        """Drops what was kept of ``workers`` (scaled in): one of their ids added again starts from zero."""
        for w in workers:
            self.prev.pop(w, None)
            self.rank_moe_seconds.pop(w, None)

    def due(self, now: float) -> bool:
        return self.cfg.auto and self.cfg.is_due(now, self.steps, self.last_time, self.last_step)

    # ---- deciding ------------------------------------------------------------------------------
    def current_balancedness(self) -> torch.Tensor:
        """Per layer [L] of the current placement on the window's load (1.0 with no load yet); with an
        EP group's measured rank loads (since the last placement change), those."""
        if self.measured and len(self.rank_window) and int(self.rank_window.total().sum()) > 0:
            return _balance(self.rank_window.total())
        if not len(self.window):
            return torch.ones(self.num_layers, dtype=torch.float64)
        p = self.placement
        return balancedness(self.window.total(), p.phy2log, p.logcnt, self.cfg.num_ranks)

    def plan(self, now: float, force: bool = False) -> Decision:
        """Evaluates a rebalance now. ``force`` (a manual trigger) skips the threshold, not the need for
        a better placement. Either way the schedule restarts from ``now``."""
        self.last_time, self.last_step = float(now), self.steps
        before = self.current_balancedness()
        if not len(self.window) or int(self.window.total().sum()) == 0:
            return Decision(False, "no expert load recorded yet", None, before, before)
        new = rebalance_placement(self.window.total(), self.cfg)
        reference_moves = moved_slots(self.placement.phy2log, new.phy2log)
        if self.cfg.migration_aware:
            # Same rank loads, fewer weights to move: keep experts where they already are when possible.
            new = Placement.from_phy2log(align_placement(self.placement.phy2log, new.phy2log, self.cfg.num_ranks,
                                                         self.cfg.num_nodes), self.num_logical)
        after = balancedness(self.window.total(), new.phy2log, new.logcnt, self.cfg.num_ranks)
        b, a = float(before.mean()), float(after.mean())
        if force:
            ok, why = a > b, f"no better placement (balancedness {b:.3f})"
        else:
            ok = should_rebalance(before, after, self.cfg.threshold)
            why = (f"balanced enough ({b:.3f} >= threshold {self.cfg.threshold})" if b >= self.cfg.threshold
                   else f"no better placement (balancedness {b:.3f})")
        if not ok:
            return Decision(False, why, None, before, before)
        return Decision(True, f"balancedness {b:.3f} -> {a:.3f}", new, before, after,
                        moved_slots(self.placement.phy2log, new.phy2log), reference_moves)

    def applied(self, d: Decision, seconds: float, apply_seconds: float, moved: int, workers: int) -> dict:
        """Records a placement pushed to the workers (``seconds``: the whole push; ``apply_seconds``:
        the slowest worker's weight swap)."""
        self.placement = d.placement
        self.rank_window = LoadWindow(self.cfg.window)    # measured under the old placement
        self.rebalances += 1
        self.last_seconds, self.last_apply_seconds = seconds, apply_seconds
        self.total_seconds += seconds
        self.last = self.last_applied = d.report(seconds, moved, workers)
        return self.last

    def skip(self, d: Decision) -> dict:
        self.skipped += 1
        self.last = d.report()
        return self.last

    def status(self) -> dict:
        """Balancedness per layer of the current placement on the window's logical load, and the load
        each rank really served (from the slot counters) over the window and in the last interval."""
        cur = self.current_balancedness()
        window = self.rank_window.total() if len(self.rank_window) else self.rank_load
        return {
            "auto": self.cfg.auto, "num_ranks": self.cfg.num_ranks,
            "num_physical": self.placement.num_physical, "steps": self.steps,
            "window_intervals": len(self.window),
            "rebalances": self.rebalances, "skipped": self.skipped,
            "last_seconds": self.last_seconds, "last_apply_seconds": self.last_apply_seconds,
            "total_seconds": self.total_seconds,
            "balancedness": cur.tolist(), "balancedness_mean": float(cur.mean()),
            "balancedness_min": float(cur.min()),
            "rank_load": window.tolist(), "rank_load_total": window.sum(0).tolist(),
            "measured_balancedness": _balance(window).tolist(),
            "rank_load_last": self.rank_load.tolist(), "measured_balancedness_last": _balance(self.rank_load).tolist(),
            "rank_moe_seconds": {w: list(v) for w, v in sorted(self.rank_moe_seconds.items())},
            "phy2log": self.placement.phy2log.tolist(), "last": self.last, "last_applied": self.last_applied,
        }


def _balance(rank_load: torch.Tensor) -> torch.Tensor:
    """Mean / max over ranks per layer of rank_load [L, R] (1.0 for a layer with no load)."""
    rl = rank_load.to(torch.float64)
    mx = rl.max(1).values
    return torch.where(mx > 0, rl.mean(1) / mx.clamp_min(1e-300), torch.ones_like(mx))
