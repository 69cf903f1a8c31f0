"""Room in L1 (the device pools): evict what the tree holds unlocked, under the write policy's
``on_evict`` (write-back saves a node to L2 just before its L1 pages go)."""
from __future__ import annotations

from storage.hicache.tier import free_pages
from storage.pools import KVPools
from storage.radix import RadixTree
from storage.radix.node import L1


class L1Space:
    def __init__(self, tree: RadixTree, pools: KVPools, l2, copier, stats: dict, on_evict=None) -> None:
        self.tree, self.pools, self.l2, self.copier = tree, pools, l2, copier
        self.stats = stats
        self.on_evict = on_evict

    def evict(self, c: str, n_pages: int, spare_kept: bool = False) -> int:
        """Free at least ``n_pages`` L1 pages of ``c`` if the tree can; returns pages freed. Nodes whose
        backup is still in flight are pinned: when they are what stands in the way, wait for the copies
        rather than lose cached data or preempt a request."""
        got = 0
        for attempt in range(2):
            freed = self.tree.evict(c, L1, n_pages - got, on_evict=self.on_evict, spare_kept=spare_kept)
            free_pages(freed, self.pools, self.l2)
            got += len(freed[c, L1])
            if got >= n_pages or attempt or not self.copier.num_pending:
                break
            self.copier.poll(block=True)
        self.stats["evicted_pages"]["L1"] += got
        return got

    def room(self, c: str, n: int) -> bool:
        """Whether ``n`` L1 pages of ``c`` can be allocated, evicting for them."""
        alloc = self.pools.pool(c).allocator
        if not alloc.can_alloc(n):
            self.evict(c, n - alloc.num_free)
        return alloc.can_alloc(n)

    def free(self, full: list[int], swa: list[int]) -> None:
        if full:
            self.pools.full.allocator.free(full)
        if swa:
            self.pools.swa.allocator.free(swa)

    def reclaimable(self, c: str) -> int:
        """L1 pages of ``c`` the tree would give back if asked (held by unlocked nodes)."""
        return self.tree.num_pages(c, L1) - self.tree.locked_pages(c, L1)
