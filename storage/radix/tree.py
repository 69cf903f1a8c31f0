"""The unified, SWA-aware, tiered radix tree of one worker (pure bookkeeping: no tensors, no clock).

The tree maps page-key paths (storage/hashing.py) to where each page's KV lives, per component
(``full``: full-attention layers, ``swa``: sliding-window layers) and per tier (L1 device pool page
indices, L2 host pool page indices, L3 presence flag). It owns no memory: page indices handed to it
belong to it until it hands them back in a ``Freed`` (evict / flush / set_l3) or as insert duplicates.

Rules (checked by ``check_integrity``, see storage/radix_check.py):

* **Existence.** Every node holds full data in some tier; a node losing its last full copy is removed
  together with its subtree (descendants are unreachable without it; they only hold L2/L3 full data
  by then, plus SWA data, all of which is freed).
* **L1 is closed towards the root** for full: a node has full L1 data only if its parent does (or is the
  root). So a match's L1 pages are always its first pages, used in place.
* **Tombstones.** SWA data is independent per node: any node may lose it (internal nodes too) while
  its full data stays. A match is usable at page m only if the last ``window_pages`` pages before m
  have SWA data in some tier.
* **Locks** (``lock(node, c)``). Full: path lock -- the node and all its ancestors. SWA: only the nodes
  intersecting the window ``[max(0, end - W), end)`` before the node's end, since that is all the SWA
  data a request continuing from there reads. A SWA lock requires the node to be full-locked, and a
  full unlock that would leave a SWA-locked node full-unlocked raises: so every SWA-locked node is
  full-locked, hence never removed.
* **LRU** per (component, tier), see storage/radix_lru.py. Full lists order by ``last_access``, SWA
  lists by ``swa_access``: a match or insert touches the whole path for full but only the nodes inside
  the window before its end for SWA, so the stale windows of earlier turns on the path age and SWA
  eviction takes them before the live one. A node is in the (c, L1) list iff it holds c
  in L1 and is unlocked for c, and, for full, no child holds full L1 (evict from the leaves, as
  removing or demoting a parent first would break L1 closure). It is in the (c, L2) list iff it holds c
  in L2 but not in L1 (L2 is its top copy -- never in both lists for the same data), is unlocked for
  c, and, for full, no child holds full L1 or L2. SWA has no leaf condition: tombstoning an internal
  node is harmless, and a window shares one timestamp, so children still go first.
* **Retention** (``swa_keep``). The caller may insert the sliding KV of every page it computed, not only
  the last window: out-of-window pages are evictable, matchable data. The windows before *kept points*
  -- an insert's end (``keep_end``), the point where an insert branches off the existing tree, and the
  caller's ``boundaries`` (message ends) and ``checkpoints`` (every ``swa_checkpoint_interval`` tokens) --
  are cut into nodes of their own and flagged ``swa_keep`` (checkpoints at a lower level than the
  others); the SWA lists take every unflagged (interior) node first, then checkpoints, then the rest
  (radix_lru.py), and write policies back up only flagged SWA data (L2/L3 hold one window
  per kept point). A node that becomes a SWA tombstone loses the flag.
* **Eviction** of (c, tier) from a node drops that copy. Full: if no other full copy is left the node
  and its subtree are removed (``on_evict`` lets a write-back controller back it up first). SWA: the
  node stays, tombstoned if no other SWA copy is left.
* **Joining.** A node that becomes a SWA tombstone is joined with its parent and its only child where
  they are alike (unlocked, tombstones, full data in the same tiers, the same recency; radix_tiers.py):
  a conversation's stale windows would otherwise leave its path cut into two nodes per turn. Like a
  split, a join changes no data and emits no event; the lower node object stays.
"""
from __future__ import annotations

from typing import Optional, Sequence

from storage.hashing import DEFAULT_SEED, Seed, page_keys, root_key
from storage.radix.check import check_tree
from storage.radix.locks import LockOps
from storage.radix.lru import SLRU_PROTECTED, LRUIndex
from storage.radix.node import (COMPONENTS, FULL, L1, L2, L3, PAGE_TIERS, SWA, TIERS, Freed, InsertResult,
                                KVEvent, MatchResult, Node, SLOT)
from storage.radix.tiers import OnEvict, TierOps
from storage.radix.view import ReadOps
from storage.radix.walk import WalkOps, _run
from storage.sequence_keys import SequenceKeys


KEEP_CHECKPOINT = 1
"""``Node.swa_keep`` of a window kept every ``swa_checkpoint_interval`` tokens (speculative)."""
KEEP_POINT = 2
"""``Node.swa_keep`` of a window before a sequence end, a branch point or a message boundary."""

EVICTIONS = ("lru", "slru")
"""Order of the full LRU lists: plain LRU, or segmented LRU (never-reused data first; radix_lru.py)."""


class RadixTree(WalkOps, LockOps, TierOps, ReadOps):
    """Page-granular radix tree over page keys (storage/hashing.py).

    ``window_pages`` (W) is how many pages before a match point must hold SWA data for the match to be
    usable -- the caller converts the model's sliding window in tokens (e.g. ``ceil((window - 1) /
    page_size)`` for a request continuing at a page boundary); 0 disables the SWA condition. Times
    (``now``) are whatever monotonic clock the owner uses; the tree never reads one.
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
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
        self.eviction = eviction
        # SLRU orders the full lists only: SWA recency already follows the live window (module doc).
        protect = SLRU_PROTECTED if eviction == "slru" else 0.0
        self._lru = {(c, t): LRUIndex(f"{c}/{t}", "last_access" if c == FULL else "swa_access",
                                      protect if c == FULL else 0.0, 1 << i, keep_first=c == SWA)
                     for i, (c, t) in enumerate((c, t) for c in COMPONENTS for t in PAGE_TIERS)}
        self._full_lrus = tuple(self._lru[(FULL, t)] for t in PAGE_TIERS)
        self._lrus_of = {c: (self._lru[(c, L1)], self._lru[(c, L2)]) for c in COMPONENTS}
        # node -> [lock(node, FULL) calls held, lock(node, SWA) calls held] (one entry per locked node: a
        # request's lock and unlock touch one dict slot, not one per component)
        self._locks: dict[Node, list[int]] = {}
        self._events: list[KVEvent] = []
        self._size = {(c, t): 0 for c in COMPONENTS for t in PAGE_TIERS}
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
        out, self._events = self._events, []
        return out

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
        n_keys, step = len(keys), self._step
        # m may only end right after a SWA-present run that is >= W long or starts at page 0: ``best``
        # is the last such node of the path, found during the walk.
        best, run_start = -1, None
        while i < n_keys:
            child, k = step(cur, keys, i, by_tokens, n_keys)
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
                self._lock_both(root)
            return res
        del nodes[best + 1:]
        last = nodes[-1]
        if last.end > i:   # the match stops inside it: split, so the result ends exactly there
            last = nodes[-1] = self._split(last, i - last.depth)
        if lock and not fuse:
            self._lock_both(last)
        m = last.end
        res.node, res.nodes, res.num_pages = last, nodes, m
        full_l1, l1_full = 0, res.l1_full
        lru1, lru2 = self._full_lrus
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
            if fuse:   # lock(last, FULL) inlined: a locked node leaves both full lists
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
        lru1, lru2 = self._lrus_of[SWA]
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
                if fuse:   # lock(last, SWA) inlined: the window's nodes are the ones it covers
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
            held = self._locks.get(last)
            if held is None:
                held = self._locks[last] = [0, 0]
            held[0] += 1
            if w:
                start = max(0, m - w)
                top.swa_lock_starts[start] = top.swa_lock_starts.get(start, 0) + 1
                held[1] += 1
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
        cur, i = self.root, 0
        while i < n:
            child, cut = self._step(cur, keys, i, by_tokens, n)
            if child is None:
                break
            if child.l1_swa is None:  # adopting SWA pages must cover the whole node: cut at run ends
                cut = min(cut, _run(swa, i, i + cut))
            if cut < child.num_pages:
                child = self._split(child, cut)
            self._absorb(child, i, full, swa, toks, res, now)
            cur, i = child, i + cut
        res.num_existing = i
        # A new edge beside existing ones (or under a node the walk split): a branch point.
        branch = i if 0 < i < n and cur.children else 0
        while i < n:
            r = _run(swa, i, n)
            ps = self.page_size
            node = Node(cur, list(keys[i:i + r]), i, toks[i * ps:(i + r) * ps] if toks else None, now)
            cur.attach(node)
            self.num_nodes += 1
            self._set(node, FULL, L1, full[i:i + r])
            if swa[i] is not None:
                self._set(node, SWA, L1, swa[i:i + r])
            cur, i = node, i + r
        # Recency, bottom up in one pass: the whole path for full, the window before its end for SWA
        # (LRUIndex.touch and _touch_window inlined, for the members only).
        lru1, lru2 = self._full_lrus
        bit1, bit2 = lru1.bit, lru2.bit
        slru1, slru2 = self._lrus_of[SWA]
        sbit1, sbit2 = slru1.bit, slru2.bit
        lo = cur.end - self.window_pages if self.window_pages else -1
        node, root = cur, self.root
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
                    self._refresh(x, SWA)   # re-keyed behind the interior pages
                if up is not None:
                    x = up
                    break
                x = x.parent

    def _touch(self, node: Node, c: str) -> None:
        for t in PAGE_TIERS:
            self._lru[(c, t)].touch(node)

    def _touch_window(self, path: list[Node], now: float) -> None:
        """SWA recency for the nodes of ``path`` inside the window before its end (the whole path
        without a window): the only SWA data a request continuing from there reads."""
        lo = path[-1].end - self.window_pages if path and self.window_pages else -1
        for node in reversed(path):
            if node.end <= lo:
                break
            node.swa_access = now
            self._touch(node, SWA)

    def split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after its first ``k`` pages; returns the new upper node (the original object
        stays the lower part). The tree means the same; for a caller about to move only part of a
        node's data (a load of just the SWA pages inside a window)."""
        self._check_live(node)
        if node is self.root or not 0 < k < node.num_pages:
            raise ValueError(f"cannot split {node!r} after {k} pages")
        return self._split(node, k)

    # ------------------------------------------------------------------ internals

    def _set(self, node: Node, c: str, tier: str, value) -> None:
        """The one place data changes: keeps sizes, events, parent counters and LRU lists exact."""
        slot = SLOT[c, tier]
        old = getattr(node, slot)
        if tier == L3:
            was, now = old, bool(value)
            setattr(node, slot, now)
        else:
            was, now = old is not None, value is not None
            setattr(node, slot, value)
            self._size[(c, tier)] += len(value or ()) - len(old or ())
        if was != now:
            self._events.append(KVEvent("stored" if now else "removed", tier, c, tuple(node.keys)))
            if c == SWA and not now and node.swa_keep and not node.has_any(SWA):
                node.swa_keep = 0   # a tombstone keeps nothing (and may join its neighbours again)
            if c == FULL and tier != L3:
                parent = node.parent
                if tier == L1:
                    parent.child_l1 += 1 if now else -1
                else:
                    parent.child_l2 += 1 if now else -1
                self._refresh(parent, FULL)
        self._refresh(node, c)

    def _refresh(self, node: Node, component: Optional[str] = None) -> None:
        """Re-file ``node`` in the LRU lists of ``component`` (default: both) after its data, locks or
        children changed."""
        if node is self.root or node.removed:
            return
        # The membership rule of the module doc ("LRU") for both tiers; runs on every data and lock change.
        if component != SWA:
            lru1, lru2 = self._full_lrus
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
            lru1, lru2 = self._lrus_of[SWA]
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
        for lru in self._lru.values():
            lru.resize(node, old_pages)
        self.num_nodes += 1
        self._refresh(up)
        return up


__all__ = ["RadixTree", "OnEvict", "MatchResult", "InsertResult", "KVEvent", "Freed", "Node", "TIERS", "L1", "L2",
           "L3", "FULL", "SWA", "COMPONENTS"]
