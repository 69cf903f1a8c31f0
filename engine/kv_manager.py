"""The one owner of every request's L1 pages: each request's page table (full pages + its SWA window)
is written here only, and every L1 page a request takes or gives back passes through here.

Operations, in a request's life:
* ``borrow``  -- take a prefix hit's pages from the cache (already locked by the match) as shared pages;
* ``extend``  -- allocate what the next positions need (``slide`` first frees the SWA pages leaving the
  window, reusing them for the new positions where it can). With a prefix cache, a prefill chunk also
  writes the sliding KV of its positions before the window (*interior* pages) when SWA room allows,
  without evicting a kept window for it, and ``commit`` hands them to the tree after every chunk: out
  of the window they are evictable, matchable tree data, so a later prompt branching off inside this
  one finds the window before its branch point (storage/radix/tree.py, "Retention");
* ``import_leased`` -- pages a P/D transfer filled under a lease (engine/pd.py);
* ``commit``  -- hand the request's whole pages to the prefix cache (a prompt just prefilled, or the
  finished sequence), keeping them as borrowed pages or giving up the rest;
* ``release`` -- give back everything (finish, abort, preemption).

The scheduler only decides (who runs, who is preempted); the window-in-pages rules come from
``KVGeometry``. Shared pages belong to the cache's tree; owned ones to the request. The only other
takers of L1 pages are the tree's own load-back (storage/hicache) and the P/D leases (engine/pd.py over
storage/transfer/base.py), whose pages become a request's through ``import_leased``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple, Optional

from storage.geometry import KVGeometry
from storage.pools import COMPONENTS, FULL, SWA, KVPools, PageAllocator

from storage.hicache.no_cache import NoCache

if TYPE_CHECKING:   # engine/request.py imports PageTable from here
    from engine.request import Request
    from storage.hicache import HiCache
    from storage.transfer.base import LeasedPages


@dataclass
class PageTable:
    """One request's L1 pages, by logical page (page ``a`` covers positions [a * ps, (a + 1) * ps))."""

    full: list[int] = field(default_factory=list)
    swa: list[Optional[int]] = field(default_factory=list)   # None: slid out of the window / never stored
    num_shared_full: int = 0               # leading full pages borrowed from the prefix cache
    shared_swa: set[int] = field(default_factory=set)        # logical SWA pages borrowed from it
    swa_valid_from: int = 0                # SWA KV of earlier positions was never stored
    interior: set[int] = field(default_factory=set)   # logical SWA pages below the window, until committed
    whole_below: set[int] = field(default_factory=set)  # pages below swa_valid_from written whole anyway

    def owned_full(self) -> list[int]:
        return self.full[self.num_shared_full:]

    def owned_swa(self) -> list[int]:
        return [p for a, p in enumerate(self.swa) if p is not None and a not in self.shared_swa]


class Extent(NamedTuple):
    """What ``extend`` reserved for positions [start, end) of one request."""

    full_pages: list[int]                  # pages covering [0, end)
    swa_lo: int                            # first position read from the SWA pool
    swa_read_pages: list[int]              # pages covering [swa_lo, start), snapshot before recycling
    swa_write: list[tuple[int, int, int]]  # (position, page, offset) stored in the SWA pool


class KVManager:
    retain_interior = True
    """Write and cache the sliding KV of a prompt's interior (see the module doc). bench/branch.py turns it
    off for its window-only row (the retention before [branch]); nothing in serving does."""

    def __init__(self, geom: KVGeometry, pools: KVPools, cache: "HiCache | NoCache" = NoCache(),
                 clock: Callable[[], float] = lambda: 0.0, checkpoint_interval: int = 0) -> None:
        """``cache``: the prefix cache pages are committed to and evicted from; a NoCache (stateless, so
        the default instance is shared) keeps none."""
        self.geom = geom
        self.ps = geom.page_size
        self.pools = pools
        self.cache = cache
        self.clock = clock   # the engine's logical time, for the cache's LRU
        self.full: PageAllocator = pools.full.allocator
        self.swa: PageAllocator | None = pools.swa.allocator if geom.has_swa else None
        # With a prefix cache the SWA window is kept in whole pages, so the cache can reuse it; with one
        # that keeps no pages (NoCache) a request's pages stay its own until release (``commit``).
        self.page_aligned = cache.keeps_pages
        # SWA pages that left the window this step: still read by this step's forward, so they go back
        # to the allocator only after it (anyone else could overwrite them before the read).
        self._retired: list[int] = []
        self.holders: dict[str, "Request"] = {}   # requests whose table may hold pages, by rid
        self.checkpoint_pages = geom.checkpoint_pages(checkpoint_interval)

    # ---- room --------------------------------------------------------------------------------------
    def allocator(self, comp: str) -> PageAllocator:
        return self.pools.pool(comp).allocator

    def reclaimable(self, comp: str) -> int:
        """L1 pages of ``comp`` the cache would give back if asked."""
        return self.cache.reclaimable_l1(comp)

    def available(self, comp: str) -> int:
        return self.allocator(comp).num_free + self.reclaimable(comp)

    def ensure(self, comp: str, n: int) -> bool:
        """Can ``n`` pages of ``comp`` be allocated, after asking the cache to evict if need be?"""
        alloc = self.allocator(comp)
        if not alloc.can_alloc(n):
            self.cache.evict_l1(comp, n - alloc.num_free)
        return alloc.can_alloc(n)

    def keep_from(self, e: int) -> int:
        """First position later steps still need after ``e``: whole pages (KVGeometry.swa_retained_from)
        when the prefix cache may reuse the window, else the window itself."""
        if self.page_aligned:
            return self.geom.swa_retained_from(e)
        return self.geom.swa_lo(e)

    def need(self, start: int, end: int) -> dict[str, int]:
        """Pages a request whose table holds whole pages [0, start) (a prefix hit) needs to run [start, end)."""
        ps = self.ps
        out = {FULL: self.geom.pages(end) - start // ps}
        if self.swa is not None:
            first = max(start, self.keep_from(end))
            out[SWA] = (end - 1) // ps - first // ps + 1 if first < end else 0
        return out

    # ---- a request's life --------------------------------------------------------------------------
    def borrow(self, req: "Request", hit) -> None:
        """Take a prefix hit's (locked) pages as the request's shared leading pages."""
        t = req.pages
        t.full = list(hit.full_pages)
        t.num_shared_full = hit.num_pages
        t.swa = list(hit.swa_pages)
        t.shared_swa = {a for a, p in enumerate(hit.swa_pages) if p is not None}
        present = sorted(t.shared_swa)
        t.swa_valid_from = present[0] * self.ps if present else hit.num_pages * self.ps
        req.hit = hit
        self.holders[req.rid] = req

    def extend(self, req: "Request", n: int) -> Extent | None:
        """Allocate what positions [num_computed, num_computed + n) need, or nothing at all (None).

        SWA: the window is required. Interior sliding KV (prefix cache on: a chunk's positions below its
        window, and the request's own pages leaving the window) is kept only as far as free pages and
        interior pages the cache holds allow, the pages nearest the window first, so keeping it never
        costs a kept window or a request its place: under pressure the request falls back to writing
        and keeping the window alone. Cost: a chunk of C tokens takes up to C / page_size SWA pages
        instead of window_pages + 1."""
        t, ps, s = req.pages, self.ps, req.num_computed
        e = s + n
        need_full = self.geom.pages(e) - len(t.full)
        if not self.ensure(FULL, need_full):
            return None
        leaving: list[int] = []
        new_logical: list[int] = []
        swa_lo = keep_from = first_write = s
        if self.swa is not None:
            swa_lo = self.geom.swa_lo(s)
            keep_from = self.keep_from(e)
            first_write = max(s, keep_from)
            window = [a for a in range(first_write // ps, (e - 1) // ps + 1)
                      if a >= len(t.swa) or t.swa[a] is None] if first_write < e else []
            interior = self._interior(t, s, first_write)
            lo = interior[0] if interior else first_write // ps
            below = [a for a, p in enumerate(t.swa) if p is not None and (a + 1) * ps <= keep_from and a < lo]
            owned_below = [a for a in below if a not in t.shared_swa]
            need = max(0, len(window) - len(owned_below))
            if not self.ensure(SWA, need):
                return None
            stay: list[int] = []
            written: list[int] = []   # interior pages this chunk writes
            # Prompt chunks only: decode frees what slides out of the window, as before (a running request
            # holds at most swa_pages_bound pages between steps).
            prefill = s < len(req.prompt_ids) and self.page_aligned and self.retain_interior
            if interior or prefill:
                missing = [a for a in interior if a >= len(t.swa) or t.swa[a] is None]
                # Whole pages of its own the request may keep as interior instead of reusing them.
                cands = [a for a in owned_below if a * ps >= t.swa_valid_from or a in t.whole_below] \
                    if prefill else []
                order = self._interior_order(req, missing, cands)
                room = self.swa.num_free - len(window) + len(owned_below)
                if len(order) > room:
                    self.cache.evict_l1(SWA, len(order) - room, spare_kept=True)
                    room = self.swa.num_free - len(window) + len(owned_below)
                take = set(order[:max(0, room)])
                missing = [a for a in missing if a in take]
                stay = [a for a in cands if a in take]
                new_logical = missing + window
                written = sorted(set(missing) | {a for a in interior if a < len(t.swa) and t.swa[a] is not None})
            else:
                new_logical = window
            leaving = [a for a in below if a not in stay]
        # Commit: nothing below can fail.
        t.full += self.full.alloc(max(0, need_full))
        self.holders[req.rid] = req
        if self.swa is None:
            return Extent(t.full[:self.geom.pages(e)], swa_lo, [], [])
        swa_read = [t.swa[a] for a in range(swa_lo // ps, -(-s // ps))] if s > swa_lo else []
        # Pages leaving the window are reused for this request's new positions at once (each layer
        # reads its window before it writes); the rest return to the allocator after the forward.
        owned_left = self.slide(req, leaving)
        reuse = owned_left[:len(new_logical)]
        self._retired += owned_left[len(new_logical):]
        fresh = reuse + self.swa.alloc(len(new_logical) - len(reuse))
        for a, p in zip(new_logical, fresh):
            if a >= len(t.swa):
                t.swa += [None] * (a + 1 - len(t.swa))
            t.swa[a] = p
        # The written interior run that reaches the window, and pages written whole below a gap in it
        # (a checkpoint's window chosen first under pressure).
        lo = first_write // ps
        while lo - 1 in written:
            lo -= 1
        start = max(s, lo * ps) if written and lo < first_write // ps else first_write
        t.whole_below.update(a for a in written if a < lo)
        if start > s:  # positions [s, start) reach the SWA pool only in whole_below pages
            t.swa_valid_from = max(t.swa_valid_from, start)
        t.interior = {a for a, p in enumerate(t.swa) if p is not None and a not in t.shared_swa
                      and (a + 1) * ps <= keep_from}
        swa_write = [(pos, t.swa[a], pos % ps) for a in written if a < lo
                     for pos in range(max(s, a * ps), (a + 1) * ps)]
        swa_write += [(pos, t.swa[pos // ps], pos % ps) for pos in range(start, e)]
        return Extent(t.full[:self.geom.pages(e)], swa_lo, swa_read, swa_write)

    def _interior_order(self, req: "Request", missing: list[int], cands: list[int]) -> list[int]:
        """Which interior pages to keep first when SWA room is short: the windows before the request's
        checkpoints and message boundaries (kept once committed; only whole windows count), then the
        pages nearest the window (a branch point just before the prompt's end is the likeliest), then
        its own older pages."""
        w, t = self.geom.window_pages, req.pages
        pool = set(missing)
        have = lambda a: a in pool or (a < len(t.swa) and t.swa[a] is not None)   # noqa: E731
        first: list[int] = []
        top = max(missing, default=0) + 1
        for c in sorted(set(self.checkpoints(req, 0, top)) | set(self.boundaries(req, top)), reverse=True):
            win = range(max(0, c - w), c)
            if any(a in pool for a in win) and all(have(a) for a in win):
                first += [a for a in reversed(win) if a in pool and a not in first]
        rest = [a for a in sorted(missing, reverse=True) if a not in first]
        return first + rest + sorted(cands, reverse=True)

    def _interior(self, t: PageTable, s: int, first_write: int) -> list[int]:
        """Logical pages below the window that positions [s, first_write) would complete: those whose
        data starts at their first position (a page begun before ``s`` only if the request holds it whole
        from there). Empty without a prefix cache or for a decode step."""
        if not (self.page_aligned and self.retain_interior) or first_write <= s:
            return []
        ps = self.ps
        a0 = s // ps
        if s % ps and not (a0 < len(t.swa) and t.swa[a0] is not None and a0 not in t.shared_swa
                           and a0 * ps >= t.swa_valid_from):
            a0 += 1
        return list(range(a0, first_write // ps))

    def slide(self, req: "Request", leaving: Iterable[int]) -> list[int]:
        """Drop the logical SWA pages ``leaving`` (out of the window) from the table; -> the pages among
        them the request owned, in order (borrowed ones stay the tree's). The caller reuses or retires them."""
        t = req.pages
        owned = [t.swa[a] for a in leaving if a not in t.shared_swa]
        for a in leaving:
            t.swa[a] = None
            t.shared_swa.discard(a)
        return owned

    def after_forward(self) -> None:
        """Return the SWA pages retired this step (their last reader, the forward, is done)."""
        if self._retired:
            self.swa.free(self._retired)
            self._retired = []

    def import_leased(self, req: "Request", pages: "LeasedPages", swa_first: int, swa_valid_from: int) -> None:
        """Make a committed lease's pages (engine/pd.py) the request's table; the SWA pages before
        ``swa_first`` (the payload's window began after the lease's ``swa_first_page``) are freed."""
        off = swa_first - pages.swa_first_page
        if self.geom.has_swa and off:
            self.allocator(SWA).free(pages.swa[:off])
        self._adopt(req, list(pages.full), [None] * swa_first + list(pages.swa[off:]) if self.geom.has_swa else [],
                    swa_valid_from)

    def give_back(self, pages: dict) -> None:
        """Free pages nobody's table holds yet ({component: pages}, e.g. a lease whose admission failed)."""
        for comp, ps in pages.items():
            self.allocator(comp).free(ps)

    def commit(self, req: "Request", finished: bool = False, keep_end: bool = True) -> None:
        """Insert the request's whole computed pages into the prefix cache (no-op with one that keeps no
        pages: a NoCache, decided at construction as ``page_aligned``).

        The windows kept for later branches (storage/radix/tree.py, "Retention"): before the end unless
        ``keep_end`` is False (a prompt's chunk, committed so its interior sliding KV becomes the tree's),
        before each of the request's message boundaries (``Request.boundaries``) and every
        ``checkpoint_pages`` pages of what this commit adds.

        ``finished=False`` (a prompt just prefilled, the request decodes on): the pages become borrowed
        ones, locked while it runs. Decode would otherwise slide the SWA window past the prompt's end
        before finish, so a repeat of it would find no usable window.
        ``finished=True``: the tree takes the pages, the rest the request owns is freed; its borrowed
        prefix stays locked until ``release``."""
        if not self.page_aligned:
            return
        t, ps = req.pages, self.ps
        n = req.num_computed // ps
        if not finished and n <= t.num_shared_full:
            return  # the cache already holds every whole page (the prompt ends inside its hit's last)
        # Only pages written from their first position are whole SWA data the cache can serve. A prompt's
        # chunk keeps the pages its next chunk reads as its own (reused when they leave the window, if
        # SWA room is short), and hands the tree the ones below.
        upto = n if keep_end or finished else min(n, self.keep_from(req.num_computed) // ps)
        swa = [p if (a * ps >= t.swa_valid_from or a in t.whole_below) and a < upto and a not in t.shared_swa
               else None for a, p in enumerate((t.swa + [None] * n)[:n])]
        keys = req.hit.keys if req.hit is not None else None
        # Checkpoints of the previous chunk's last window are marked again: its SWA arrives only now.
        marks = self.checkpoints(req, max(0, t.num_shared_full - self.geom.window_pages - 1), n)
        ends = self.boundaries(req, n)
        if keep_end or finished:
            # A repeat of this prompt matches only the whole pages before its last token: that point's
            # window is kept too (one page more when the prompt ends on a page boundary).
            ends.append(max(0, req.num_computed - 1) // ps)
        t.interior.clear()   # the tree's now, or freed below as duplicates
        t.whole_below.difference_update(range(upto))
        if finished:
            dup_full, dup_swa = self.cache.insert(req.tokens(0, n * ps), t.full[:n], swa, self.clock(), keys,
                                                  checkpoints=marks, boundaries=ends, offloaded=req.offloaded_pages)
            dup_full = dup_full + t.full[max(n, t.num_shared_full):]
            dup_swa = dup_swa + [p for a, p in enumerate(t.swa)
                        if p is not None and a not in t.shared_swa and (a >= n or swa[a] is None)]
            t.full, t.swa, t.num_shared_full, t.shared_swa, t.swa_valid_from = [], [], 0, set(), 0
            t.whole_below.clear()
        else:
            hit, dup_full, dup_swa = self.cache.insert_and_hold(req.tokens(0, n * ps), t.full[:n], swa,
                                                                self.clock(), keys, keep_end=keep_end,
                                                                checkpoints=marks, boundaries=ends,
                                                                offloaded=req.offloaded_pages)
            t.full[:n] = hit.full_pages
            t.num_shared_full = n
            for a, p in enumerate(swa):
                if p is not None:  # the tree's now (kept or a duplicate); below the window it is never read
                    t.swa[a] = None
                    t.shared_swa.discard(a)
            for a, q in enumerate(hit.swa_pages):
                if q is not None and t.swa[a] is None:   # a page of its own stays its own
                    t.swa[a] = q
                    t.shared_swa.add(a)
        self.full.free(dup_full)
        self.allocator(SWA).free(dup_swa)
        if not finished:
            if req.hit is not None:
                self.cache.release(req.hit)
            req.hit = hit

    def checkpoints(self, req: "Request", done: int, n: int) -> list[int]:
        """Page indices in (done, n] past ``done`` pages (those an earlier commit or its hit covered)
        where the tree keeps a checkpoint's window: every ``checkpoint_pages`` pages (any edit or
        truncation of a raw prompt finds a window at most that far back)."""
        every = self.checkpoint_pages
        return list(range(max(every, (done // every + 1) * every), n + 1, every)) if every else []

    def boundaries(self, req: "Request", n: int) -> list[int]:
        """Page indices in (0, n] where one of ``req``'s messages ends (a later prompt that edits or adds
        a message branches there): the tree keeps the window before each, above checkpoints."""
        ps = self.ps
        return [b // ps for b in req.boundaries if 0 < b // ps <= n]

    def release(self, req: "Request") -> None:
        """Give back everything the request holds: its own pages to the pools, its hit to the cache.
        ``swa_valid_from`` survives (a recompute after preemption keeps the stricter bound, as before)."""
        t = req.pages
        self.full.free(t.owned_full())
        if self.swa is not None:
            self.swa.free(t.owned_swa())
        t.full, t.swa, t.num_shared_full, t.shared_swa = [], [], 0, set()
        t.interior.clear()
        t.whole_below.clear()
        self.holders.pop(req.rid, None)
        if req.hit is not None:
            self.cache.release(req.hit)
            req.hit = None

    def _adopt(self, req: "Request", full: list[int], swa: list[Optional[int]], swa_valid_from: int) -> None:
        t = req.pages
        t.full, t.swa, t.num_shared_full, t.shared_swa = full, swa, 0, set()
        t.swa_valid_from = swa_valid_from
        self.holders[req.rid] = req

    # ---- invariants --------------------------------------------------------------------------------
    def holds(self, req: "Request") -> bool:
        return req.rid in self.holders

    def owners(self) -> dict[str, dict[str, list[int]]]:
        """{component: {owner: pages}} of the pages requests own (and the SWA pages retired this step)."""
        out = {FULL: {rid: r.pages.owned_full() for rid, r in self.holders.items()},
               SWA: {rid: r.pages.owned_swa() for rid, r in self.holders.items()}}
        out[SWA]["retired this step"] = list(self._retired)
        return out

    def check_integrity(self, extra_owners: dict[str, dict[str, list[int]]] | None = None) -> None:
        """Every L1 page is free or owned by exactly one of: a request, the retired list, or one of
        ``extra_owners`` ({component: {owner: pages}}: the cache's tree, P/D leases); requests keep at most
        ``swa_pages_bound`` SWA pages and borrow only under a hit."""
        extra_owners = extra_owners or {}
        mine = self.owners()
        self.pools.check_integrity({c: {**mine[c], **extra_owners.get(c, {})} for c in COMPONENTS})
        bound = self.geom.swa_pages_bound
        for rid, r in self.holders.items():
            t = r.pages
            # Interior pages are held only from a chunk's extend to its commit (the same step).
            held = [p for a, p in enumerate(t.swa) if p is not None and a not in t.shared_swa and a not in t.interior]
            if self.swa is not None and len(held) > bound:
                raise AssertionError(f"{rid} holds {len(held)} SWA pages > bound {bound} "
                                     f"(+ {len(t.interior)} interior pages of this step)")
            if r.hit is None and (t.num_shared_full or t.shared_swa):
                raise AssertionError(f"{rid} borrows pages without a cache hit")
            if t.num_shared_full > len(t.full) or any(a >= len(t.swa) or t.swa[a] is None for a in t.shared_swa):
                raise AssertionError(f"{rid}: shared pages outside its table")
