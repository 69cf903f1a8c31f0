"""Load-back (L2 -> L1) of a prefix hit, at the time its request is about to run.

A mixin only to keep storage/hicache.py short: it works on HiCache's state (tree, pools, host, copier,
stats, ``_loading``) and has no meaning on its own.

When: ``HiCache.match`` locks the hit and asks the caller's ``room`` whether L1 can take the pages to
load *and* what the request runs next. Only then are pages allocated (they belong to the tree at once,
under the hit's lock, so no eviction can take them back before the forward reads them); otherwise the
hit stays locked and unloaded (``deferred``) and ``resume`` asks again at the next schedule. A load
for a request that then cannot run would be evicted by the requests that do, and loaded again.

Accounting (``stats["loadback"]``): every page copied L2 -> L1 for a hit is ``loaded`` (``loaded_full`` /
``loaded_swa`` by component); it is ``used`` once a forward of that hit's request ran (``mark_read``),
``wasted`` if the hit is released before; ``deferred`` counts hits that had to wait for room.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import kernels
from storage.copier import Job, LayerFuture
from storage.hashing import SequenceKeys
from storage.pools import FULL, SWA
from storage.radix_node import L1, Node

if TYPE_CHECKING:
    from storage.hicache import HiCache


@dataclass
class PrefixHit:
    """A request's cached prefix: ``num_pages`` pages whose L1 pages it borrows (pinned by locks)."""

    node: Optional[Node] = None
    num_pages: int = 0
    full_pages: list[int] = field(default_factory=list)          # [num_pages] L1 full pages
    swa_pages: list[Optional[int]] = field(default_factory=list)  # [num_pages], None outside the window
    tokens_by_tier: dict[str, int] = field(default_factory=lambda: {"L1": 0, "L2": 0, "L3": 0})
    locked: tuple[str, ...] = ()
    waits: list[LayerFuture] = field(default_factory=list)  # loads to wait for, layer by layer
    # The request's page keys as far as the match needed them: hand them back to ``insert``.
    keys: Optional[SequenceKeys] = None
    deferred: bool = False   # locked, but its L2 pages wait for room in L1 (``resume``)
    unread: int = 0          # pages loaded for it that no forward has read yet (``mark_read``)


Room = Callable[[int, dict], bool]
"""``room(num_pages, needs)``: may a hit of ``num_pages`` pages load ``needs`` ({component: pages}) now?"""


class LoadBackOps:
    """resume / load_needs / reclaimable_l1 / mark_read and the copy itself, for HiCache."""

    def resume(self: "HiCache", hit: PrefixHit, now: float, prefetch=None,
               room: Optional[Room] = None) -> PrefixHit:
        """Complete a locked hit: load its L2 part into L1 if ``room`` allows (else it stays, or comes
        back, ``deferred``), assemble its page lists, then take what ``prefetch`` brought from L3. A hit
        all in L1 asks ``room`` too: its request waits holding it rather than matching it again at
        every schedule (and losing it to eviction meanwhile)."""
        nodes = self._cut_window(hit.node.path())   # afresh: inserts may have split it while it waited
        needs = self.load_needs(nodes)
        if room is not None and not room(hit.num_pages, needs):
            if not hit.deferred:
                self.stats["loadback"]["deferred"] += 1
            hit.deferred = True
            return hit
        hit.deferred = False
        from_l1 = sum(nd.num_pages for nd in nodes if nd.l1[FULL] is not None)
        if not self._load_back(nodes, hit):
            self._drop_prefetch(prefetch)
            return self._give_up(hit)
        hit.waits += [f for f in (self._loading.get(nd.id) for nd in nodes) if f is not None and not f.done]
        hit.full_pages, hit.swa_pages = [], []   # from the path as it is now (loads included)
        self._gather_l1(hit, nodes, hit.num_pages)
        ps = self.page_size
        hit.tokens_by_tier = {"L1": from_l1 * ps, "L2": (hit.num_pages - from_l1) * ps, "L3": 0}
        hit = self._take_prefetch(prefetch, hit, now)
        self._count_hit(hit)
        if self.cfg is not None and self.cfg.write_policy == "write_through_selective":
            for nd in nodes:
                if nd.hit_count >= self.cfg.write_through_threshold:
                    self._backup(nd, now)
        return hit

    def _cut_window(self: "HiCache", nodes: list[Node]) -> list[Node]:
        """Split the node the last window starts inside when its SWA data must be loaded, so only the
        window's pages are (the part before it is never read)."""
        if not self.has_swa or not nodes:
            return nodes
        lo = nodes[-1].end - self.tree.window_pages
        for i, nd in enumerate(nodes):
            if nd.depth < lo < nd.end and nd.l1[SWA] is None and nd.l2[SWA] is not None:
                return nodes[:i] + [self.tree.split(nd, lo - nd.depth)] + nodes[i:]
        return nodes

    def load_needs(self: "HiCache", nodes: list[Node]) -> dict[str, int]:
        """L1 pages per component a hit on the path ``nodes`` must load (full: every page not in L1;
        SWA: the nodes reaching into the last window), {} when it is all in L1."""
        needs: dict[str, int] = {}
        lo = (nodes[-1].end - self.tree.window_pages) if nodes else 0
        for nd in nodes:
            if nd.l1[FULL] is None:
                needs[FULL] = needs.get(FULL, 0) + nd.num_pages
            if self.has_swa and nd.end > lo and nd.l1[SWA] is None and nd.l2[SWA] is not None:
                needs[SWA] = needs.get(SWA, 0) + nd.num_pages
        return needs

    def reclaimable_l1(self: "HiCache", component: str) -> int:
        """L1 pages of ``component`` the tree would give back if asked (held by unlocked nodes)."""
        return self.tree.num_pages(component, L1) - self.tree.locked_pages(component, L1)

    def mark_read(self: "HiCache", hit: PrefixHit) -> None:
        """A forward of the hit's request ran: the pages loaded for it served their purpose."""
        if hit.unread:
            self.stats["loadback"]["used"] += hit.unread
            hit.unread = 0

    def _load_back(self: "HiCache", nodes: list[Node], hit: PrefixHit) -> bool:
        """Bring the L2-only data the match needs into L1 (full: every node; SWA: the window). The pages
        are recorded in the tree at once; the copy runs in the background layer by layer and
        ``hit.waits`` tells the forward when each layer has arrived."""
        lo = (nodes[-1].end - self.tree.window_pages) if nodes else 0
        moves: list[tuple[str, list[int], list[int]]] = []   # (component, L2 src, L1 dst)
        for nd in nodes:  # root first: L1 holds full data only below L1 parents
            needs = [FULL] if nd.l1[FULL] is None else []
            if self.has_swa and nd.end > lo and nd.l1[SWA] is None and nd.l2[SWA] is not None:
                needs.append(SWA)
            for c in needs:
                if nd.l2[c] is None or not self._l1_room(c, nd.num_pages):
                    return False  # pages already moved stay valid L1 copies in the tree
                host = self.host.pool(c)
                dst = self.pools.pool(c).allocator.alloc(nd.num_pages)
                self.tree.set_l1(nd, c, dst)
                moves.append((c, list(nd.l2[c]), dst))
                self._count("L2->L1", nd.num_pages, host.page_bytes)
                self.stats["loadback"]["loaded"] += nd.num_pages
                self.stats["loadback"][f"loaded_{c}"] += nd.num_pages
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
                host, l1 = self.host.pool(c), self.pools.pool(c).flat()
                for mc, src, dst in moves:
                    if mc == c:
                        kernels.l2_to_l1(l1, host.data, host.layout, src, dst, layer=slot, check=False)
                f.set_layer(c, slot)

        def done() -> None:
            for c in reversed(locks):
                self.tree.unlock(node, c)
            for i in loaded:
                if self._loading.get(i) is fut:
                    del self._loading[i]

        for i in loaded:
            self._loading[i] = fut
        self.copier.submit(Job(run, fut, done, tag="load"))
        hit.waits.append(fut)
        return True
