"""L3, the shared store below L2: write-through of L2 pages to the store, and the prefetcher that reads
pages other workers (or an earlier life of this one) left there back into L2.

Given the store, the tree, the L2 tier (whose host pages it writes from and reads into) and the copier
its writes run on. Pages are keyed ``l3_key(model_id, component, page_key)``; the SWA component stores only each
sequence's last window, like L2. Reads are verified by the store (a failed read is a miss: the prefix
just stops short, never wrong tokens).
"""
from __future__ import annotations

from storage.copier import Copier, Job, LayerFuture
from storage.hicache.prefetch import Prefetch
from storage.hicache.prefetcher import Prefetcher
from storage.hicache.tier import pin_locks
from storage.kernels_path import transfer
from storage.l3 import l3_key
from storage.l3.base import L3Store
from storage.l3.config import L3Config
from storage.radix import RadixTree
from storage.radix.node import Node


class L3Tier:
    present = True

    def __init__(self, store: L3Store, cfg: L3Config, model_id: str, tree: RadixTree, l2, copier: Copier,
                 window_pages: int, page_size: int) -> None:
        self.tree, self.l2, self.copier = tree, l2, copier
        self.store = store   # read through here (the prefetcher too), so a test may swap it
        self.model_id = model_id
        self.stats = {"written_pages": 0, "write_failures": 0, "hit_pages": 0, "read_failures": 0}
        self.prefetcher = Prefetcher(self, l2, tree, window_pages, page_size, cfg)

    def keys(self, page_keys, component: str) -> list[str]:
        return [l3_key(self.model_id, component, k) for k in page_keys]

    def exists(self, keys: list[str]) -> int:
        return self.store.batch_exists(keys)

    # ---- L2 -> L3 ----------------------------------------------------------------------------------
    def write_many(self, pieces: list[tuple[Node, str]], then=None) -> None:
        """Copy each (node, component)'s L2 pages to L3 in the background, all in one store batch (a
        store call's fixed cost is paid once per step, not per prompt); each node pinned meanwhile.
        ``then``: nothing is below L3."""
        tree = self.tree
        pieces = [(nd, c) for nd, c in pieces if not nd.removed and nd.l2[c] is not None and not nd.l3[c]]
        if not pieces:
            return
        keys: list[str] = []
        pages: list = []
        spans = []
        for nd, c in pieces:
            for lc in pin_locks(c):
                tree.lock(nd, lc)
            host = self.l2.pool(c)
            # A match may split the node meanwhile: the object keeps the lower part, from ``nd.depth`` on.
            k = self.keys(nd.keys, c)
            spans.append((nd, c, nd.depth, len(keys), len(keys) + len(k)))
            keys += k
            pages += [host.page(p) for p in nd.l2[c]]
        result: list[bool] = []

        def run(fut: LayerFuture) -> None:
            result.extend(self.store.batch_set(keys, pages))

        def done() -> None:
            whole = len(result) == len(keys)
            for nd, c, first, a, b in spans:
                for lc in reversed(pin_locks(c)):
                    tree.unlock(nd, lc)
                ok = whole and all(result[a:b])
                self.stats["written_pages" if ok else "write_failures"] += b - a
                x = nd  # mark every piece of the written range
                while ok and x is not None and x.parent is not None and not x.removed and x.depth >= first:
                    if not x.l3[c]:
                        tree.set_l3(x, c, True)   # setting the flag never frees anything
                    x = x.parent

        self.copier.submit(Job(run, LayerFuture({}), done, tag="l3 write"))

    # ---- L3 -> L2 ------------------------------------------------------------------------------------
    def read_pages(self, host, keys: list[str], pages: list[int]) -> int:
        """batch_get into host pages (any thread); returns how many leading pages arrived intact."""
        direct = host.layout != transfer.LAYER_FIRST
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

    def begin(self, page_keys: list[bytes], now: float):
        return self.prefetcher.begin(page_keys, now)

    def ready(self, prefetch: Prefetch, now: float) -> bool:
        return self.prefetcher.ready(prefetch, now)

    def take(self, prefetch: Prefetch, num_pages: int):
        return self.prefetcher.take(prefetch, num_pages)

    def taken(self, num_pages: int) -> None:
        """``num_pages`` of a take made it into the tree."""
        self.stats["hit_pages"] += num_pages

    def release(self, prefetch: Prefetch) -> None:
        self.prefetcher.release(prefetch)

    def wait(self, timeout: float) -> None:
        self.prefetcher.wait(timeout)

    def clear(self) -> int:
        """Remove this model's pages from the store (a flush of every tier); objects removed, -1 unknown.
        Raises when the store could not clear (the flush reports it)."""
        return self.store.clear_model(self.model_id)

    # ---- the Tier interface ------------------------------------------------------------------------------
    def poll(self, block: bool = False) -> None:
        self.prefetcher.jobs.poll(block)

    def busy(self) -> bool:
        return self.prefetcher.pending()

    def owners(self, c: str) -> dict[str, list[int]]:
        return {"L3 prefetches": self.prefetcher.owned(c)}

    def usage(self) -> dict:
        return {"L3": {**self.store.stats(), **self.stats,
                       **{f"prefetch_{k}": v for k, v in self.prefetcher.stats.items()}}}

    def close(self) -> None:
        self.prefetcher.close()
        self.store.close()
