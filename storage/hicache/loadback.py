"""Load-back (L2 -> L1) of a prefix hit, at the time its request is about to run.

``HiCache.match`` locks the hit and asks the caller's ``room`` whether L1 can take the pages to load
*and* what the request runs next. Only then are pages allocated (they belong to the tree at once, under
the hit's lock, so no eviction can take them back before the forward reads them); otherwise the hit
stays locked and unloaded (``deferred``) and ``resume`` asks again at the next schedule. A load for a
request that then cannot run would be evicted by the requests that do, and loaded again.

Given the tree, the L1 pools and room in them, the L2 tier, the copier and the stats it counts into
(``stats["loadback"]``: ``loaded`` (``loaded_full`` / ``loaded_swa``) per page copied L2 -> L1 for a
hit; ``used`` / ``wasted`` are the cache's, when the hit's request reads them or lets them go).
"""
from __future__ import annotations

from storage.copier import Job, LayerFuture
from storage.hicache.hit import PrefixHit
from storage.hicache.l1 import L1Space
from storage.kernels_path import transfer
from storage.pools import FULL, SWA, KVPools
from storage.radix import RadixTree
from storage.radix.node import Node


def gather_l1(hit: PrefixHit, nodes, n: int, window_pages: int) -> None:
    """Append the L1 pages of ``nodes`` (a path from the root, ``n`` pages in all) to ``hit``: every
    full page, and SWA pages only inside the last window (None before it; no window: all None)."""
    lo = n - window_pages if window_pages else n
    for nd in nodes:
        hit.full_pages += nd.l1[FULL]
        swa = nd.l1[SWA]
        if nd.end <= lo or swa is None:
            hit.swa_pages += [None] * nd.num_pages
        else:
            cut = max(0, lo - nd.depth)
            hit.swa_pages += [None] * cut + swa[cut:]


class LoadBack:
    def __init__(self, tree: RadixTree, pools: KVPools, l1: L1Space, l2, copier, stats: dict,
                 window_pages: int) -> None:
        self.tree, self.pools, self.l1, self.l2, self.copier = tree, pools, l1, l2, copier
        self.stats = stats
        self.window_pages = window_pages   # 0: no sliding layers
        self.loading: dict[int, LayerFuture] = {}      # node id -> its load into L1, until polled

    def cut_window(self, nodes: list[Node]) -> list[Node]:
        """Split the node the last window starts inside when its SWA data must be loaded, so only the
        window's pages are (the part before it is never read)."""
        if not self.window_pages or not nodes:
            return nodes
        lo = nodes[-1].end - self.window_pages
        for i, nd in enumerate(nodes):
            if nd.depth < lo < nd.end and nd.l1[SWA] is None and nd.l2[SWA] is not None:
                return nodes[:i] + [self.tree.split(nd, lo - nd.depth)] + nodes[i:]
        return nodes

    def _moves(self, nodes: list[Node]):
        """(node, component) pairs of L2-only data a hit on ``nodes`` must load: full, every node not in
        L1; SWA, the nodes reaching into the last window."""
        lo = (nodes[-1].end - self.window_pages) if nodes else 0
        for nd in nodes:   # root first: L1 holds full data only below L1 parents
            if nd.l1[FULL] is None:
                yield nd, FULL
            if self.window_pages and nd.end > lo and nd.l1[SWA] is None and nd.l2[SWA] is not None:
                yield nd, SWA

    def needs(self, nodes: list[Node]) -> dict[str, int]:
        """L1 pages per component a hit on the path ``nodes`` must load, {} when it is all in L1."""
        out: dict[str, int] = {}
        for nd, c in self._moves(nodes):
            out[c] = out.get(c, 0) + nd.num_pages
        return out

    def load(self, nodes: list[Node], hit: PrefixHit) -> bool:
        """Bring the L2-only data the match needs into L1. The pages are recorded in the tree at once;
        the copy runs in the background layer by layer and ``hit.waits`` tells the forward when each
        layer has arrived. False when some of it cannot be (the hit must be given up)."""
        moves: list[tuple[str, list[int], list[int]]] = []   # (component, L2 src, L1 dst)
        for nd, c in self._moves(nodes):
            if nd.l2[c] is None or not self.l1.room(c, nd.num_pages):
                return False  # pages already moved stay valid L1 copies in the tree
            dst = self.pools.pool(c).allocator.alloc(nd.num_pages)
            self.tree.set_l1(nd, c, dst)
            moves.append((c, list(nd.l2[c]), dst))
            self.stats["pages"]["L2->L1"] += nd.num_pages
            self.stats["bytes"]["L2->L1"] += nd.num_pages * self.l2.pool(c).page_bytes
            lb = self.stats["loadback"]
            lb["loaded"] += nd.num_pages
            lb[f"loaded_{c}"] += nd.num_pages
            hit.unread += nd.num_pages
        if not moves:
            return True
        comps = sorted({c for c, _, _ in moves})
        fut = LayerFuture({c: len(self.pools.pool(c).layer_ids) for c in comps})
        locks = tuple(hit.locked)
        for c in locks:  # the copy keeps its own pin: the request may be aborted before it ends
            self.tree.lock(hit.node, c)
        node, loaded = hit.node, [nd.id for nd in nodes]
        # In the model's layer order, so the forward's first layer is the first to arrive.
        order = sorted((lid, c, slot) for c in comps for slot, lid in enumerate(self.pools.pool(c).layer_ids))

        def run(f: LayerFuture) -> None:
            for _, c, slot in order:
                host, l1 = self.l2.pool(c), self.pools.pool(c).flat()
                for mc, src, dst in moves:
                    if mc == c:
                        transfer.l2_to_l1(l1, host.data, host.layout, src, dst, layer=slot, check=False)
                f.set_layer(c, slot)

        def done() -> None:
            for c in reversed(locks):
                self.tree.unlock(node, c)
            for i in loaded:
                if self.loading.get(i) is fut:
                    del self.loading[i]

        for i in loaded:
            self.loading[i] = fut
        self.copier.submit(Job(run, fut, done, tag="load", memory=True))
        hit.waits.append(fut)
        return True

    def waits(self, nodes: list[Node]) -> list[LayerFuture]:
        """Loads still running into ``nodes``."""
        return [f for f in (self.loading.get(nd.id) for nd in nodes) if f is not None and not f.done]
