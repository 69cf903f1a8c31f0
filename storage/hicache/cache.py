"""The tier controller of one worker: the unified radix tree over the L1 pools, the L2 host tier and
the L3 store.

It answers "how much of this sequence is cached, and where" (``match``), pins what a request borrows,
takes finished sequences in (``insert``), makes room in L1 when the scheduler runs short (``evict_l1``),
and moves pages between the tiers under the write policy (storage/hicache/write.py). It composes
objects that each get their collaborators in their constructor -- ``L1Space`` (room in L1), the L2
tier (``HostTier``, or ``NoTier`` without L2), the L3 tier (``L3Tier`` or ``NoTier``), ``LoadBack``
(L2 -> L1) -- and only assembles hits from what they return.

Load-back copies L2 pages into fresh L1 pages when the request that hit them is about to run and L1 can
take them with its first chunk; until then the hit waits, locked. Pages only L3 holds come from the
prefetcher: ``prefetch_begin`` reads them into L2 in the background while the request waits,
``prefetch_ready`` applies the prefetch policy, and ``match(..., prefetch=)`` installs what arrived
after the L1/L2 prefix.
"""
from __future__ import annotations

import atexit
import weakref
from typing import Optional, Sequence

from storage.config import HiCacheConfig
from storage.copier import Copier
from storage.geometry import KVGeometry
from storage.hashing import DEFAULT_SEED
from storage.sequence_keys import SequenceKeys
from storage.hicache.hit import NO_TIERS, PrefixHit, Room
from storage.hicache.host_tier import HostTier
from storage.hicache.install import install
from storage.hicache.l1 import L1Space
from storage.hicache.l3_tier import L3Tier
from storage.hicache.loadback import LoadBack, gather_l1
from storage.hicache.tier import NoCopier, NoTier, free_pages
from storage.hicache.write import write_policy
from storage.l3 import make_store
from storage.pools import COMPONENTS, FULL, SWA, KVPools
from storage.radix import RadixTree
from storage.radix.node import L1, L3, Node


class HiCache:
    keeps_pages = True
    """Requests' pages are committed to it (storage/hicache/no_cache.py: NoCache keeps none)."""

    def __init__(self, pools: KVPools, geom: KVGeometry, cfg: Optional[HiCacheConfig] = None,
                 seed=DEFAULT_SEED, model_id: str = "model", eviction: str = "lru",
                 host_tier: type[HostTier] = HostTier) -> None:
        """``host_tier``: the L2 tier built when ``cfg`` asks for L2 (a bench builds its baseline's
        subclass through it, bench/swa_oblivious.py)."""
        self.pools = pools
        self.cfg = cfg
        self.page_size = pools.cfg.page_size
        if geom.page_size != self.page_size:
            raise ValueError(f"hicache: geometry page_size {geom.page_size} != the pools' {self.page_size}")
        self.geom = geom
        self.has_swa = bool(pools.swa.layer_ids) and geom.has_swa
        wp = geom.window_pages if self.has_swa else 0
        self.tree = RadixTree(self.page_size, wp, seed=seed, eviction=eviction)
        self._components = COMPONENTS if self.has_swa else (FULL,)
        # match_prefix(lock=True) takes SWA iff the tree has a window: the same locks as _lock.
        self._fused_lock = bool(wp) == self.has_swa
        self.stats = {"hit_tokens": {"L1": 0, "L2": 0, "L3": 0}, "lookup_tokens": 0,
                      "bytes": {"L1->L2": 0, "L2->L1": 0}, "pages": {"L1->L2": 0, "L2->L1": 0},
                      "evicted_pages": {"L1": 0, "L2": 0}, "hits_given_up": 0,
                      # L2 -> L1 pages of load-back: read by their request's forward, or released unread
                      "loadback": {"loaded": 0, "used": 0, "wasted": 0, "deferred": 0,
                                   "loaded_full": 0, "loaded_swa": 0}}
        self.copier = Copier(device=pools.full.kv.device) if cfg is not None else NoCopier()
        self._l2 = NoTier() if cfg is None else \
            host_tier(self.tree, pools, cfg, self.copier, self.components, self.stats)
        self._l3 = NoTier() if cfg is None or cfg.l3 is None else \
            L3Tier(make_store(cfg.l3), cfg.l3, model_id, self.tree, self._l2, self.copier, wp, self.page_size)
        self._write = write_policy(cfg, self._l2, self._l3, self.components)
        self._l1 = L1Space(self.tree, pools, self._l2, self.copier, self.stats, self._write.on_evict)
        self._load = LoadBack(self.tree, pools, self._l1, self._l2, self.copier, self.stats, wp)
        self._closed = False
        if cfg is not None:
            # Finish background copies before interpreter teardown stops the store's I/O threads.
            ref = weakref.ref(self)
            atexit.register(lambda: ref() is not None and ref().close())

    @property
    def components(self) -> tuple[str, ...]:
        return self._components

    @property
    def host(self):
        """The L2 host pools (HostPools), or None without L2."""
        return self._l2.pools if self._l2.present else None

    @property
    def offloads_to(self) -> str:
        """The L3 store (``L3Store.location``) every sequence inserted is written through to, or "" (not
        write_through, no L3, or a store that cannot name itself)."""
        return self._l3.store.location if self._write.offloads_inserts and self._l3.present else ""

    @property
    def l3(self) -> Optional[L3Tier]:
        """The L3 tier (store, stats, prefetcher), or None without L3."""
        return self._l3 if self._l3.present else None

    # ---- lookups ---------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], max_pages: int, now: float, prefetch=None,
              room: Optional[Room] = None) -> PrefixHit:
        """Longest usable cached prefix of ``tokens`` (at most ``max_pages`` pages), loaded into L1 and
        locked. L3 pages come only from ``prefetch`` (``prefetch_begin``), which a completed match consumes.

        ``room(num_pages, needs)``: whether L1 can take the ``needs`` pages ({component: n}) the L2 part of
        a ``num_pages`` hit must be loaded into, on top of what its request runs next. When it says no,
        nothing is loaded: the hit comes back ``deferred`` (locked, so it stays put) and ``resume``
        retries when the scheduler may run the request again; ``prefetch`` is left to the caller. Loading
        only then means pages are never loaded for a request that cannot run, evicted, and loaded again.
        Without ``room``, a hit that cannot be brought into L1 is given up (the request recomputes it)."""
        ps = self.page_size
        n = min(max_pages, len(tokens) // ps)
        self.stats["lookup_tokens"] += n * ps
        if n <= 0:
            self._drop_prefetch(prefetch)
            return PrefixHit()
        keys = self.tree.sequence_keys(tokens, n)
        # The common hit (nothing only in L3) is locked by the match itself, in the same pass.
        res = self.tree.match_prefix(keys, now=now, lock=self._fused_lock)
        locked = self._fused_lock
        if locked and (res.full_l3 or res.swa_l3 or res.num_pages == 0):
            self._unlock(res.node, self._components)
            locked = False
        if res.full_l3 or res.swa_l3:
            res = self._match_l12(keys, res, now)
        if res.num_pages == 0:
            return self._count_hit(self._take_prefetch(prefetch, PrefixHit(keys=keys), now))
        # Fields given here skip the dataclass's default factories (a hit is built for every request).
        hit = PrefixHit(res.node, res.num_pages, res.l1_full, res.l1_swa, NO_TIERS, (), [], keys)
        if locked:
            hit.locked = self._components
        else:
            self._lock(hit)
        from_l2 = res.full_l2
        if from_l2 and not self._l2.worth_loading(from_l2):
            self._drop_prefetch(prefetch)
            return self._give_up(hit)   # short L2 runs are cheaper to recompute
        if from_l2 or res.swa_l2 or self._load.loading:
            return self.resume(hit, now, prefetch, room)
        return self._l1_hit(hit, res, now, prefetch, room)

    def _l1_hit(self, hit: PrefixHit, res, now: float, prefetch, room: Optional[Room]) -> PrefixHit:
        """``resume`` for the common hit that is all in L1 and not being loaded (nothing to move): its
        pages straight from the match result."""
        if room is not None and not room(hit.num_pages, {}):
            self.stats["loadback"]["deferred"] += 1
            hit.deferred = True
            return hit
        m = hit.num_pages   # hit.swa_pages is the match's l1_swa: the window's pages, None before it
        hit.tokens_by_tier = {"L1": m * self.page_size, "L2": 0, "L3": 0}
        if prefetch is not None:
            hit = self._take_prefetch(prefetch, hit, now)
            self._count_hit(hit)
        else:
            self.stats["hit_tokens"]["L1"] += m * self.page_size
        self._write.hit(res.nodes)
        return hit

    def resume(self, hit: PrefixHit, now: float, prefetch=None, room: Optional[Room] = None) -> PrefixHit:
        """Complete a locked hit: load its L2 part into L1 if ``room`` allows (else it stays, or comes
        back, ``deferred``), assemble its page lists, then take what ``prefetch`` brought from L3. A hit
        all in L1 asks ``room`` too: its request waits holding it rather than matching it again at
        every schedule (and losing it to eviction meanwhile)."""
        nodes = self._load.cut_window(hit.node.path())   # afresh: inserts may have split it while it waited
        needs = self._load.needs(nodes)
        if room is not None and not room(hit.num_pages, needs):
            if not hit.deferred:
                self.stats["loadback"]["deferred"] += 1
            hit.deferred = True
            return hit
        hit.deferred = False
        from_l1 = sum(nd.num_pages for nd in nodes if nd.l1[FULL] is not None)
        if not self._load.load(nodes, hit):
            self._drop_prefetch(prefetch)
            return self._give_up(hit)
        hit.waits += self._load.waits(nodes)
        hit.full_pages, hit.swa_pages = [], []   # from the path as it is now (loads included)
        gather_l1(hit, nodes, hit.num_pages, self.tree.window_pages)
        ps = self.page_size
        hit.tokens_by_tier = {"L1": from_l1 * ps, "L2": (hit.num_pages - from_l1) * ps, "L3": 0}
        hit = self._take_prefetch(prefetch, hit, now)
        self._count_hit(hit)
        self._write.hit(nodes)
        return hit

    def load_needs(self, nodes: list[Node]) -> dict[str, int]:
        """L1 pages per component a hit on the path ``nodes`` must load ({} when it is all in L1)."""
        return self._load.needs(nodes)

    def reclaimable_l1(self, component: str) -> int:
        """L1 pages of ``component`` the tree would give back if asked (held by unlocked nodes)."""
        return self._l1.reclaimable(component)

    def mark_read(self, hit: PrefixHit) -> None:
        """A forward of the hit's request ran: the pages loaded for it served their purpose."""
        if hit.unread:
            self.stats["loadback"]["used"] += hit.unread
            hit.unread = 0

    def _match_l12(self, keys: list[bytes], res, now: float):
        """Cut a match short of its first page that only L3 holds (full, or SWA inside the last window):
        those come from the L3 prefetcher, not from the tree."""
        wp = self.tree.window_pages
        while res.num_pages and (res.full_l3 or res.swa_l3):
            m = res.num_pages
            bad = [nd.depth for nd in res.nodes if nd.best_tier(FULL) == L3
                   or (wp and nd.end > m - wp and nd.best_tier(SWA) == L3)]
            res = self.tree.match_prefix(keys[:min(bad)], now=now) if min(bad) else type(res)(node=self.tree.root)
        return res

    def _count_hit(self, hit: PrefixHit) -> PrefixHit:
        for t, v in hit.tokens_by_tier.items():
            self.stats["hit_tokens"][t] += v
        return hit

    # ---- L3 prefetch ---------------------------------------------------------------------------------
    def prefetch_begin(self, tokens: Sequence[int], max_pages: int, now: float):
        """Start fetching into L2 the part of ``tokens``' prefix that only L3 holds; a handle for
        ``prefetch_ready`` / ``match``, or None when there is nothing to fetch (or no L3)."""
        n = min(max_pages, len(tokens) // self.page_size)
        if n <= 0 or not self._l3.present:
            return None
        return self._l3.begin(self.tree.page_keys(list(tokens[:n * self.page_size])), now)

    def prefetch_ready(self, prefetch, now: float) -> bool:
        """Whether the prefetch policy lets the request that owns ``prefetch`` start at ``now`` (seconds)."""
        return self._l3.ready(prefetch, now)

    def prefetch_release(self, prefetch) -> None:
        self._drop_prefetch(prefetch)

    def prefetching(self) -> bool:
        return self._l3.busy()

    def wait_prefetch(self, timeout: float) -> None:
        """Block until a background L3 read finishes or ``timeout`` seconds pass (an idle step)."""
        self._l3.wait(timeout)

    def _take_prefetch(self, prefetch, hit: PrefixHit, now: float) -> PrefixHit:
        got = self._l3.take(prefetch, hit.num_pages) if prefetch is not None else None
        if got is None:
            return hit
        done = install(self.tree, self.pools, self._l1, self._l2, hit, prefetch.keys, got, now)
        if done is None:
            return hit
        self._l3.taken(got.m - got.m0)
        unread, hit.unread = hit.unread, 0   # the L2 loads move to the new hit, not wasted
        self.release(hit)
        new = PrefixHit(node=done.node, num_pages=got.m, full_pages=done.full_pages, swa_pages=done.swa_pages,
                        unread=unread, waits=hit.waits, keys=None)
        self._lock(new)
        new.tokens_by_tier = {**hit.tokens_by_tier, "L3": (got.m - got.m0) * self.page_size}
        return new

    def _drop_prefetch(self, prefetch) -> None:
        if prefetch is not None:
            self._l3.release(prefetch)

    # ---- pins ----------------------------------------------------------------------------------------
    def _lock(self, hit: PrefixHit) -> None:
        for c in self._components:   # full before SWA (a SWA lock needs the full one)
            self.tree.lock(hit.node, c)
        hit.locked = self._components

    def _unlock(self, node, components) -> None:
        for c in reversed(components):
            self.tree.unlock(node, c)

    def release(self, hit: PrefixHit) -> None:
        """Unpin a hit (the request finished, was aborted or preempted)."""
        if hit.unread:
            self.stats["loadback"]["wasted"] += hit.unread
            hit.unread = 0
        self._unlock(hit.node, hit.locked)
        hit.locked = ()

    def _give_up(self, hit: PrefixHit) -> PrefixHit:
        self.stats["hits_given_up"] += 1
        self.release(hit)
        return PrefixHit(keys=hit.keys)

    # ---- insert ------------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], full_pages: Sequence[int], swa_pages: Sequence[Optional[int]],
               now: float, keys: Optional[SequenceKeys] = None, keep_end: bool = True,
               checkpoints: Sequence[int] = (), boundaries: Sequence[int] = (),
               offloaded: int = 0) -> tuple[list[int], list[int]]:
        """Hand a finished sequence's whole pages to the tree. Returns (full, swa) L1 pages the caller
        still owns and must free (duplicates of pages the tree already had). ``keys``: the request's
        ``PrefixHit.keys``, so what its match already knows is not hashed again. ``keep_end``,
        ``checkpoints`` and ``boundaries``: the windows the tree keeps (RadixTree.insert). ``offloaded``:
        leading pages another worker's cache offloads to L3 (WritePolicy.inserted)."""
        n = len(full_pages)
        if n == 0:
            return [], []
        swa = swa_pages if self.has_swa else None   # the tree copies both lists
        keys = keys.extended(tokens, n) if keys is not None else self.tree.sequence_keys(tokens, n)
        res = self.tree.insert(keys, full_pages, swa, now=now, keep_end=keep_end, checkpoints=checkpoints,
                               boundaries=boundaries)
        self._write.inserted(res.node, offloaded)
        return res.free_full, res.free_swa

    def insert_and_hold(self, tokens: Sequence[int], full_pages: Sequence[int],
                        swa_pages: Sequence[Optional[int]], now: float,
                        keys: Optional[SequenceKeys] = None, keep_end: bool = True,
                        checkpoints: Sequence[int] = (), boundaries: Sequence[int] = (),
                        offloaded: int = 0) -> tuple[PrefixHit, list[int], list[int]]:
        """``insert`` for a request that keeps running on these pages (a prompt just prefilled): the
        inserted sequence comes back locked as a hit whose ``full_pages`` / ``swa_pages`` (the last
        window) are the tree's pages the request must read from now on, with the request's duplicates
        of them to free. So a repeat of the prompt finds it, window included, however long the first
        request then decodes."""
        n = len(full_pages)
        swa = list(swa_pages) if self.has_swa else [None] * n
        keys = keys.extended(tokens, n) if keys is not None else self.tree.sequence_keys(tokens, n)
        res = self.tree.insert(keys, list(full_pages), swa, now=now, keep_end=keep_end, checkpoints=checkpoints,
                               boundaries=boundaries)
        hit = PrefixHit(node=res.node, num_pages=n, keys=keys)
        self._lock(hit)
        gather_l1(hit, res.node.path(), n, self.tree.window_pages)   # an insert leaves its whole path in L1
        self._write.inserted(res.node, offloaded)
        return hit, res.free_full, res.free_swa

    # ---- L1 room and background work ---------------------------------------------------------------
    def evict_l1(self, component: str, n_pages: int, spare_kept: bool = False) -> int:
        """Free at least ``n_pages`` L1 pages of ``component`` if the tree can; returns pages freed.
        ``spare_kept``: SWA interior pages only (RadixTree.evict)."""
        return self._l1.evict(component, n_pages, spare_kept)

    def batched_writes(self):
        """A context in which the write policy's background backups of inserted (or hit) nodes are gathered
        and made when it ends, as one copy per component and one L3 batch (storage/hicache/write.py).
        The engine's step holds one around its commits."""
        return self._write.batched()

    def poll(self, block: bool = False) -> None:
        """Apply finished background copies and L3 reads (call between steps); ``block`` waits for all."""
        self.copier.poll(block)
        self._l3.poll(block)

    # ---- maintenance -----------------------------------------------------------------------------------
    def flush(self) -> dict[str, dict[str, int]]:
        """Drop every page the tree holds in L1 and L2 and its L3 marks (no request may hold a hit); the
        L3 store itself is shared and kept (``clear_l3``). Returns the pages dropped per tier and component
        (L3: the pages the tree knew the store held)."""
        self.poll(block=True)      # background L2/L3 writes land first, so none lands after the flush
        l3 = dict.fromkeys(COMPONENTS, 0)
        stack = list(self.tree.root.children.values())
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            for c in COMPONENTS:
                l3[c] += len(x.keys) if x.l3[c] else 0
        freed = self.tree.flush()
        free_pages(freed, self.pools, self._l2)
        out = {t: {c: len(freed[c, t]) for c in COMPONENTS} for t in (L1, "L2")}
        return {**out, L3: l3}

    def clear_l3(self) -> int | None:
        """Empty this model's namespace of the L3 store (None without L3); objects removed, -1 unknown."""
        return self._l3.clear()

    def close(self) -> None:
        """Finish background copies and release the L3 store (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.copier.close()
        self._l3.close()
        self._l3 = NoTier()

    def owners(self) -> dict[str, list[int]]:
        return {c: self.tree.all_pages(c, L1) for c in COMPONENTS}

    def take_events(self) -> list:
        """The tree's KV events since the last call, oldest first (RadixTree.take_events)."""
        return self.tree.take_events()

    def snapshot_events(self) -> list:
        """Everything the tree holds, as ``stored`` events (RadixTree.snapshot_events)."""
        return self.tree.snapshot_events()

    def check_integrity(self) -> None:
        self.tree.check_integrity()
        self._l2.check_integrity(self._l3.owners)

    def usage(self) -> dict:
        return {"L1": {c: self.tree.num_pages(c, L1) for c in COMPONENTS}, **self._l2.usage(), **self._l3.usage()}

    def stats_entry(self) -> dict:
        """The ``"cache"`` entry of Engine.stats(): the counters and what each tier holds."""
        return {"cache": {**self.stats, "usage": self.usage()}}
