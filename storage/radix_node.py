"""Value types of the unified radix tree (storage/radix.py): nodes, results, KV events.

Units: every length here is in **pages** (``page_size`` tokens each) unless it says tokens; page
indices are indices into the L1 pools (storage/pools.py) or the L2 host pool of one component.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Optional

from storage.pools import COMPONENTS, FULL, SWA

L1 = "L1"
L2 = "L2"
L3 = "L3"
TIERS = (L1, L2, L3)
PAGE_TIERS = (L1, L2)
"""Tiers whose data the tree holds as page indices (L3 is a presence flag: the store owns the bytes)."""

__all__ = ["COMPONENTS", "FULL", "SWA", "L1", "L2", "L3", "TIERS", "PAGE_TIERS",
           "Node", "KVEvent", "Freed", "MatchResult", "InsertResult"]

_ids = itertools.count()


class Node:
    """One edge of the tree: a run of ``len(keys) >= 1`` whole pages starting at page ``depth``.

    Per component ``c``: ``l1[c]`` / ``l2[c]`` are lists of ``len(keys)`` page indices or None (data
    presence is all-or-nothing per node), ``l3[c]`` is a flag, ``lock[c]`` a count. ``swa_lock_starts``
    counts the SWA locks whose window starts inside this node (see RadixTree.lock). ``child_full[t]``
    counts the children holding full data in page tier ``t`` (for the leaf test of eviction).
    """

    __slots__ = ("id", "parent", "children", "keys", "tokens", "depth", "l1", "l2", "l3", "lock",
                 "swa_lock_starts", "last_access", "swa_access", "hit_count", "demoted_hits", "child_full",
                 "removed")

    def __init__(self, parent: Optional["Node"], keys: list[bytes], depth: int,
                 tokens: Optional[list[int]] = None, now: float = 0.0) -> None:
        self.id = next(_ids)
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.keys = keys
        self.tokens = tokens
        self.depth = depth
        # Literals, not comprehensions over COMPONENTS: every insert builds nodes, and a comprehension
        # costs a frame each.
        self.l1: dict[str, Optional[list[int]]] = {FULL: None, SWA: None}
        self.l2: dict[str, Optional[list[int]]] = {FULL: None, SWA: None}
        self.l3: dict[str, bool] = {FULL: False, SWA: False}
        self.lock: dict[str, int] = {FULL: 0, SWA: 0}
        self.swa_lock_starts: dict[int, int] = {}   # window start page -> SWA locks (> 0)
        self.last_access = now
        # SWA recency apart from full: a match or insert refreshes SWA only inside the window before its
        # end, so the stale windows of earlier turns age while the path's full data stays hot.
        self.swa_access = now
        self.hit_count = 0
        self.demoted_hits = 0   # hit_count when segmented LRU last demoted it (radix_lru.py)
        self.child_full: dict[str, int] = {L1: 0, L2: 0}
        self.removed = False

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    @property
    def end(self) -> int:
        """Page index one past this node's last page (its depth from the root, in pages)."""
        return self.depth + len(self.keys)

    def pages(self, component: str, tier: str) -> Optional[list[int]]:
        if tier == L1:
            return self.l1[component]
        if tier == L2:
            return self.l2[component]
        raise ValueError(f"tier {tier!r} holds no page indices")

    def has(self, component: str, tier: str) -> bool:
        if tier == L3:
            return self.l3[component]
        return self.pages(component, tier) is not None

    def has_any(self, component: str) -> bool:
        return self.l1[component] is not None or self.l2[component] is not None or self.l3[component]

    def best_tier(self, component: str) -> Optional[str]:
        """The fastest tier holding this node's data of ``component`` (None: tombstone / no data)."""
        for t in TIERS:
            if self.has(component, t):
                return t
        return None

    def path(self) -> list["Node"]:
        """Nodes from the root's child down to this node (empty for the root)."""
        out = []
        n: Optional[Node] = self
        while n is not None and n.parent is not None:
            out.append(n)
            n = n.parent
        return out[::-1]

    def __repr__(self) -> str:
        data = ",".join(f"{c}:{''.join(t[1] for t in TIERS if self.has(c, t)) or '-'}" for c in COMPONENTS)
        return (f"Node(id={self.id}, pages=[{self.depth},{self.end}), {data}, "
                f"lock={self.lock[FULL]}/{self.lock[SWA]})")


class KVEvent(NamedTuple):
    """A change of what the tree stores: ``page_keys`` gained (``stored``) or lost (``removed``) data of
    ``component`` in ``tier``. Splits emit nothing (no data changes); per (tier, component) the events
    of one key alternate stored/removed, starting with stored. (A NamedTuple: every data change makes
    one, and a frozen dataclass costs several times more to build.)"""

    kind: str  # "stored" | "removed"
    tier: str  # L1 | L2 | L3
    component: str  # FULL | SWA
    page_keys: tuple[bytes, ...]


class Freed:
    """Page indices released by the tree, per (component, tier in L1/L2): the caller frees them to the
    matching allocator. ``freed[FULL, L1]`` is a list (empty when nothing was freed there)."""

    def __init__(self) -> None:
        self._pages: dict[tuple[str, str], list[int]] = {(c, t): [] for c in COMPONENTS for t in PAGE_TIERS}

    def __getitem__(self, key: tuple[str, str]) -> list[int]:
        return self._pages[key]

    def add(self, component: str, tier: str, pages: list[int]) -> None:
        self._pages[(component, tier)].extend(pages)

    def items(self) -> Iterator[tuple[tuple[str, str], list[int]]]:
        return iter(self._pages.items())

    def total(self) -> int:
        return sum(len(p) for p in self._pages.values())

    def __repr__(self) -> str:
        return "Freed(" + ", ".join(f"{c}/{t}={len(p)}" for (c, t), p in self._pages.items() if p) + ")"


@dataclass
class MatchResult:
    """Outcome of RadixTree.match_prefix.

    ``num_pages`` (m) is the usable prefix: every page before m has full data in some tier and the last
    ``min(window, m)`` pages have SWA data in some tier. ``node`` ends exactly at page m (the root when
    m == 0); ``nodes`` is the usable path. Full pages are served ``full_l1`` from L1 (always the first
    pages: L1 is closed towards the root), then ``full_l2`` from L2 and ``full_l3`` from L3 only
    (those two may interleave). ``swa_window`` = min(window, m) pages need SWA data, of which
    ``swa_l1`` / ``swa_l2`` / ``swa_l3`` are served from each tier. ``l1_full`` are the L1 indices of the
    first ``full_l1`` pages; ``l1_swa`` is aligned with the m pages: the L1 SWA pages of the window (the
    last ``swa_window``), None before it and where the window's data is not in L1 (no request reads SWA
    data out of its window, so a match does not gather it).
    ``matched_pages`` is how far the keys matched before the SWA cut (>= m).
    """

    node: Node
    num_pages: int = 0
    nodes: list[Node] = field(default_factory=list)
    matched_pages: int = 0
    full_l1: int = 0
    full_l2: int = 0
    full_l3: int = 0
    swa_window: int = 0
    swa_l1: int = 0
    swa_l2: int = 0
    swa_l3: int = 0
    l1_full: list[int] = field(default_factory=list)
    l1_swa: list[Optional[int]] = field(default_factory=list)


@dataclass
class InsertResult:
    """Outcome of RadixTree.insert. ``node`` ends exactly at the inserted length (lock it to pin the
    sequence). ``num_existing`` pages were already in the tree. The caller's pages now belong to the
    tree except ``free_full`` / ``free_swa``: duplicates of data the tree already had in L1, which the
    caller must free (pages equal to the tree's own -- e.g. a borrowed L1 prefix -- are never listed)."""

    node: Node
    num_existing: int = 0
    free_full: list[int] = field(default_factory=list)
    free_swa: list[int] = field(default_factory=list)
