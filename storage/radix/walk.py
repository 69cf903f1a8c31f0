"""The radix walk: how a page-key path continues from a node into one of its children, one step at a
time (``step``), shared by RadixTree.match_prefix and insert, the hottest code of the tree. Pure
functions over nodes: the tree owns what a walk finds.
"""
from __future__ import annotations

from itertools import islice, repeat
from operator import is_not
from typing import Optional, Sequence

from storage.radix.node import Node
from storage.tokens import same_run


def common(edge: list[bytes], keys: Sequence[bytes], i: int) -> int:
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


def run(swa: list, i: int, limit: int) -> int:
    """Length of the run starting at ``i`` (before ``limit``) where SWA pages are all given or all None
    (found at C speed: this runs over every page of every insert)."""
    try:
        if swa[i] is None:
            return list(map(is_not, islice(swa, i, limit), repeat(None))).index(True)
        return swa.index(None, i, limit) - i
    except ValueError:
        return limit - i


def step(root: Node, page_size: int, cur: Node, keys, i: int, by_tokens: bool,
         n_keys: int) -> tuple[Optional[Node], int]:
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
        ps, toks = page_size, keys.tokens
        ch = cur.only
        if ch is not None and cur is not root:
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
        if cur is not root and len(children) <= _SCAN_CHILDREN:
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
            return child, common(ck, keys, i)
        nk, a = len(ct) // ps, i * ps
        if i + nk <= n_keys and same_run(toks, a, ct):
            known = keys._known   # the edge's keys are this sequence's: borrowed, not hashed
            if i <= known < i + nk:
                keys._runs.append((ck, known - i, nk))
                keys._known = i + nk
            return child, nk
        return child, keys.match_run(i, ck, ct)
    child = children.get(keys[i])
    return (child, common(child.keys, keys, i)) if child is not None else (None, 0)

