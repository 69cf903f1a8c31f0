"""L2, the host tier: backs L1 pages up into host memory (L1 -> L2) and makes room in it.

It is given what it works with -- the tree, the L1 pools it copies from, the host pools, the copier
and the stats it counts into -- and knows nothing of the cache above it or of L3: whoever asks for a
backup says what follows it (``then``, e.g. the write to L3 once the L2 copy is complete).

SWA data is backed up only where the tree keeps it (``swa_keep``: the window before a sequence end, a
branch point or a checkpoint; storage/radix/tree.py, "Retention"): the interior sliding KV the engine leaves
in L1 is evictable there and recomputed rather than moved, so L2 and L3 hold one window per kept point
(``backs_up``). The benches' SWA-oblivious baseline is a subclass in bench/swa_oblivious.py, which
builds its own cache with it (``HiCache(host_tier=...)``); nothing here exists for it.
"""
from __future__ import annotations

from typing import Callable, Optional

from storage.config import HiCacheConfig
from storage.copier import Copier, Job, LayerFuture, wait_copies
from storage.hicache.tier import free_pages, pin_locks
from storage.host import HostPool, HostPools
from storage.kernels_path import transfer
from storage.pools import COMPONENTS, SWA, KVPools
from storage.radix import RadixTree
from storage.radix.node import L1, L2, Node

Then = Optional[Callable[[list[tuple[Node, str]]], None]]   # the pieces that got their L2 copy


class HostTier:
    present = True

    def __init__(self, tree: RadixTree, l1: KVPools, cfg: HiCacheConfig, copier: Copier,
                 components: tuple[str, ...], stats: dict) -> None:
        self.tree, self.l1, self.cfg, self.copier = tree, l1, cfg, copier
        self.pools = HostPools(l1, cfg)
        self.components = components
        self.stats = stats
        self._backing_up: dict[tuple[int, str], list[int]] = {}  # (node id, component) -> L2 pages

    def pool(self, c: str) -> HostPool:
        return self.pools.pool(c)

    def worth_loading(self, num_pages: int) -> bool:
        """Whether an L2 run of ``num_pages`` is loaded back rather than recomputed."""
        return num_pages >= self.cfg.load_back_threshold_pages

    # ---- L1 -> L2 --------------------------------------------------------------------------------
    def write(self, node: Node, c: str, sync: bool = False, then: Then = None) -> bool:
        """Copy ``node``'s L1 data of ``c`` into fresh L2 pages. In the background unless ``sync``
        (write-back: the L1 pages are about to be freed); the node stays locked meanwhile. ``then(pieces)``
        runs once with every (piece of the node, ``c``) that got its L2 copy. False for SWA data the tree
        does not keep (``backs_up``)."""
        if c == SWA and not self.backs_up(node):
            return node.l2[c] is not None
        if node.l1[c] is None or node.l2[c] is not None:
            return node.l2[c] is not None
        if (node.id, c) in self._backing_up:
            if not sync:
                return True
            self.copier.poll(block=True)
            return node.l2[c] is not None
        if not self.room(c, node.num_pages):
            return False
        dst = self.pool(c).allocator.alloc(node.num_pages)
        if not sync:
            self._copy([node], c, dst, then)
            return True
        host, l1 = self.pool(c), self.l1.pool(c).flat()
        self._count(c, node.num_pages)
        transfer.l1_to_l2(l1, host.data, host.layout, list(node.l1[c]), dst, check=False)
        wait_copies(l1)   # the L1 pages are freed next, and ``then`` may read the host copy
        self.tree.set_l2(node, c, dst)
        if then is not None:
            then([(node, c)])
        return True

    def write_many(self, pieces: list[tuple[Node, str]], then: Then = None) -> None:
        """``write`` in the background for each (node, component) of ``pieces``, with one copy per
        component for all of them: a step's write-through of many short prompts is many small copies,
        and a copy's fixed cost (its index tensors, a job, a completion) dwarfs a few pages' bytes.
        ``then`` runs once per component with every piece that landed (the L3 write, one batch too)."""
        for c in self.components:
            nodes = [nd for nd, pc in pieces if pc == c and self._needs_copy(nd, c)]
            total = sum(nd.num_pages for nd in nodes)
            if not total:
                continue
            if self.room(c, total):
                self._copy(nodes, c, self.pool(c).allocator.alloc(total), then)
                continue
            for nd in nodes:   # short of host room for all of them: each one as far as room goes
                self.write(nd, c, then=then)

    def _needs_copy(self, node: Node, c: str) -> bool:
        return not node.removed and node.l1[c] is not None and node.l2[c] is None \
            and (node.id, c) not in self._backing_up and (c != SWA or self.backs_up(node))

    def _count(self, c: str, n: int) -> None:
        self.stats["pages"]["L1->L2"] += n
        self.stats["bytes"]["L1->L2"] += n * self.pool(c).page_bytes

    def _copy(self, nodes: list[Node], c: str, dst: list[int], then: Then) -> None:
        """One background copy of ``nodes``' L1 pages of ``c`` into ``dst`` (their page counts in order),
        each node locked until it lands."""
        host, l1 = self.pool(c), self.l1.pool(c).flat()
        locks = pin_locks(c)
        src: list[int] = []
        parts = []
        for nd in nodes:
            part = dst[len(src):len(src) + nd.num_pages]
            src += nd.l1[c]
            for lc in locks:
                self.tree.lock(nd, lc)
            self._backing_up[(nd.id, c)] = part
            # A match may split the node meanwhile: the object keeps the lower part, from ``nd.depth`` on.
            parts.append((nd, nd.depth, part))
        self._count(c, len(dst))

        def run(fut: LayerFuture) -> None:
            transfer.l1_to_l2(l1, host.data, host.layout, src, dst, check=False)

        def done() -> None:
            landed: list[tuple[Node, str]] = []
            for nd, first, part in parts:
                del self._backing_up[(nd.id, c)]
                for lc in reversed(locks):
                    self.tree.unlock(nd, lc)
                self.free(c, self._land(nd, c, first, part, fut.error, landed))
            if then is not None and landed:
                then(landed)

        fut = LayerFuture({})
        self.copier.submit(Job(run, fut, done, tag=f"backup {c}", memory=True))

    def _land(self, node: Node, c: str, first: int, dst: list[int], error, landed: list) -> list[int]:
        """Give each piece of the copied range that still wants it its part of ``dst`` (appended to
        ``landed``); the pages no piece took, to free."""
        x, unused = node, list(dst)
        while error is None and x is not None and x.parent is not None and not x.removed and x.depth >= first:
            part = dst[x.depth - first:x.end - first]
            if x.l2[c] is None and x.l1[c] is not None:
                self.tree.set_l2(x, c, part)
                taken = set(part)
                unused = [p for p in unused if p not in taken]
                landed.append((x, c))
            x = x.parent
        return unused

    # ---- room --------------------------------------------------------------------------------------
    def room(self, c: str, n: int) -> bool:
        """Whether ``n`` host pages of ``c`` can be allocated, evicting L2 data to make room."""
        host = self.pool(c)
        if not host.allocator.can_alloc(n):
            freed = self.tree.evict(c, L2, n - host.allocator.num_free)
            self.stats["evicted_pages"]["L2"] += len(freed[c, L2])
            free_pages(freed, self.l1, self)
        if not host.allocator.can_alloc(n):
            # Still short: drop backups of data L1 still holds, least recently used first (unlocked, so
            # no copy reads them). The data stays cached; only its second copy goes. Without this, kept
            # windows resident in L1 could fill the host pool and refuse every L3 prefetch.
            for node in self.tree.evictable(c, L1, n - host.allocator.num_free + host.allocator.num_used):
                if node.l2[c] is not None and (node.id, c) not in self._backing_up:
                    dropped = self.tree.set_l2(node, c, None)
                    self.stats["evicted_pages"]["L2"] += len(dropped)
                    self.free(c, dropped)
                    if host.allocator.can_alloc(n):
                        break
        return host.allocator.can_alloc(n)

    def alloc(self, c: str, n: int) -> Optional[list[int]]:
        """``n`` host pages of ``c`` (evicting L2 data for them), or None when there is no room."""
        return self.pool(c).allocator.alloc(n) if n and self.room(c, n) else ([] if not n else None)

    def free(self, c: str, pages: list[int]) -> None:
        if pages:
            self.pool(c).allocator.free(pages)

    # ---- what earns host room ------------------------------------------------------------------------
    def backs_up(self, node: Node) -> bool:
        """Whether ``node``'s SWA data earns host room: only kept windows (interior pages are recomputed)."""
        return node.swa_keep > 0

    # ---- the Tier interface ----------------------------------------------------------------------------
    def poll(self, block: bool = False) -> None:
        self.copier.poll(block)

    def busy(self) -> bool:
        return self.copier.num_pending > 0

    def owners(self, c: str) -> dict[str, list[int]]:
        return {"backups in flight": self.in_flight(c)}

    def in_flight(self, c: str) -> list[int]:
        return [p for (_, pc), pages in self._backing_up.items() if pc == c for p in pages]

    def check_integrity(self, others: Callable[[str], dict[str, list[int]]]) -> None:
        """Every host page is owned by exactly one of: free list, tree, this tier, ``others(c)``."""
        for c in COMPONENTS:
            owners = {"tree": self.tree.all_pages(c, L2), **self.owners(c), **others(c)}
            self.pool(c).allocator.check_integrity(owners)

    def usage(self) -> dict:
        return {"L2": {c: self.pool(c).allocator.num_used for c in COMPONENTS},
                "L2_bytes": self.pools.bytes_used()}

    def close(self) -> None:
        self.copier.close()
