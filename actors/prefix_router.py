"""The global router's state (plain: no Ray, time passed in): the worker registry, liveness, load
bookkeeping and the prefix index, over the pure policy of actors/routing.py. PrefixRouterActor
(actors/router.py) is its Ray shell.

Cache state and load travel apart. The index is fed only by the KV-event wire (storage/kv_events/: each
worker's stream, and the L3 store's under the holder ``L3``), as the shell's subscriber delivers it
(``apply``); a stream whose history is lost (``Lost``: the publisher's replay buffer no longer holds it)
forgets that holder and asks it for a snapshot (``take_resync``). Load and liveness come in Ray reports.
Beside the index, the prompts just routed (actors/recent_routes.py) count as held by their worker until
its events can have caught up (two reports), so a prompt repeated sooner goes there too.

A worker is *live* while it reports within ``stale_after`` seconds; silent longer (dead, hung, its node
gone), what it cached is dropped and it gets no traffic until it reports again (a restart says
``fresh``). An operator or ``strata scale`` may *drain* a worker (no new requests; it stays known so
its drain can be watched) or *remove* it (forgotten, and its late reports ignored).
"""
from __future__ import annotations

from typing import NamedTuple

from typing import Iterable

from actors.recent_routes import RecentRoutes
from actors.routing import L3_WORKER, NoWorkerError, PrefixIndex, RouterConfig, local_prefill, pick_decode, route
from engine.worker_load import WorkerLoad
from storage.geometry import KVGeometry
from storage.kv_events.subscriber import Delivered, Lost, Update
from storage.kv_events.wire import CPU, CPU_PINNED, DISK, EXTERNAL, GPU, AllBlocksCleared

WORKER_TIERS = {GPU: "L1", CPU: "L1", CPU_PINNED: "L2"}
"""A worker's media (storage/kv_events/translate.worker_media): L1 as GPU (or CPU, by config), L2 pinned."""
L3_TIERS = {DISK: "L3", EXTERNAL: "L3"}


class ReportReply(NamedTuple):
    """The router's answer to a worker's report: ``ignored`` (a removed worker: nothing was recorded),
    ``resync`` (its stream lost history here: publish a snapshot)."""

    ignored: bool = False
    resync: bool = False


class Route(NamedTuple):
    """The router's choice for one prompt: its prefill worker, its decode worker (None: the prefill
    worker is colocated and decodes too), and the prompt pages it expects cached there: in all, and by
    the fastest tier holding each ("L1", "L2", "L3" -> pages). ``alone``: no other choice was open (one
    live worker of each role it names, none avoided), so the next prompt's choice is known before asking."""
    prefill: str
    decode: str | None
    cached_pages: int
    by_tier: dict[str, int]
    alone: bool = False


RESYNC_WAIT_S = 2.0
"""How long routing waits for a snapshot it asked of a live publisher (and how often it asks again)."""


class Router:
    """``ready_at``: no route before this time (a restarted router: the workers' first reports rebuild its
    index, every report interval, so it waits for them rather than route on an empty index)."""

    def __init__(self, cfg: RouterConfig, geometry: KVGeometry | None = None, stale_after: float = 10.0,
                 ready_at: float = 0.0) -> None:
        self.cfg = cfg
        self.geom = geometry or KVGeometry()
        self.index = PrefixIndex()
        self.recent = RecentRoutes(cfg.recent_reports)
        self.loads: dict[str, WorkerLoad] = {}
        self.roles: dict[str, str] = {}
        self.seen: dict[str, float] = {}
        self.removed: set[str] = set()
        self.draining: set[str] = set()
        self.dropped: set[str] = set()
        self.stale_after = stale_after
        self.decisions = 0
        self.resync: set[str] = set()    # holders whose stream lost history: not exact until a snapshot
        self.asked: dict[str, float] = {}   # holder -> when its snapshot was last asked
        self.asks: dict[str, int] = {}      # holder -> snapshots asked since it was last exact
        self.ready_at = ready_at
        self.applied = self.lost = 0     # wire events applied, gaps lost
        self.local_prefills = 0          # requests prefilled on their decode worker (no handoff)

    def needs_replay(self, worker: str) -> bool:
        """Whether the worker's stream must be read again from its start before its report counts: a
        worker dropped for silence had its pages forgotten while its stream went on."""
        return worker in self.dropped

    def forget(self, holder: str) -> int:
        """Forget what ``holder`` held (a new incarnation of its stream follows); the pages dropped."""
        self._exact(holder)
        self.recent.forget(holder)
        return self.index.drop_worker(holder)

    def _exact(self, holder: str) -> None:
        self.resync.discard(holder)
        self.asked.pop(holder, None)
        self.asks.pop(holder, None)

    def apply(self, updates: Iterable[Update]) -> None:
        """The subscriber's updates (storage/kv_events/subscriber.py), in order."""
        for u in updates:
            if u.name in self.removed:
                continue
            if isinstance(u, Delivered):
                events = u.batch.events
                if events and (isinstance(events[0], AllBlocksCleared) or isinstance(events[-1], AllBlocksCleared)):
                    self._exact(u.name)   # a snapshot (first) or a flush (last): exact again
                    self.recent.forget(u.name)
                tiers = L3_TIERS if u.name == L3_WORKER else WORKER_TIERS
                self.applied += self.index.apply_wire(u.name, events, tiers)
            elif isinstance(u, Lost):
                self.index.drop_worker(u.name)
                self.resync.add(u.name)
                self.asked.pop(u.name, None)
                self.lost += 1

    def take_resync(self, holder: str, now: float) -> bool:
        """Whether ``holder`` should publish a snapshot now: its stream lost history, and it was not asked
        in the last RESYNC_WAIT_S (a snapshot lost in turn is asked again)."""
        if holder not in self.resync or now - self.asked.get(holder, -RESYNC_WAIT_S) < RESYNC_WAIT_S:
            return False
        self.asked[holder] = now
        self.asks[holder] = self.asks.get(holder, 0) + 1
        return True

    def rebuilding(self, now: float) -> list[str]:
        """The workers routing waits for: live, and asked for their first snapshot since they lost history
        less than RESYNC_WAIT_S ago (a snapshot that does not come is not waited for again; the shared L3
        is never waited for: its loss only makes predictions lower)."""
        return sorted(h for h, t in self.asked.items() if h in self.resync and now - t < RESYNC_WAIT_S
                      and self.asks.get(h) == 1 and h in self.roles and h not in self.dropped)

    def report(self, worker: str, role: str, load: WorkerLoad, fresh: bool, now: float) -> bool:
        """A worker's load and liveness; False when ignored (a removed worker). ``fresh``: a new
        incarnation, whose cache state its stream tells again from the start."""
        if not isinstance(load, WorkerLoad):
            raise ValueError(f"report of {worker}: load must be a WorkerLoad, not {type(load).__name__}")
        if worker in self.removed:
            return False
        if fresh or worker in self.dropped:
            self.index.drop_worker(worker)
            self.recent.forget(worker)
            self.dropped.discard(worker)
        self.recent.reported(worker)
        self.loads[worker], self.roles[worker], self.seen[worker] = load, role, now
        return True

    def _sweep(self, now: float) -> None:
        for w in [w for w in self.roles if now - self.seen[w] >= self.stale_after and w not in self.dropped]:
            # Silent for too long (dead or hung): what it cached cannot be trusted any more.
            self.index.drop_worker(w)
            self.recent.forget(w)
            self.dropped.add(w)

    def live(self, roles: tuple[str, ...], now: float) -> dict[str, WorkerLoad]:
        """Loads of the live, routable workers of ``roles`` (not dropped, draining or removed)."""
        self._sweep(now)
        return {w: self.loads[w] for w, r in self.roles.items()
                if r in roles and w not in self.dropped and w not in self.removed and w not in self.draining}

    def route(self, keys: list[int], prompt_len: int, now: float, avoid: list[str] | None = None,
              local: bool = True) -> Route:
        """The prefill worker (and, for a prefill worker, the decode worker) of a prompt given its block
        ids ``keys``. ``avoid``: workers that just failed this request (used only when no other is left).
        ``local``: the request has a decode phase, and may be prefilled on its decode worker when that one
        holds nearly all of its prompt (``RouterConfig.local_prefill_tokens``; the answer then names the
        decode worker as its only worker, and is never ``alone``: it depends on the prompt).
        While the index is being rebuilt (a restart's warm-up, a first snapshot asked) it raises
        NoWorkerError, which callers retry."""
        if now < self.ready_at:
            raise NoWorkerError("the router restarted: its index is rebuilt from the workers' first reports")
        waiting = self.rebuilding(now)
        if waiting:
            raise NoWorkerError(f"the router is rebuilding its index of {', '.join(waiting)} from a snapshot")
        prefill = _avoiding(self.live(("prefill", "colocated"), now), avoid)
        by_prefix = self.cfg.policy == "prefix"    # round_robin reads neither the cache nor recent routes
        worker, ov = route(self.index, keys, prompt_len, prefill, self.cfg, self.geom, turn=self.decisions,
                           recent=self.recent.pages(keys, prefill) if by_prefix else None)
        decode, alone = None, len(prefill) == 1
        if self.roles[worker] == "prefill":
            decodes = _avoiding(self.live(("decode",), now), avoid)
            decode, alone = pick_decode(decodes), alone and len(decodes) == 1
            own = local_prefill(self.index, keys, prompt_len, decode, self.cfg, self.geom,
                                self.recent.pages(keys, (decode,)).get(decode, 0)) if local and by_prefix else None
            self.loads[decode] = self.loads[decode].routed(running=1)
            if own is not None:   # it prefills on its decode worker: no handoff
                worker, decode, ov, alone = decode, None, own, False
                self.local_prefills += 1
        if by_prefix:
            self.recent.add(worker, keys)
        # Count the request against the worker until its next report, so a burst spreads out.
        self.loads[worker] = self.loads[worker].routed(prompt_len)
        self.decisions += 1
        return Route(worker, decode, ov.pages, ov.by_tier, alone and not avoid)

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
        self._exact(worker)
        self.recent.forget(worker)
        return self.index.drop_worker(worker)

    def restore_worker(self, worker: str) -> None:
        """Undo ``remove_worker``/``drain``: its next report (which the worker marks fresh after being
        ignored) makes it routable again."""
        self.removed.discard(worker)
        self.draining.discard(worker)

    def status(self, now: float) -> dict:
        self._sweep(now)
        return {"workers": {w: {"role": self.roles[w], "load": self.loads[w].as_document(),
                                "age_s": round(now - self.seen[w], 3),
                                "live": w not in self.dropped, "draining": w in self.draining}
                            for w in self.roles},
                "indexed_pages": len(self.index), "decisions": self.decisions,
                "local_prefills": self.local_prefills, "removed": sorted(self.removed),
                "draining": sorted(self.draining), "events_applied": self.applied, "gaps_lost": self.lost,
                "resync_pending": sorted(self.resync)}


def _avoiding(live: dict[str, dict], avoid: list[str] | None) -> dict[str, dict]:
    rest = {w: v for w, v in live.items() if w not in (avoid or ())}
    return rest or live  # the only worker may have restarted: try it again


__all__ = ["NoWorkerError", "Route", "Router"]
