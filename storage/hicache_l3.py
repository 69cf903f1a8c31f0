"""The L3 side of the tier controller: write-through of L2 pages to the shared store, and installing the
pages other workers (or an earlier life of this one) left in L3 once the prefetcher
(storage/hicache_prefetch.py) has read them into L2.

Pages are keyed ``l3_key(model_id, component, page_key)``; the SWA component stores only each sequence's
last window, like L2. Reads are verified by the store (a failed read is a miss: the prefix just stops
short, never wrong tokens).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import kernels
from storage.copier import Job, LayerFuture
from storage.hicache_prefetch import Prefetcher
from storage.l3 import l3_key, make_store
from storage.pools import FULL, SWA
from storage.radix_node import L1, Node

if TYPE_CHECKING:
    from storage.hicache import HiCache, PrefixHit


class L3Tier:
    def __init__(self, cache: "HiCache", model_id: str) -> None:
        self.cache = cache
        self.store = make_store(cache.cfg.l3)
        self.model_id = model_id
        self.stats = {"written_pages": 0, "write_failures": 0, "hit_pages": 0, "read_failures": 0}
        self.prefetcher = Prefetcher(self)

    def keys(self, page_keys, component: str) -> list[str]:
        return [l3_key(self.model_id, component, k) for k in page_keys]

    # ---- L2 -> L3 ----------------------------------------------------------------------------------
    def write(self, node: Node, c: str) -> None:
        """Copy a node's L2 pages of ``c`` to L3 in the background (node pinned meanwhile)."""
        tree, host = self.cache.tree, self.cache.host.pool(c)
        if node.removed or node.l2[c] is None or node.l3[c]:
            return
        locks = (FULL, SWA) if c == SWA else (FULL,)
        for lc in locks:
            tree.lock(node, lc)
        keys = self.keys(node.keys, c)
        pages = [host.page(p) for p in node.l2[c]]
        first = node.depth
        result: list[bool] = []

        def run(fut: LayerFuture) -> None:
            result.extend(self.store.batch_set(keys, pages))

        def done() -> None:
            for lc in reversed(locks):
                tree.unlock(node, lc)
            ok = len(result) == len(keys) and all(result)
            self.stats["written_pages" if ok else "write_failures"] += len(keys)
            x = node  # a match may have split the node: mark every piece of the written range
            while ok and x is not None and x.parent is not None and not x.removed and x.depth >= first:
                if not x.l3[c]:
                    self.cache._free(tree.set_l3(x, c, True))
                x = x.parent

        self.cache.copier.submit(Job(run, LayerFuture({}), done, tag=f"l3 write {c}"))

    # ---- L3 -> L2 -> L1 ----------------------------------------------------------------------------
    def l12_depth(self, page_keys: list[bytes]) -> int:
        """Pages of ``page_keys`` whose full data the tree holds in L1 or L2 (read-only walk: no touch,
        no split): where an L3 prefetch starts."""
        tree = self.cache.tree
        cur, i = tree.root, 0
        while i < len(page_keys):
            child = cur.children.get(page_keys[i])
            if child is None or (child.l1[FULL] is None and child.l2[FULL] is None):
                break
            k = 0
            while k < child.num_pages and i + k < len(page_keys) and child.keys[k] == page_keys[i + k]:
                k += 1
            i += k
            if k < child.num_pages:
                break
            cur = child
        return i

    def install(self, hit: "PrefixHit", page_keys: list[bytes], m0: int, m: int, swa_lo: int,
                h_full: list[int], h_swa: list[int], now: float) -> "PrefixHit":
        """Extend ``hit`` (``m0`` pages, locked) to ``m`` pages with prefetched host pages: ``h_full`` hold
        the full pages [m0, m), ``h_swa`` the SWA pages [swa_lo, m) (the last window; empty on a model
        without SWA). They become the tree's L2 copies (L3 flag set) and are loaded into fresh L1 pages.
        The host pages belong to this call: used or freed. Returns the new hit, or ``hit`` unchanged
        when L1 has no room."""
        cache, tree = self.cache, self.cache.tree
        full_host, swa_host = cache.host.pool(FULL), cache.host.pool(SWA)
        n_swa = len(h_swa)
        if not (cache._l1_room(FULL, m - m0) and (not n_swa or cache._l1_room(SWA, n_swa))):
            full_host.allocator.free(h_full)
            swa_host.allocator.free(h_swa)
            return hit
        l1_full = cache.pools.full.allocator.alloc(m - m0)
        l1_swa = cache.pools.swa.allocator.alloc(n_swa) if n_swa else []
        kernels.l2_to_l1(cache.pools.full.flat(), full_host.data, full_host.layout, h_full, l1_full, check=False)
        if n_swa:
            kernels.l2_to_l1(cache.pools.swa.flat(), swa_host.data, swa_host.layout, h_swa, l1_swa, check=False)
        # Pages before m0 keep the tree's own L1 pages (never reported as duplicates); SWA pages the tree
        # does not hold in L1 below m0 are simply not offered.
        swa_all: list[Optional[int]] = list(hit.swa_pages) + [None] * (m - m0)
        for i in range(swa_lo, m):
            if i >= m0 or swa_all[i] is None:
                swa_all[i] = l1_swa[i - swa_lo]   # below m0: the tree lacked it in L1, adopt the L3 copy
        used_swa = {swa_all[i] for i in range(swa_lo, m)}
        spare_swa = [p for p in l1_swa if p not in used_swa]
        res = tree.insert(page_keys[:m], hit.full_pages + l1_full, swa_all, now=now)
        cache._free_l1(res.free_full, res.free_swa + spare_swa)
        # Record the L2 copies (the host pages just read) and the L3 flag on the nodes past m0; a node
        # that meanwhile got its own L2 copy keeps it and the prefetched page goes back.
        x, spare_full = res.node, []
        while x is not None and x.parent is not None and x.depth >= m0:
            part = h_full[x.depth - m0:x.end - m0]
            if x.l2[FULL] is None:
                tree.set_l2(x, FULL, part)
            else:
                spare_full += part
            if not x.l3[FULL]:
                cache._free(tree.set_l3(x, FULL, True))
            x = x.parent
        full_host.allocator.free(spare_full)
        x, used_h = res.node, set()
        while n_swa and x is not None and x.parent is not None and x.end > swa_lo:
            if x.depth >= swa_lo and x.l2[SWA] is None and x.l1[SWA] is not None:
                part = h_swa[x.depth - swa_lo:x.end - swa_lo]
                tree.set_l2(x, SWA, part)
                used_h.update(part)
                if not x.l3[SWA]:
                    cache._free(tree.set_l3(x, SWA, True))
            x = x.parent
        swa_host.allocator.free([p for p in h_swa if p not in used_h])
        self.stats["hit_pages"] += m - m0
        unread, hit.unread = hit.unread, 0   # the L2 loads move to the new hit, not wasted
        cache.release(hit)
        new = type(hit)(node=res.node, num_pages=m, unread=unread)
        cache._lock(new)
        new.waits = hit.waits
        new.full_pages = [p for nd in res.node.path() for p in nd.l1[FULL]]
        new.swa_pages = [None] * m
        for nd in res.node.path():
            if nd.l1[SWA] is not None:
                for i in range(nd.num_pages):
                    if nd.depth + i >= swa_lo:
                        new.swa_pages[nd.depth + i] = nd.l1[SWA][i]
        ps = cache.page_size
        new.tokens_by_tier = {**hit.tokens_by_tier, "L3": (m - m0) * ps}
        return new

    def read_pages(self, host, keys: list[str], pages: list[int]) -> int:
        """batch_get into host pages (any thread); returns how many leading pages arrived intact."""
        direct = host.layout != kernels.LAYER_FIRST
        bufs = [host.page(p) for p in pages]   # views for page-major layouts, copies for layer_first
        ok = self.store.batch_get(keys, bufs)
        n = 0
        while n < len(ok) and ok[n]:
            n += 1
        if n < len(ok):
            self.stats["read_failures"] += 1
        if not direct:
            for p, b in zip(pages[:n], bufs[:n]):
                host.set_page(p, b)
        return n

    def close(self) -> None:
        self.prefetcher.close()
        self.store.close()
