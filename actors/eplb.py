"""The EPLB rebalancer: ``EplbRebalancer`` (the logic, no Ray, time passed in) and its Ray shell
``EplbRebalancerActor`` (named ``strata-eplb``).

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

import logging
import threading
import time
from dataclasses import dataclass, field

import ray
import torch

from engine.eplb import (EplbConfig, LoadWindow, Placement, align_placement, balancedness,
                         identity_placement, interval_counts, moved_slots, rebalance_placement,
                         should_rebalance)

log = logging.getLogger("strata.eplb")

ACTOR_NAME = "strata-eplb"
WORKERS_REFRESH_S = 5.0    # how often the rebalancer asks the router which workers there are


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
    def observe(self, readings: dict[str, dict], now: float) -> list[str]:
        """Adds one interval from the workers' readings ({"logical": [L, E], "slot_counts": [L, P],
        "phy2log": [L, P], "steps": int}, cumulative); returns the workers whose placement is not the
        current one (to push it again). An expert-parallel group's reading also carries what its ranks
        measured: "rank_counts" [L, R] (token-choice pairs each rank's experts served) and
        "rank_moe_seconds" [R] (expert compute time); those then are the rank loads, not the slot
        counters."""
        L, E, P = self.num_layers, self.num_logical, self.placement.num_physical
        load = torch.zeros(L, E, dtype=torch.int64)
        slots = torch.zeros(L, P, dtype=torch.int64)
        measured = torch.zeros(L, self.cfg.num_ranks, dtype=torch.int64)
        has_measured = False
        stale = []
        for w, r in sorted(readings.items()):
            cur = _Prev(torch.as_tensor(r["logical"]).to(torch.int64),
                        torch.as_tensor(r["slot_counts"]).to(torch.int64), int(r["steps"]))
            if cur.logical.shape != (L, E) or cur.slots.shape != (L, P):
                raise ValueError(f"worker {w}: counters {tuple(cur.logical.shape)}/{tuple(cur.slots.shape)}, "
                                 f"expected {(L, E)}/{(L, P)}")
            if "rank_counts" in r:
                cur.ranks = torch.as_tensor(r["rank_counts"]).to(torch.int64)
                if cur.ranks.shape != (L, self.cfg.num_ranks):
                    raise ValueError(f"worker {w}: rank_counts {tuple(cur.ranks.shape)}, expected "
                                     f"{(L, self.cfg.num_ranks)}")
                self.rank_moe_seconds[w] = [float(x) for x in r.get("rank_moe_seconds", [])]
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
            if not torch.equal(torch.as_tensor(r["phy2log"]).to(torch.int64), self.placement.phy2log):
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


# ------------------------------------------------------------------------------------------ Ray shell

@ray.remote(max_restarts=-1, max_task_retries=-1, max_concurrency=4)
class EplbRebalancerActor:
    """Runs ``EplbRebalancer`` on its schedule against the workers, named by id and looked up by their actor
    names in ``namespace``. Names, not handles: Ray keeps an actor's constructor arguments that hold
    handles in its creator's object store, and a restart after that creator (the launcher, a RayJob's
    driver) has gone would fail. ``router``: the router actor's name; the workers it knows (``strata
    scale`` adds and removes them) replace ``workers`` every ``WORKERS_REFRESH_S``."""

    def __init__(self, cfg: EplbConfig, workers: list[str], num_layers: int, num_logical: int,
                 namespace: str, router: str | None = None, call_timeout: float = 60.0) -> None:
        self.cfg, self.namespace, self.router, self.timeout = cfg, namespace, router, call_timeout
        self.worker_ids = list(workers)
        self.workers: dict = {}
        self._refresh_at = 0.0
        self._look_up()
        self.logic = EplbRebalancer(cfg, num_layers, num_logical, time.monotonic())
        self._lock = threading.Lock()
        self._status = self.logic.status()   # a snapshot, so status() never waits for a cycle
        self._stop = threading.Event()
        # A thread started here, so a restarted actor resumes its schedule without anyone calling it.
        threading.Thread(target=self._loop, name="strata-eplb", daemon=True).start()

    def _look_up(self) -> None:
        """The workers the router knows now (at most every WORKERS_REFRESH_S), and the handles of those not
        looked up yet (one restarting is found on a later cycle)."""
        from actors.worker import actor_name
        now = time.monotonic()
        if self.router is not None and now >= self._refresh_at:
            self._refresh_at = now + WORKERS_REFRESH_S
            try:
                st = ray.get(ray.get_actor(self.router, namespace=self.namespace).status.remote(),
                             timeout=self.timeout)
                self.worker_ids = sorted(w for w in st["workers"] if w not in st["removed"])
            except Exception as e:  # noqa: BLE001 - a restarting router: the last list stands
                log.warning("eplb: the router's workers are unknown for now: %r", e)
        for w in set(self.workers) - set(self.worker_ids):
            del self.workers[w]
        for w in self.worker_ids:
            if w not in self.workers:
                try:
                    self.workers[w] = ray.get_actor(actor_name(w), namespace=self.namespace)
                except ValueError as e:
                    log.warning("eplb: worker %s not found: %s", w, e)

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.collect_seconds):
            try:
                with self._lock:
                    self._cycle(force=False)
                    self._status = self.logic.status()
            except Exception as e:  # a worker may be restarting: try again next time
                log.warning("eplb cycle failed: %r", e)

    def _gather(self, refs: dict) -> dict:
        out = {}
        for w, ref in refs.items():
            try:
                out[w] = ray.get(ref, timeout=self.timeout)
            except Exception as e:
                log.warning("eplb: worker %s did not answer: %r", w, e)
        return out

    def _push(self, phy2log: torch.Tensor, workers: list[str]) -> dict:
        return self._gather({w: self.workers[w].apply_placement.remote(phy2log) for w in workers})

    def _cycle(self, force: bool) -> dict | None:
        self._look_up()
        self.logic.forget(set(self.logic.prev) - set(self.worker_ids))
        readings = self._gather({w: h.expert_load.remote() for w, h in self.workers.items()})
        readings = {w: r for w, r in readings.items() if r is not None}
        stale = self.logic.observe(readings, time.monotonic())
        if stale:
            self._push(self.logic.placement.phy2log, stale)
        now = time.monotonic()
        if not force and not self.logic.due(now):
            return None
        d = self.logic.plan(now, force)
        if not d.apply:
            return self.logic.skip(d)
        t = time.perf_counter()
        res = self._push(d.placement.phy2log, list(self.workers))
        seconds = time.perf_counter() - t
        log.info("eplb: %s on %d/%d workers in %.3fs", d.reason, len(res), len(self.workers), seconds)
        return self.logic.applied(d, seconds, max((r["seconds"] for r in res.values()), default=0.0),
                                  max((r["moved_slots"] for r in res.values()), default=0), len(res))

    def trigger(self) -> dict:
        """Collect and rebalance now (``strata rebalance``)."""
        with self._lock:
            report = self._cycle(force=True)
            self._status = self.logic.status()
            return report

    def status(self) -> dict:
        """The state after the last cycle (EplbRebalancer.status)."""
        return self._status

    def stop(self) -> None:
        self._stop.set()


def start_rebalancer(cfg: EplbConfig, workers, num_layers: int, num_logical: int,
                     detached: bool = False, namespace: str | None = None, name: str = ACTOR_NAME,
                     router: str | None = None):
    """Starts (or finds) the ``strata-eplb`` actor in ``namespace`` (None: the caller's); returns its
    handle. ``workers``: the worker ids (a dict's keys); ``router``: the router actor's name, whose
    workers it follows. The cluster's namespace even from a Serve app builder's task, so ``strata
    rebalance`` finds it."""
    life = {"lifetime": "detached"} if detached else {}
    ns = namespace or ray.get_runtime_context().namespace
    return EplbRebalancerActor.options(name=name, namespace=ns, num_cpus=0, get_if_exists=True,
                                       **life).remote(
        cfg, list(workers), num_layers, num_logical, ns, router)
