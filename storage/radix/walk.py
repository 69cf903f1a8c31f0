"""One step of a radix walk, and merging a caller's pages into a node the walk found: the per-node
half of RadixTree.match_prefix / insert, the hottest code of the tree.

A mixin only to keep storage/radix.py under 500 lines: it reads RadixTree's state (``root``,
``page_size``, ``_set``) and has no meaning on its own.
"""
from __future__ import annotations

from itertools import islice, repeat
from operator import is_not
from typing import Optional, Sequence

from storage.radix.node import FULL, L1, SWA, InsertResult, Node
from storage.tokens import same_run


def _common(edge: list[bytes], keys: Sequence[bytes], i: int) -> int:
    """Length of the common prefix of ``edge`` and ``keys[i:]``."""
    n = min(len(edge), len(keys) - i)
    if edge[:n] == keys[i:i + n]:  # the common case, one C-level comparison
        return n
    k = 0
    while k < n and edge[k] == keys[i + k]:
        k += 1
    return k


_SCAN_CHILDREN = 8
"""Up to this many children, a tree walk finds the next child by its tokens instead of hashing a page."""


def _run(swa: list, i: int, limit: int) -> int:
    """Length of the run starting at ``i`` (before ``limit``) where SWA pages are all given or all None
    (found at C speed: this runs over every page of every insert)."""
    try:
        if swa[i] is None:
            return list(map(is_not, islice(swa, i, limit), repeat(None))).index(True)
        return swa.index(None, i, limit) - i
    except ValueError:
        return limit - i


class WalkOps:
    """_step / _absorb of RadixTree."""

    root: Node
    page_size: int

    def _step(self, cur: Node, keys, i: int, by_tokens: bool, n_keys: int) -> tuple[Optional[Node], int]:
        """One step of a walk: the child of ``cur`` page ``i`` of ``keys`` continues into and how many of
        its pages the keys share (None, 0: none); ``keys`` is a SequenceKeys when ``by_tokens``. The
        common case (a few children told apart by their first page; a whole edge equal to the tokens)
        is done here, SequenceKeys.match_run only past a mismatch: it runs for every node of every
        match and insert."""
        children = cur.children
        if not children:
            return None, 0
        if by_tokens:
            # Edges are compared in place (same_run) and sized by their tokens, not their keys: every
            # object a step does not touch is a cache miss saved on a large tree.
            ps, toks = self.page_size, keys.tokens
            ch = cur.only
            if ch is not None and cur is not self.root:
                # One way on (a conversation's next turn): compare the whole edge at once, which covers
                # its first page; only a mismatch needs the page-by-page rules below.
                ct, a = ch.tokens, i * ps
                if ct is not None:
                    nk = len(ct) // ps
                    if i + nk <= n_keys and same_run(toks, a, ct):
                        known = keys._known   # SequenceKeys.borrow, inlined
                        if i <= known < i + nk:
                            keys._runs.append((ch.keys, known - i, nk))
                            keys._known = i + nk
                        return ch, nk
            if cur is not self.root and len(children) <= _SCAN_CHILDREN:
                a, child, hashed_only = i * ps, None, False
                for ch in children.values():
                    t = ch.tokens
                    if t is None:
                        hashed_only = True
                    elif same_run(toks, a, t, ps):
                        child = ch
                        break
                if child is None:
                    if not hashed_only:
                        return None, 0
                    child = children.get(keys[i])
            else:
                child = children.get(keys[i])
            if child is None:
                return None, 0
            ck, ct = child.keys, child.tokens
            if ct is None:
                return child, _common(ck, keys, i)
            nk, a = len(ct) // ps, i * ps
            if i + nk <= n_keys and same_run(toks, a, ct):
                known = keys._known   # the edge's keys are this sequence's: borrowed, not hashed
                if i <= known < i + nk:
                    keys._runs.append((ck, known - i, nk))
                    keys._known = i + nk
                return child, nk
            return child, keys.match_run(i, ck, ct)
        child = children.get(keys[i])
        return (child, _common(child.keys, keys, i)) if child is not None else (None, 0)

    def _absorb(self, node: Node, i: int, full: list, swa: list, toks: Optional[list],
                res: InsertResult, now: float) -> None:
        """Merge the caller's pages ``[i, i + node.num_pages)`` into an existing node."""
        k = node.num_pages
        mine = full[i:i + k]
        have = node.l1_full
        if have is None:
            self._set(node, FULL, L1, mine)  # the parent was absorbed just before: L1 closure holds
        elif mine != have:   # usually the same pages: the caller borrowed them from the tree
            res.free_full.extend(p for p, q in zip(mine, have) if p != q)
        mine = swa[i:i + k]
        have = node.l1_swa
        if have is None:
            if mine[0] is not None:  # uniform by the run cut: un-tombstone / load with the caller's
                node.swa_access = now  # fresh data, as a new node's
                self._set(node, SWA, L1, mine)
        elif mine != have:
            res.free_swa.extend(p for p, q in zip(mine, have) if p is not None and p != q)
        if node.tokens is None and toks is not None:
            node.tokens = toks[i * self.page_size:(i + k) * self.page_size]
