"""``NoCache``: the prefix cache of an engine that caches nothing (``enable_prefix_cache: false``).

The engine is built with either a ``HiCache`` or a ``NoCache`` and from then on calls its cache without
asking which it has, as HiCache does with its absent tiers (``NoTier``, ``NoCopier``, storage/hicache/tier.py).
It answers only the calls the engine makes on every engine (room, background work, maintenance,
introspection); matching and inserting are never asked of it: no request ever holds a hit without a
cache, and the engine commits pages only to a cache that ``keeps_pages`` (engine/kv_manager.py).

Note the difference with a ``HiCache`` built without ``HiCacheConfig`` (``hicache: null`` with the prefix
cache on): that one is the radix tree over L1, with no L2 or L3; a NoCache has no tree at all.
"""
from __future__ import annotations

import contextlib

from storage.hicache.hit import PrefixHit
from storage.hicache.tier import NoCopier


class NoCache:
    """A cache that keeps nothing: no page is ever given to it, so it has nothing to give back, to
    move, to report or to flush. Stateless (one instance may serve any number of engines)."""

    keeps_pages = False
    """Whether requests' pages may be committed to it (HiCache: True). Read at construction only."""
    l3 = None     # no L3 tier (HiCache.l3)
    offloads_to = ""   # nothing is inserted, so nothing reaches L3 (HiCache.offloads_to)
    host = None   # no L2 host pools (HiCache.host)

    def __init__(self) -> None:
        self.copier = NoCopier()

    # ---- room in L1 ------------------------------------------------------------------------------
    def reclaimable_l1(self, component: str) -> int:
        return 0

    def evict_l1(self, component: str, n_pages: int, spare_kept: bool = False) -> int:
        return 0

    def release(self, hit: PrefixHit) -> None:
        """Never reached with a real hit (none is ever made here); kept so a caller need not ask."""

    # ---- background work -------------------------------------------------------------------------
    def batched_writes(self) -> contextlib.nullcontext:
        return contextlib.nullcontext()   # nothing is ever written below L1

    def poll(self, block: bool = False) -> None:
        pass

    def prefetching(self) -> bool:
        return False

    def wait_prefetch(self, timeout: float) -> None:
        pass

    def take_events(self) -> list:
        """No tree, so no KV events: the router never learns of a page here."""
        return []

    def snapshot_events(self) -> list:
        """Nothing is held."""
        return []

    # ---- maintenance -----------------------------------------------------------------------------
    def flush(self) -> dict[str, dict[str, int]]:
        """Nothing dropped in any tier (the same answer an engine without a cache always gave)."""
        return {"L1": {}, "L2": {}, "L3": {}}

    def clear_l3(self) -> None:
        return None   # no L3 store

    def close(self) -> None:
        pass

    # ---- introspection ---------------------------------------------------------------------------
    def owners(self) -> dict[str, list[int]]:
        """No L1 page is the cache's."""
        return {}

    def check_integrity(self) -> None:
        pass

    def stats_entry(self) -> dict:
        """Engine.stats() has no ``"cache"`` entry without a cache (HiCache.stats_entry)."""
        return {}
