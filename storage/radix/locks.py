"""Locks of the radix tree: ``lock`` / ``unlock`` (the rules are in storage/radix.py's module doc,
"Locks"), and the pair a fused match takes.

A mixin only to keep storage/radix.py under 500 lines: it works on RadixTree's state (``root``,
``_locks``, ``_lru``, ``_full_lrus``, ``_refresh``, ``swa_window_start``) and has no meaning on its own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from storage.radix.node import COMPONENTS, FULL, L1, L2, SWA, Node

if TYPE_CHECKING:
    from storage.radix.lru import LRUIndex


class LockOps:
    """lock / unlock / _lock_both / _check_live of RadixTree."""

    root: Node
    window_pages: int
    _locks: dict[Node, list[int]]
    _lru: dict[tuple[str, str], "LRUIndex"]
    _full_lrus: tuple

    def _lock_both(self, node: Node) -> None:
        """``lock(node, FULL)``, then SWA when the tree has a window (what ``match_prefix(lock=True)`` takes)."""
        self.lock(node, FULL)
        if self.window_pages:
            self.lock(node, SWA)

    def _check_live(self, node: Node) -> None:
        if node.removed or (node is not self.root and node.parent is None):
            raise ValueError(f"{node!r} is not in the tree")

    def lock(self, node: Node, component: str) -> None:
        """Pin ``node``'s data of ``component`` (see the module doc for the extent of a lock)."""
        self._check_live(node)
        if component == FULL:
            x, root = node, self.root
            lru1, lru2 = self._full_lrus
            bit1, bit2 = lru1.bit, lru2.bit
            while x is not root:
                x.lock_full += 1
                if x.lock_full == 1:   # _refresh of a locked node, inlined: it leaves both full lists
                    if x.lru_in & bit1:
                        lru1.discard(x)
                    if x.lru_in & bit2:
                        lru2.discard(x)
                x = x.parent
        elif component == SWA:
            if node is not self.root and node.lock_full == 0:
                raise ValueError(f"lock {FULL} before {SWA}: {node!r}")
            start, x, top = self.swa_window_start(node), node, None
            lru1, lru2 = self._lru[(SWA, L1)], self._lru[(SWA, L2)]
            while x is not self.root and x.end > start:
                x.lock_swa += 1
                if x.lock_swa == 1:   # _refresh of a locked node, inlined: it leaves both SWA lists
                    if x.lru_in & lru1.bit:
                        lru1.discard(x)
                    if x.lru_in & lru2.bit:
                        lru2.discard(x)
                top, x = x, x.parent
            if top is not None:
                # Remembered where the window starts so a later split of `top` knows which half it covers.
                top.swa_lock_starts[start] = top.swa_lock_starts.get(start, 0) + 1
        else:
            raise ValueError(f"unknown component {component!r}")
        held = self._locks.get(node)
        if held is None:
            held = self._locks[node] = [0, 0]
        held[component == SWA] += 1

    def unlock(self, node: Node, component: str) -> None:
        """Undo one ``lock(node, component)``; raises ValueError if none is held (never negative)."""
        if component not in COMPONENTS:
            raise ValueError(f"unknown component {component!r}")
        held = self._locks.get(node)
        if held is None or held[component == SWA] <= 0:
            raise ValueError(f"{node!r} holds no {component} lock")
        if component == FULL:
            x = node
            while x is not self.root:
                if x.lock_full == 1 and x.lock_swa > 0:
                    raise ValueError(f"unlock {SWA} before {FULL}: {x!r} is still {SWA}-locked")
                x = x.parent
            x = node
            while x is not self.root:
                x.lock_full -= 1
                if x.lock_full == 0:
                    self._refresh(x, FULL)
                x = x.parent
        else:
            start, x, top = self.swa_window_start(node), node, None
            while x is not self.root and x.end > start:
                x.lock_swa -= 1
                if x.lock_swa == 0:
                    self._refresh(x, SWA)
                top, x = x, x.parent
            if top is not None:
                top.swa_lock_starts[start] -= 1
                if top.swa_lock_starts[start] == 0:
                    del top.swa_lock_starts[start]
        held[component == SWA] -= 1
        if not held[0] and not held[1]:
            del self._locks[node]
