"""Eviction and tier bookkeeping of the radix tree: the half of RadixTree a tier controller drives.

A mixin only to keep storage/radix.py readable: it works on RadixTree's state (``_lru``, ``_locks``,
``_set``, ``_check_live``) and has no meaning on its own. The rules it applies are in radix.py's
module doc ("Eviction", "Existence").
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

from storage.radix.node import COMPONENTS, FULL, L1, L2, L3, PAGE_TIERS, SWA, Freed, Node

if TYPE_CHECKING:
    from storage.radix.lru import LRUIndex

OnEvict = Callable[[Node, str, str], None]
"""``on_evict(node, component, tier)``: called before a victim's data is dropped."""


class TierOps:
    """evict / evictable / flush / set_l1 / set_l2 / set_l3 of RadixTree."""

    _lru: dict[tuple[str, str], "LRUIndex"]
    root: Node
    num_nodes: int

    # ------------------------------------------------------------------ eviction

    def evictable(self, component: str, tier: str, n_pages: int) -> list[Node]:
        """Peek: the LRU-first candidates of (component, tier) holding >= ``n_pages`` pages (fewer if
        the list is short). For full this is only the current leaves; a write-back controller that
        must see every victim should pass ``on_evict`` to ``evict`` instead."""
        out, got = [], 0
        for node in self._lru[(component, tier)].ordered():
            if got >= n_pages:
                break
            out.append(node)
            got += node.num_pages
        return out

    def evict(self, component: str, tier: str, n_pages: int, *, on_evict: Optional[OnEvict] = None,
              spare_kept: bool = False) -> Freed:
        """Evict LRU (component, tier) data until >= ``n_pages`` pages of it are freed or nothing is
        evictable. ``on_evict(node, component, tier)`` runs before each victim is dropped (it may
        back the node up with set_l2 / set_l3, which turns a removal into a demotion). The result
        also lists collateral pages (SWA and L2 data of removed nodes). ``spare_kept``: SWA only, stop at
        the first kept window (radix.py, "Retention"): room for interior pages is made from interior pages."""
        if component not in COMPONENTS or tier not in PAGE_TIERS:
            raise ValueError(f"cannot evict {component!r} from {tier!r}")
        lru, freed = self._lru[(component, tier)], Freed()
        while len(freed[component, tier]) < n_pages:
            node = lru.peek()
            if node is None or (spare_kept and node.swa_keep):
                break
            if on_evict is not None:
                on_evict(node, component, tier)
                if node.removed or node not in lru:
                    continue
            freed.add(component, tier, node.pages(component, tier))
            self._set(node, component, tier, None)
            if component == FULL and not node.has_any(FULL):
                self._remove_subtree(node, freed)
            elif component == SWA and not node.has_any(SWA):
                self._merge_around(node)
        return freed

    # ------------------------------------------------------------------ path compression

    def _merge_around(self, node: Node) -> None:
        """``node`` just became a SWA tombstone: join it with its parent and its only child where they
        are alike (``_alike``). Each turn of a conversation inserts two nodes (the pages before its last
        window, the window); once a stale window loses its SWA data, the turn's two nodes and the next
        turn's first are one run of full-only pages, and a walk over three nodes costs three steps.
        Nothing a caller holds is affected: only unlocked nodes are joined, the lower node object stays
        (as a split keeps it), no data changes and no event is emitted."""
        parent = node.parent
        if self._alike(parent, node):
            self._join(parent, node)
        if len(node.children) == 1:
            (child,) = node.children.values()
            if self._alike(node, child):
                self._join(node, child)

    def _alike(self, upper: Node, lower: Node) -> bool:
        """Whether ``lower`` may absorb ``upper`` (its parent): upper's only child, both unlocked, both
        SWA tombstones, full data in the same tiers (L1 in both), the same recency and SLRU segment."""
        return (upper is not self.root and len(upper.children) == 1 and not upper.removed
                and not (upper.lock_full or upper.lock_swa or lower.lock_full or lower.lock_swa)
                and not upper.has_any(SWA) and not lower.has_any(SWA)
                and upper.l1_full is not None and lower.l1_full is not None
                and (upper.l2_full is None) == (lower.l2_full is None) and upper.l3_full == lower.l3_full
                and upper.last_access == lower.last_access
                and (upper.hit_count > upper.demoted_hits) == (lower.hit_count > lower.demoted_hits))

    def _join(self, upper: Node, lower: Node) -> None:
        """``lower`` absorbs ``upper`` (see ``_merge_around``); ``upper`` leaves the tree."""
        old_pages, parent = lower.num_pages, upper.parent
        lower.keys = upper.keys + lower.keys
        lower.tokens = upper.tokens + lower.tokens if upper.tokens and lower.tokens else None
        lower.depth = upper.depth
        lower.l1_full = upper.l1_full + lower.l1_full
        if lower.l2_full is not None:
            lower.l2_full = upper.l2_full + lower.l2_full
        lower.hit_count = max(upper.hit_count, lower.hit_count)
        lower.demoted_hits = max(upper.demoted_hits, lower.demoted_hits)
        parent.replace(upper, lower)
        lower.parent = parent
        upper.children, upper.only = {}, None
        upper.removed, upper.parent = True, None
        for lru in self._lru.values():
            lru.discard(upper)
            lru.resize(lower, old_pages)
        self.num_nodes -= 1

    def flush(self) -> Freed:
        """Remove every node; returns all their pages. Raises RuntimeError while any lock is held."""
        if self._locks:
            raise RuntimeError(f"flush with {sum(map(sum, self._locks.values()))} locks held")
        freed = Freed()
        for child in list(self.root.children.values()):
            self._remove_subtree(child, freed)
        return freed

    def _remove_subtree(self, node: Node, freed: Freed) -> None:
        if node.lock_full or node.lock_swa:
            raise RuntimeError(f"removing locked {node!r}")
        order, stack = [], [node]
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(x.children.values())
        parent = node.parent
        for x in reversed(order):  # children before parents, so counters and events stay exact
            for c in COMPONENTS:
                for t in PAGE_TIERS:
                    pages = x.pages(c, t)
                    if pages is not None:
                        freed.add(c, t, pages)
                        self._set(x, c, t, None)
                if x.l3[c]:
                    self._set(x, c, L3, False)
            x.parent.detach(x)
            for lru in self._lru.values():
                lru.discard(x)
            x.removed, x.parent = True, None
            self.num_nodes -= 1
        self._refresh(parent)

    # ------------------------------------------------------------------ tier bookkeeping (controller)

    def set_l1(self, node: Node, component: str, pages: Sequence[int]) -> None:
        """Record that ``node``'s data of ``component`` was loaded (from L2/L3) into L1 ``pages``."""
        self._check_data_call(node, component, pages)
        if node.l1[component] is not None:
            raise ValueError(f"{node!r} already holds {component} in L1")
        if component == FULL and node.parent is not self.root and node.parent.l1[FULL] is None:
            raise ValueError(f"load the parent of {node!r} into L1 first")
        self._set(node, component, L1, list(pages))

    def set_l2(self, node: Node, component: str, pages: Optional[Sequence[int]]) -> Optional[list[int]]:
        """Record an L2 (host) backup in ``pages``; ``pages=None`` clears it and returns the old pages
        for the caller to free. Clearing the top copy of a locked node, or the last full copy, raises."""
        if pages is None:
            self._check_data_call(node, component, None)
            old = node.l2[component]
            if old is None:
                return None
            if node.l1[component] is None:
                if node.lock[component]:
                    raise ValueError(f"{node!r} is locked and L2 is its top {component} copy")
                if component == FULL and not node.l3[FULL]:
                    raise ValueError(f"L2 is the last {FULL} copy of {node!r}: use evict")
            self._set(node, component, L2, None)
            return old
        self._check_data_call(node, component, pages)
        if node.l2[component] is not None:
            raise ValueError(f"{node!r} already holds {component} in L2")
        self._set(node, component, L2, list(pages))
        return None

    def set_l3(self, node: Node, component: str, present: bool) -> Freed:
        """Record that L3 holds (or no longer holds) ``node``'s data. Losing the last full copy removes
        the node and its subtree; their pages come back in the result."""
        self._check_data_call(node, component, None)
        freed = Freed()
        if present or not node.l3[component]:
            self._set(node, component, L3, bool(present))
            return freed
        only = node.l1[component] is None and node.l2[component] is None
        if only and node.lock[component]:
            raise ValueError(f"{node!r} is locked and L3 is its only {component} copy")
        self._set(node, component, L3, False)
        if component == FULL and only:
            self._remove_subtree(node, freed)
        return freed

    def _check_data_call(self, node: Node, component: str, pages: Optional[Sequence[int]]) -> None:
        self._check_live(node)
        if node is self.root:
            raise ValueError("the root holds no data")
        if component not in COMPONENTS:
            raise ValueError(f"unknown component {component!r}")
        if pages is not None and len(pages) != node.num_pages:
            raise ValueError(f"{node!r} has {node.num_pages} pages, got {len(pages)}")
