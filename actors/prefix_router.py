"""The global router's state (plain: no Ray, time passed in): the worker registry, liveness, load
bookkeeping and the prefix index, over the pure policy of actors/routing.py. PrefixRouterActor
(actors/router.py) is its Ray shell.

A worker is *live* while it reports within ``stale_after`` seconds; silent longer (dead, hung, its node
gone), what it cached is dropped and it gets no traffic until it reports again (a restart says
``fresh``). An operator or ``strata scale`` may *drain* a worker (no new requests; it stays known so
its drain can be watched) or *remove* it (forgotten, and its late reports ignored).
"""
from __future__ import annotations

from typing import NamedTuple

from actors.routing import L3_WORKER, NoWorkerError, PrefixIndex, RouterConfig, pick_decode, route
from storage.geometry import KVGeometry


class Route(NamedTuple):
    """The router's choice for one prompt: its prefill worker, its decode worker (None: the prefill
    worker is colocated and decodes too), and the prompt pages it expects cached there: in all, and by
    the fastest tier holding each ("L1", "L2", "L3" -> pages)."""
    prefill: str
    decode: str | None
    cached_pages: int
    by_tier: dict[str, int]


class Router:
    def __init__(self, cfg: RouterConfig, geometry: KVGeometry | None = None, stale_after: float = 10.0) -> None:
        self.cfg = cfg
        self.geom = geometry or KVGeometry()
        self.index = PrefixIndex()
        self.loads: dict[str, dict] = {}
        self.roles: dict[str, str] = {}
        self.seen: dict[str, float] = {}
        self.removed: set[str] = set()
        self.draining: set[str] = set()
        self.dropped: set[str] = set()
        self.stale_after = stale_after
        self.decisions = 0

    def report(self, worker: str, role: str, events: list, load: dict, fresh: bool, now: float,
               flushed: bool = False) -> None:
        """``flushed``: the worker flushed every tier, and the cluster's flush cleared L3 (or will, before
        anyone is admitted again), after these events: forget what it held and every L3 page."""
        if worker in self.removed:
            return
        if fresh or worker in self.dropped:
            self.index.drop_worker(worker)
            self.dropped.discard(worker)
        # L3 is shared: a worker's L3 writes tell everyone the store has those pages. Its "removed L3"
        # events only mean it forgot the node, not that the store dropped the pages, so they are skipped.
        self.index.apply(worker, [e for e in events if e.tier != "L3"])
        self.index.apply(L3_WORKER, [e for e in events if e.tier == "L3" and e.kind == "stored"])
        if flushed:
            self.index.drop_worker(worker)
            self.index.drop_worker(L3_WORKER)
        self.loads[worker], self.roles[worker], self.seen[worker] = load, role, now

    def _sweep(self, now: float) -> None:
        for w in [w for w in self.roles if now - self.seen[w] >= self.stale_after and w not in self.dropped]:
            # Silent for too long (dead or hung): what it cached cannot be trusted any more.
            self.index.drop_worker(w)
            self.dropped.add(w)

    def live(self, roles: tuple[str, ...], now: float) -> dict[str, dict]:
        """Loads of the live, routable workers of ``roles`` (not dropped, draining or removed)."""
        self._sweep(now)
        return {w: self.loads[w] for w, r in self.roles.items()
                if r in roles and w not in self.dropped and w not in self.removed and w not in self.draining}

    def route(self, keys: list[bytes], prompt_len: int, now: float, avoid: list[str] | None = None) -> Route:
        """The prefill worker (and, for a prefill worker, the decode worker) of a prompt given its page
        ``keys``. ``avoid``: workers that just failed this request (used only when no other is left)."""
        prefill = _avoiding(self.live(("prefill", "colocated"), now), avoid)
        worker, ov = route(self.index, keys, prompt_len, prefill, self.cfg, self.geom, turn=self.decisions)
        decode = None
        if self.roles[worker] == "prefill":
            decode = pick_decode(_avoiding(self.live(("decode",), now), avoid))
            self.loads[decode]["running"] = self.loads[decode].get("running", 0) + 1
        # Count the request against the worker until its next report, so a burst spreads out.
        self.loads[worker]["queued_tokens"] = self.loads[worker].get("queued_tokens", 0) + prompt_len
        self.decisions += 1
        return Route(worker, decode, ov.pages, ov.by_tier)

    def drain(self, worker: str) -> bool:
        """No new requests for ``worker`` (scale-in); it keeps reporting so its drain can be watched."""
        known = worker in self.roles
        self.draining.add(worker)
        return known

    def remove_worker(self, worker: str) -> int:
        """Stop routing to a worker and forget its cache (operators, tests, failure handling)."""
        self.removed.add(worker)
        self.draining.discard(worker)
        self.loads.pop(worker, None)
        self.roles.pop(worker, None)
        self.seen.pop(worker, None)
        self.dropped.discard(worker)
        return self.index.drop_worker(worker)

    def restore_worker(self, worker: str) -> None:
        """Undo ``remove_worker``/``drain``: its next report (which the worker marks fresh after being
        ignored) makes it routable again."""
        self.removed.discard(worker)
        self.draining.discard(worker)

    def status(self, now: float) -> dict:
        self._sweep(now)
        return {"workers": {w: {"role": self.roles[w], "load": self.loads[w], "age_s": round(now - self.seen[w], 3),
                                "live": w not in self.dropped, "draining": w in self.draining}
                            for w in self.roles},
                "indexed_pages": len(self.index), "decisions": self.decisions, "removed": sorted(self.removed),
                "draining": sorted(self.draining)}


def _avoiding(live: dict[str, dict], avoid: list[str] | None) -> dict[str, dict]:
    rest = {w: v for w, v in live.items() if w not in (avoid or ())}
    return rest or live  # the only worker may have restarted: try it again


__all__ = ["NoWorkerError", "Route", "Router"]
