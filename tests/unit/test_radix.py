"""Unified SWA-aware radix tree (storage/radix/): one test per operation, then a stateful test that
drives the tree with real PageAllocators and checks every invariant after every step."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from storage.sequence_keys import SequenceKeys
from storage.pools import PageAllocator
from storage.radix import COMPONENTS, FULL, L1, L2, L3, SWA, TIERS, Freed, RadixTree

PS = 2  # tokens per page
W = 2  # SWA window, pages


def seq(n_pages: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n_pages * PS)]


def tree_and_keys(n_pages: int = 6, window: int = W):
    t = RadixTree(PS, window)
    return t, t.page_keys(seq(n_pages))


def swa_last(n: int, pages: list[int], window: int = W) -> list:
    """SWA pages aligned with n pages: only the last `window` get one (what a finished request has)."""
    return [None] * (n - window) + pages[-window:]


def present(t: RadixTree) -> set:
    return {(tier, c, k) for n in t.iter_nodes() for c in COMPONENTS for tier in TIERS if n.has(c, tier)
            for k in n.keys}


# ---------------------------------------------------------------------------------------- insert


def test_insert_new_sequence():
    t, k = tree_and_keys(6)
    r = t.insert(k, [10, 11, 12, 13, 14, 15], swa_last(6, [0, 1]), now=1.0, tokens=seq(6))
    assert r.num_existing == 0 and not r.free_full and not r.free_swa and r.node.end == 6
    # Data presence is per node: the SWA boundary splits the new edge in two.
    assert [n.num_pages for n in r.node.path()] == [4, 2]
    assert t.all_pages(FULL, L1) == [10, 11, 12, 13, 14, 15] and sorted(t.all_pages(SWA, L1)) == [0, 1]
    assert r.node.tokens == seq(6)[8:]
    ev = t.take_events()
    assert [(e.kind, e.tier, e.component, len(e.page_keys)) for e in ev] == [
        ("stored", L1, FULL, 4), ("stored", L1, FULL, 2), ("stored", L1, SWA, 2)]
    assert t.take_events() == []
    t.check_integrity()


def test_insert_duplicates_are_returned_but_own_pages_are_not():
    t, k = tree_and_keys(4)
    t.insert(k, [0, 1, 2, 3], swa_last(4, [0, 1]), now=1)
    r = t.insert(k, [0, 1, 7, 8], [None, None, 5, 1], now=2)  # pages 0,1 and swa 1 are the tree's own
    assert r.num_existing == 4 and r.free_full == [7, 8] and r.free_swa == [5]
    assert t.all_pages(FULL, L1) == [0, 1, 2, 3]
    t.check_integrity()


def test_insert_shared_prefix_splits():
    t = RadixTree(PS, W)
    a, b = t.page_keys(seq(5)), t.page_keys(seq(2) + [99] * 6)
    t.insert(a, [0, 1, 2, 3, 4], swa_last(5, [0, 1]), now=1)  # nodes [0,3) [3,5)
    r = t.insert(b, [0, 6, 7, 8, 9], swa_last(5, [2, 3]), now=2)
    assert r.num_existing == 2 and r.free_full == [6]
    assert t.num_nodes == 5 and [n.num_pages for n in r.node.path()] == [2, 1, 2]  # SWA run cut
    assert sorted(t.all_pages(FULL, L1)) == [0, 1, 2, 3, 4, 7, 8, 9]
    t.check_integrity()


def test_insert_adopts_swa_into_tombstone():
    t, k = tree_and_keys(4)
    t.insert(k, [0, 1, 2, 3], swa_last(4, [0, 1]), now=1)
    assert sorted(t.evict(SWA, L1, 2)[SWA, L1]) == [0, 1]  # tombstone: full stays
    # the tombstone is joined with the full-only node above it (same data, same recency)
    assert t.num_nodes == 1 and t.match_prefix(k, now=2).num_pages == 0
    r = t.insert(k, [0, 1, 2, 3], [None, None, None, 7], now=3)  # only one page: node is split
    assert r.free_swa == [] and t.all_pages(SWA, L1) == [7]
    assert t.match_prefix(k, now=4, window_pages=1).num_pages == 4
    t.check_integrity()


def _two_turns(t, k):
    """Turn 0 (4 pages) then turn 1 (8 pages), each finishing with its last window in SWA: nodes
    [0,2) tombstone, [2,4) turn 0's window, [4,6) tombstone, [6,8) turn 1's window."""
    t.insert(k[:4], [0, 1, 2, 3], swa_last(4, [0, 1]), now=1)
    t.insert(k, list(range(8)), swa_last(8, [6, 7]), now=2)
    assert t.num_nodes == 4
    t.check_integrity()


def test_a_stale_window_losing_swa_joins_its_neighbours():
    t, k = tree_and_keys(8)
    _two_turns(t, k)
    events = len(t.take_events())
    assert sorted(t.evict(SWA, L1, 2)[SWA, L1]) == [0, 1]   # turn 0's window is the stale one
    t.check_integrity()
    assert t.num_nodes == 2 and [n.num_pages for n in t.root.children.values()] == [6]
    m = t.match_prefix(k, now=3)
    assert m.num_pages == 8 and m.l1_full == list(range(8)) and m.l1_swa == [None] * 6 + [6, 7]
    assert events > 0
    t.check_integrity()


def test_joining_only_emits_the_swa_removal():
    t, k = tree_and_keys(8)
    _two_turns(t, k)
    t.take_events()
    t.evict(SWA, L1, 2)
    assert [(e.kind, e.tier, e.component, len(e.page_keys)) for e in t.take_events()] == [("removed", L1, SWA, 2)]


def test_locked_or_differently_recent_nodes_are_not_joined():
    t, k = tree_and_keys(8)
    _two_turns(t, k)
    top = next(iter(t.root.children.values()))
    t.lock(top, FULL)   # a request holds [0, 2): it stays a node of its own
    t.evict(SWA, L1, 2)
    assert t.num_nodes == 3
    t.unlock(top, FULL)
    t.check_integrity()

    t, k = tree_and_keys(8)
    _two_turns(t, k)
    t.match_prefix(k[:2], now=5, window_pages=0)   # [0, 2) seen again: more recent than the rest
    t.evict(SWA, L1, 2)   # turn 0's window: joins [4, 6) below it, not [0, 2) above
    (top,) = t.root.children.values()
    (mid,) = top.children.values()
    assert t.num_nodes == 3 and (top.num_pages, mid.num_pages) == (2, 4)
    t.check_integrity()


def test_insert_adopts_full_into_l2_only_node():
    t, k = tree_and_keys(3)
    r = t.insert(k, [0, 1, 2], [None, None, 0], now=1)
    for n in r.node.path():
        t.set_l2(n, FULL, [n.depth + 100 + i for i in range(n.num_pages)])
    freed = t.evict(FULL, L1, 3)
    assert sorted(freed[FULL, L1]) == [0, 1, 2] and t.num_nodes == 2
    r = t.insert(k, [5, 6, 7], [None, None, 3], now=2)
    assert r.free_full == [] and r.free_swa == [3] and t.all_pages(FULL, L1) == [5, 6, 7]
    t.check_integrity()


def test_insert_rejects_bad_input():
    t, k = tree_and_keys(2)
    with pytest.raises(ValueError):
        t.insert(k, [0], now=0)
    with pytest.raises(ValueError):
        t.insert(k, [0, None], now=0)
    with pytest.raises(ValueError):
        t.insert(k, [0, 1], [None], now=0)
    with pytest.raises(ValueError):
        t.insert(k, [0, 1], now=0, tokens=[1])
    with pytest.raises(ValueError):
        RadixTree(0, 1)
    with pytest.raises(ValueError):
        RadixTree(2, -1)


# ---------------------------------------------------------------------------------------- match


def test_match_respects_swa_window():
    t, k = tree_and_keys(8)
    t.insert(k, list(range(8)), swa_last(8, [0, 1]), now=1)
    assert t.match_prefix(k, now=2).num_pages == 8
    # Pages 6..7 have SWA; a match ending at 7 needs pages 5..6, page 5 is a tombstone -> 0.
    assert t.match_prefix(k[:7], now=3).num_pages == 0
    assert t.match_prefix(k[:7], now=3, window_pages=1).num_pages == 7
    assert t.match_prefix(k[:5], now=3, window_pages=0).num_pages == 5
    m = t.match_prefix(k + t.page_keys([77, 77]), now=4)
    assert (m.num_pages, m.matched_pages, m.swa_window, m.swa_l1) == (8, 8, 2, 2)
    assert t.match_prefix([], now=5).num_pages == 0
    t.check_integrity()


def test_match_falls_back_to_earlier_swa_run():
    t = RadixTree(PS, W)
    k = t.page_keys(seq(8))
    t.insert(k[:4], [0, 1, 2, 3], swa_last(4, [0, 1]), now=1)  # turn 1: SWA on pages 2..3
    r = t.insert(k, list(range(8)), swa_last(8, [2, 3]), now=2)  # turn 2: SWA on pages 6..7
    # Turn 1's window is stale (turn 2 refreshed SWA only inside its own window); a match ending at
    # page 4 makes it the recent one, so turn 2's window goes first.
    assert t.match_prefix(k[:4], now=3).num_pages == 4
    assert sorted(t.evict(SWA, L1, 1)[SWA, L1]) == [2, 3]
    m = t.match_prefix(k, now=3)
    assert (m.num_pages, m.matched_pages) == (4, 8) and m.node.end == 4
    # An SWA copy in L3 makes the window usable again, served from L3.
    t.set_l3(r.node, SWA, True)
    m = t.match_prefix(k, now=4)
    assert (m.num_pages, m.swa_window, m.swa_l1, m.swa_l3) == (8, 2, 0, 2)
    assert t.set_l3(r.node, SWA, False).total() == 0 and t.match_prefix(k, now=5).num_pages == 4
    t.check_integrity()


def test_swa_refresh_is_limited_to_the_window_so_the_live_window_outlives_stale_ones():
    """Issue #22: match and insert touch the whole path for full, but only the window before their end
    for SWA. Under SWA pressure the stale window of an earlier turn goes before the live one, so the
    conversation's next turn still matches all the way."""
    t = RadixTree(PS, W)
    a, b = t.page_keys(seq(8)), t.page_keys(seq(2, 500))
    t.insert(a[:4], [0, 1, 2, 3], swa_last(4, [0, 1]), now=1)      # conversation A, turn 1: window [2, 4)
    t.insert(b, [10, 11], [10, 11], now=2)                           # conversation B
    assert t.match_prefix(a, now=3).num_pages == 4                   # A, turn 2 continues from page 4...
    r = t.insert(a, list(range(8)), swa_last(8, [2, 3]), now=3)      # ...and leaves its window [6, 8)
    stale, live = [n for n in r.node.path() if n.l1[SWA] is not None]
    assert (stale.last_access, live.last_access) == (3, 3)          # full: the whole path is hot
    assert (stale.swa_access, live.swa_access) == (3, 3)            # turn 2's match ended at stale's end
    t.match_prefix(a, now=4)
    assert (stale.last_access, stale.swa_access, live.swa_access) == (4, 3, 4)
    # SWA pressure: B's window (older) and A's stale one go; a whole-path refresh made the stale window
    # as recent as the live one and, deeper first, evicted the live one instead.
    assert sorted(t.evict(SWA, L1, 4)[SWA, L1]) == [0, 1, 10, 11]
    assert t.match_prefix(a, now=5).num_pages == 8
    assert t.match_prefix(a[:4], now=5).num_pages == 0              # the stale window is gone, as wanted
    t.check_integrity()


def test_match_short_sequence_needs_swa_from_page_zero():
    t, k = tree_and_keys(1)
    t.insert(k, [0], [5], now=1)  # shorter than the window: usable (nothing before page 0)
    assert t.match_prefix(k, now=2).num_pages == 1


def test_match_splits_mid_node_and_touches_path():
    t, k = tree_and_keys(6)
    t.insert(k, list(range(6)), list(range(6)), now=1, keep_end=False)   # one node: no kept window cut
    m = t.match_prefix(k[:3], now=7)
    assert m.num_pages == 3 and m.node.end == 3 and t.num_nodes == 2
    assert m.l1_full == [0, 1, 2] and m.l1_swa == [None, 1, 2] and m.full_l1 == 3   # SWA: the window only
    assert (m.node.last_access, m.node.hit_count) == (7, 1)
    lower = next(iter(m.node.children.values()))
    assert (lower.last_access, lower.hit_count) == (1, 0)
    assert t.take_events()[-1].kind == "stored"  # the split emitted nothing
    t.check_integrity()


def test_match_reports_tiers():
    t, k = tree_and_keys(6)
    t.insert(k[:2], [0, 1], [0, 1], now=1)
    t.insert(k[:4], [0, 1, 2, 3], [None, None, 2, 3], now=2)
    r = t.insert(k, list(range(6)), swa_last(6, [4, 5]), now=3)
    n1, n2, n3 = r.node.path()
    t.set_l2(n2, FULL, [20, 21])
    t.set_l3(n3, FULL, True)
    assert sorted(t.evict(FULL, L1, 4)[FULL, L1]) == [2, 3, 4, 5]  # leaf first, then its parent
    m = t.match_prefix(k, now=4)
    assert (m.num_pages, m.full_l1, m.full_l2, m.full_l3) == (6, 2, 2, 2)
    assert m.l1_full == [0, 1] and m.nodes == [n1, n2, n3]
    t.check_integrity()


# ---------------------------------------------------------------------------------------- locks


def test_full_lock_is_a_path_lock_and_blocks_eviction():
    t, k = tree_and_keys(4)
    r = t.insert(k, [0, 1, 2, 3], swa_last(4, [0, 1]), now=1)
    top = t.match_prefix(k[:2], now=2, window_pages=0).node
    t.lock(r.node, FULL)
    assert top.lock[FULL] == 1 and t.evict(FULL, L1, 4).total() == 0
    t.unlock(r.node, FULL)
    assert top.lock[FULL] == 0 and len(t.evict(FULL, L1, 4)[FULL, L1]) == 4
    with pytest.raises(ValueError):
        t.unlock(r.node, FULL)  # never negative
    with pytest.raises(ValueError):
        t.lock(r.node, FULL)  # removed node
    t.check_integrity()


def test_swa_lock_covers_only_the_window():
    t, k = tree_and_keys(6)
    t.insert(k, list(range(6)), list(range(6)), now=1, keep_end=False)   # one node: no kept window cut
    t.match_prefix(k[:2], now=2)
    m = t.match_prefix(k[:5], now=3)  # nodes [0,2) [2,5) [5,6)
    with pytest.raises(ValueError):
        t.lock(m.node, SWA)  # SWA lock requires the full lock
    t.lock(m.node, FULL)
    t.lock(m.node, SWA)
    first, second = m.nodes
    assert (first.lock[SWA], second.lock[SWA]) == (0, 1)  # window [3,5) is inside the second node
    with pytest.raises(ValueError):
        t.unlock(m.node, FULL)  # would leave a SWA-locked node without its full lock
    freed = t.evict(SWA, L1, 10)
    assert sorted(freed[SWA, L1]) == [0, 1, 5]
    # Split the locked node inside and outside the window: counts follow the window.
    t.match_prefix(k[:3], now=4, window_pages=0)
    t.match_prefix(k[:4], now=4, window_pages=0)
    assert [n.lock[SWA] for n in m.node.path()] == [0, 0, 1, 1]
    t.check_integrity()
    t.unlock(m.node, SWA)
    t.unlock(m.node, FULL)
    assert all(n.lock[c] == 0 for n in t.iter_nodes() for c in COMPONENTS)
    t.check_integrity()


def test_lock_root_is_a_noop():
    t = RadixTree(PS, W)
    for c in COMPONENTS:
        t.lock(t.root, c)
    with pytest.raises(RuntimeError):
        t.flush()
    for c in (SWA, FULL):
        t.unlock(t.root, c)
    t.check_integrity()


# ---------------------------------------------------------------------------------------- evict


def test_lru_order_and_leaf_first():
    t = RadixTree(PS, 0)
    a, b = t.page_keys(seq(2, 100)), t.page_keys(seq(3, 200))
    t.insert(a, [0, 1], now=1)
    rb = t.insert(b, [2, 3, 4], now=2)
    assert t.evictable(FULL, L1, 1)[0].keys == a and t.evictable_pages(FULL, L1) == 5
    assert t.evict(FULL, L1, 1)[FULL, L1] == [0, 1]
    t.match_prefix(b[:1], now=3)  # split: the upper node is newer but has a child: the leaf goes first
    assert t.evictable(FULL, L1, 10) == [rb.node]
    assert t.evict(FULL, L1, 1)[FULL, L1] == [3, 4]
    assert t.evict(FULL, L1, 1)[FULL, L1] == [2]
    assert t.num_nodes == 0 and t.evict(FULL, L1, 1).total() == 0
    t.check_integrity()


def test_evict_demotes_through_tiers_and_removes_last_copy():
    t, k = tree_and_keys(2)
    r = t.insert(k, [0, 1], [0, 1], now=1)
    node = r.node
    t.set_l2(node, FULL, [10, 11])
    t.set_l2(node, SWA, [12, 13])
    t.set_l3(node, FULL, True)
    assert t.evict(FULL, L1, 1)[FULL, L1] == [0, 1] and not node.removed
    assert node in t.evictable(FULL, L2, 1) and t.evictable(FULL, L1, 1) == []
    assert t.evict(FULL, L2, 1)[FULL, L2] == [10, 11] and node.best_tier(FULL) == L3
    assert t.evict(SWA, L1, 1)[SWA, L1] == [0, 1] and node.best_tier(SWA) == L2
    t.take_events()
    freed = t.set_l3(node, FULL, False)  # last full copy gone: node removed with its SWA data
    assert node.removed and freed[SWA, L2] == [12, 13] and t.num_nodes == 0
    kinds = {(e.kind, e.tier, e.component) for e in t.take_events()}
    assert kinds == {("removed", L3, FULL), ("removed", L2, SWA)}
    t.check_integrity()


def test_evict_without_backup_removes_subtree_with_collateral():
    t, k = tree_and_keys(4)
    t.insert(k[:2], [0, 1], [0, 1], now=1)
    r = t.insert(k, [0, 1, 2, 3], [0, 1, 2, 3], now=2)
    t.set_l2(r.node, FULL, [20, 21])
    t.evict(FULL, L1, 2)  # the child keeps an L2 copy; its parent has none
    freed = t.evict(FULL, L1, 2)
    assert freed[FULL, L1] == [0, 1] and freed[FULL, L2] == [20, 21]
    assert sorted(freed[SWA, L1]) == [0, 1, 2, 3] and t.num_nodes == 0
    t.check_integrity()


def test_on_evict_write_back():
    t, k = tree_and_keys(3)
    t.insert(k, [0, 1, 2], [None, 0, 1], now=1)
    host = iter(range(100, 200))
    seen = []

    def back_up(node, c, tier):
        seen.append((node.end, c, tier))
        if node.l2[c] is None:
            t.set_l2(node, c, [next(host) for _ in range(node.num_pages)])

    freed = t.evict(FULL, L1, 3, on_evict=back_up)
    assert sorted(freed[FULL, L1]) == [0, 1, 2] and seen == [(3, FULL, L1), (1, FULL, L1)]
    assert t.num_nodes == 2 and t.num_pages(FULL, L2) == 3 and t.num_pages(SWA, L1) == 2
    m = t.match_prefix(k, now=2)
    assert (m.num_pages, m.full_l2, m.swa_l1) == (3, 3, 2)
    t.check_integrity()


def test_set_tier_rules():
    t, k = tree_and_keys(2)
    r = t.insert(k, [0, 1], [0, 1], now=1)
    n = r.node
    with pytest.raises(ValueError):
        t.set_l1(n, FULL, [5, 6])  # already in L1
    with pytest.raises(ValueError):
        t.set_l2(n, FULL, [5])  # wrong length
    with pytest.raises(ValueError):
        t.set_l2(t.root, FULL, [])
    t.set_l2(n, FULL, [5, 6])
    with pytest.raises(ValueError):
        t.set_l2(n, FULL, [7, 8])
    t.evict(FULL, L1, 2)
    with pytest.raises(ValueError):
        t.set_l2(n, FULL, None)  # last full copy: must go through evict
    t.lock(n, FULL)
    t.set_l3(n, FULL, True)
    with pytest.raises(ValueError):
        t.set_l2(n, FULL, None)  # locked, and L2 is the top copy (a load-back may be reading it)
    t.unlock(n, FULL)
    assert t.set_l2(n, FULL, None) == [5, 6] and t.set_l2(n, FULL, None) is None
    t.set_l1(n, FULL, [3, 4])
    assert t.match_prefix(k, now=2).l1_full == [3, 4]
    t.check_integrity()


def test_set_l1_requires_parent_in_l1():
    t, k = tree_and_keys(3)
    t.insert(k[:1], [0], [0], now=1)
    r = t.insert(k, [0, 1, 2], [0, 1, 2], now=2)
    for n in r.node.path():
        t.set_l3(n, FULL, True)
    t.evict(FULL, L1, 3)
    with pytest.raises(ValueError):
        t.set_l1(r.node, FULL, [7, 8])
    t.set_l1(r.node.parent, FULL, [9])
    t.set_l1(r.node, FULL, [7, 8])
    t.check_integrity()


# ---------------------------------------------------------------------------------------- owners, flush, checks


def test_owners_flush_and_allocators():
    full, swa = PageAllocator(8, "full"), PageAllocator(4, "swa")
    t, k = tree_and_keys(6)
    pages = full.alloc(6)
    w = swa.alloc(2)
    t.insert(k, pages, swa_last(6, w), now=1)
    full.check_integrity(t.owners()[FULL])
    swa.check_integrity(t.owners()[SWA])
    freed = t.flush()
    full.free(freed[FULL, L1])
    swa.free(freed[SWA, L1])
    assert full.num_free == 8 and swa.num_free == 4 and t.num_nodes == 0
    assert {e.kind for e in t.take_events()} == {"stored", "removed"} and present(t) == set()
    t.check_integrity()


@pytest.mark.parametrize("tamper", ["dup_page", "lock", "lru", "key", "no_full", "closure", "len", "only",
                                    "lru_bits"])
def test_check_integrity_catches_corruption(tamper):
    t, k = tree_and_keys(4)
    t.insert(k[:2], [0, 1], [0, 1], now=1)
    r = t.insert(k, [0, 1, 2, 3], [0, 1, 2, 3], now=2)
    n, p = r.node, r.node.parent
    t.check_integrity()
    if tamper == "dup_page":
        n.l1[FULL] = [0, 3]
    elif tamper == "lock":
        n.lock[FULL] = 1  # not in the registry, and the parent is not locked
    elif tamper == "lru":
        t.lru[(SWA, L1)].discard(p)
    elif tamper == "key":
        p.children = {b"x" * 16: n}
    elif tamper == "no_full":
        n.l1[FULL] = None
        t.tiers._sizes[(FULL, L1)] -= 2
        p.child_full[L1] -= 1
    elif tamper == "closure":
        p.l2[FULL], p.l1[FULL] = p.l1[FULL], None
    elif tamper == "len":
        n.l1[SWA] = [2]
    elif tamper == "only":   # p's only child, not remembered as such
        p.only = None
    elif tamper == "lru_bits":   # a member of the full L1 list whose own bits deny it
        n.lru_in = 0
    with pytest.raises(AssertionError):
        t.check_integrity()


def test_storage_never_imports_ray_engine_cluster_actors():
    banned = {"ray", "engine", "cluster", "actors"}
    for path in (Path(__file__).parents[2] / "storage").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in banned for n in names), (path, names)


# ---------------------------------------------------------------------------------------- stateful

BASES = [[0, 1, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0], [0, 1, 0, 1, 0, 0, 1, 1], [1, 1, 0, 0, 1, 0, 1, 0, 0, 1]]
token_seqs = st.builds(lambda b, cut, tail: BASES[b][:cut] + tail, st.integers(0, len(BASES) - 1),
                       st.integers(0, 12), st.lists(st.integers(0, 1), max_size=6))
node_pick = st.integers(0, 10**6)
POOL = {(FULL, L1): 24, (SWA, L1): 8, (FULL, L2): 24, (SWA, L2): 8}


def reference_match(t: RadixTree, keys: list, w: int) -> tuple[int, list]:
    """Brute force over pages: (largest usable m, per-page best full tier of the first m pages)."""
    pages, node, i = [], t.root, 0  # per matched page: (best full tier, best swa tier)
    while i < len(keys) and keys[i] in node.children:
        node = node.children[keys[i]]
        for j, k in enumerate(node.keys):
            if i + j == len(keys) or keys[i + j] != k:
                break
            pages.append((node.best_tier(FULL), node.best_tier(SWA)))
        else:
            i += node.num_pages
            continue
        break
    usable = [m for m in range(len(pages) + 1) if all(s for _, s in pages[max(0, m - w):m])]
    return max(usable), [f for f, _ in pages[:max(usable)]]


class Request:
    """A running request: it borrows the tree's L1 prefix under lock and owns the rest."""

    def __init__(self, keys, node, full_pages, swa_pages, own):
        self.keys, self.node, self.full, self.swa, self.own = keys, node, full_pages, swa_pages, own
        self.borrowed_full = [p for p in full_pages if p not in own[FULL, L1]]
        self.borrowed_swa = {i: p for i, p in enumerate(swa_pages) if p is not None and p not in own[SWA, L1]}


class TreeMachine(RuleBasedStateMachine):
    """The tree as a worker drives it: requests match/lock/borrow/finish, the controller evicts (with
    and without write-back), backs up, loads back and loses L3 copies, over real allocators. After
    every step: tree.check_integrity(), each allocator's check_integrity(owners), borrowed pages still
    in place, locks cover each request's path and window, match agrees with a brute-force oracle,
    and replaying the KV events reproduces exactly what the tree holds."""

    EVICTION = "lru"

    def __init__(self):
        super().__init__()
        self.tree = RadixTree(PS, W, eviction=self.EVICTION)
        self.alloc = {key: PageAllocator(n, f"{key[0]}/{key[1]}") for key, n in POOL.items()}
        self.reqs: dict[int, Request] = {}
        self.extra_locks: list = []  # (node, component) held outside any request
        self.model: set = set()  # (tier, component, key) rebuilt from the KV events alone
        self.now, self.next_rid = 0.0, 0

    # -- helpers
    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def release(self, freed: Freed) -> None:
        for key, pages in freed.items():
            self.alloc[key].free(pages)

    def alloc_pages(self, c: str, tier: str, n: int, may_evict: bool = True):
        a = self.alloc[(c, tier)]
        if not a.can_alloc(n) and may_evict:
            self.release(self.tree.evict(c, tier, n - a.num_free))  # eviction under lock included
        return a.alloc(n) if a.can_alloc(n) else None

    def pick(self, i: int, where=lambda n: True):
        """The i-th (mod count) node satisfying ``where``, to steer rules at nodes they can act on."""
        nodes = [n for n in self.tree.iter_nodes() if where(n)]
        return nodes[i % len(nodes)] if nodes else None

    # -- rules
    @rule(tokens=token_seqs, lazy=st.booleans(), fused=st.booleans(), interior=st.booleans())
    def start(self, tokens, lazy=False, fused=False, interior=False):
        t = self.tree
        keys = t.sequence_keys(tokens) if lazy else t.page_keys(tokens)
        m = self.checked_match(keys, lock=fused)   # fused: match_prefix takes both locks itself
        assert m.num_pages <= m.matched_pages <= len(keys)
        assert m.full_l1 + m.full_l2 + m.full_l3 == m.num_pages == len(m.l1_swa)
        assert m.swa_l1 + m.swa_l2 + m.swa_l3 == m.swa_window == min(W, m.num_pages)
        if not fused:
            t.lock(m.node, FULL)
            t.lock(m.node, SWA)
        n, own = len(keys), {key: [] for key in POOL}
        full = self.alloc_pages(FULL, L1, n - m.full_l1)
        # interior: the sliding KV of every page the request computes, not only its last window
        window = range(min(m.num_pages, max(0, n - W)) if interior else max(0, n - W), n)
        swa = [None] * n
        need = [i for i in window if not (i < m.num_pages and m.l1_swa[i] is not None)]
        swa_own = self.alloc_pages(SWA, L1, len(need)) if full is not None else None
        if full is None or swa_own is None:  # no room even after eviction: the request is refused
            self.alloc[(FULL, L1)].free(full or [])
            t.unlock(m.node, SWA)
            t.unlock(m.node, FULL)
            return
        for i in window:
            swa[i] = m.l1_swa[i] if i not in need else swa_own[need.index(i)]
        own[FULL, L1], own[SWA, L1] = full, swa_own
        self.reqs[self.next_rid] = Request(keys, m.node, m.l1_full + full, swa, own)
        self.next_rid += 1

    @rule(tokens=token_seqs, write_through=st.booleans(), l3=st.booleans(), lazy=st.booleans())
    def serve(self, tokens, write_through, l3, lazy):
        """A whole request (start + finish), then the write-through policy backs its path up."""
        rid = self.next_rid
        self.start(tokens, lazy)
        if rid not in self.reqs:
            return
        r = self.finish_request(rid)
        if r.node.removed or not (write_through or l3):
            return
        for n in self.tree.match_prefix(r.keys, now=self.tick()).nodes:
            for c in COMPONENTS:
                if write_through and n.l2[c] is None and n.has_any(c):
                    pages = self.alloc_pages(c, L2, n.num_pages)
                    if pages is None or n.removed or len(pages) != n.num_pages or n.l2[c] is not None:
                        self.alloc[(c, L2)].free(pages or [])
                        return
                    self.tree.set_l2(n, c, pages)
                if l3 and n.has_any(c):
                    self.tree.set_l3(n, c, True)

    @rule(tokens=token_seqs)
    def load_back_path(self, tokens):
        """The controller's load-back of a match's L2/L3 part into L1, in path order."""
        for n in self.tree.match_prefix(self.tree.page_keys(tokens), now=self.tick()).nodes:
            if n.removed or n.l1[FULL] is not None:
                continue
            pages = self.alloc_pages(FULL, L1, n.num_pages, may_evict=False)
            if pages is None:
                return
            self.tree.set_l1(n, FULL, pages)

    @precondition(lambda self: self.reqs)
    @rule(i=node_pick)
    def finish(self, i):
        self.finish_request(sorted(self.reqs)[i % len(self.reqs)])

    def finish_request(self, rid: int) -> Request:
        r = self.reqs.pop(rid)
        # kept windows: the end (or not, as a prompt's chunk), a checkpoint halfway, a message end
        res = self.tree.insert(r.keys, r.full, r.swa, now=self.tick(), keep_end=rid % 3 != 0,
                               checkpoints=[len(r.keys) // 2], boundaries=[len(r.keys) // 3])
        assert set(res.free_full) <= set(r.own[FULL, L1]) and set(res.free_swa) <= set(r.own[SWA, L1])
        self.alloc[(FULL, L1)].free(res.free_full)
        self.alloc[(SWA, L1)].free(res.free_swa)
        assert res.node.end == len(r.keys)
        self.tree.unlock(r.node, SWA)
        self.tree.unlock(r.node, FULL)
        return r

    @precondition(lambda self: self.reqs)
    @rule(i=node_pick)
    def abort(self, i):
        rid = sorted(self.reqs)[i % len(self.reqs)]
        r = self.reqs.pop(rid)
        if any(n.lock[FULL] == 1 and n.lock[SWA] for n in r.node.path()):
            with pytest.raises(ValueError):
                self.tree.unlock(r.node, FULL)  # wrong order is refused, nothing changes
        self.tree.unlock(r.node, SWA)
        self.tree.unlock(r.node, FULL)
        self.release_own(r)

    def release_own(self, r: Request) -> None:
        for key, pages in r.own.items():
            self.alloc[key].free(pages)

    def checked_match(self, keys, window=None, lock=False):
        w = W if window is None else window
        lazy = isinstance(keys, SequenceKeys)
        # The oracle hashes on its own copy: the lazy keys must come out of the match itself.
        hashed = self.tree.page_keys(keys.tokens)[:len(keys)] if lazy else keys
        want_m, want_tiers = reference_match(self.tree, hashed, w)
        m = self.tree.match_prefix(keys, now=self.tick(), window_pages=window, lock=lock)
        assert m.num_pages == want_m and m.node.end == want_m
        if lazy:  # keys taken from the tree's edges are the ones hashing gives
            assert keys[:keys.num_known] == hashed[:keys.num_known] and list(keys) == hashed
        assert (m.full_l1, m.full_l2, m.full_l3) == tuple(want_tiers.count(x) for x in (L1, L2, L3))
        assert m.l1_full == [p for n in m.nodes if n.l1[FULL] is not None for p in n.l1[FULL]]
        return m

    @rule(tokens=token_seqs, window=st.sampled_from([None, 0, 1, 3]), lazy=st.booleans(), lock=st.booleans())
    def match_only(self, tokens, window, lazy, lock):
        t = self.tree
        m = self.checked_match(t.sequence_keys(tokens) if lazy else t.page_keys(tokens), window, lock)
        if lock:   # held outside any request (the tree's own W, whatever the query's)
            self.extra_locks += [(m.node, FULL), (m.node, SWA)]

    @rule(c=st.sampled_from(COMPONENTS), tier=st.sampled_from([L1, L2]), n=st.integers(1, 12),
          write_back=st.booleans())
    def evict(self, c, tier, n, write_back):
        def back_up(node, comp, t):
            if t == L1 and node.l2[comp] is None:
                pages = self.alloc_pages(comp, L2, node.num_pages, may_evict=False)
                if pages is not None:
                    self.tree.set_l2(node, comp, pages)

        before = self.tree.evictable_pages(c, tier)
        freed = self.tree.evict(c, tier, n, on_evict=back_up if write_back else None)
        assert len(freed[c, tier]) >= min(n, before) or write_back
        self.release(freed)

    @rule(i=node_pick, c=st.sampled_from(COMPONENTS))
    def backup(self, i, c):
        node = self.pick(i, lambda n: n.l2[c] is None)
        if node is not None:
            pages = self.alloc_pages(c, L2, node.num_pages)
            # the eviction that made room may have removed the node or joined it with a neighbour
            if pages is not None and not node.removed and len(pages) == node.num_pages and node.l2[c] is None:
                self.tree.set_l2(node, c, pages)
            elif pages is not None:
                self.alloc[(c, L2)].free(pages)

    @rule(i=node_pick, c=st.sampled_from(COMPONENTS))
    def drop_l2(self, i, c):
        node = self.pick(i, lambda n: n.l2[c] is not None)
        if node is None:
            return
        top = node.l1[c] is None
        if top and (node.lock[c] or (c == FULL and not node.l3[c])):
            with pytest.raises(ValueError):
                self.tree.set_l2(node, c, None)
            return
        self.alloc[(c, L2)].free(self.tree.set_l2(node, c, None))

    @rule(i=node_pick, c=st.sampled_from(COMPONENTS), flag=st.booleans(), only_copy=st.booleans())
    def l3(self, i, c, flag, only_copy):
        def last_copy(n):
            return n.l3[c] and n.l1[c] is None and n.l2[c] is None

        node = self.pick(i, lambda n: n.l3[c] != flag and (flag or not only_copy or last_copy(n)))
        if node is None:
            return
        only = node.l3[c] and node.l1[c] is None and node.l2[c] is None
        if not flag and only and node.lock[c]:
            with pytest.raises(ValueError):
                self.tree.set_l3(node, c, flag)
            return
        self.release(self.tree.set_l3(node, c, flag))

    @rule(c=st.sampled_from(COMPONENTS), l2=st.booleans())
    def offload_then_lose_l3(self, c, l2):
        """The LRU victim goes to L3 only (or L2 + L3), then the store loses it: a removal (full) or a
        tombstone (SWA), or refused while locked."""
        victims = self.tree.evictable(c, L1, 1)
        if not victims or (victims[0].l2[c] is not None and not l2):
            return
        v = victims[0]
        self.tree.set_l3(v, c, True)
        self.release(self.tree.evict(c, L1, v.num_pages))
        assert v.removed or v.l1[c] is None
        if v.removed:
            return
        if l2 and v.l2[c] is not None:  # evict from L2 too, so L3 is the only copy
            if v not in self.tree.evictable(c, L2, 1 << 30):
                return
            while not v.removed and v.l2[c] is not None:
                self.release(self.tree.evict(c, L2, 1))
        if not v.removed and v.lock[c] == 0:
            self.release(self.tree.set_l3(v, c, False))
            assert v.removed if c == FULL else v.best_tier(SWA) is None

    @rule(i=node_pick, c=st.sampled_from(COMPONENTS))
    def load_back(self, i, c):
        node = self.pick(i, lambda n: n.l1[c] is None)
        if node is None:
            return
        if c == FULL and node.parent is not self.tree.root and node.parent.l1[FULL] is None:
            with pytest.raises(ValueError):
                self.tree.set_l1(node, c, [0] * node.num_pages)
            return
        pages = self.alloc_pages(c, L1, node.num_pages, may_evict=False)
        if pages is not None:
            self.tree.set_l1(node, c, pages)

    @rule(i=node_pick, swa=st.booleans())
    def extra_lock(self, i, swa):
        node = self.pick(i)
        if node is not None:
            self.tree.lock(node, FULL)
            self.extra_locks.append((node, FULL))
            if swa:
                self.tree.lock(node, SWA)
                self.extra_locks.append((node, SWA))

    @precondition(lambda self: self.extra_locks)
    @rule()
    def extra_unlock(self):
        node, c = self.extra_locks.pop()
        self.tree.unlock(node, c)

    # -- invariants
    @invariant()
    def integrity(self):
        t = self.tree
        t.check_integrity()
        for key, a in self.alloc.items():
            owners = {"tree": t.all_pages(*key)}
            owners.update({f"req{rid}": r.own[key] for rid, r in self.reqs.items()})
            a.check_integrity(owners)
        for r in self.reqs.values():  # what a request borrows is still the tree's, at the same place
            assert (r.node is t.root or r.node.lock[FULL] > 0) and not r.node.removed
            path = r.node.path()
            assert all(n.lock[FULL] > 0 for n in path)
            assert all(n.lock[SWA] > 0 for n in path if n.end > r.node.end - W)  # the window is pinned
            l1 = [p for n in path if n.l1[FULL] is not None for p in n.l1[FULL]]
            assert l1[:len(r.borrowed_full)] == r.borrowed_full
            swa_at = {n.depth + j: p for n in path if n.l1[SWA] is not None for j, p in enumerate(n.l1[SWA])}
            assert all(swa_at.get(i) == p for i, p in r.borrowed_swa.items())
        for e in t.take_events():
            for k in e.page_keys:
                item = (e.tier, e.component, k)
                if e.kind == "stored":
                    assert item not in self.model
                    self.model.add(item)
                else:
                    self.model.remove(item)
        assert self.model == present(t)

    def teardown(self):
        for r in self.reqs.values():
            self.tree.unlock(r.node, SWA)
            self.tree.unlock(r.node, FULL)
            self.release_own(r)
        for node, c in reversed(self.extra_locks):
            self.tree.unlock(node, c)
        self.release(self.tree.flush())
        self.tree.check_integrity()
        assert self.tree.num_nodes == 0 and present(self.tree) == set()
        assert all(a.num_free == a.num_pages for a in self.alloc.values())
        assert {(e.tier, e.component, k) for e in self.tree.take_events() for k in e.page_keys} == self.model


TreeMachine.TestCase.settings = settings(max_examples=2000, stateful_step_count=20, deadline=None,
                                         derandomize=True, suppress_health_check=[HealthCheck.too_slow])
test_tree_machine = TreeMachine.TestCase


class SlruTreeMachine(TreeMachine):
    """The same machine over a segmented-LRU tree (prefix_eviction: slru): every invariant holds, the
    protected share included (storage/radix/lru.py consistent())."""

    EVICTION = "slru"


SlruTreeMachine.TestCase.settings = settings(max_examples=600, stateful_step_count=20, deadline=None)
test_slru_tree_machine = SlruTreeMachine.TestCase


def test_slru_evicts_the_never_reused_tail_before_a_reused_prefix():
    """Two conversations: A's turn-1 prefix was reused (turn 2 matched it), B's single turn never was.
    Plain LRU evicts A's prefix (least recent); SLRU evicts B's never-reused pages first."""
    out = {}
    for eviction in ("lru", "slru"):
        t = RadixTree(PS, 0, eviction=eviction)
        a1, b = seq(4, 0), seq(4, 1000)
        t.insert(t.page_keys(a1), list(range(4)), now=1)
        m = t.match_prefix(t.page_keys(a1 + seq(2, 500)), now=2)   # A's turn 2 reuses turn 1...
        assert m.num_pages == 4
        t.insert(t.page_keys(b), list(range(10, 14)), now=3)       # ...then B arrives, never reused
        freed = t.evict(FULL, L1, 4)
        out[eviction] = sorted(freed[FULL, L1])
        t.check_integrity()
    assert out == {"lru": [0, 1, 2, 3], "slru": [10, 11, 12, 13]}
    with pytest.raises(ValueError, match="eviction"):
        RadixTree(PS, W, eviction="mru")


def test_slru_heaps_stay_bounded_under_repeated_touches():
    """A long-running server re-keys its members on every match: stale heap entries are dropped, in the
    protected heap too (it used to grow with every touch)."""
    t = RadixTree(PS, 0, eviction="slru")
    keys = [t.page_keys(seq(2, 1000 * i)) for i in range(8)]
    for i, k in enumerate(keys):
        t.insert(k, [2 * i, 2 * i + 1], now=i)
    for step in range(5000):
        t.match_prefix(keys[step % 8], now=10 + step)
    lru = t.lru[(FULL, L1)]
    assert lru.protected_pages == 16 and len(lru._heap) <= 2 * 8 + 64 + 1 and len(lru._pheap) <= 2 * 8 + 64 + 1
    t.check_integrity()
