"""Read-only queries of the radix tree: sizes, nodes, pages, locks and LRU membership.

A mixin only to keep storage/radix.py short: it reads RadixTree's state (``root``, ``_size``, ``_lru``,
``_locks``, ``window_pages``). It is also the public view storage/radix_check.py checks the tree
through (radix_check.TreeView), so the checker never reaches into the tree's privates.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from storage.radix.node import COMPONENTS, L1, Node

if TYPE_CHECKING:
    from storage.radix.lru import LRUIndex


class ReadOps:
    """num_pages / evictable_pages / iter_nodes / all_pages / owners and the checker's view."""

    root: Node
    window_pages: int
    _size: dict[tuple[str, str], int]
    _lru: dict[tuple[str, str], "LRUIndex"]
    _locks: dict[Node, list[int]]

    def num_pages(self, component: str, tier: str) -> int:
        """Pages of ``component`` the tree holds in page tier ``tier``."""
        return self._size[(component, tier)]

    def evictable_pages(self, component: str, tier: str) -> int:
        """Pages currently in the (component, tier) LRU (full: leaves only; more become evictable)."""
        return self._lru[(component, tier)].num_pages

    def locked_pages(self, component: str, tier: str) -> int:
        """Pages of ``component`` in ``tier`` held by locked nodes (what eviction cannot reach). Walks
        up from each lock: O(locks x depth), for admission decisions, not per page."""
        seen: set[int] = set()
        n = 0
        idx = COMPONENTS.index(component)
        for node, held in self._locks.items():
            if not held[idx]:
                continue
            x = node
            while x is not self.root and x.lock[component] and x.id not in seen:
                seen.add(x.id)
                p = x.pages(component, tier)
                n += len(p) if p is not None else 0
                x = x.parent
        return n

    def iter_nodes(self) -> Iterator[Node]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def all_pages(self, component: str, tier: str) -> list[int]:
        out: list[int] = []
        for n in self.iter_nodes():
            p = n.pages(component, tier)
            if p is not None:
                out.extend(p)
        return out

    def owners(self, tier: str = L1, name: str = "tree") -> dict[str, dict[str, list[int]]]:
        """``{component: {name: pages}}``, the shape KVPools.check_integrity(owners) takes."""
        return {c: {name: self.all_pages(c, tier)} for c in COMPONENTS}

    def lock_registry(self) -> Iterator[tuple[str, Node, int]]:
        """``(component, node, count)`` for every ``lock(node, component)`` still held."""
        return ((c, node, held[i]) for node, held in self._locks.items() for i, c in enumerate(COMPONENTS)
                if held[i])

    def swa_window_start(self, node: Node) -> int:
        """First page of the SWA window a lock on ``node`` covers."""
        return max(0, node.end - self.window_pages)

    def lru_members(self, component: str, tier: str) -> list[Node]:
        return self._lru[(component, tier)].members()

    def in_lru(self, node: Node, component: str, tier: str) -> bool:
        """Membership as the node's own ``lru_in`` bits tell it (the hot paths' answer)."""
        return node in self._lru[(component, tier)]

    def lru_consistent(self, component: str, tier: str) -> bool:
        """Whether the (component, tier) LRU's heap agrees with its members and their current keys."""
        return self._lru[(component, tier)].consistent()
