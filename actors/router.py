"""The Ray shell of the global prefix router (logic in actors/routing.py)."""
from __future__ import annotations

import time

import ray

from actors.routing import L3_WORKER, PrefixIndex, RouterConfig, pick_decode, route
from storage.geometry import KVGeometry


@ray.remote(max_restarts=-1, max_task_retries=-1)
class PrefixRouterActor:
    def __init__(self, cfg: RouterConfig, geometry: KVGeometry | None = None, stale_after: float = 10.0,
                 l3_model: str | None = None) -> None:
        self.cfg = cfg
        self.geom = geometry or KVGeometry()   # the workers' page size and window (from the model)
        self.index = PrefixIndex()
        self.loads: dict[str, dict] = {}
        self.roles: dict[str, str] = {}
        self.seen: dict[str, float] = {}
        self.removed: set[str] = set()
        self.dropped: set[str] = set()
        self.stale_after = stale_after
        self.decisions = 0
        self.l3_names = None          # storage/l3/index.py: L3 object names -> page keys
        if l3_model:   # a constructor argument, so a restarted router maps evicted names again
            self.set_l3_model(l3_model)

    def report(self, worker: str, role: str, events: list, load: dict, fresh: bool) -> None:
        if worker in self.removed:
            return
        if fresh or worker in self.dropped:
            self.index.drop_worker(worker)
            self.dropped.discard(worker)
        # L3 is shared: a worker's L3 writes tell everyone the store has those pages. Its "removed L3"
        # events only mean it forgot the node, not that the store dropped the pages, so they are skipped.
        self.index.apply(worker, [e for e in events if e.tier != "L3"])
        self.index.apply(L3_WORKER, [e for e in events if e.tier == "L3" and e.kind == "stored"])
        if self.l3_names is not None:
            self.l3_names.stored(events)
        self.loads[worker], self.roles[worker], self.seen[worker] = load, role, time.monotonic()

    def config(self) -> RouterConfig:
        return self.cfg

    def geometry(self) -> KVGeometry:
        return self.geom

    def report_l3(self, events: list) -> None:
        self.index.apply("L3", events)

    # ---- the L3 store's own changes (actors/storage.py) -----------------------------------------------
    def set_l3_model(self, model_id: str) -> None:
        """Name the model whose pages the L3 store holds, so evicted object names map to page keys."""
        from storage.l3.index import L3NameIndex
        if self.l3_names is None or self.l3_names.model_id != model_id:
            self.l3_names = L3NameIndex(model_id)

    def l3_evicted(self, names: list[str]) -> int:
        """The store evicted these objects: stop counting their pages. Returns the pages dropped."""
        events = self.l3_names.removed(names) if self.l3_names is not None else []
        self.index.apply(L3_WORKER, events)
        return len(events)

    def l3_entries(self) -> list[tuple[str, str]]:
        """(store key, object name) of the L3 pages the router counts, for the storage actor's audit."""
        return self.l3_names.entries() if self.l3_names is not None else []

    def l3_reset(self) -> int:
        """The store lost everything (its server restarted empty). Returns the pages dropped."""
        if self.l3_names is not None:
            self.l3_names.clear()
        return self.index.drop_worker(L3_WORKER)

    def _live(self, roles: tuple[str, ...]) -> dict[str, dict]:
        now = time.monotonic()
        for w in [w for w in self.roles if now - self.seen[w] >= self.stale_after and w not in self.dropped]:
            # Silent for too long (dead or hung): what it cached cannot be trusted any more. A restart
            # reports "fresh" and starts over.
            self.index.drop_worker(w)
            self.dropped.add(w)
        return {w: self.loads[w] for w, r in self.roles.items()
                if r in roles and w not in self.dropped and w not in self.removed}

    def route(self, keys: list[bytes], prompt_len: int, avoid: list[str] | None = None) -> dict:
        """{"prefill": worker, "decode": worker or None, "cached_pages": n, "by_tier": {...}}.
        ``keys``: the prompt's page keys (``prompt_keys``), hashed by the caller so the one router
        actor only decides. ``avoid``: workers that just failed this request (used only when no
        other worker is left)."""
        prefill = self._avoiding(self._live(("prefill", "colocated")), avoid)
        worker, ov = route(self.index, keys, prompt_len, prefill, self.cfg, self.geom, turn=self.decisions)
        decode = None
        if self.roles[worker] == "prefill":
            decode = pick_decode(self._avoiding(self._live(("decode",)), avoid))
            self.loads[decode]["running"] = self.loads[decode].get("running", 0) + 1
        # Count the request against the worker until its next report, so a burst spreads out.
        self.loads[worker]["queued_tokens"] = self.loads[worker].get("queued_tokens", 0) + prompt_len
        self.decisions += 1
        return {"prefill": worker, "decode": decode, "cached_pages": ov.pages, "by_tier": ov.by_tier}

    @staticmethod
    def _avoiding(live: dict[str, dict], avoid: list[str] | None) -> dict[str, dict]:
        rest = {w: v for w, v in live.items() if w not in (avoid or ())}
        return rest or live  # the only worker may have restarted: try it again

    def remove_worker(self, worker: str) -> int:
        """Stop routing to a worker and forget its cache (operators, tests, failure handling)."""
        self.removed.add(worker)
        self.loads.pop(worker, None)
        self.roles.pop(worker, None)
        return self.index.drop_worker(worker)

    def restore_worker(self, worker: str) -> None:
        self.removed.discard(worker)

    def status(self) -> dict:
        return {"workers": {w: {"role": self.roles[w], "load": self.loads[w],
                                "age_s": round(time.monotonic() - self.seen[w], 3)} for w in self.roles},
                "indexed_pages": len(self.index), "decisions": self.decisions, "removed": sorted(self.removed)}
