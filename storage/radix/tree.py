"""The unified, SWA-aware, tiered radix tree of one worker (pure bookkeeping: no tensors, no clock).

The tree maps page-key paths (storage/hashing.py) to where each page's KV lives, per component
(``full``: full-attention layers, ``swa``: sliding-window layers) and per tier (L1 device pool page
indices, L2 host pool page indices, L3 presence flag). It owns no memory: page indices handed to it
belong to it until it hands them back in a ``Freed`` (evict / flush / set_l3) or as insert duplicates.

The tree is composed of objects that own their state: the ``Tiers`` ledger (tiers.py: data slots, page
counts, KV events), the ``LRULists`` (lru.py: eviction order), the ``Locks`` table (locks.py); the walk
is pure functions (walk.py), the integrity check a function over the public reads (check.py). This
module holds the structure (nodes joined, split, removed) and the verbs that compose the others.

Rules (checked by ``check_integrity``, see storage/radix/check.py):

* **Existence.** Every node holds full data in some tier; a node losing its last full copy is removed
  together with its subtree (descendants are unreachable without it; they only hold L2/L3 full data
  by then, plus SWA data, all of which is freed).
* **L1 is closed towards the root** for full: a node has full L1 data only if its parent does (or is the
  root). So a match's L1 pages are always its first pages, used in place.
* **Tombstones.** SWA data is independent per node: any node may lose it (internal nodes too) while
  its full data stays. A match is usable at page m only if the last ``window_pages`` pages before m
  have SWA data in some tier.
* **Locks** (``lock(node, c)``): full locks pin the path, SWA locks the window before the node's end;
  every SWA-locked node is full-locked, hence never removed (storage/radix/locks.py).
* **LRU** per (component, tier): which nodes are evictable, in which order (storage/radix/lru.py). Full
  lists order by ``last_access``, SWA lists by ``swa_access``: a match or insert touches the whole path
  for full but only the nodes inside the window before its end for SWA.
* **Retention** (``swa_keep``). The caller may insert the sliding KV of every page it computed, not only
  the last window: out-of-window pages are evictable, matchable data. The windows before *kept points*
  -- an insert's end (``keep_end``), the point where an insert branches off the existing tree, and the
  caller's ``boundaries`` (message ends) and ``checkpoints`` (every ``swa_checkpoint_interval`` tokens) --
  are cut into nodes of their own and flagged ``swa_keep`` (checkpoints at a lower level than the
  others); the SWA lists take every unflagged (interior) node first, then checkpoints, then the rest
  (lru.py), and write policies back up only flagged SWA data (L2/L3 hold one window
  per kept point). A node that becomes a SWA tombstone loses the flag.
* **Eviction** of (c, tier) from a node drops that copy. Full: if no other full copy is left the node
  and its subtree are removed (``on_evict`` lets a write-back controller back it up first). SWA: the
  node stays, tombstoned if no other SWA copy is left.
* **Joining.** A node that becomes a SWA tombstone is joined with its parent and its only child where
  they are alike (unlocked, tombstones, full data in the same tiers, the same recency; ``_alike``):
  a conversation's stale windows would otherwise leave its path cut into two nodes per turn. Like a
  split, a join changes no data and emits no event; the lower node object stays.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

from storage.hashing import DEFAULT_SEED, Seed, page_keys, root_key
from storage.radix.check import check_tree
from storage.radix.locks import Locks
from storage.radix.lru import EVICTIONS, LRULists
from storage.radix.node import (COMPONENTS, FULL, L1, L2, L3, PAGE_TIERS, SWA, TIERS, Freed, InsertResult,
                                KVEvent, MatchResult, Node, check_live)
from storage.radix.tiers import Tiers
from storage.radix.walk import run, step
from storage.sequence_keys import SequenceKeys


KEEP_CHECKPOINT = 1
"""``Node.swa_keep`` of a window kept every ``swa_checkpoint_interval`` tokens (speculative)."""
KEEP_POINT = 2
"""``Node.swa_keep`` of a window before a sequence end, a branch point or a message boundary."""

OnEvict = Callable[[Node, str, str], None]
"""``on_evict(node, component, tier)``: called before a victim's data is dropped."""


class RadixTree:
    """Page-granular radix tree over page keys (storage/hashing.py).

    ``window_pages`` (W) is how many pages before a match point must hold SWA data for the match to be
    usable -- the caller converts the model's sliding window in tokens (e.g. ``ceil((window - 1) /
    page_size)`` for a request continuing at a page boundary); 0 disables the SWA condition. Times
    (``now``) are whatever monotonic clock the owner uses; the tree never reads one. ``eviction`` orders
    the full LRU lists (``EVICTIONS``, storage/radix/lru.py).

    Its parts, each owning its state: ``tiers`` (the data ledger), ``lru`` (the eviction lists), ``locks``
    (the lock table). ``page_size``, ``window_pages``, ``seed`` and ``eviction`` are fixed at construction.
    """

    def __init__(self, page_size: int, window_pages: int, *, seed: Seed = DEFAULT_SEED,
                 eviction: str = "lru") -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.window_pages = self._check_window(window_pages)
        self.seed = seed
        self._root_key: Optional[bytes] = None   # root_key(seed), on first use (it may be invalid)
        self.root = Node(None, [], 0)
        self.lru = LRULists(self.root, eviction)
        self.eviction = eviction
        self.tiers = Tiers(self.root, self.lru)
        self.locks = Locks(self.root, self.window_pages, self.lru)
        self.num_nodes = 0

    @staticmethod
    def _check_window(w: int) -> int:
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"window_pages must be an int >= 0, got {w!r}")
        return w

    # ------------------------------------------------------------------ keys, queries, events

    def page_keys(self, tokens, salt: Seed | None = None) -> list[bytes]:
        """Keys of the full pages of ``tokens`` under this tree's seed (and a tenant ``salt``)."""
        return page_keys(tokens, self.page_size, seed=self.seed, salt=salt)

    def sequence_keys(self, tokens, num_pages: Optional[int] = None, salt: Seed | None = None) -> SequenceKeys:
        """The same keys computed lazily (storage/sequence_keys.py): pass it to ``match_prefix``
        and ``insert`` and the pages the tree recognises by their tokens are not hashed."""
        if salt is None and type(tokens) is list and num_pages is not None \
                and type(num_pages) is int and 0 <= num_pages <= len(tokens) // self.page_size:
            if self._root_key is None:
                self._root_key = root_key(self.seed)
            return SequenceKeys.trusted(tokens, self.page_size, self._root_key, num_pages)
        return SequenceKeys(tokens, self.page_size, seed=self.seed, salt=salt, num_pages=num_pages)

    def take_events(self) -> list[KVEvent]:
        """Drain the KV events accumulated since the last call, oldest first."""
        return self.tiers.take_events()

    def snapshot_events(self) -> list[KVEvent]:
        """Everything the tree holds now as ``stored`` events, parents first (Tiers.snapshot). Take the
        pending events first: the snapshot already includes them."""
        return self.tiers.snapshot(self.iter_nodes())

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant of the module doc (or of the bookkeeping) is broken."""
        check_tree(self)

    # ------------------------------------------------------------------ match / insert

    def match_prefix(self, keys: Sequence[bytes], *, now: float, window_pages: Optional[int] = None,
                     lock: bool = False) -> MatchResult:
        """Longest usable prefix of ``keys`` (see MatchResult); touches the usable path (SWA: only the
        window before its end, see the module doc). ``lock=True`` also takes ``lock(result.node, FULL)``
        and, when the tree has a window, ``lock(result.node, SWA)``, in the same pass (a request locks
        what it matched: touching the path's LRU entries only for the lock to take them out again is
        most of a match's cost).

        ``keys`` is a list of page keys or a SequenceKeys (``sequence_keys``), which hashes only what the
        tree does not recognise by its tokens. ``window_pages`` overrides the tree's W for this query
        only (locks and touches always use the tree's W). Splits the last node when m falls inside it,
        so ``result.node`` ends exactly at m.
        """
        w = self.window_pages if window_pages is None else self._check_window(window_pages)
        nodes: list[Node] = []   # the walked path; only its last node may be matched in part
        cur, i, root = self.root, 0, self.root
        by_tokens = isinstance(keys, SequenceKeys) and keys.page_size == self.page_size
        n_keys, ps = len(keys), self.page_size
        # m may only end right after a SWA-present run that is >= W long or starts at page 0: ``best``
        # is the last such node of the path, found during the walk.
        best, run_start = -1, None
        while i < n_keys:
            child, k = step(root, ps, cur, keys, i, by_tokens, n_keys)
            if child is None:
                break
            if child.l1_swa is not None or child.l2_swa is not None or child.l3_swa:
                if run_start is None:
                    run_start = child.depth
                if w == 0 or run_start == 0 or i + k - run_start >= w:
                    best = len(nodes)
            else:
                run_start = None
                if w == 0:
                    best = len(nodes)
            nodes.append(child)
            i += k
            if k < len(child.keys):
                break
            cur = child
        res = MatchResult(node=root, matched_pages=i)
        # Locks always cover the tree's W: fused into the loops below only when the query uses it too.
        fuse = lock and best >= 0 and w == self.window_pages
        if best < 0:
            if lock:
                self.locks.lock_both(root)
            return res
        del nodes[best + 1:]
        last = nodes[-1]
        if last.end > i:   # the match stops inside it: split, so the result ends exactly there
            last = nodes[-1] = self._split(last, i - last.depth)
        if lock and not fuse:
            self.locks.lock_both(last)
        m = last.end
        res.node, res.nodes, res.num_pages = last, nodes, m
        full_l1, l1_full = 0, res.l1_full
        lru1, lru2 = self.lru.full
        bit1, bit2 = lru1.bit, lru2.bit
        for n in nodes:  # the hot loop of every request: attribute reads inlined
            pages = n.l1_full
            if pages is not None:
                full_l1 += len(pages)
                l1_full += pages
            elif n.l2_full is not None:
                res.full_l2 += len(n.keys)
            else:
                res.full_l3 += len(n.keys)
            n.last_access = now
            n.hit_count += 1
            if fuse:   # Locks.lock(last, FULL) inlined: a locked node leaves both full lists
                n.lock_full += 1
                if n.lock_full == 1:
                    if n.lru_in & bit1:
                        lru1.discard(n)
                    if n.lru_in & bit2:
                        lru2.discard(n)
            else:
                if n.lru_in & bit1:   # LRUIndex.touch, for the members only
                    lru1.add(n)
                if n.lru_in & bit2:
                    lru2.add(n)
        res.full_l1 = full_l1
        res.swa_window = left = min(w, m)
        if w != self.window_pages or not w:
            self._touch_window(nodes, now)
        # The window's nodes, once: their SWA tiers and L1 pages, and SWA recency (_touch_window,
        # inlined). All cover the last min(W, m) pages: the nodes ending after m - W.
        s1 = s2 = s3 = 0
        top = None   # the highest node of the window: where a fused SWA lock notes its start
        lru1, lru2 = self.lru.swa
        bit1, bit2 = lru1.bit, lru2.bit
        window: list = []   # the window's L1 SWA pages, last node first
        for n in reversed(nodes):
            if left <= 0:
                break
            nk = len(n.keys)
            take = left if left < nk else nk
            swa = n.l1_swa
            if swa is not None:   # never a tombstone: the window is inside a SWA run
                s1 += take
                window.append(swa if take == nk else swa[nk - take:])
            else:
                window.append([None] * take)
                if n.l2_swa is not None:
                    s2 += take
                else:
                    s3 += take
            left -= take
            if w == self.window_pages:
                n.swa_access = now
                if fuse:   # Locks.lock(last, SWA) inlined: the window's nodes are the ones it covers
                    n.lock_swa += 1
                    if n.lock_swa == 1:
                        if n.lru_in & bit1:
                            lru1.discard(n)
                        if n.lru_in & bit2:
                            lru2.discard(n)
                    top = n
                else:
                    if n.lru_in & bit1:
                        lru1.add(n)
                    if n.lru_in & bit2:
                        lru2.add(n)
        l1_swa = res.l1_swa = [None] * (m - res.swa_window)
        for part in reversed(window):
            l1_swa += part
        res.swa_l1, res.swa_l2, res.swa_l3 = s1, s2, s3
        if fuse:
            self.locks.taken(last, top if w else None)
        return res

    def insert(self, keys: Sequence[bytes], full_pages: Sequence[int],
               swa_pages: Optional[Sequence[Optional[int]]] = None, *, now: float,
               tokens: Optional[Sequence[int]] = None, keep_end: bool = True,
               checkpoints: Sequence[int] = (), boundaries: Sequence[int] = ()) -> InsertResult:
        """Insert a finished sequence of ``len(keys)`` pages with its L1 pages.

        ``full_pages[i]`` is the full L1 page of page i; ``swa_pages`` is aligned with the pages, None
        where the caller has no SWA data (typically all but the last window). Existing nodes keep
        their L1 data (the caller's differing pages come back as duplicates to free); a node lacking
        L1 data of a component (evicted to L2/L3, or a SWA tombstone) adopts the caller's pages.
        ``tokens`` (``len(keys) * page_size`` ids, the ones the keys were computed from) are stored on
        new edges, where later matches compare them instead of hashing; a SequenceKeys ``keys`` brings
        its own.

        Kept windows (module doc, "Retention"): the one before the insert's end unless ``keep_end`` is
        False (a prompt inserted chunk by chunk: its chunk ends are not points anyone resumes from), the
        one before the point where the insert branches off the tree, and those before ``boundaries``
        (message ends) and ``checkpoints`` (page indices in ``(0, len(keys)]``). Checkpoints are kept at
        ``KEEP_CHECKPOINT``, below the others (``KEEP_POINT``): pressure takes a speculative checkpoint
        before a window where traffic is known to resume.
        """
        n = len(keys)
        full = list(full_pages)
        swa = list(swa_pages) if swa_pages is not None else [None] * n
        by_tokens = isinstance(keys, SequenceKeys) and keys.page_size == self.page_size
        toks = list(tokens) if tokens is not None else None
        if len(full) != n or len(swa) != n:
            raise ValueError(f"{n} keys but {len(full)} full pages and {len(swa)} swa entries")
        if None in full:
            raise ValueError("every page needs a full L1 page")
        if toks is not None and len(toks) != n * self.page_size:
            raise ValueError(f"{len(toks)} tokens for {n} pages of {self.page_size}")
        if toks is None and by_tokens:
            toks = keys.tokens  # may run past the n pages: only page slices are taken
        res = InsertResult(node=self.root)
        root, ps, set_ = self.root, self.page_size, self.tiers.set
        cur, i = root, 0
        while i < n:
            child, cut = step(root, ps, cur, keys, i, by_tokens, n)
            if child is None:
                break
            if child.l1_swa is None:  # adopting SWA pages must cover the whole node: cut at run ends
                cut = min(cut, run(swa, i, i + cut))
            if cut < child.num_pages:
                child = self._split(child, cut)
            self._absorb(child, i, full, swa, toks, res, now)
            cur, i = child, i + cut
        res.num_existing = i
        # A new edge beside existing ones (or under a node the walk split): a branch point.
        branch = i if 0 < i < n and cur.children else 0
        while i < n:
            r = run(swa, i, n)
            node = Node(cur, list(keys[i:i + r]), i, toks[i * ps:(i + r) * ps] if toks else None, now)
            cur.attach(node)
            self.num_nodes += 1
            set_(node, FULL, L1, full[i:i + r])
            if swa[i] is not None:
                set_(node, SWA, L1, swa[i:i + r])
            cur, i = node, i + r
        # Recency, bottom up in one pass: the whole path for full, the window before its end for SWA
        # (LRUIndex.touch and _touch_window inlined, for the members only).
        lru1, lru2 = self.lru.full
        bit1, bit2 = lru1.bit, lru2.bit
        slru1, slru2 = self.lru.swa
        sbit1, sbit2 = slru1.bit, slru2.bit
        lo = cur.end - self.window_pages if self.window_pages else -1
        node = cur
        while node is not root:
            node.last_access = now
            inl = node.lru_in
            if inl & bit1:
                lru1.add(node)
            if inl & bit2:
                lru2.add(node)
            if node.end > lo:
                node.swa_access = now
                if inl & sbit1:
                    slru1.add(node)
                if inl & sbit2:
                    slru2.add(node)
            node = node.parent
        res.node = cur
        if self.window_pages:
            ends = {c: KEEP_CHECKPOINT for c in checkpoints if 0 < c <= n}
            points = [c for c in boundaries if 0 < c <= n] + ([n] if keep_end and n else []) + \
                ([branch] if branch else [])
            ends.update((c, KEEP_POINT) for c in points)
            if ends:
                self._keep_windows(cur, ends)
        return res

    def _absorb(self, node: Node, i: int, full: list, swa: list, toks: Optional[list],
                res: InsertResult, now: float) -> None:
        """Merge the caller's pages ``[i, i + node.num_pages)`` into an existing node (insert's step)."""
        k = node.num_pages
        if node.tokens is None and toks is not None:   # before any data change: its event carries them
            node.tokens = toks[i * self.page_size:(i + k) * self.page_size]
        mine = full[i:i + k]
        have = node.l1_full
        if have is None:
            self.tiers.set(node, FULL, L1, mine)  # the parent was absorbed just before: L1 closure holds
        elif mine != have:   # usually the same pages: the caller borrowed them from the tree
            res.free_full.extend(p for p, q in zip(mine, have) if p != q)
        mine = swa[i:i + k]
        have = node.l1_swa
        if have is None:
            if mine[0] is not None:  # uniform by the run cut: un-tombstone / load with the caller's
                node.swa_access = now  # fresh data, as a new node's
                self.tiers.set(node, SWA, L1, mine)
        elif mine != have:
            res.free_swa.extend(p for p, q in zip(mine, have) if p is not None and p != q)

    def _keep_windows(self, last: Node, ends: dict[int, int]) -> None:
        """Raise ``swa_keep`` to ``ends[e]`` on the nodes covering the window ``[e - W, e)`` before each
        page index ``e`` on the path to ``last`` (which ends at or after every e), splitting nodes so
        that each kept node lies wholly inside a window (overlapping windows take the higher level)."""
        w, root = self.window_pages, self.root
        spans: list[list[int]] = []   # merged [lo, hi, level), highest first
        for e in sorted(ends, reverse=True):
            lo = max(0, e - w)
            if spans and e >= spans[-1][0]:
                spans[-1][0] = min(spans[-1][0], lo)
                spans[-1][2] = max(spans[-1][2], ends[e])
            else:
                spans.append([lo, e, ends[e]])
        x = last
        for lo, hi, level in spans:
            while x is not root and x.depth >= hi:
                x = x.parent
            while x is not root and x.end > lo:
                if not x.has_any(SWA):   # a tombstone keeps nothing: no flag, no split
                    if x.depth < lo:
                        break
                    x = x.parent
                    continue
                if x.end > hi:
                    x = self._split(x, hi - x.depth)
                up = None
                if x.depth < lo:
                    up = self._split(x, lo - x.depth)
                if x.swa_keep < level:
                    x.swa_keep = level
                    self.lru.refresh(x, SWA)   # re-keyed behind the interior pages
                if up is not None:
                    x = up
                    break
                x = x.parent

    def _touch_window(self, path: list[Node], now: float) -> None:
        """SWA recency for the nodes of ``path`` inside the window before its end (the whole path
        without a window): the only SWA data a request continuing from there reads."""
        lo = path[-1].end - self.window_pages if path and self.window_pages else -1
        for node in reversed(path):
            if node.end <= lo:
                break
            node.swa_access = now
            self.lru.touch(node, SWA)

    def split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after its first ``k`` pages; returns the new upper node (the original object
        stays the lower part). The tree means the same; for a caller about to move only part of a
        node's data (a load of just the SWA pages inside a window)."""
        check_live(node, self.root)
        if node is self.root or not 0 < k < node.num_pages:
            raise ValueError(f"cannot split {node!r} after {k} pages")
        return self._split(node, k)

    # ------------------------------------------------------------------ internals

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after its first ``k`` pages; returns the new upper node. The original object
        stays the lower part, so lock holders (who hold the deepest node) keep a valid handle."""
        assert 0 < k < node.num_pages, (k, node)
        ps, s, parent = self.page_size, node.depth + k, node.parent
        up = Node(parent, node.keys[:k], node.depth, node.tokens[:k * ps] if node.tokens else None,
                  node.last_access)
        up.swa_access, up.hit_count, up.demoted_hits = node.swa_access, node.hit_count, node.demoted_hits
        up.swa_keep = node.swa_keep
        for slot in ("l1_full", "l1_swa", "l2_full", "l2_swa"):
            pages = getattr(node, slot)
            if pages is not None:
                setattr(up, slot, pages[:k])
                setattr(node, slot, pages[k:])
        up.l3_full, up.l3_swa = node.l3_full, node.l3_swa
        # Full locks are path locks: both halves carry them all. A SWA lock reaches the upper half iff
        # its window starts before the cut; those move their start marker up with it.
        up.lock_full = node.lock_full
        keep = {st: n for st, n in node.swa_lock_starts.items() if st >= s}
        up.swa_lock_starts = {st: n for st, n in node.swa_lock_starts.items() if st < s}
        up.lock_swa = node.lock_swa - sum(keep.values())
        node.swa_lock_starts = keep
        old_pages = node.num_pages
        node.keys, node.depth = node.keys[k:], s
        node.tokens = node.tokens[k * ps:] if node.tokens else node.tokens
        parent.replace(node, up)
        up.attach(node)
        node.parent = up
        up.child_l1, up.child_l2 = int(node.l1_full is not None), int(node.l2_full is not None)
        self.lru.resize(node, old_pages)
        self.num_nodes += 1
        self.lru.refresh(up)
        return up

    # ------------------------------------------------------------------ locks (locks.py)

    def lock(self, node: Node, component: str) -> None:
        """Pin ``node``'s data of ``component`` (the extent of a lock: storage/radix/locks.py)."""
        self.locks.lock(node, component)

    def unlock(self, node: Node, component: str) -> None:
        """Undo one ``lock(node, component)``; raises ValueError if none is held (never negative)."""
        self.locks.unlock(node, component)

    # ------------------------------------------------------------------ eviction

    def evictable(self, component: str, tier: str, n_pages: int) -> list[Node]:
        """Peek: the LRU-first candidates of (component, tier) holding >= ``n_pages`` pages (fewer if
        the list is short). For full this is only the current leaves; a write-back controller that
        must see every victim should pass ``on_evict`` to ``evict`` instead."""
        out, got = [], 0
        for node in self.lru[(component, tier)].ordered():
            if got >= n_pages:
                break
            out.append(node)
            got += node.num_pages
        return out

    def evict(self, component: str, tier: str, n_pages: int, *, on_evict: Optional[OnEvict] = None,
              spare_kept: bool = False) -> Freed:
        """Evict LRU (component, tier) data until >= ``n_pages`` pages of it are freed or nothing is
        evictable. ``on_evict(node, component, tier)`` runs before each victim is dropped (it may
        back the node up with set_l2 / set_l3, which turns a removal into a demotion). The result
        also lists collateral pages (SWA and L2 data of removed nodes). ``spare_kept``: SWA only, stop at
        the first kept window (module doc, "Retention"): room for interior pages is made from interior pages."""
        if component not in COMPONENTS or tier not in PAGE_TIERS:
            raise ValueError(f"cannot evict {component!r} from {tier!r}")
        lru, freed = self.lru[(component, tier)], Freed()
        while len(freed[component, tier]) < n_pages:
            node = lru.peek()
            if node is None or (spare_kept and node.swa_keep):
                break
            if on_evict is not None:
                on_evict(node, component, tier)
                if node.removed or node not in lru:
                    continue
            freed.add(component, tier, node.pages(component, tier))
            self.tiers.set(node, component, tier, None)
            if component == FULL and not node.has_any(FULL):
                self._remove_subtree(node, freed)
            elif component == SWA and not node.has_any(SWA):
                self._merge_around(node)
        return freed

    def flush(self) -> Freed:
        """Remove every node; returns all their pages. Raises RuntimeError while any lock is held."""
        if len(self.locks):
            raise RuntimeError(f"flush with {len(self.locks)} locks held")
        freed = Freed()
        for child in list(self.root.children.values()):
            self._remove_subtree(child, freed)
        return freed

    def _remove_subtree(self, node: Node, freed: Freed) -> None:
        if node.lock_full or node.lock_swa:
            raise RuntimeError(f"removing locked {node!r}")
        order, stack = [], [node]
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(x.children.values())
        parent, set_ = node.parent, self.tiers.set
        for x in reversed(order):  # children before parents, so counters and events stay exact
            for c in COMPONENTS:
                for t in PAGE_TIERS:
                    pages = x.pages(c, t)
                    if pages is not None:
                        freed.add(c, t, pages)
                        set_(x, c, t, None)
                if x.l3[c]:
                    set_(x, c, L3, False)
            x.parent.detach(x)
            self.lru.discard(x)
            x.removed, x.parent = True, None
            self.num_nodes -= 1
        self.lru.refresh(parent)

    # ------------------------------------------------------------------ path compression

    def _merge_around(self, node: Node) -> None:
        """``node`` just became a SWA tombstone: join it with its parent and its only child where they
        are alike (``_alike``). Each turn of a conversation inserts two nodes (the pages before its last
        window, the window); once a stale window loses its SWA data, the turn's two nodes and the next
        turn's first are one run of full-only pages, and a walk over three nodes costs three steps.
        Nothing a caller holds is affected: only unlocked nodes are joined, the lower node object stays
        (as a split keeps it), no data changes and no event is emitted."""
        parent = node.parent
        if self._alike(parent, node):
            self._join(parent, node)
        if len(node.children) == 1:
            (child,) = node.children.values()
            if self._alike(node, child):
                self._join(node, child)

    def _alike(self, upper: Node, lower: Node) -> bool:
        """Whether ``lower`` may absorb ``upper`` (its parent): upper's only child, both unlocked, both
        SWA tombstones, full data in the same tiers (L1 in both), the same recency and SLRU segment."""
        return (upper is not self.root and len(upper.children) == 1 and not upper.removed
                and not (upper.lock_full or upper.lock_swa or lower.lock_full or lower.lock_swa)
                and not upper.has_any(SWA) and not lower.has_any(SWA)
                and upper.l1_full is not None and lower.l1_full is not None
                and (upper.l2_full is None) == (lower.l2_full is None) and upper.l3_full == lower.l3_full
                and upper.last_access == lower.last_access
                and (upper.hit_count > upper.demoted_hits) == (lower.hit_count > lower.demoted_hits))

    def _join(self, upper: Node, lower: Node) -> None:
        """``lower`` absorbs ``upper`` (see ``_merge_around``); ``upper`` leaves the tree."""
        old_pages, parent = lower.num_pages, upper.parent
        lower.keys = upper.keys + lower.keys
        lower.tokens = upper.tokens + lower.tokens if upper.tokens and lower.tokens else None
        lower.depth = upper.depth
        lower.l1_full = upper.l1_full + lower.l1_full
        if lower.l2_full is not None:
            lower.l2_full = upper.l2_full + lower.l2_full
        lower.hit_count = max(upper.hit_count, lower.hit_count)
        lower.demoted_hits = max(upper.demoted_hits, lower.demoted_hits)
        parent.replace(upper, lower)
        lower.parent = parent
        upper.children, upper.only = {}, None
        upper.removed, upper.parent = True, None
        self.lru.discard(upper)
        self.lru.resize(lower, old_pages)
        self.num_nodes -= 1

    # ------------------------------------------------------------------ tier bookkeeping (tiers.py)

    def set_l1(self, node: Node, component: str, pages: Sequence[int]) -> None:
        """Record that ``node``'s data of ``component`` was loaded (from L2/L3) into L1 ``pages``."""
        self.tiers.set_l1(node, component, pages)

    def set_l2(self, node: Node, component: str, pages: Optional[Sequence[int]]) -> Optional[list[int]]:
        """Record an L2 (host) backup in ``pages``; ``pages=None`` clears it and returns the old pages
        for the caller to free. Clearing the top copy of a locked node, or the last full copy, raises."""
        return self.tiers.set_l2(node, component, pages)

    def set_l3(self, node: Node, component: str, present: bool) -> Freed:
        """Record that L3 holds (or no longer holds) ``node``'s data. Losing the last full copy removes
        the node and its subtree; their pages come back in the result."""
        freed = Freed()
        if self.tiers.set_l3(node, component, present):
            self._remove_subtree(node, freed)
        return freed

    # ------------------------------------------------------------------ reads (also check.py's TreeView)

    def num_pages(self, component: str, tier: str) -> int:
        """Pages of ``component`` the tree holds in page tier ``tier``."""
        return self.tiers.num_pages(component, tier)

    def evictable_pages(self, component: str, tier: str) -> int:
        """Pages currently in the (component, tier) LRU (full: leaves only; more become evictable)."""
        return self.lru[(component, tier)].num_pages

    def locked_pages(self, component: str, tier: str) -> int:
        """Pages of ``component`` in ``tier`` held by locked nodes (what eviction cannot reach). Walks
        up from each lock: O(locks x depth), for admission decisions, not per page."""
        return self.locks.locked_pages(component, tier)

    def iter_nodes(self) -> Iterator[Node]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def all_pages(self, component: str, tier: str) -> list[int]:
        out: list[int] = []
        for n in self.iter_nodes():
            p = n.pages(component, tier)
            if p is not None:
                out.extend(p)
        return out

    def owners(self, tier: str = L1, name: str = "tree") -> dict[str, dict[str, list[int]]]:
        """``{component: {name: pages}}``, the shape KVPools.check_integrity(owners) takes."""
        return {c: {name: self.all_pages(c, tier)} for c in COMPONENTS}

    def lock_registry(self) -> Iterator[tuple[str, Node, int]]:
        """``(component, node, count)`` for every ``lock(node, component)`` still held."""
        return self.locks.registry()

    def swa_window_start(self, node: Node) -> int:
        """First page of the SWA window a lock on ``node`` covers."""
        return self.locks.window_start(node)

    def lru_members(self, component: str, tier: str) -> list[Node]:
        return self.lru[(component, tier)].members()

    def in_lru(self, node: Node, component: str, tier: str) -> bool:
        """Membership as the node's own ``lru_in`` bits tell it (the hot paths' answer)."""
        return node in self.lru[(component, tier)]

    def lru_consistent(self, component: str, tier: str) -> bool:
        """Whether the (component, tier) LRU's heap agrees with its members and their current keys."""
        return self.lru[(component, tier)].consistent()


__all__ = ["RadixTree", "OnEvict", "MatchResult", "InsertResult", "KVEvent", "Freed", "Node", "TIERS", "L1", "L2",
           "L3", "FULL", "SWA", "COMPONENTS", "KEEP_CHECKPOINT", "KEEP_POINT", "EVICTIONS"]
