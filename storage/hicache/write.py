"""Write policies (L1 -> L2 -> L3) as strategies, one chosen from ``HiCacheConfig.write_policy``:

* ``write_through``: every node is backed up to L2 when it enters the tree;
* ``write_through_selective``: once its hit count reaches ``write_through_threshold``;
* ``write_back``: only when L1 evicts it (synchronously: its L1 pages are about to go).

L2 -> L3 follows once the L2 copy is complete, whatever the policy. ``NoWrite`` is the policy of a
cache without L2.

Background backups go in batches: inside ``batched()`` (the engine's step, around its commits) the nodes
are gathered and backed up when it ends, with one L1 -> L2 copy per component and one L3 store batch for
the step's every new prompt, instead of a copy, a job and a store call per prompt. Nothing evicts L1
inside a step's commits; a node gone by the flush anyway (or no longer in L1) is skipped.

``offloaded``: the leading pages of an inserted sequence that another worker's cache already offloads to
L3 (P/D: the prefill worker writes a prompt through before the decode worker inserts prompt + output).
Write-through leaves the nodes wholly inside them alone, so the decode side moves only what it computed.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

from storage.config import HiCacheConfig
from storage.radix.node import L1, Node


class WritePolicy:
    """Backs nodes up from L1 into ``l2``, and from there into ``l3``; the hooks decide when."""

    on_evict = None   # RadixTree.evict's callback, or None

    def __init__(self, l2, l3, components: tuple[str, ...], threshold: int = 0) -> None:
        self.l2, self.l3, self.components, self.threshold = l2, l3, components, threshold
        self._held = 0
        self._pending: list[tuple[Node, int]] = []   # (node, its first page when given) until the flush

    def backup(self, node: Node, c: str, sync: bool = False) -> bool:
        return self.l2.write(node, c, sync, then=self.l3.write_many)

    def backup_all(self, nodes: Iterable[Node]) -> None:
        """Back ``nodes`` up in the background: now, or when the outermost ``batched()`` ends."""
        self._pending += [(nd, nd.depth) for nd in nodes]
        if not self._held:
            self.flush()

    @contextmanager
    def batched(self) -> Iterator[None]:
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if not self._held:
                self.flush()

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        nodes: dict[int, Node] = {}
        for nd, first in pending:
            # An insert after it may have split the node: the object keeps the lower part, so the upper
            # pieces are its ancestors from ``first`` on.
            x = nd
            while x is not None and x.parent is not None and not x.removed and x.depth >= first:
                nodes.setdefault(x.id, x)
                x = x.parent
        if nodes:
            self.l2.write_many([(nd, c) for nd in nodes.values() for c in self.components], then=self.l3.write_many)

    offloads_inserts = False   # whether ``inserted`` puts every inserted page in L3 (given an L3)

    def inserted(self, node: Node, offloaded: int = 0) -> None:
        """The path from the root to ``node`` just entered the tree or was extended; its first
        ``offloaded`` pages are offloaded elsewhere."""

    def hit(self, nodes: list[Node]) -> None:
        """A match used ``nodes``; their hit counts are up to date."""


class WriteThrough(WritePolicy):
    offloads_inserts = True

    def inserted(self, node: Node, offloaded: int = 0) -> None:
        # A node reaching past ``offloaded`` is backed up whole: its pages share one L2 allocation.
        self.backup_all(nd for nd in node.path() if nd.end > offloaded)


class WriteThroughSelective(WritePolicy):
    def hit(self, nodes: list[Node]) -> None:
        self.backup_all(nd for nd in nodes if nd.hit_count >= self.threshold)


class WriteBack(WritePolicy):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.on_evict = self._evicting

    def _evicting(self, node: Node, c: str, tier: str) -> None:
        if tier == L1:
            self.backup(node, c, sync=True)


class NoWrite(WritePolicy):
    """No L2: nothing is ever backed up."""

    def backup(self, node: Node, c: str, sync: bool = False) -> bool:
        return False


WRITE_STRATEGIES = {"write_through": WriteThrough, "write_through_selective": WriteThroughSelective,
                    "write_back": WriteBack}


def write_policy(cfg: HiCacheConfig | None, l2, l3, components: tuple[str, ...]) -> WritePolicy:
    if cfg is None:
        return NoWrite(l2, l3, components)
    return WRITE_STRATEGIES[cfg.write_policy](l2, l3, components, cfg.write_through_threshold)
