"""Continuous batching with chunked prefill over the paged full and SWA pools.

Every step takes, in order: one token for each decoding request, then prefill chunks of running
requests, then new requests from the waiting queue (FIFO), all under ``max_batch_tokens``. Pages are
allocated on demand; when a running request cannot get a page, the newest running request is
preempted (its pages freed, to be recomputed later), as in vLLM's recompute policy.

The scheduler only decides: every page a request takes or gives back goes through the KVManager
(engine/kv_manager.py), which also slides the SWA window (a request holds at most
``KVGeometry.swa_pages_bound`` SWA pages).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.kv_manager import KVManager
from engine.request import Request, Status


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

    def drop_hold(self, req: Request) -> None:
        """Give back the cached prefix a queued request holds while it waits for room (nothing else)."""

    def on_release(self, req: Request) -> None:
        """After the KVManager gave back a request's pages and hit (preemption, finish, abort)."""

    def after_forward(self, reqs) -> None:
        """A forward ran for ``reqs`` (the engine calls it after each step's forward)."""


class Scheduler:
    def __init__(self, kv: KVManager, max_batch_tokens: int, max_running: int, chunk_size: int,
                 hooks: SchedulerHooks | None = None) -> None:
        self.kv = kv
        self.geom = kv.geom
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.hooks = hooks or SchedulerHooks()

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
        """Give back the request's pages (its own to the pools, borrowed ones to the cache)."""
        self.kv.release(req)
        self.hooks.on_release(req)

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
        s = hit_pages * self.geom.page_size
        e = s + min(req.seq_len - s, budget, self.chunk_size)
        need = self.kv.need(s, e)
        return all(n + needs.get(c, 0) <= self.kv.available(c) for c, n in need.items())

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
        """Pages for positions [num_computed, num_computed + n), or nothing at all (None)."""
        ext = self.kv.extend(req, n)
        return None if ext is None else ScheduledSeq(req, req.num_computed, n, *ext)

    def after_forward(self) -> None:
        self.kv.after_forward()

    def check_integrity(self, extra_owners: dict[str, dict[str, list[int]]] | None = None) -> None:
        """The KVManager's page invariants, and: only running requests hold pages."""
        self.kv.check_integrity(extra_owners)
        running = {r.rid for r in self.running}
        for rid in self.kv.holders:
            if rid not in running:
                raise AssertionError(f"{rid} holds pages but is not running")
