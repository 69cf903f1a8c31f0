"""Eviction order of the radix tree: one LRUIndex per (component, tier), and the tree's four of them
(``LRULists``) with the rule of which nodes belong to which.

**Membership** (``LRULists.refresh``). Full lists order by ``last_access``, SWA lists by ``swa_access``: a
match or insert touches the whole path for full but only the nodes inside the window before its end for
SWA (storage/radix/tree.py), so the stale windows of earlier turns on the path age and SWA eviction takes
them before the live one. A node is in the (c, L1) list iff it holds c in L1 and is unlocked for c, and,
for full, no child holds full L1 (evict from the leaves, as removing or demoting a parent first would
break L1 closure). It is in the (c, L2) list iff it holds c in L2 but not in L1 (L2 is its top copy --
never in both lists for the same data), is unlocked for c, and, for full, no child holds full L1 or L2.
SWA has no leaf condition: tombstoning an internal node is harmless, and a window shares one timestamp,
so children still go first.

A binary heap with lazy deletion instead of an OrderedDict: nodes *enter* a list at arbitrary times
(a parent becomes a leaf when its last child is evicted) with an old access time, and an
OrderedDict would put them at the MRU end. Here the order is always exactly ``(access time, deeper
first, node id)`` -- deeper first because a match touches a whole path with one timestamp and a child
must go before its parent. The access time is the node's ``last_access`` for full lists and its
``swa_access`` for SWA lists (a match refreshes SWA only inside its window). add/discard/touch are O(log n) (O(1) for discard), pop is amortised
O(log n); stale heap entries are dropped when met or when they outnumber live ones.

**Segmented LRU** (``protect > 0``; the full lists under ``prefix_eviction: slru``). A member reused since
it was last demoted (``hit_count > demoted_hits``) is *protected*; every unprotected member goes before
any protected one, each segment in LRU order. Plain LRU strips whole conversations when a workload cycles
through more of them than L1 holds (the next one due is always the least recent); SLRU takes each
conversation's never-reused newest turn first, so every conversation keeps its older prefix. Protected
members may hold at most ``protect`` of the list's pages: past that, the least recent ones are demoted
(at eviction time), so stale content that was once reused cannot pin the cache for ever.

**Kept windows first-kept** (``keep_first``; the SWA lists). A SWA member whose ``swa_keep`` is set (the
window before a point where traffic branches or resumes: a sequence end, a branch point, a message end,
a checkpoint; storage/radix/tree.py) goes after every member that is not, and a checkpoint's (level 1) before
the others' (level 2): interior sliding KV, which no match can start
from unless the pages before a later point are all present, is what SWA-pool pressure takes first. No
cap: kept windows are a bounded share of the SWA data by construction (one window per kept point).
Interior members of one recency go shallowest first: the pages just before a sequence's kept end are
where the next prompt sharing most of it branches off (a shared system prompt, an edited last message),
and a match needs the window before its branch point whole.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Iterator, Optional

from storage.radix.node import COMPONENTS, FULL, L1, L2, PAGE_TIERS, SWA, Node

_Key = tuple  # (protected, access time, -end, id)

SLRU_PROTECTED = 0.8
"""Share of a segmented list's pages protected members may hold (``prefix_eviction: slru``)."""

EVICTIONS = ("lru", "slru")
"""Order of the full lists: plain LRU, or segmented LRU (never-reused data first; see the module doc)."""


def lru_key(node: Node, stamp: str = "last_access", protect: bool = False, keep_first: bool = False) -> _Key:
    if keep_first:   # interior pages shallowest first (see the module doc)
        return (node.swa_keep, getattr(node, stamp), -node.end if node.swa_keep else node.end, node.id)
    return (protect and node.hit_count > node.demoted_hits, getattr(node, stamp), -node.end, node.id)


class LRUIndex:
    """The set of nodes currently evictable for one (component, tier), in LRU order."""

    def __init__(self, name: str, stamp: str = "last_access", protect: float = 0.0, bit: int = 1,
                 keep_first: bool = False) -> None:
        if not 0.0 <= protect <= 1.0:
            raise ValueError(f"protect must be in [0, 1], got {protect!r}")
        if keep_first and protect:
            raise ValueError("a list orders by either kept windows or reuse, not both")
        if bit <= 0 or bit & (bit - 1):
            raise ValueError(f"bit must be a power of two, got {bit!r}")
        self.name = name
        # Membership is also this bit of each member's ``lru_in``: the tree asks "is it a member?" for
        # every node of every match and insert, and a node's own slot is already in cache.
        self.bit = bit
        self.stamp = stamp  # the Node attribute ordering this list
        self.protect = protect  # 0: plain LRU; else segmented, see the module doc
        self.keep_first = keep_first  # kept windows after every other member, see the module doc
        self._prot: dict[int, int] = {}  # protected member id -> its pages
        self.protected_pages = 0
        self._pheap: list[tuple[_Key, int, Node]] = []  # the protected entries alone (demotion order)
        # Heap entries are (key, seq, node); seq is unique so a re-added node's old entry (same key) is stale.
        self._heap: list[tuple[_Key, int, Node]] = []
        # node id -> [its current key, seq of its live heap entry, node, pages]: one dict, so that adding
        # or dropping a member (every match and insert does) is one hash lookup.
        self._members: dict[int, list] = {}
        self._counter = itertools.count()
        self.num_pages = 0  # pages held by the members: what evicting everything would free

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, node: Node) -> bool:
        return bool(node.lru_in & self.bit)

    def members(self) -> list[Node]:
        return [e[2] for e in self._members.values()]

    def key_of(self, node: Node) -> Optional[_Key]:
        e = self._members.get(node.id)
        return None if e is None else e[0]

    def add(self, node: Node) -> None:
        """Insert, or re-key after the access time (or reuse) changed (no-op when already current)."""
        if self.keep_first:
            keep = node.swa_keep
            key = (keep, getattr(node, self.stamp), -node.end if keep else node.end, node.id)
            prot = False   # no protected segment to cap: the first key part only orders
        else:
            prot = self.protect > 0 and node.hit_count > node.demoted_hits
            key = (prot, getattr(node, self.stamp), -node.end, node.id)
        e = self._members.get(node.id)
        if e is None:
            seq = next(self._counter)
            e = self._members[node.id] = [key, seq, node, node.num_pages]
            self.num_pages += e[3]
            node.lru_in |= self.bit
        else:
            if e[0] == key:   # already current: touched twice with one timestamp
                return
            if node.id in self._prot:
                self.protected_pages -= self._prot.pop(node.id)
            seq = next(self._counter)
            e[0], e[1] = key, seq
        heapq.heappush(self._heap, (key, seq, node))
        if prot:
            self._prot[node.id] = e[3]
            self.protected_pages += e[3]
            heapq.heappush(self._pheap, (key, seq, node))
        self._maybe_compact()

    def touch(self, node: Node) -> None:
        """Re-key a member whose access time changed; nothing for a non-member (cheaper than asking
        the tree whether it belongs, which only data, lock and children changes can alter)."""
        if node.lru_in & self.bit:
            self.add(node)

    def discard(self, node: Node) -> None:
        e = self._members.pop(node.id, None)
        if e is not None:
            node.lru_in &= ~self.bit
            self.num_pages -= e[3]
            if node.id in self._prot:
                self.protected_pages -= self._prot.pop(node.id)

    def resize(self, node: Node, old_pages: int) -> None:
        """A member was split or joined: its page count changed from ``old_pages``."""
        e = self._members.get(node.id)
        if e is not None:
            e[3] = node.num_pages
            self.num_pages += e[3] - old_pages
            if node.id in self._prot:
                self.protected_pages += e[3] - old_pages
                self._prot[node.id] = e[3]

    def _live(self, seq: int, node: Node) -> Optional[list]:
        """The member entry a heap entry with this seq stands for, or None when the heap entry is stale."""
        e = self._members.get(node.id)
        return e if e is not None and e[1] == seq else None

    def _demote_over_cap(self) -> None:
        """Segmented: demote the least recent protected members while they hold more than their share."""
        # self._pheap each time round: add() may compact it into a new list.
        while self.protected_pages > self.protect * self.num_pages and self._pheap:
            _, seq, node = heapq.heappop(self._pheap)
            e = self._live(seq, node)
            if e is not None and e[0][0]:
                node.demoted_hits = node.hit_count
                self.add(node)   # re-keyed unprotected
        self._maybe_compact()

    def peek(self) -> Optional[Node]:
        """Next member to evict: the least recently used (unprotected first when segmented); None when
        empty."""
        if self.protect and self.protected_pages > self.protect * self.num_pages:
            self._demote_over_cap()
        heap = self._heap
        while heap:
            _, seq, node = heap[0]
            if self._live(seq, node) is not None:
                return node
            heapq.heappop(heap)
        return None

    def ordered(self) -> Iterator[Node]:
        """Members in eviction order, leaving the heap alone (O(n log n): for peeking, not the hot path).
        Segmented: the demotions ``peek`` would make come first, so the order is the one eviction takes."""
        prot = self.protect > 0
        if prot and self.protected_pages > self.protect * self.num_pages:
            self._demote_over_cap()
        return iter(sorted(self.members(), key=lambda n: lru_key(n, self.stamp, prot, self.keep_first)))

    def _maybe_compact(self) -> None:
        """Drop stale entries once they outnumber live ones (both heaps: a long-running server re-keys
        its members on every touch)."""
        if len(self._heap) > 2 * len(self._members) + 64:
            self._heap = [(e[0], e[1], e[2]) for e in self._members.values()]
            heapq.heapify(self._heap)
        if len(self._pheap) > 2 * len(self._prot) + 64:
            self._pheap = [(e[0], e[1], e[2]) for e in map(self._members.__getitem__, self._prot)]
            heapq.heapify(self._pheap)

    def consistent(self) -> bool:
        """Every member has exactly one live heap entry, keyed by its current key, its own bit set and its
        page count right (check_integrity)."""
        live = [(n.id, k) for k, seq, n in self._heap if self._live(seq, n) is not None]
        prot = self.protect > 0
        members = self._members
        protected = {i: e[3] for i, e in members.items() if e[0][0] and not self.keep_first}
        return (len(live) == len(members) and len({i for i, _ in live}) == len(live)
                and all(members[i][0] == k == lru_key(members[i][2], self.stamp, prot, self.keep_first)
                        for i, k in live)
                and all(e[2].lru_in & self.bit and e[2].id == i and e[3] == e[2].num_pages
                        for i, e in members.items())
                and protected == self._prot and self.protected_pages == sum(protected.values())
                and self.num_pages == sum(e[3] for e in members.values())
                and set(self._prot) <= {n.id for k, seq, n in self._pheap if self._live(seq, n) is not None})


class LRULists:
    """The four LRU lists of one tree, (component, tier) for component in (full, swa) and tier in (L1, L2),
    and the membership rule of the module doc. The tree's data changes (tiers.py), locks (locks.py) and
    structure changes (tree.py) call ``refresh`` on what they touched; its hot loops read ``full`` and
    ``swa`` (the L1 and L2 lists of a component) and test a node's ``lru_in`` against their bits
    themselves, since a method call per node was most of a match's cost.

    ``eviction``: ``"lru"``, or ``"slru"`` for segmented full lists (the module doc). SLRU orders the full
    lists only: SWA recency already follows the live window.
    """

    def __init__(self, root: Node, eviction: str = "lru") -> None:
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
        self.root = root   # never a member: refresh ignores it
        protect = SLRU_PROTECTED if eviction == "slru" else 0.0
        self.lists = {(c, t): LRUIndex(f"{c}/{t}", "last_access" if c == FULL else "swa_access",
                                       protect if c == FULL else 0.0, 1 << i, keep_first=c == SWA)
                      for i, (c, t) in enumerate((c, t) for c in COMPONENTS for t in PAGE_TIERS)}
        self.full = (self.lists[(FULL, L1)], self.lists[(FULL, L2)])
        self.swa = (self.lists[(SWA, L1)], self.lists[(SWA, L2)])

    def __getitem__(self, key: tuple[str, str]) -> LRUIndex:
        return self.lists[key]

    def touch(self, node: Node, component: str) -> None:
        """Re-key ``node`` in the lists of ``component`` it is a member of (its access time changed)."""
        for lru in (self.full if component == FULL else self.swa):
            lru.touch(node)

    def discard(self, node: Node) -> None:
        """``node`` leaves the tree (removed, or joined into its child): out of every list."""
        for lru in self.lists.values():
            lru.discard(node)

    def resize(self, node: Node, old_pages: int) -> None:
        """``node`` was split or joined: its page count changed from ``old_pages`` in every list it is in."""
        for lru in self.lists.values():
            lru.resize(node, old_pages)

    def refresh(self, node: Node, component: Optional[str] = None) -> None:
        """Re-file ``node`` in the lists of ``component`` (default: both) after its data, locks or
        children changed."""
        if node is self.root or node.removed:
            return
        # The membership rule of the module doc for both tiers; runs on every data and lock change.
        if component != SWA:
            lru1, lru2 = self.full
            if node.lock_full:
                lru1.discard(node)
                lru2.discard(node)
            else:
                l1 = node.l1_full is not None
                if l1 and not node.child_l1:
                    lru1.add(node)
                else:
                    lru1.discard(node)
                if not l1 and node.l2_full is not None and not node.child_l1 and not node.child_l2:
                    lru2.add(node)
                else:
                    lru2.discard(node)
        if component != FULL:
            lru1, lru2 = self.swa
            if node.lock_swa:
                lru1.discard(node)
                lru2.discard(node)
            elif node.l1_swa is not None:
                lru1.add(node)
                lru2.discard(node)
            else:
                lru1.discard(node)
                if node.l2_swa is not None:
                    lru2.add(node)
                else:
                    lru2.discard(node)
