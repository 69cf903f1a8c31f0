"""The Ray shell of the global prefix router (state in actors/prefix_router.py, policy in actors/routing.py).

It holds the router's end of the KV-event wire: a ``KVEventSubscriber`` (storage/kv_events/subscriber.py)
following every worker's stream and the L3 store's. A worker's report names its stream and the last seq it
published (``StreamPosition``), and, once it wrote to L3, the L3 stream's position after its writes; the
report returns only when the index holds every batch up to those seqs, so a route asked after a report
sees everything the worker published before it. A restarted router starts empty: the first report of each
worker makes it follow that stream from seq 0 (the replay), and a stream whose replay no longer reaches
back answers ``resync`` (the worker then publishes a snapshot of its tree); the L3 store is asked by name.

``route`` and ``report`` have two doors: the Ray method, and the route channel (actors/route_channel.py),
a ZMQ ROUTER on this node that a thread of this actor serves, which the ingress replicas route through and
the workers report through (a Ray call costs ~1 ms of round trip and ~0.3 ms of CPU each side; the
decision ~0.05 ms). The Ray methods run one at a time on Ray's thread, the channel's on its own: one lock
guards the state (``core`` and ``feed``) for both, held only while the state is read or changed, never
across a Ray call. A restarted router binds anew:
``route_endpoint`` says where, and callers that lost the old one ask again.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import ray

from actors.prefix_router import ReportReply, Route, Router
from actors.route_channel import RouteServer
from actors.routing import L3_WORKER, Overlap, RouterConfig
from actors.startup_heap import freeze_startup_heap
from engine.worker_load import WorkerLoad
from storage.geometry import KVGeometry
from storage.kv_events.publisher import KVEventsEndpoint, StreamPosition
from storage.kv_events.subscriber import KVEventSubscriber

log = logging.getLogger("strata.router")

REPLAY_LIMIT = 512
"""A stream followed anew (a restarted router, a worker back) is replayed from seq 0 only when it has
published fewer batches than this; a longer one is rebuilt from a snapshot (one batch) instead."""

RESTART_WARMUP_S = 0.25
"""A restarted router routes nothing for this long: every worker reports (every 50 ms by default) and its
stream is replayed, or its snapshot asked, meanwhile."""


@ray.remote(max_restarts=-1, max_task_retries=-1)
class PrefixRouterActor:
    """Ray shell over ``Router`` (actors/prefix_router.py): reads the clock, owns the wire's subscriber.
    ``storage``: the L3 storage actor's name, asked for a snapshot when the L3 stream's history is lost.
    ``host``: the address the route channel binds and advertises (None: this node's IP as Ray knows it)."""

    def __init__(self, cfg: RouterConfig, geometry: KVGeometry | None = None, stale_after: float = 10.0,
                 storage: str | None = None, host: str | None = None) -> None:
        ctx = ray.get_runtime_context()
        # A restart: routes wait (the caller retries) until the workers' first reports rebuilt the index.
        warmup = RESTART_WARMUP_S if ctx.was_current_actor_reconstructed else 0.0
        self._lock = threading.Lock()
        self.core = Router(cfg, geometry, stale_after, ready_at=time.monotonic() + warmup)
        self.feed = KVEventSubscriber()
        self.storage = storage
        self.namespace = ctx.namespace
        try:
            self.channel: RouteServer | None = RouteServer(host or ray.util.get_node_ip_address(), self.route,
                                                           self.report)
        except Exception as e:  # noqa: BLE001 - routes and reports still go over Ray: slower, not wrong
            log.warning("no route channel (routes and reports go over Ray only): %s", e)
            self.channel = None
        freeze_startup_heap()

    def route_endpoint(self) -> str | None:
        """Where the route channel listens (None: it could not bind; ask ``route`` over Ray)."""
        return self.channel.endpoint if self.channel is not None else None

    def report(self, worker: str, role: str, load: WorkerLoad, fresh: bool, stream: Optional[StreamPosition] = None,
               l3: Optional[StreamPosition] = None) -> ReportReply:
        """A worker's load and liveness, and where its KV events (and the L3 store's) stand. The catch-up's
        short wait for batches still on their way (the subscriber's ``wait_s``) is under the lock, as the
        route that follows a report must see them."""
        with self._lock:
            replay = fresh or self.core.needs_replay(worker)
            if not self.core.report(worker, role, load, fresh, time.monotonic()):
                return ReportReply(ignored=True)
            updates = []
            if stream is not None:
                new = self.feed.follow(worker, stream.endpoint)
                if new or replay:
                    self.feed.restart(worker)
                    self.core.forget(worker)
                    if stream.seq >= REPLAY_LIMIT:   # a long history: its snapshot is cheaper than its replay
                        updates += self.feed.skip(worker, stream.seq + 1)
                updates += self.feed.catch_up(worker, stream.seq)
            if l3 is not None:
                updates += self._follow_l3(l3.endpoint, l3.seq)
            self.core.apply(updates)
            now = time.monotonic()
            ask_l3 = self._l3_snapshot_due(now)
            reply = ReportReply(resync=self.core.take_resync(worker, now))
        if ask_l3:
            self._ask_l3_snapshot()
        return reply

    def _follow_l3(self, endpoint: KVEventsEndpoint, seq: int) -> list:
        if self.feed.follow(L3_WORKER, endpoint):
            self.core.forget(L3_WORKER)   # a new L3 publisher: the store restarted (empty) or is new here
        return self.feed.catch_up(L3_WORKER, seq)

    def _l3_snapshot_due(self, now: float) -> bool:
        """Under the lock: whether to ask the L3 store for a snapshot (asked after the lock is let go)."""
        return self.storage is not None and self.core.take_resync(L3_WORKER, now)

    def _ask_l3_snapshot(self) -> None:
        try:
            ray.get_actor(self.storage, namespace=self.namespace).kv_snapshot.remote()
        except ValueError as e:   # not there (yet): the next loss asks again
            log.warning("cannot ask the L3 store for a snapshot: %s", e)

    def sync(self) -> None:
        """Apply whatever the streams delivered so far (operators, tests; reports do it anyway)."""
        with self._lock:
            self.core.apply(self.feed.poll())
            ask_l3 = self._l3_snapshot_due(time.monotonic())
        if ask_l3:
            self._ask_l3_snapshot()

    def overlaps(self, keys: list[int], workers: list[str] | None = None, window: bool = True) -> dict[str, Overlap]:
        """Read-only: per worker (the live prefill and colocated ones by default), the cached prefix of a
        prompt's block ids that the index holds: SWA-exact (``window``), or full pages alone as a full-only
        indexer counts them. Decides nothing and counts no load."""
        with self._lock:
            if workers is None:
                workers = [w for w, r in self.core.roles.items() if r in ("prefill", "colocated")]
            return self.core.index.overlap_all(keys, list(workers), self.core.geom.window_pages if window else 0)

    def indexed_blocks(self, holder: str) -> dict[str, dict[str, list[int]]]:
        """Read-only: the block ids the index holds for ``holder`` (a worker, or ``L3``), by tier and
        component: for audits against the holder's own tree (WorkerActor.cached_blocks)."""
        out: dict[str, dict[str, list[int]]] = {}
        with self._lock:
            for tier in ("L1", "L2", "L3"):
                for comp, full in (("full", True), ("swa", False)):
                    got = self.core.index.blocks(holder, tier, full)
                    if got:
                        out.setdefault(tier, {})[comp] = sorted(got)
        return out

    def config(self) -> RouterConfig:
        return self.core.cfg

    def geometry(self) -> KVGeometry:
        return self.core.geom

    # ---- routing and the registry ----------------------------------------------------------------------
    def route(self, keys: list[int], prompt_len: int, avoid: list[str] | None = None, local: bool = True) -> Route:
        """``keys``: the prompt's block ids (``prompt_blocks``), hashed by the caller so the one router
        actor only decides (``local``: Router.route's). While a snapshot it asked is due, it reads the
        streams first (the snapshot may be waiting on the socket) and raises NoWorkerError if still
        rebuilding (callers retry).
        Called by Ray and by the route channel's thread."""
        with self._lock:
            now = time.monotonic()
            if self.core.rebuilding(now):
                self.core.apply(self.feed.poll())
            return self.core.route(keys, prompt_len, now, avoid, local)

    def drain(self, worker: str) -> bool:
        with self._lock:
            return self.core.drain(worker)

    def remove_worker(self, worker: str) -> int:
        with self._lock:
            self.feed.unfollow(worker)
            return self.core.remove_worker(worker)

    def restore_worker(self, worker: str) -> None:
        with self._lock:
            self.core.restore_worker(worker)

    def kv_events_endpoint(self, publisher: str, endpoint: KVEventsEndpoint) -> None:
        """``publisher`` (the L3 store: ``L3``) publishes its KV events at ``endpoint``: follow it. Workers
        name theirs in every report."""
        if publisher == L3_WORKER:
            with self._lock:
                self.core.apply(self._follow_l3(endpoint, -1))

    def status(self) -> dict:
        with self._lock:
            followed = self.feed.followed()
            return {**self.core.status(time.monotonic()),
                    "kv_events": {name: ep._asdict() for name, ep in followed.items()},
                    "kv_events_feed": {**self.feed.stats()._asdict(),
                                       "next_seq": {name: self.feed.next_seq(name) for name in followed}},
                    "route_channel": {"endpoint": self.route_endpoint(),
                                      "answered": self.channel.answered if self.channel is not None else 0,
                                      "reports": self.channel.reports if self.channel is not None else 0}}
