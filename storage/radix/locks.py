"""Locks of the radix tree: which ``lock(node, component)`` calls are held, and the per-node lock counts
they imply.

Rules (checked by check.py):

* **Full** locks are path locks: ``lock(node, FULL)`` pins the node and all its ancestors.
* **SWA** locks pin only the nodes intersecting the window ``[max(0, end - W), end)`` before the node's
  end, since that is all the SWA data a request continuing from there reads. The highest of them
  remembers where the window starts (``Node.swa_lock_starts``), so a later split knows which half a lock
  covers.
* A SWA lock requires the node to be full-locked, and a full unlock that would leave a SWA-locked node
  full-unlocked raises: so every SWA-locked node is full-locked, hence never removed.
* A locked node (count > 0 for a component) is in no LRU list of that component (lru.py); counts never go
  negative: an unlock without its lock raises.
"""
from __future__ import annotations

from typing import Iterator, Optional

from storage.radix.lru import LRULists
from storage.radix.node import COMPONENTS, FULL, SWA, Node, check_live


class Locks:
    """The lock table of one tree: node -> [lock(node, FULL) calls held, lock(node, SWA) calls held], one
    entry per locked node (a request's lock and unlock touch one dict slot, not one per component), and
    the counts on the nodes (``Node.lock_full`` / ``lock_swa``) it keeps in step with it. ``window_pages``
    is the tree's W, fixed for the tree's life."""

    def __init__(self, root: Node, window_pages: int, lru: LRULists) -> None:
        self.root = root
        self.window_pages = window_pages
        self.lru = lru   # a lock takes a node out of its lists, the last unlock re-files it
        self._held: dict[Node, list[int]] = {}

    def __len__(self) -> int:
        """Lock calls held, all nodes and components together."""
        return sum(map(sum, self._held.values()))

    def window_start(self, node: Node) -> int:
        """First page of the SWA window a lock on ``node`` covers."""
        return max(0, node.end - self.window_pages)

    def lock_both(self, node: Node) -> None:
        """``lock(node, FULL)``, then SWA when the tree has a window (what ``match_prefix(lock=True)`` takes)."""
        self.lock(node, FULL)
        if self.window_pages:
            self.lock(node, SWA)

    def lock(self, node: Node, component: str) -> None:
        """Pin ``node``'s data of ``component`` (see the module doc for the extent of a lock)."""
        root = self.root
        check_live(node, root)
        if component == FULL:
            x = node
            lru1, lru2 = self.lru.full
            bit1, bit2 = lru1.bit, lru2.bit
            while x is not root:
                x.lock_full += 1
                if x.lock_full == 1:   # LRULists.refresh of a locked node, inlined: it leaves both full lists
                    if x.lru_in & bit1:
                        lru1.discard(x)
                    if x.lru_in & bit2:
                        lru2.discard(x)
                x = x.parent
            top = None
        elif component == SWA:
            if node is not root and node.lock_full == 0:
                raise ValueError(f"lock {FULL} before {SWA}: {node!r}")
            start, x, top = self.window_start(node), node, None
            lru1, lru2 = self.lru.swa
            while x is not root and x.end > start:
                x.lock_swa += 1
                if x.lock_swa == 1:   # LRULists.refresh of a locked node, inlined: it leaves both SWA lists
                    if x.lru_in & lru1.bit:
                        lru1.discard(x)
                    if x.lru_in & lru2.bit:
                        lru2.discard(x)
                top, x = x, x.parent
        else:
            raise ValueError(f"unknown component {component!r}")
        self._register(node, component == SWA, top)

    def taken(self, node: Node, top: Optional[Node]) -> None:
        """Register ``lock(node, FULL)``, and ``lock(node, SWA)`` when ``top`` (the highest node of its
        window) is given, whose node counts the caller already raised: RadixTree.match_prefix takes them
        in its own pass over the path."""
        held = self._held.get(node)
        if held is None:
            held = self._held[node] = [0, 0]
        held[0] += 1
        if top is not None:
            start = max(0, node.end - self.window_pages)
            top.swa_lock_starts[start] = top.swa_lock_starts.get(start, 0) + 1
            held[1] += 1

    def _register(self, node: Node, swa: bool, top: Optional[Node]) -> None:
        if top is not None:
            start = self.window_start(node)
            top.swa_lock_starts[start] = top.swa_lock_starts.get(start, 0) + 1
        held = self._held.get(node)
        if held is None:
            held = self._held[node] = [0, 0]
        held[swa] += 1

    def unlock(self, node: Node, component: str) -> None:
        """Undo one ``lock(node, component)``; raises ValueError if none is held (never negative)."""
        if component not in COMPONENTS:
            raise ValueError(f"unknown component {component!r}")
        held = self._held.get(node)
        if held is None or held[component == SWA] <= 0:
            raise ValueError(f"{node!r} holds no {component} lock")
        root, refresh = self.root, self.lru.refresh
        if component == FULL:
            x = node
            while x is not root:
                if x.lock_full == 1 and x.lock_swa > 0:
                    raise ValueError(f"unlock {SWA} before {FULL}: {x!r} is still {SWA}-locked")
                x = x.parent
            x = node
            while x is not root:
                x.lock_full -= 1
                if x.lock_full == 0:
                    refresh(x, FULL)
                x = x.parent
        else:
            start, x, top = self.window_start(node), node, None
            while x is not root and x.end > start:
                x.lock_swa -= 1
                if x.lock_swa == 0:
                    refresh(x, SWA)
                top, x = x, x.parent
            if top is not None:
                top.swa_lock_starts[start] -= 1
                if top.swa_lock_starts[start] == 0:
                    del top.swa_lock_starts[start]
        held[component == SWA] -= 1
        if not held[0] and not held[1]:
            del self._held[node]

    def registry(self) -> Iterator[tuple[str, Node, int]]:
        """``(component, node, count)`` for every ``lock(node, component)`` still held."""
        return ((c, node, held[i]) for node, held in self._held.items() for i, c in enumerate(COMPONENTS)
                if held[i])

    def locked_pages(self, component: str, tier: str) -> int:
        """Pages of ``component`` in ``tier`` held by locked nodes (what eviction cannot reach). Walks
        up from each lock: O(locks x depth), for admission decisions, not per page."""
        seen: set[int] = set()
        n = 0
        idx = COMPONENTS.index(component)
        for node, held in self._held.items():
            if not held[idx]:
                continue
            x = node
            while x is not self.root and x.lock[component] and x.id not in seen:
                seen.add(x.id)
                p = x.pages(component, tier)
                n += len(p) if p is not None else 0
                x = x.parent
        return n
