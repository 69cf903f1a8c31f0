"""The EPLB rebalancer's Ray shell: ``EplbRebalancerActor`` (named ``strata-eplb``) runs ``EplbRebalancer``
(actors/eplb.py) on its schedule, and ``start_rebalancer`` starts it.

No torch here: Ray loads an actor's class in every process that gets a handle to it (the launcher that
starts it, `strata rebalance`, an ingress replica reading its status for /metrics), and none of those runs
a tensor operation. The logic, which does, is imported where the actor runs."""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    import torch

    from engine.config import EplbConfig

log = logging.getLogger("strata.eplb")

ACTOR_NAME = "strata-eplb"
WORKERS_REFRESH_S = 5.0    # how often the rebalancer asks the router which workers there are


@ray.remote(max_restarts=-1, max_task_retries=-1, max_concurrency=4)
class EplbRebalancerActor:
    """Runs ``EplbRebalancer`` on its schedule against the workers, named by id and looked up by their actor
    names in ``namespace``. Names, not handles: Ray keeps an actor's constructor arguments that hold
    handles in its creator's object store, and a restart after that creator (the launcher, a RayJob's
    driver) has gone would fail. ``router``: the router actor's name; the workers it knows (``strata
    scale`` adds and removes them) replace ``workers`` every ``WORKERS_REFRESH_S``."""

    def __init__(self, cfg: EplbConfig, workers: list[str], num_layers: int, num_logical: int,
                 namespace: str, router: str | None = None, call_timeout: float = 60.0) -> None:
        from actors.eplb import EplbRebalancer   # torch: in this process only
        self.cfg, self.namespace, self.router, self.timeout = cfg, namespace, router, call_timeout
        self.worker_ids = list(workers)
        self.workers: dict = {}
        self.absent: set[str] = set()   # workers missing or silent since they were last said to be
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
                             timeout=min(self.timeout, 10.0))
                self.worker_ids = sorted(w for w in st["workers"] if w not in st["removed"])
            except Exception as e:  # noqa: BLE001 - a restarting router: the last list stands
                log.warning("eplb: the router's workers are unknown for now: %r", e)
        for w in set(self.workers) - set(self.worker_ids):
            del self.workers[w]
        self.absent &= set(self.worker_ids)
        for w in self.worker_ids:
            if w not in self.workers:
                try:
                    self.workers[w] = ray.get_actor(actor_name(w), namespace=self.namespace)
                except ValueError as e:
                    self._gone(w, f"not found: {e}")

    def _gone(self, w: str, why: str) -> None:
        # Once per absence: a worker restarting or not yet made would otherwise log on every collection.
        if w not in self.absent:
            self.absent.add(w)
            log.warning("eplb: worker %s %s (not said again until it answers)", w, why)

    def _back(self, w: str) -> None:
        if w in self.absent:
            self.absent.discard(w)
            log.warning("eplb: worker %s answers again", w)

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
                self._gone(w, f"did not answer: {e!r}")
                if isinstance(e, ray.exceptions.ActorDiedError):
                    self.workers.pop(w, None)   # looked up by name again: a worker made anew under it
            else:
                self._back(w)
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
        return self.logic.applied(d, seconds, max((r.seconds for r in res.values()), default=0.0),
                                  max((r.moved_slots for r in res.values()), default=0), len(res))

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
