"""The L3 service of the cluster: ``StorageService`` (plain logic) and ``StorageActor`` (its Ray shell).

It owns what the workers' L3 clients share:

* ``mooncake``: a real ``mooncake_master`` on the configured address (loopback by default), restarted
  when it dies (it comes back empty: AllBlocksCleared on the L3 stream), and a client whose
  segment (``capacity_bytes``) holds the pages: workers prefer it, so pages outlive their writer;
* ``file`` / ``nixl`` (POSIX): the directory and its evictor. Workers open the directory with
  ``evict=False`` (a write that would pass the cap fails instead), and the service evicts least recently
  used pages once more than ``high_water`` of the cap is used, down to ``low_water``, publishing the
  evicted pages (object names mapped back to page keys, storage/l3/index.py) on the L3 stream, so no
  consumer counts a page L3 no longer has.

``worker_config()`` is the L3Config a worker opens its store with (the connection info); ``status()``
reports capacity, use, evictions, the master's state and the workers' hit/miss/corrupt counts.

With ``kv_events`` enabled the actor is the one publisher of the L3 store on the KV-event wire
(storage/kv_events/l3_stream.py: medium DISK for the file store, EXTERNAL for Mooncake / NIXL): the L3
writes workers forward (``l3_stored``), the evictions, and AllBlocksCleared when the store comes back
empty or the cluster flush clears it (``l3_cleared``); ``kv_snapshot`` republishes what it holds for a
consumer that lost the history (the router asks). The router learns the stream from this actor at start
and from the workers' reports.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass

import ray

from actors.startup_heap import freeze_startup_heap
from storage.kv_events import (KVEventPublisher, KVEventsConfig, KVEventsEndpoint, StreamPosition, TreeEventStream,
                               WireMapping, l3_medium)
from storage.l3 import L3Config
from storage.radix.node import L3

log = logging.getLogger("strata.storage")


@dataclass(frozen=True)
class StorageConfig:
    """The storage actor's own settings (the store itself is ``engine.hicache.l3``)."""

    enabled: bool = True              # start a StorageActor when L3 is configured
    evict_interval_s: float = 1.0     # how often the evictor and the master supervisor run
    high_water: float = 0.9           # evict once this fraction of the cap is used ...
    low_water: float = 0.8            # ... down to this fraction
    num_cpus: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"storage.enabled must be a bool, got {self.enabled!r}")
        for name in ("evict_interval_s", "num_cpus"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"storage.{name} must be a positive number, got {v!r}")
        for name in ("high_water", "low_water"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"storage.{name} must be in (0, 1], got {v!r}")
        if self.low_water > self.high_water:
            raise ValueError(f"storage.low_water ({self.low_water}) must be <= high_water ({self.high_water})")


def _here(host: str) -> str:
    """``auto``: this node's IP (each process advertises where it runs; workers resolve their own)."""
    return ray.util.get_node_ip_address() if host == "auto" else host


class StorageService:
    def __init__(self, l3: L3Config, cfg: StorageConfig | None = None, log_dir: str | None = None) -> None:
        if not isinstance(l3, L3Config):
            raise ValueError(f"l3 must be an L3Config, got {type(l3).__name__}")
        self.l3, self.cfg = l3, cfg or StorageConfig()
        self.master = None
        self.client = None
        self.store = None
        self.restarts = 0
        self.evicted = 0
        self._evicted_seen = 0.0
        self._log = os.path.join(log_dir, "mooncake_master.log") if log_dir else None
        if l3.backend == "mooncake":
            from storage.l3.mooncake import MooncakeMaster
            host, port = l3.mooncake.master_addr.rsplit(":", 1)
            self.master = MooncakeMaster(host, int(port), log_path=self._log).start()
            # The service's own client contributes the L3 memory (``capacity_bytes``) and workers place
            # pages there: a Mooncake object lives in a client's segment, so pages written into a
            # worker's segment would vanish when that worker stops.
            from storage.l3.mooncake import MooncakeStore
            # Its segment is the whole ``capacity_bytes`` whatever ``segment_bytes`` (a worker's own) says.
            self.client = MooncakeStore(dataclasses.replace(
                l3, mooncake=dataclasses.replace(l3.mooncake, master_addr=self.master.addr, preferred_segment="",
                                                 segment_bytes=l3.capacity_bytes,
                                                 local_hostname=_here(l3.mooncake.local_hostname))))
        elif l3.backend == "file" or l3.nixl.mode == "posix":
            from storage.l3.file import FileStore
            # The evictor's own view of the directory (a plain file store: the bytes are the same).
            self.store = FileStore(dataclasses.replace(l3, backend="file", path=l3.resolved_path(), evict=True))
        # nixl/ucx: the slab server is its own process at nixl.remote_addr; nothing to own here.

    def worker_config(self) -> L3Config:
        """The L3Config a worker opens its store with."""
        l3 = self.l3
        if self.master is not None:
            return dataclasses.replace(l3, mooncake=dataclasses.replace(
                l3.mooncake, master_addr=self.master.addr, preferred_segment=self.client.segment_name()))
        if self.store is not None:
            return dataclasses.replace(l3, path=l3.resolved_path(), evict=False)
        return l3

    def evict(self) -> list[str]:
        """One evictor pass: the object names it removed (empty when under the high-water mark)."""
        if self.store is None:
            return []
        names = self.store.evict(self.cfg.high_water, self.cfg.low_water)
        self.evicted += len(names)
        return names

    def master_evicted(self) -> bool:
        """True when the master evicted objects since the last call (Mooncake evicts by itself when its
        segments fill; which keys it dropped is not reported, so the caller audits)."""
        if self.master is None:
            return False
        n = self.master.metrics().get("master_evicted_key_count", 0.0)
        seen, self._evicted_seen = self._evicted_seen, max(self._evicted_seen, n)
        return n > seen

    def audit(self, entries: list[tuple[str, str]], batch: int = 512) -> list[str]:
        """Names among ``entries`` ((store key, object name), the L3 stream's view) the store no longer has."""
        if self.client is None or not entries:
            return []
        gone = []
        for i in range(0, len(entries), batch):
            chunk = entries[i:i + batch]
            res = self.client.present([k for k, _ in chunk])
            if res is None:          # the master is unreachable: no verdict (a restart resets anyway)
                return gone
            gone += [name for (_, name), ok in zip(chunk, res) if not ok]
        return gone

    def supervise(self) -> bool:
        """Restart a dead mooncake_master on its address; True when it did (the store is empty again)."""
        m = self.master
        if m is None or (m.proc is not None and m.proc.poll() is None):
            return False
        log.warning("mooncake_master %s died (code %s); restarting", m.addr, m.proc.returncode if m.proc else None)
        m.start()
        self.restarts += 1
        self._evicted_seen = 0.0   # the new master counts from zero
        return True

    def status(self, worker_stats: list[dict] | None = None) -> dict:
        """Capacity, use and counts. ``worker_stats``: the workers' ``stats()["cache"]["usage"]["L3"]``."""
        # Here, not at the top: cluster/config.py imports this module for StorageConfig in processes that
        # only read the cluster's settings (the router, the launcher), which need not load the store contract.
        from storage.l3.base import STAT_KEYS
        counts = dict.fromkeys(STAT_KEYS, 0)
        for ws in worker_stats or []:
            for k in STAT_KEYS:
                counts[k] += int(ws.get(k, 0))
        out = {"backend": self.l3.backend, "capacity_bytes": self.l3.capacity_bytes, "used_bytes": None,
               "evicted_pages": self.evicted, "counts": counts, "workers": len(worker_stats or [])}
        if self.store is not None:
            self.store.refresh()   # exact use, including the workers' writes
            out.update(path=self.store.root, used_bytes=self.store.used_bytes())
        if self.master is not None:
            alive = self.master.proc is not None and self.master.proc.poll() is None
            m = self.master.metrics() if alive else {}
            out["master"] = {"addr": self.master.addr, "pid": self.master.proc.pid if self.master.proc else None,
                             "alive": alive, "restarts": self.restarts, "keys": m.get("master_key_count"),
                             "evicted_keys": m.get("master_evicted_key_count")}
            if "master_allocated_bytes" in m:
                out.update(used_bytes=int(m["master_allocated_bytes"]),
                           segments_bytes=int(m.get("master_total_capacity_bytes", 0)))
        return out

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.master is not None:
            self.master.stop()
        if self.store is not None:
            self.store.close()


@ray.remote(max_restarts=-1, max_task_retries=-1)
class StorageActor:
    """Ray shell: a thread runs the evictor and the master supervisor every ``evict_interval_s`` and
    publishes what changed on the L3 stream (evictions; "everything is gone" after a master restart)."""

    def __init__(self, l3: L3Config, cfg: StorageConfig | None = None, router: str | None = None,
                 namespace: str | None = None, kv_events: KVEventsConfig | None = None,
                 l3_model: str | None = None, served_name: str | None = None,
                 geometry: tuple[int, int] = (0, 0)) -> None:
        """``kv_events`` / ``l3_model`` (the model id the L3 keys carry) / ``served_name`` / ``geometry``
        (page size, window in tokens): the L3 publisher, when all are given and it is enabled."""
        self.service = StorageService(l3, cfg, log_dir=os.environ.get("STRATA_HOME"))
        self.kv_events = self._kv_events(l3, kv_events, l3_model, served_name, geometry)
        # The router by name, not by handle: a handle among the constructor arguments is a reference
        # Ray keeps in its object store for restarts (and logs an error about at every start); a name
        # is plain config, and a restarted actor finds the router (itself perhaps restarted) again.
        self.router = ray.get_actor(router, namespace=namespace) if router else None
        self.workers: dict = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # A (re)started actor publishes on a new stream: the router, told of it, forgets the old one's
        # pages (a restarted master is empty; the pages a surviving one holds are unknown to this stream).
        if self.router is not None and self.kv_events is not None:
            self.router.kv_events_endpoint.remote("L3", self.kv_events.stream.endpoint)
        threading.Thread(target=self._loop, name="strata-storage", daemon=True).start()
        freeze_startup_heap()

    @staticmethod
    def _kv_events(l3: L3Config, cfg: KVEventsConfig | None, l3_model: str | None, served_name: str | None,
                   geometry: tuple[int, int]):
        if cfg is None or not cfg.enabled or not l3_model or not geometry[0]:
            return None
        from storage.kv_events.l3_stream import L3EventStream
        from storage.l3.index import L3NameIndex
        host = ray.util.get_node_ip_address() if cfg.host == "auto" else cfg.host
        try:
            pub = KVEventPublisher(cfg, served_name or l3_model, host)
        except OSError as e:
            log.warning("L3: not publishing KV events: %s", e)
            return None
        page_size, window = geometry
        return L3EventStream(TreeEventStream(pub, WireMapping.of(page_size, window, {L3: l3_medium(l3.backend)})),
                             L3NameIndex(l3_model))

    def kv_events_endpoint(self) -> KVEventsEndpoint | None:
        """Where the L3 store's KV events are published (None when they are not)."""
        return self.kv_events.stream.endpoint if self.kv_events is not None else None

    def l3_stored(self, events: list) -> StreamPosition | None:
        """A worker's tree recorded these L3 writes (its L3 ``stored`` events): publish them. Returns where
        the L3 stream then stands (the worker's next report names it, so the router has them after it)."""
        if self.kv_events is None:
            return None
        with self._lock:
            self.kv_events.stored(events, time.time())
            return self.kv_events.stream.position()

    def l3_cleared(self) -> StreamPosition | None:
        """The cluster flush cleared the store (actors/flush.py); where the L3 stream then stands."""
        if self.kv_events is None:
            return None
        with self._lock:
            self.kv_events.cleared(time.time())
            return self.kv_events.stream.position()

    def kv_snapshot(self) -> StreamPosition | None:
        """Publish everything the L3 stream has said the store holds, as a snapshot (a consumer lost its
        history: the router asks); where the stream then stands."""
        if self.kv_events is None:
            return None
        with self._lock:
            self.kv_events.snapshot(time.time())
            return self.kv_events.stream.position()

    def l3_entries(self) -> list[tuple[str, str]]:
        """(store key, object name) of every L3 page the L3 stream says the store holds (what consumers of
        the wire count)."""
        if self.kv_events is None:
            return []
        with self._lock:
            return self.kv_events.names.entries()

    def _loop(self) -> None:
        while not self._stop.wait(self.service.cfg.evict_interval_s):
            try:
                self._pass()
            except Exception as e:  # noqa: BLE001 - the next pass retries
                log.warning("storage pass failed: %r", e)

    def worker_config(self) -> L3Config:
        return self.service.worker_config()

    def worker_segment(self) -> str:
        """The Mooncake segment workers should place pages in ("" without one): a restarted actor has a
        new one, and workers poll this to follow it (actors/worker.py)."""
        return self.service.client.segment_name() if self.service.client is not None else ""

    def attach(self, workers: dict) -> None:
        """The workers whose L3 counts ``status()`` sums."""
        self.workers = dict(workers)

    def _pass(self, audit: bool = False) -> dict:
        with self._lock:
            names = self.service.evict()
            restarted = self.service.supervise()
            audit = (audit or self.service.master_evicted()) and not restarted
        removed = 0
        if self.kv_events is not None:
            with self._lock:
                if audit:   # Mooncake evicted on its own: check every page the stream says it holds
                    names = names + self.service.audit(self.kv_events.names.entries())
                if names:
                    before = len(self.kv_events.names)
                    self.kv_events.evicted(names, time.time())
                    removed = before - len(self.kv_events.names)
                if restarted:
                    removed += len(self.kv_events.names)
                    self.kv_events.cleared(time.time())
        return {"evicted": len(names), "restarted": restarted, "pages_removed": removed}

    def run_once(self, audit: bool = False) -> dict:
        """One evictor/supervisor pass now (operators, tests); ``audit`` also checks every page the stream
        counts against the store. Returns what it did."""
        return self._pass(audit)

    def status(self) -> dict:
        stats = []
        for w in self.workers.values():
            try:
                st = ray.get(w.stats.remote(), timeout=30)
                stats.append(st.get("cache", {}).get("usage", {}).get("L3", {}))
            except Exception as e:  # noqa: BLE001 - a dead worker contributes nothing
                log.warning("worker stats failed: %r", e)
        with self._lock:
            return self.service.status(stats)

    def shutdown(self) -> None:
        self._stop.set()
        with self._lock:
            self.service.close()
            if self.kv_events is not None:
                self.kv_events.close()
                self.kv_events = None
