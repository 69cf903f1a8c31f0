"""The tier controller of one worker: the unified radix tree over the L1 pools and the L2 host pools.

It answers "how much of this sequence is cached, and where" (``match``), pins what a request borrows,
takes finished sequences in (``insert``), makes room in L1 when the scheduler runs short (``evict_l1``),
and moves pages between the tiers under the write policy:

* ``write_through``: every node is backed up to L2 when it enters the tree;
* ``write_through_selective``: once its hit count reaches ``write_through_threshold``;
* ``write_back``: only when L1 evicts it.

SWA components only ever hold a sequence's last window (the engine frees the rest as it slides), so an
SWA-aware backup moves only that window. ``swa_backup="all"`` is the SWA-oblivious baseline: every full
page backed up also takes a host SWA page, as a host pool that keeps every layer of every token would
(where the window has slid past there is no data to put in it, so it is reserved, never served).
Load-back copies L2 pages into fresh L1 pages when the request that hit them is about to run and L1
can take them with its first chunk (storage/hicache_load.py); until then the hit waits, locked. Pages
only L3 holds come from the prefetcher (storage/hicache_prefetch.py): ``prefetch_begin`` reads them into
L2 in the background while the request waits, ``prefetch_ready`` applies the prefetch policy, and
``match(..., prefetch=)`` installs what arrived after the L1/L2 prefix.
"""
from __future__ import annotations

import atexit
import weakref
from typing import Optional, Sequence

import kernels
from storage.config import HiCacheConfig
from storage.host import HostPools
from storage.pools import COMPONENTS, FULL, SWA, KVPools
from storage.radix import Freed, Node, RadixTree
from storage.radix_node import L1, L2, L3
from storage.copier import Copier, Job, LayerFuture
from storage.geometry import KVGeometry
from storage.hashing import DEFAULT_SEED, SequenceKeys
from storage.hicache_load import LoadBackOps, PrefixHit, Room


_NO_TIERS = {"L1": 0, "L2": 0, "L3": 0}   # placeholder until a hit is complete (never mutated)


class HiCache(LoadBackOps):
    def __init__(self, pools: KVPools, geom: KVGeometry, cfg: Optional[HiCacheConfig] = None,
                 seed=DEFAULT_SEED, model_id: str = "model") -> None:
        self.pools = pools
        self.cfg = cfg
        self.page_size = pools.cfg.page_size
        if geom.page_size != self.page_size:
            raise ValueError(f"hicache: geometry page_size {geom.page_size} != the pools' {self.page_size}")
        self.geom = geom
        self.has_swa = bool(pools.swa.layer_ids) and geom.has_swa
        self.tree = RadixTree(self.page_size, geom.window_pages if self.has_swa else 0,
                              seed=seed)
        self.host = HostPools(pools, cfg) if cfg is not None else None
        self.copier = Copier() if cfg is not None else None
        self._loading: dict[int, LayerFuture] = {}      # node id -> its load into L1, until polled
        self._backing_up: dict[tuple[int, str], list[int]] = {}  # (node id, component) -> L2 pages
        # swa_backup="all": full L2 page -> the host SWA page reserved beside it (freed with it)
        self._oblivious: dict[int, int] = {}
        self.l3 = None
        if cfg is not None and cfg.l3 is not None:
            from storage.hicache_l3 import L3Tier
            self.l3 = L3Tier(self, model_id)
        if self.copier is not None:
            # Finish background copies before interpreter teardown stops the store's I/O threads.
            ref = weakref.ref(self)
            atexit.register(lambda: ref() is not None and ref().close())
        self.stats = {"hit_tokens": {"L1": 0, "L2": 0, "L3": 0}, "lookup_tokens": 0,
                      "bytes": {"L1->L2": 0, "L2->L1": 0}, "pages": {"L1->L2": 0, "L2->L1": 0},
                      "evicted_pages": {"L1": 0, "L2": 0}, "hits_given_up": 0,
                      # L2 -> L1 pages of load-back: read by their request's forward, or released unread
                      "loadback": {"loaded": 0, "used": 0, "wasted": 0, "deferred": 0,
                                   "loaded_full": 0, "loaded_swa": 0}}

    @property
    def components(self) -> tuple[str, ...]:
        return COMPONENTS if self.has_swa else (FULL,)

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
        res = self.tree.match_prefix(keys, now=now)
        if res.full_l3 or res.swa_l3:
            res = self._match_l12(keys, res, now)
        if res.num_pages == 0:
            return self._count_hit(self._take_prefetch(prefetch, PrefixHit(keys=keys), now))
        # Fields given here skip the dataclass's default factories (a hit is built for every request).
        hit = PrefixHit(res.node, res.num_pages, res.l1_full, res.l1_swa, _NO_TIERS, (), [], keys)
        self._lock(hit)
        from_l2 = res.full_l2
        if from_l2 and (self.host is None or from_l2 < self.cfg.load_back_threshold_pages):
            self._drop_prefetch(prefetch)
            return self._give_up(hit)   # short L2 runs are cheaper to recompute
        if from_l2 or res.swa_l2 or self._loading:
            return self.resume(hit, now, prefetch, room)
        return self._l1_hit(hit, res, now, prefetch, room)

    def _l1_hit(self, hit: PrefixHit, res, now: float, prefetch, room: Optional[Room]) -> PrefixHit:
        """``resume`` for the common hit that is all in L1 and not being loaded (nothing to move): its
        pages straight from the match result."""
        if room is not None and not room(hit.num_pages, {}):
            self.stats["loadback"]["deferred"] += 1
            hit.deferred = True
            return hit
        m = hit.num_pages
        if self.has_swa:
            lo = m - self.tree.window_pages
            if lo > 0:
                hit.swa_pages = [None] * lo + res.l1_swa[lo:]
        else:
            hit.swa_pages = [None] * m
        hit.tokens_by_tier = {"L1": m * self.page_size, "L2": 0, "L3": 0}
        if prefetch is not None:
            hit = self._take_prefetch(prefetch, hit, now)
            self._count_hit(hit)
        else:
            self.stats["hit_tokens"]["L1"] += m * self.page_size
        if self.cfg is not None and self.cfg.write_policy == "write_through_selective":
            for nd in res.nodes:
                if nd.hit_count >= self.cfg.write_through_threshold:
                    self._backup(nd, now)
        return hit

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

    def _gather_l1(self, hit: PrefixHit, nodes, n: int) -> None:
        """Append the L1 pages of ``nodes`` (a path from the root, ``n`` pages in all) to ``hit``: every
        full page, and SWA pages only inside the last window (None before it)."""
        lo = n - self.tree.window_pages if self.has_swa else n
        for nd in nodes:
            hit.full_pages += nd.l1[FULL]
            swa = nd.l1[SWA]
            if nd.end <= lo or swa is None:
                hit.swa_pages += [None] * nd.num_pages
            else:
                cut = max(0, lo - nd.depth)
                hit.swa_pages += [None] * cut + swa[cut:]

    def _count_hit(self, hit: PrefixHit) -> PrefixHit:
        for t, v in hit.tokens_by_tier.items():
            self.stats["hit_tokens"][t] += v
        return hit

    # ---- L3 prefetch ---------------------------------------------------------------------------------
    def prefetch_begin(self, tokens: Sequence[int], max_pages: int, now: float):
        """Start fetching into L2 the part of ``tokens``' prefix that only L3 holds; a handle for
        ``prefetch_ready`` / ``match``, or None when there is nothing to fetch (or no L3)."""
        n = min(max_pages, len(tokens) // self.page_size)
        if self.l3 is None or n <= 0:
            return None
        return self.l3.prefetcher.begin(self.tree.page_keys(list(tokens[:n * self.page_size])), now)

    def prefetch_ready(self, prefetch, now: float) -> bool:
        """Whether the prefetch policy lets the request that owns ``prefetch`` start at ``now`` (seconds)."""
        return self.l3.prefetcher.ready(prefetch, now)

    def prefetch_release(self, prefetch) -> None:
        self._drop_prefetch(prefetch)

    def prefetching(self) -> bool:
        return self.l3 is not None and self.l3.prefetcher.pending()

    def wait_prefetch(self, timeout: float) -> None:
        """Block until a background L3 read finishes or ``timeout`` seconds pass (an idle step)."""
        if self.l3 is not None:
            self.l3.prefetcher.wait(timeout)

    def _take_prefetch(self, prefetch, hit: PrefixHit, now: float) -> PrefixHit:
        if prefetch is None or self.l3 is None:
            return hit
        return self.l3.prefetcher.take(prefetch, hit, now)

    def _drop_prefetch(self, prefetch) -> None:
        if prefetch is not None and self.l3 is not None:
            self.l3.prefetcher.release(prefetch)

    def _lock(self, hit: PrefixHit) -> None:
        self.tree.lock(hit.node, FULL)
        hit.locked = (FULL,)
        if self.has_swa:
            self.tree.lock(hit.node, SWA)
            hit.locked = (FULL, SWA)

    def release(self, hit: PrefixHit) -> None:
        """Unpin a hit (the request finished, was aborted or preempted)."""
        if hit.unread:
            self.stats["loadback"]["wasted"] += hit.unread
            hit.unread = 0
        for c in reversed(hit.locked):
            self.tree.unlock(hit.node, c)
        hit.locked = ()

    def _give_up(self, hit: PrefixHit) -> PrefixHit:
        self.stats["hits_given_up"] += 1
        self.release(hit)
        return PrefixHit(keys=hit.keys)

    # ---- insert ------------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], full_pages: Sequence[int], swa_pages: Sequence[Optional[int]],
               now: float, keys: Optional[SequenceKeys] = None) -> tuple[list[int], list[int]]:
        """Hand a finished sequence's whole pages to the tree. Returns (full, swa) L1 pages the caller
        still owns and must free (duplicates of pages the tree already had). ``keys``: the request's
        ``PrefixHit.keys``, so what its match already knows is not hashed again."""
        n = len(full_pages)
        if n == 0:
            return [], []
        swa = swa_pages if self.has_swa else None   # the tree copies both lists
        keys = keys.extended(tokens, n) if keys is not None else self.tree.sequence_keys(tokens, n)
        res = self.tree.insert(keys, full_pages, swa, now=now)
        if self.cfg is not None and self.cfg.write_policy == "write_through":
            for nd in res.node.path():
                self._backup(nd, now)
        return res.free_full, res.free_swa

    def insert_and_hold(self, tokens: Sequence[int], full_pages: Sequence[int],
                        swa_pages: Sequence[Optional[int]], now: float,
                        keys: Optional[SequenceKeys] = None) -> tuple[PrefixHit, list[int], list[int]]:
        """``insert`` for a request that keeps running on these pages (a prompt just prefilled): the
        inserted sequence comes back locked as a hit whose ``full_pages`` / ``swa_pages`` (the last
        window) are the tree's pages the request must read from now on, with the request's duplicates
        of them to free. So a repeat of the prompt finds it, window included, however long the first
        request then decodes."""
        n = len(full_pages)
        swa = list(swa_pages) if self.has_swa else [None] * n
        keys = keys.extended(tokens, n) if keys is not None else self.tree.sequence_keys(tokens, n)
        res = self.tree.insert(keys, list(full_pages), swa, now=now)
        hit = PrefixHit(node=res.node, num_pages=n, keys=keys)
        self._lock(hit)
        self._gather_l1(hit, res.node.path(), n)   # an insert leaves its whole path in L1
        if self.cfg is not None and self.cfg.write_policy == "write_through":
            for nd in res.node.path():
                self._backup(nd, now)
        return hit, res.free_full, res.free_swa

    # ---- L1 room -----------------------------------------------------------------------------------
    def evict_l1(self, component: str, n_pages: int) -> int:
        """Free at least ``n_pages`` L1 pages of ``component`` if the tree can; returns pages freed.
        Nodes whose backup is still in flight are pinned: when they are what stands in the way, wait
        for the copies rather than lose cached data or preempt a request."""
        write_back = self.cfg is not None and self.cfg.write_policy == "write_back"
        got = 0
        for attempt in range(2):
            freed = self.tree.evict(component, L1, n_pages - got, on_evict=self._on_evict if write_back else None)
            self._free(freed)
            got += len(freed[component, L1])
            if got >= n_pages or attempt or self.copier is None or not self.copier.num_pending:
                break
            self.copier.poll(block=True)
        self.stats["evicted_pages"]["L1"] += got
        return got

    def _on_evict(self, node: Node, component: str, tier: str) -> None:
        if tier == L1:
            self._backup_component(node, component, sync=True)

    def _free_l1(self, full: list[int], swa: list[int]) -> None:
        if full:
            self.pools.full.allocator.free(full)
        if swa:
            self.pools.swa.allocator.free(swa)

    def _free(self, freed: Freed) -> None:
        for (c, t), pages in freed.items():
            if not pages:
                continue
            if t == L1:
                self.pools.pool(c).allocator.free(pages)
            else:
                self.host.pool(c).allocator.free(pages)
                if c == FULL:
                    self._release_oblivious(pages)

    def _reserve_oblivious(self, node: Node, full_l2: list[int]) -> None:
        """SWA-oblivious backup: host SWA room beside each backed-up full page whose SWA data the tree
        no longer has (the SWA-aware backup copies the pages that still have it, as usual)."""
        if self.cfg.swa_backup != "all" or not self.has_swa or node.l1[SWA] is not None \
                or node.l2[SWA] is not None:
            return
        if not self._host_room(SWA, len(full_l2)):
            return
        for f, s in zip(full_l2, self.host.swa.allocator.alloc(len(full_l2))):
            self._oblivious[f] = s

    def _release_oblivious(self, full_l2: list[int]) -> None:
        if self._oblivious:
            room = [self._oblivious.pop(p) for p in full_l2 if p in self._oblivious]
            if room:
                self.host.swa.allocator.free(room)

    # ---- tier moves ----------------------------------------------------------------------------------
    def _backup(self, node: Node, now: float) -> None:
        for c in self.components:
            self._backup_component(node, c)

    def _backup_component(self, node: Node, c: str, sync: bool = False) -> bool:
        """Copy ``node``'s L1 data of ``c`` into fresh L2 pages (L1 -> L2). In the background unless
        ``sync`` (write-back: the L1 pages are about to be freed); the node stays locked meanwhile."""
        if self.host is None or node.l1[c] is None or node.l2[c] is not None:
            return node.l2[c] is not None
        if (node.id, c) in self._backing_up:
            if not sync:
                return True
            self.copier.poll(block=True)
            return node.l2[c] is not None
        host = self.host.pool(c)
        if not self._host_room(c, node.num_pages):
            return False
        dst = host.allocator.alloc(node.num_pages)
        if c == FULL:
            self._reserve_oblivious(node, dst)
        elif node.l2[FULL] is not None:
            self._release_oblivious(list(node.l2[FULL]))  # the real SWA copy takes the reserved room's place
        src = list(node.l1[c])
        l1 = self.pools.pool(c).flat()
        self._count("L1->L2", node.num_pages, host.page_bytes)
        if sync:
            kernels.l1_to_l2(l1, host.data, host.layout, src, dst, check=False)
            self.tree.set_l2(node, c, dst)
            if self.l3 is not None:
                self.l3.write(node, c)
            return True
        locks = (FULL, SWA) if c == SWA else (FULL,)
        for lc in locks:
            self.tree.lock(node, lc)
        self._backing_up[(node.id, c)] = dst

        def run(fut: LayerFuture) -> None:
            kernels.l1_to_l2(l1, host.data, host.layout, src, dst, check=False)

        first = node.depth  # a match may split the node meanwhile: the object keeps the lower part

        def done() -> None:
            del self._backing_up[(node.id, c)]
            for lc in reversed(locks):
                self.tree.unlock(node, lc)
            x, unused = node, list(dst)
            while fut.error is None and x is not None and x.parent is not None and not x.removed \
                    and x.depth >= first:
                part = dst[x.depth - first:x.end - first]
                if x.l2[c] is None and x.l1[c] is not None:
                    self.tree.set_l2(x, c, part)
                    unused = [p for p in unused if p not in set(part)]
                    if self.l3 is not None:
                        self.l3.write(x, c)
                x = x.parent
            host.allocator.free(unused)
            if c == FULL:
                self._release_oblivious(unused)

        fut = LayerFuture({})
        self.copier.submit(Job(run, fut, done, tag=f"backup {c}"))
        return True

    def poll(self, block: bool = False) -> None:
        """Apply finished background copies and L3 reads (call between steps); ``block`` waits for all."""
        if self.copier is not None:
            self.copier.poll(block)
        if self.l3 is not None:
            self.l3.prefetcher.jobs.poll(block)

    def _host_room(self, c: str, n: int) -> bool:
        host = self.host.pool(c)
        if not host.allocator.can_alloc(n):
            freed = self.tree.evict(c, L2, n - host.allocator.num_free)
            self.stats["evicted_pages"]["L2"] += len(freed[c, L2])
            self._free(freed)
        return host.allocator.can_alloc(n)

    def _l1_room(self, c: str, n: int) -> bool:
        alloc = self.pools.pool(c).allocator
        if not alloc.can_alloc(n):
            self.evict_l1(c, n - alloc.num_free)
        return alloc.can_alloc(n)

    def _count(self, direction: str, pages: int, page_bytes: int) -> None:
        self.stats["pages"][direction] += pages
        self.stats["bytes"][direction] += pages * page_bytes

    # ---- maintenance -----------------------------------------------------------------------------------
    def flush(self) -> None:
        """Drop every cached page of every tier (no request may hold a hit)."""
        self.poll(block=True)
        self._free(self.tree.flush())

    def close(self) -> None:
        """Finish background copies and release the L3 store (idempotent)."""
        if self.copier is not None:
            self.copier.close()
            self.copier = None
        if self.l3 is not None:
            self.l3.close()
            self.l3 = None

    def owners(self) -> dict[str, list[int]]:
        return {c: self.tree.all_pages(c, L1) for c in COMPONENTS}

    def check_integrity(self) -> None:
        self.tree.check_integrity()
        if self.host is not None:
            for c in COMPONENTS:
                pending = [p for (_, pc), pages in self._backing_up.items() if pc == c for p in pages]
                owners = {"tree": self.tree.all_pages(c, L2), "backups in flight": pending}
                if c == SWA:
                    owners["oblivious reservations"] = list(self._oblivious.values())
                if self.l3 is not None:
                    owners["L3 prefetches"] = self.l3.prefetcher.owned(c)
                self.host.pool(c).allocator.check_integrity(owners)
            live_full = set(self.tree.all_pages(FULL, L2)) | {
                p for (_, pc), pages in self._backing_up.items() if pc == FULL for p in pages}
            stray = [p for p in self._oblivious if p not in live_full]
            if stray:
                raise AssertionError(f"oblivious SWA room reserved beside freed full L2 pages {stray[:5]}")

    def usage(self) -> dict:
        out = {"L1": {c: self.tree.num_pages(c, L1) for c in COMPONENTS}}
        if self.host is not None:
            out["L2"] = {c: self.host.pool(c).allocator.num_used for c in COMPONENTS}
            out["L2_bytes"] = self.host.bytes_used()
        if self.l3 is not None:
            out["L3"] = {**self.l3.store.stats(), **self.l3.stats,
                         **{f"prefetch_{k}": v for k, v in self.l3.prefetcher.stats.items()}}
        return out
