"""Where the radix tree's data lives: the per-node tier slots, the page count per (component, tier) and
the KV events, kept exact by one method (``Tiers.set``), and the checked verbs a tier controller
(storage/hicache/) records its loads, backups and L3 writes with.

It enforces the data rules of storage/radix/tree.py's module doc ("Existence", "L1 is closed towards the root",
"Tombstones") at the level of one node; removing what lost its last full copy is the tree's (structure).
"""
from __future__ import annotations

from typing import Optional, Sequence

from storage.radix.lru import LRULists
from storage.radix.node import COMPONENTS, FULL, L1, L2, L3, PAGE_TIERS, SLOT, SWA, KVEvent, Node, check_live


class Tiers:
    """The data ledger of one tree: page counts per (component, page tier) and the KV events not yet
    taken. Every change of a node's data goes through ``set``, which keeps the counts, the events, the
    parent's child counters and the LRU lists (``lru``) exact."""

    def __init__(self, root: Node, lru: LRULists) -> None:
        self.root = root
        self.lru = lru
        self._sizes = {(c, t): 0 for c in COMPONENTS for t in PAGE_TIERS}
        self._events: list[KVEvent] = []

    def num_pages(self, component: str, tier: str) -> int:
        """Pages of ``component`` the tree holds in page tier ``tier``."""
        return self._sizes[(component, tier)]

    def take_events(self) -> list[KVEvent]:
        """Drain the KV events accumulated since the last call, oldest first."""
        out, self._events = self._events, []
        return out

    def snapshot(self, nodes) -> list[KVEvent]:
        """What ``nodes`` (the tree's, parents first) hold, as ``stored`` events: replayed into an empty
        consumer, they give the state the events so far gave (a consumer that lost them resyncs from it)."""
        out: list[KVEvent] = []
        for node in nodes:
            pk = node.parent.keys
            parent = pk[-1] if pk else None
            for c in COMPONENTS:
                for tier in (L1, L2, L3):
                    v = getattr(node, SLOT[c, tier])
                    if v is not None and v is not False:
                        out.append(KVEvent("stored", tier, c, tuple(node.keys), node.tokens, parent))
        return out

    def set(self, node: Node, c: str, tier: str, value) -> None:
        """The one place data changes: ``node``'s (c, tier) slot becomes ``value`` (page indices or None;
        a flag for L3), unchecked: the tree's walks and the verbs below have checked it."""
        slot = SLOT[c, tier]
        old = getattr(node, slot)
        if tier == L3:
            was, now = old, bool(value)
            setattr(node, slot, now)
        else:
            was, now = old is not None, value is not None
            setattr(node, slot, value)
            self._sizes[(c, tier)] += len(value or ()) - len(old or ())
        if was != now:
            if now:   # the parent's last key: a root child's parent (the root) has no keys
                pk = node.parent.keys
                self._events.append(KVEvent("stored", tier, c, tuple(node.keys), node.tokens, pk[-1] if pk else None))
            else:
                self._events.append(KVEvent("removed", tier, c, tuple(node.keys)))
            if c == SWA and not now and node.swa_keep and not node.has_any(SWA):
                node.swa_keep = 0   # a tombstone keeps nothing (and may join its neighbours again)
            if c == FULL and tier != L3:
                parent = node.parent
                if tier == L1:
                    parent.child_l1 += 1 if now else -1
                else:
                    parent.child_l2 += 1 if now else -1
                self.lru.refresh(parent, FULL)
        self.lru.refresh(node, c)

    # ------------------------------------------------------------------ the controller's verbs

    def set_l1(self, node: Node, component: str, pages: Sequence[int]) -> None:
        """Record that ``node``'s data of ``component`` was loaded (from L2/L3) into L1 ``pages``."""
        self._check_data_call(node, component, pages)
        if node.l1[component] is not None:
            raise ValueError(f"{node!r} already holds {component} in L1")
        if component == FULL and node.parent is not self.root and node.parent.l1[FULL] is None:
            raise ValueError(f"load the parent of {node!r} into L1 first")
        self.set(node, component, L1, list(pages))

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
            self.set(node, component, L2, None)
            return old
        self._check_data_call(node, component, pages)
        if node.l2[component] is not None:
            raise ValueError(f"{node!r} already holds {component} in L2")
        self.set(node, component, L2, list(pages))
        return None

    def set_l3(self, node: Node, component: str, present: bool) -> bool:
        """Record that L3 holds (or no longer holds) ``node``'s data. True when that was the node's last
        full copy: the caller (the tree) removes it with its subtree."""
        self._check_data_call(node, component, None)
        if present or not node.l3[component]:
            self.set(node, component, L3, bool(present))
            return False
        only = node.l1[component] is None and node.l2[component] is None
        if only and node.lock[component]:
            raise ValueError(f"{node!r} is locked and L3 is its only {component} copy")
        self.set(node, component, L3, False)
        return component == FULL and only

    def _check_data_call(self, node: Node, component: str, pages: Optional[Sequence[int]]) -> None:
        check_live(node, self.root)
        if node is self.root:
            raise ValueError("the root holds no data")
        if component not in COMPONENTS:
            raise ValueError(f"unknown component {component!r}")
        if pages is not None and len(pages) != node.num_pages:
            raise ValueError(f"{node!r} has {node.num_pages} pages, got {len(pages)}")
