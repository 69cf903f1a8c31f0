"""The Ray shell of the global prefix router (state in actors/prefix_router.py, policy in actors/routing.py)."""
from __future__ import annotations

import time

import ray

from actors.prefix_router import Route, Router
from actors.routing import L3_WORKER, RouterConfig
from storage.geometry import KVGeometry


@ray.remote(max_restarts=-1, max_task_retries=-1)
class PrefixRouterActor:
    """Ray shell over ``Router`` (actors/prefix_router.py): reads the clock, holds the L3 name index."""

    def __init__(self, cfg: RouterConfig, geometry: KVGeometry | None = None, stale_after: float = 10.0,
                 l3_model: str | None = None) -> None:
        self.core = Router(cfg, geometry, stale_after)
        self.l3_names = None          # storage/l3/index.py: L3 object names -> page keys
        # Where each worker (and the L3 storage actor) publishes its KV events (storage/kv_events/), as they
        # tell it: for the status, so a consumer of the wire finds them. Not yet read by the index.
        self.kv_events: dict[str, dict] = {}
        if l3_model:   # a constructor argument, so a restarted router maps evicted names again
            self.set_l3_model(l3_model)

    def report(self, worker: str, role: str, events: list, load: dict, fresh: bool, flushed: bool = False) -> None:
        self.core.report(worker, role, events, load, fresh, time.monotonic(), flushed)
        if self.l3_names is not None and worker not in self.core.removed:
            self.l3_names.stored(events)
            if flushed:
                self.l3_names.clear()

    def config(self) -> RouterConfig:
        return self.core.cfg

    def geometry(self) -> KVGeometry:
        return self.core.geom

    # ---- the L3 store's own changes (actors/storage.py) -----------------------------------------------
    def set_l3_model(self, model_id: str) -> None:
        """Name the model whose pages the L3 store holds, so evicted object names map to page keys."""
        from storage.l3.index import L3NameIndex
        if self.l3_names is None or self.l3_names.model_id != model_id:
            self.l3_names = L3NameIndex(model_id)

    def l3_evicted(self, names: list[str]) -> int:
        """The store evicted these objects: stop counting their pages. Returns the pages dropped."""
        events = self.l3_names.removed(names) if self.l3_names is not None else []
        self.core.index.apply(L3_WORKER, events)
        return len(events)

    def l3_entries(self) -> list[tuple[str, str]]:
        """(store key, object name) of the L3 pages the router counts, for the storage actor's audit."""
        return self.l3_names.entries() if self.l3_names is not None else []

    def l3_reset(self) -> int:
        """The store lost everything (its server restarted empty). Returns the pages dropped."""
        if self.l3_names is not None:
            self.l3_names.clear()
        return self.core.index.drop_worker(L3_WORKER)

    # ---- routing and the registry ----------------------------------------------------------------------
    def route(self, keys: list[bytes], prompt_len: int, avoid: list[str] | None = None) -> Route:
        """``keys``: the prompt's page keys (``prompt_keys``), hashed by the caller so the one router
        actor only decides."""
        return self.core.route(keys, prompt_len, time.monotonic(), avoid)

    def drain(self, worker: str) -> bool:
        return self.core.drain(worker)

    def remove_worker(self, worker: str) -> int:
        return self.core.remove_worker(worker)

    def restore_worker(self, worker: str) -> None:
        self.core.restore_worker(worker)

    def kv_events_endpoint(self, publisher: str, endpoint) -> None:
        """``publisher`` (a worker id, or ``L3``) publishes its KV events at ``endpoint`` (a
        storage.kv_events.KVEventsEndpoint)."""
        self.kv_events[publisher] = endpoint._asdict()

    def status(self) -> dict:
        return {**self.core.status(time.monotonic()), "kv_events": dict(self.kv_events)}
