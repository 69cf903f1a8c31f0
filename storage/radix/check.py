"""RadixTree.check_integrity: recompute everything the tree maintains incrementally and compare.

O(nodes + locks * depth): for tests and debug builds, not the serving hot path. Raises AssertionError
naming the broken invariant with the counts involved.

It reads the tree only through the public, read-only ``TreeView`` below (which RadixTree provides), so
the dependency runs one way: tree.py -> check.py, never back; it recomputes what the tree's parts
(tiers.py, lru.py, locks.py) keep and compares it with what they answer.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterator, Protocol

from storage.hashing import KEY_BYTES
from storage.radix.node import COMPONENTS, FULL, L1, L2, PAGE_TIERS, SWA, Node


class TreeView(Protocol):
    """What the checker reads of a tree (all of it public API of RadixTree)."""

    root: Node
    page_size: int
    num_nodes: int

    def iter_nodes(self) -> Iterator[Node]: ...

    def lock_registry(self) -> Iterator[tuple[str, Node, int]]: ...

    def swa_window_start(self, node: Node) -> int: ...

    def num_pages(self, component: str, tier: str) -> int: ...

    def evictable_pages(self, component: str, tier: str) -> int: ...

    def lru_members(self, component: str, tier: str) -> list[Node]: ...

    def lru_consistent(self, component: str, tier: str) -> bool: ...

    def in_lru(self, node: Node, component: str, tier: str) -> bool: ...


def _fail(msg: str) -> None:
    raise AssertionError(f"radix integrity: {msg}")


def _expected_locks(tree: TreeView) -> tuple[dict[int, Counter], dict[int, Counter]]:
    """Per node id: expected lock counts, and expected SWA window starts, from the lock registry."""
    locks: dict[int, Counter] = {}
    starts: dict[int, Counter] = {}
    for c, d, k in tree.lock_registry():
        if k <= 0:
            _fail(f"lock registry holds {k} {c} locks on {d!r}")
        if d.removed:
            _fail(f"{k} {c} locks held on removed {d!r}")
        x, top = d, None
        start = tree.swa_window_start(d)
        while x is not tree.root and (c == FULL or x.end > start):
            locks.setdefault(x.id, Counter())[c] += k
            top, x = x, x.parent
        if c == SWA and top is not None:
            starts.setdefault(top.id, Counter())[start] += k
    return locks, starts


def check_tree(tree: TreeView) -> None:
    root = tree.root
    if root.keys or root.parent is not None or root.removed:
        _fail("root must have no keys and no parent")
    for c in COMPONENTS:
        if root.lock[c] or any(root.pages(c, t) is not None for t in PAGE_TIERS) or root.l3[c]:
            _fail("the root holds no data and no locks")
    exp_locks, exp_starts = _expected_locks(tree)
    seen_pages = {(c, t): {} for c in COMPONENTS for t in PAGE_TIERS}
    size = Counter()
    n_nodes, ids = 0, set()
    stack: list[Node] = [root]
    while stack:
        node = stack.pop()
        child_full = Counter()
        if node.only is not (next(iter(node.children.values())) if len(node.children) == 1 else None):
            _fail(f"{node!r}.only is {node.only!r} with {len(node.children)} children")
        for key, ch in node.children.items():
            n_nodes += 1
            if ch.id in ids:
                _fail(f"{ch!r} reachable twice")
            ids.add(ch.id)
            if ch.removed or ch.parent is not node:
                _fail(f"{ch!r}: removed={ch.removed}, parent link broken")
            if not ch.keys or ch.keys[0] != key:
                _fail(f"{ch!r} filed under a key that is not its first page key")
            if any(not isinstance(k, bytes) or len(k) != KEY_BYTES for k in ch.keys):
                _fail(f"{ch!r} has a malformed page key")
            if ch.depth != node.end:
                _fail(f"{ch!r} starts at {ch.depth}, parent ends at {node.end}")
            if ch.tokens is not None and len(ch.tokens) != ch.num_pages * tree.page_size:
                _fail(f"{ch!r} has {len(ch.tokens)} tokens for {ch.num_pages} pages")
            _check_node_data(ch, node, root, seen_pages, size)
            for t in PAGE_TIERS:
                child_full[t] += ch.pages(FULL, t) is not None
            _check_node_locks(tree, ch, exp_locks.get(ch.id, Counter()), exp_starts.get(ch.id, Counter()))
            stack.append(ch)
        for t in PAGE_TIERS:
            if node.child_full[t] != child_full[t]:
                _fail(f"{node!r} counts {node.child_full[t]} children with {FULL}/{t}, has {child_full[t]}")
    if n_nodes != tree.num_nodes:
        _fail(f"num_nodes={tree.num_nodes} but {n_nodes} nodes reachable")
    for c in COMPONENTS:
        for t in PAGE_TIERS:
            if tree.num_pages(c, t) != size[(c, t)]:
                _fail(f"size of {c}/{t} is {tree.num_pages(c, t)} but nodes hold {size[(c, t)]} pages")
    _check_lrus(tree, ids)


def _check_node_data(node: Node, parent: Node, root: Node, seen: dict, size: Counter) -> None:
    if not node.has_any(FULL):
        _fail(f"{node!r} holds {FULL} data in no tier")
    if node.l1[FULL] is not None and parent is not root and parent.l1[FULL] is None:
        _fail(f"{node!r} has {FULL}/L1 but its parent {parent!r} does not (L1 closure)")
    if node.swa_keep and not node.has_any(SWA):
        _fail(f"{node!r} is a SWA tombstone flagged as a kept window")
    for c in COMPONENTS:
        if not isinstance(node.l3[c], bool):
            _fail(f"{node!r}: L3 flag of {c} is {node.l3[c]!r}")
        for t in PAGE_TIERS:
            pages = node.pages(c, t)
            if pages is None:
                continue
            if len(pages) != node.num_pages:
                _fail(f"{node!r} has {len(pages)} {c}/{t} pages for {node.num_pages} keys")
            owner = seen[(c, t)]
            for p in pages:
                if not isinstance(p, int) or p < 0:
                    _fail(f"{node!r}: bad {c}/{t} page index {p!r}")
                if p in owner:
                    _fail(f"{c}/{t} page {p} held by {owner[p]!r} and {node!r}")
                owner[p] = node
            size[(c, t)] += len(pages)


def _check_node_locks(tree: TreeView, node: Node, exp: Counter, exp_starts: Counter) -> None:
    for c in COMPONENTS:
        if node.lock[c] < 0:
            _fail(f"{node!r} has a negative {c} lock count")
        if node.lock[c] != exp[c]:
            _fail(f"{node!r} {c} lock count {node.lock[c]}, expected {exp[c]} from the lock registry")
    if node.lock[SWA] and not node.lock[FULL]:
        _fail(f"{node!r} is {SWA}-locked but not {FULL}-locked")
    starts = Counter(node.swa_lock_starts)
    if +starts != exp_starts or len(+starts) != len(starts):
        _fail(f"{node!r} SWA window starts {dict(node.swa_lock_starts)}, expected {dict(exp_starts)}")
    if node.lock[FULL] and node.parent is not tree.root and node.parent.lock[FULL] < node.lock[FULL]:
        _fail(f"{node!r} {FULL}-locked {node.lock[FULL]}x under a parent locked {node.parent.lock[FULL]}x")


def _should_be_in_lru(node: Node, c: str, t: str) -> bool:
    """The LRU membership rule, restated from the children (not the tree's counters)."""
    if node.lock[c]:
        return False
    if t == L1:
        held = node.l1[c] is not None
        hot_children = [ch for ch in node.children.values() if ch.l1[FULL] is not None]
    else:  # L2 only while it is the top copy, so no data is in two lists of one component
        held = node.l2[c] is not None and node.l1[c] is None
        hot_children = [ch for ch in node.children.values()
                        if ch.l1[FULL] is not None or ch.l2[FULL] is not None]
    return held and (c == SWA or not hot_children)


def _check_lrus(tree: TreeView, live_ids: set[int]) -> None:
    nodes = list(tree.iter_nodes())
    for c, t in ((c, t) for c in COMPONENTS for t in PAGE_TIERS):
        members = {n.id for n in tree.lru_members(c, t)}
        if not tree.lru_consistent(c, t):
            _fail(f"LRU {c}/{t} heap disagrees with its members ({len(members)})")
        if members - live_ids:
            _fail(f"LRU {c}/{t} holds {len(members - live_ids)} evicted/removed nodes")
        pages = 0
        for node in nodes:
            want = _should_be_in_lru(node, c, t)
            if want != (node.id in members):
                _fail(f"{node!r} {'missing from' if want else 'wrongly in'} LRU {c}/{t}")
            if tree.in_lru(node, c, t) != (node.id in members):
                _fail(f"{node!r}'s lru_in bits disagree with LRU {c}/{t} membership")
            if want:
                pages += node.num_pages
        if pages != tree.evictable_pages(c, t):
            _fail(f"LRU {c}/{t} counts {tree.evictable_pages(c, t)} pages, members hold {pages}")
    for c in COMPONENTS:
        both = {n.id for n in tree.lru_members(c, L1)} & {n.id for n in tree.lru_members(c, L2)}
        if both:
            _fail(f"{len(both)} nodes in both the L1 and the L2 LRU of {c}")
