"""Value types of the unified radix tree (storage/radix/tree.py): nodes, results, KV events.

Units: every length here is in **pages** (``page_size`` tokens each) unless it says tokens; page
indices are indices into the L1 pools (storage/pools.py) or the L2 host pool of one component.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Optional

from storage.config import COMPONENTS, FULL, SWA

L1 = "L1"
L2 = "L2"
L3 = "L3"
TIERS = (L1, L2, L3)
PAGE_TIERS = (L1, L2)
"""Tiers whose data the tree holds as page indices (L3 is a presence flag: the store owns the bytes)."""

__all__ = ["COMPONENTS", "FULL", "SWA", "L1", "L2", "L3", "TIERS", "PAGE_TIERS",
           "Node", "KVEvent", "Freed", "MatchResult", "InsertResult", "check_live"]

_ids = itertools.count()


class _PerKey:
    """``node.l1[c]``, ``node.lock[c]``, ``node.child_full[t]``...: a view on two of a node's slots, for code
    generic over the component or tier. The tree's hot paths read the slots themselves (``l1_full``):
    a dict per node and tier was a pointer chase per read, and most of a match's time was memory."""

    __slots__ = ("_node", "_names")

    def __init__(self, node: "Node", names: dict[str, str]) -> None:
        self._node, self._names = node, names

    def __getitem__(self, key: str):
        return getattr(self._node, self._names[key])

    def __setitem__(self, key: str, value) -> None:
        setattr(self._node, self._names[key], value)

    def __repr__(self) -> str:
        return repr({k: self[k] for k in self._names})


def _view(names: dict[str, str], doc: str) -> property:
    return property(lambda node: _PerKey(node, names), doc=doc)


SLOT = {(FULL, L1): "l1_full", (SWA, L1): "l1_swa", (FULL, L2): "l2_full", (SWA, L2): "l2_swa",
        (FULL, L3): "l3_full", (SWA, L3): "l3_swa"}
"""(component, tier) -> the Node slot holding that data (page indices for L1/L2, a flag for L3)."""
LOCK_SLOT = {FULL: "lock_full", SWA: "lock_swa"}


class Node:
    """One edge of the tree: a run of ``len(keys) >= 1`` whole pages starting at page ``depth``. ``keys``
    and ``tokens`` are replaced, never changed in place (a request's SequenceKeys borrows the list).

    Per component ``c`` and tier: ``l1_full`` / ``l1_swa`` / ``l2_full`` / ``l2_swa`` are lists of
    ``len(keys)`` page indices or None (data presence is all-or-nothing per node), ``l3_full`` /
    ``l3_swa`` flags, ``lock_full`` / ``lock_swa`` counts (``node.l1[c]``, ``node.lock[c]``... read and
    write them by component). ``swa_lock_starts`` counts the SWA locks whose window starts inside this
    node (see RadixTree.lock). ``swa_keep``: its SWA data is a kept window (RadixTree, "Retention").
    ``child_l1`` / ``child_l2`` (``child_full[t]``) count the children
    holding full data in that page tier (for the leaf test of eviction).
    """

    __slots__ = ("id", "parent", "children", "keys", "tokens", "depth", "l1_full", "l1_swa", "l2_full",
                 "l2_swa", "l3_full", "l3_swa", "lock_full", "lock_swa", "swa_lock_starts", "last_access",
                 "swa_access", "hit_count", "demoted_hits", "child_l1", "child_l2", "removed", "lru_in", "only",
                 "swa_keep")

    def __init__(self, parent: Optional["Node"], keys: list[bytes], depth: int,
                 tokens: Optional[list[int]] = None, now: float = 0.0) -> None:
        self.id = next(_ids)
        self.parent = parent
        self.children: dict[bytes, Node] = {}   # changed only through attach / detach / replace
        self.only: Optional[Node] = None        # the child when there is exactly one (a walk's common case)
        self.keys = keys
        self.tokens = tokens
        self.depth = depth
        self.l1_full: Optional[list[int]] = None
        self.l1_swa: Optional[list[int]] = None
        self.l2_full: Optional[list[int]] = None
        self.l2_swa: Optional[list[int]] = None
        self.l3_full = self.l3_swa = False
        self.lock_full = self.lock_swa = 0
        self.swa_lock_starts: dict[int, int] = {}   # window start page -> SWA locks (> 0)
        self.last_access = now
        # SWA recency apart from full: a match or insert refreshes SWA only inside the window before its
        # end, so the stale windows of earlier turns age while the path's full data stays hot.
        self.swa_access = now
        # Whether this node's SWA data is (part of) the window before a kept point, and how strongly: 0
        # interior, 1 a checkpoint, 2 a sequence end, branch point or message boundary (RadixTree,
        # "Retention"): SWA-pool pressure takes lower levels first. 0 once the node is a SWA tombstone.
        self.swa_keep = 0
        self.hit_count = 0
        self.demoted_hits = 0   # hit_count when segmented LRU last demoted it (lru.py)
        self.child_l1 = self.child_l2 = 0
        self.removed = False
        self.lru_in = 0   # bit i: a member of the tree's LRU list i (lru.py LRUIndex.bit)

    l1 = _view({FULL: "l1_full", SWA: "l1_swa"}, "L1 page indices by component.")
    l2 = _view({FULL: "l2_full", SWA: "l2_swa"}, "L2 page indices by component.")
    l3 = _view({FULL: "l3_full", SWA: "l3_swa"}, "L3 presence by component.")
    lock = _view(LOCK_SLOT, "Lock counts by component.")
    child_full = _view({L1: "child_l1", L2: "child_l2"}, "Children holding full data, by page tier.")

    def attach(self, child: "Node") -> None:
        """Add ``child`` under its first page key."""
        children = self.children
        children[child.keys[0]] = child
        self.only = child if len(children) == 1 else None

    def detach(self, child: "Node") -> None:
        children = self.children
        del children[child.keys[0]]
        self.only = next(iter(children.values())) if len(children) == 1 else None

    def replace(self, old: "Node", new: "Node") -> None:
        """``new`` takes the place of the child ``old`` (both start with the same page key)."""
        self.children[new.keys[0]] = new
        if self.only is old:
            self.only = new

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    @property
    def end(self) -> int:
        """Page index one past this node's last page (its depth from the root, in pages)."""
        return self.depth + len(self.keys)

    def pages(self, component: str, tier: str) -> Optional[list[int]]:
        if tier != L1 and tier != L2:
            raise ValueError(f"tier {tier!r} holds no page indices")
        return getattr(self, SLOT[component, tier])

    def has(self, component: str, tier: str) -> bool:
        v = getattr(self, SLOT[component, tier])
        return v if tier == L3 else v is not None

    def has_any(self, component: str) -> bool:
        if component == FULL:
            return self.l1_full is not None or self.l2_full is not None or self.l3_full
        if component == SWA:
            return self.l1_swa is not None or self.l2_swa is not None or self.l3_swa
        raise KeyError(component)

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
                f"lock={self.lock_full}/{self.lock_swa})")


def check_live(node: Node, root: Node) -> None:
    """Raise ValueError unless ``node`` is ``root`` or a node of its tree (not removed, not detached)."""
    if node.removed or (node is not root and node.parent is None):
        raise ValueError(f"{node!r} is not in the tree")


class KVEvent(NamedTuple):
    """A change of what the tree stores: ``page_keys`` gained (``stored``) or lost (``removed``) data of
    ``component`` in ``tier``. Splits emit nothing (no data changes); per (tier, component) the events
    of one key alternate stored/removed, starting with stored. (A NamedTuple: every data change makes
    one, and a frozen dataclass costs several times more to build.)

    A ``stored`` event also carries what a consumer that computes its own block ids needs (the field's
    event wire, storage/kv_events/): ``tokens``, the ``len(page_keys) * page_size`` token ids of those
    pages (the node's own list, shared, never changed in place; None when the tree never learnt them),
    and ``parent``, the key of the page before the first one (None at the root). ``removed`` events
    leave both None."""

    kind: str  # "stored" | "removed"
    tier: str  # L1 | L2 | L3
    component: str  # FULL | SWA
    page_keys: tuple[bytes, ...]
    tokens: Optional[list[int]] = None
    parent: Optional[bytes] = None


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

    # A plain class with slots, not a dataclass: one is built for every request, and the generated
    # __init__ with its default factories was a measurable share of a match.
    __slots__ = ("node", "num_pages", "nodes", "matched_pages", "full_l1", "full_l2", "full_l3", "swa_window",
                 "swa_l1", "swa_l2", "swa_l3", "l1_full", "l1_swa")

    def __init__(self, node: Node, num_pages: int = 0, nodes: Optional[list[Node]] = None,
                 matched_pages: int = 0) -> None:
        self.node = node
        self.num_pages = num_pages
        self.nodes: list[Node] = [] if nodes is None else nodes
        self.matched_pages = matched_pages
        self.full_l1 = self.full_l2 = self.full_l3 = 0
        self.swa_window = self.swa_l1 = self.swa_l2 = self.swa_l3 = 0
        self.l1_full: list[int] = []
        self.l1_swa: list[Optional[int]] = []

    def __repr__(self) -> str:
        return "MatchResult(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


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
