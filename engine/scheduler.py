"""Continuous batching with chunked prefill over the paged full and SWA pools.

Every step takes, in order: one token for each decoding request, then prefill chunks of running
requests, then new requests from the waiting queue (FIFO), all under ``max_batch_tokens``. Pages are
allocated on demand; when a running request cannot get a page, the newest running request is
preempted (its pages freed, to be recomputed later), as in vLLM's recompute policy.

Sliding-window layers keep only what later steps can still attend to: after a step that ends at
position ``e`` only positions ``>= e - W + 1`` are stored, and SWA pages wholly below that are freed
in the same step, so a request holds at most ``ceil((W - 1) / page_size) + 1`` SWA pages.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.request import Request, Status
from storage.geometry import KVGeometry
from storage.pools import PageAllocator


PREFETCH_LOOKAHEAD = 16
"""Queued requests (at least) whose slow-tier prefetch may run ahead of their admission."""


@dataclass
class ScheduledSeq:
    """One request's share of a step: tokens at positions [start, start + n)."""

    req: Request
    start: int
    n: int
    full_pages: list[int]          # pages covering [0, end)
    swa_lo: int                    # first position read from the SWA pool
    swa_read_pages: list[int]      # pages covering [swa_lo, start), snapshot before recycling
    swa_write: list[tuple[int, int, int]]  # (position, page, offset) stored in the SWA pool

    @property
    def end(self) -> int:
        return self.start + self.n

    @property
    def samples(self) -> bool:
        return self.end == self.req.seq_len


class SchedulerHooks:
    """What the prefix cache plugs into the scheduler; the defaults are "no cache"."""

    def prefetch(self, req: Request) -> None:
        """A request is queued: start fetching what its prefix needs from slow tiers while it waits."""

    def ready(self, req: Request) -> bool:
        """May this waiting request be admitted now? (False: its cached prefix is still arriving.)"""
        return True

    def on_admit(self, req: Request, room=None) -> bool:
        """Before a waiting request's first chunk: may borrow cached pages and advance num_computed.
        ``room(num_pages, needs)`` tells whether L1 can take the ``needs`` pages ({component: n}) a hit
        of ``num_pages`` pages must load as well as its first chunk; False: the request waits."""
        return True

    def reclaimable(self, component: str) -> int:
        """L1 pages of ``component`` ``make_room`` could free."""
        return 0

    def drop_hold(self, req: Request) -> None:
        """Give back the cached prefix a queued request holds while it waits for room (nothing else)."""

    def on_release(self, req: Request) -> None:
        """After the scheduler freed a request's own pages (preemption, finish, abort)."""

    def make_room(self, component: str, n_pages: int) -> None:
        """Free up to ``n_pages`` L1 pages of ``component`` held by the cache."""


class Scheduler:
    def __init__(self, geom: KVGeometry, full: PageAllocator, swa: PageAllocator | None,
                 max_batch_tokens: int, max_running: int, chunk_size: int,
                 hooks: SchedulerHooks | None = None, swa_page_aligned: bool = False) -> None:
        self.geom = geom
        self.ps = geom.page_size
        self.full = full
        self.swa = swa if geom.has_swa else None
        self.window = geom.window
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.hooks = hooks or SchedulerHooks()
        # SWA pages that left the window this step: still read by this step's forward, so they go back
        # to the allocator only after it (anyone else could overwrite them before the read).
        self._retired: list[int] = []
        self.swa_page_aligned = swa_page_aligned

    # ---- queue -----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Drop a request wherever it is and free its pages (finish or abort)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.release(req)

    def release(self, req: Request) -> None:
        """Free the pages the request owns; borrowed ones go back through the hooks."""
        self.full.free(req.owned_full_pages())
        if self.swa is not None:
            self.swa.free(req.owned_swa_pages())
        req.full_pages, req.swa_pages = [], []
        self.hooks.on_release(req)
        req.num_shared_full, req.shared_swa = 0, set()

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_batch_tokens
        out: list[ScheduledSeq] = []
        scheduled: set[str] = set()
        # Decodes first (latency), then running prefills, in admission order.
        for req in sorted(self.running, key=lambda r: (not r.is_decoding, r.arrival)):
            if budget == 0:
                break
            if req.rid in scheduled or req.status is not Status.RUNNING:
                continue
            n = min(req.remaining, budget, self.chunk_size)
            seq = self._reserve(req, n)
            if seq is None and self._release_waiting_holds():
                seq = self._reserve(req, n)
            while seq is None:
                victim = self._preempt_newest(exclude=scheduled)
                if victim is None or victim is req:
                    break
                seq = self._reserve(req, n)
            if seq is None:
                continue
            out.append(seq)
            scheduled.add(req.rid)
            budget -= n
        # Prefetches start while requests wait, not when they reach the head: for the queue's first
        # requests (those admitted soonest; the bound caps the host pages their reads reserve).
        for k, req in enumerate(self.waiting):
            if k >= max(self.max_running, PREFETCH_LOOKAHEAD):
                break
            self.hooks.prefetch(req)
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[i]
            if not self.hooks.ready(req):   # held back (L3 prefetch): the ones behind it may go
                i += 1
                continue
            if not self.hooks.on_admit(req, lambda m, needs, r=req, b=budget: self._fits(r, m, needs, b)):
                break  # its cached prefix waits for room in L1 (see _fits); FIFO as below
            n = min(req.remaining, budget, self.chunk_size)
            seq = self._reserve(req, n)
            if seq is None:
                self.release(req)
                req.num_computed = 0
                if not self.running:   # no pages will come back: nobody may sit on cached ones
                    self._release_waiting_holds()
                break  # wait for pages to come back; FIFO keeps long prompts from starving
            del self.waiting[i]
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(seq)
            scheduled.add(req.rid)
            budget -= n
        return out

    def _fits(self, req: Request, hit_pages: int, needs: dict[str, int], budget: int) -> bool:
        """The load rule of a waiting request whose cached prefix (``hit_pages``) must first be loaded
        into L1 (``needs`` pages per component): load it now only if the pool can take those pages and
        the request's first chunk at once, from free pages and what the cache would give back. Else it
        waits: recomputing the prefix would need the same pages (it is the request's own prefix), so it
        could not run sooner, and pages loaded for a request that cannot run are evicted by those that
        do. The exception: when nothing runs, no pages will come back, so it loads what it can (giving
        up the rest of the hit, which it then recomputes)."""
        if not self.running:
            return True
        ps, s = self.ps, hit_pages * self.ps
        e = s + min(req.seq_len - s, budget, self.chunk_size)
        need = {"full": -(-e // ps) - hit_pages + needs.get("full", 0)}
        if self.swa is not None:
            first = max(s, self._swa_keep_from(e))
            need["swa"] = ((e - 1) // ps - first // ps + 1 if first < e else 0) + needs.get("swa", 0)
        allocs = {"full": self.full, "swa": self.swa}
        return all(n <= allocs[c].num_free + self.hooks.reclaimable(c) for c, n in need.items())

    def _release_waiting_holds(self) -> bool:
        """Give back the cached prefixes queued requests hold while they wait for room (see _fits):
        they are matched again when their turn comes, rather than cost a running request its place."""
        held = [r for r in self.waiting if r.hit is not None]
        for r in held:
            self.hooks.drop_hold(r)
        return bool(held)

    def _preempt_newest(self, exclude: set[str]) -> Request | None:
        cands = [r for r in self.running if r.rid not in exclude]
        if not cands:
            return None
        victim = max(cands, key=lambda r: r.arrival)
        self.running.remove(victim)
        self.release(victim)
        victim.num_computed = 0
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def _reserve(self, req: Request, n: int) -> ScheduledSeq | None:
        """Allocate what positions [num_computed, num_computed + n) need, or nothing at all."""
        ps, s = self.ps, req.num_computed
        e = s + n
        need_full = -(-e // ps) - len(req.full_pages)
        if not self.full.can_alloc(need_full):
            self.hooks.make_room("full", need_full - self.full.num_free)
            if not self.full.can_alloc(need_full):
                return None
        retire: list[int] = []
        new_logical: list[int] = []
        swa_lo = s
        if self.swa is not None:
            swa_lo = self.geom.swa_lo(s)
            keep_from = self._swa_keep_from(e)
            first_write = max(s, keep_from)
            if first_write < e:
                for a in range(first_write // ps, (e - 1) // ps + 1):
                    if a >= len(req.swa_pages) or req.swa_pages[a] is None:
                        new_logical.append(a)
            retire = [a for a, p in enumerate(req.swa_pages) if p is not None and (a + 1) * ps <= keep_from]
            need = max(0, len(new_logical) - sum(a not in req.shared_swa for a in retire))
            if not self.swa.can_alloc(need):
                self.hooks.make_room("swa", need - self.swa.num_free)
                if not self.swa.can_alloc(need):
                    return None
        # Commit: nothing below can fail.
        req.full_pages += self.full.alloc(max(0, need_full))
        swa_read: list[int] = []
        swa_write: list[tuple[int, int, int]] = []
        if self.swa is not None:
            swa_read = [req.swa_pages[a] for a in range(swa_lo // ps, -(-s // ps))] if s > swa_lo else []
            # Pages leaving the window are reused for this request's new positions at once (each layer
            # reads its window before it writes); the rest return to the allocator after the forward.
            owned_retired = [req.swa_pages[a] for a in retire if a not in req.shared_swa]
            for a in retire:
                req.swa_pages[a] = None
                req.shared_swa.discard(a)
            reuse = owned_retired[:len(new_logical)]
            self._retired += owned_retired[len(new_logical):]
            fresh = reuse + self.swa.alloc(len(new_logical) - len(reuse))
            for a, p in zip(new_logical, fresh):
                if a >= len(req.swa_pages):
                    req.swa_pages += [None] * (a + 1 - len(req.swa_pages))
                req.swa_pages[a] = p
            first_write = max(s, keep_from)
            if first_write > s:  # positions [s, first_write) never reach the SWA pool
                req.swa_valid_from = max(req.swa_valid_from, first_write)
            swa_write = [(pos, req.swa_pages[pos // ps], pos % ps) for pos in range(first_write, e)]
        return ScheduledSeq(req, s, n, req.full_pages[:-(-e // ps)], swa_lo, swa_read, swa_write)

    def after_forward(self) -> None:
        """Return the SWA pages retired this step (their last reader, the forward, is done)."""
        if self._retired:
            self.swa.free(self._retired)
            self._retired = []

    def _swa_keep_from(self, e: int) -> int:
        """First position later steps still need after ``e``. Page-aligned retention (prefix cache on)
        keeps whole pages: the window before the last page boundary *before position e - 1*, so the
        cache can reuse the sequence there, and every page it holds is written from its first position.
        That boundary, not the last one at or before e: a repeat of a prompt ending on a page boundary
        can only match up to the page before (its last token is always computed), and the window
        ending there needs the one page more. Still ``window_pages + 1`` pages at most."""
        if self.swa_page_aligned:
            return max(0, ((e - 1) // self.ps - self.geom.window_pages) * self.ps)
        return self.geom.swa_lo(e)

    def check_integrity(self, extra_owners: dict[str, dict[str, list[int]]] | None = None) -> None:
        extra_owners = extra_owners or {}
        owners_full = {r.rid: r.owned_full_pages() for r in self.running}
        self.full.check_integrity({**owners_full, **extra_owners.get("full", {})})
        if self.swa is not None:
            owners_swa = {r.rid: r.owned_swa_pages() for r in self.running}
            owners_swa["retired this step"] = self._retired
            self.swa.check_integrity({**owners_swa, **extra_owners.get("swa", {})})
            bound = self.geom.swa_pages_bound
            for r in self.running:
                if len(r.owned_swa_pages()) > bound:
                    raise AssertionError(f"{r.rid} holds {len(r.owned_swa_pages())} SWA pages > bound {bound}")
                if r.hit is None and (r.num_shared_full or r.shared_swa):
                    raise AssertionError(f"{r.rid} borrows pages without a cache hit")
        for r in self.waiting:
            if r.full_pages or r.owned_swa_pages():
                raise AssertionError(f"waiting request {r.rid} holds pages")
