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
from storage.pools import PageAllocator


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


def swa_pages_bound(window: int, page_size: int) -> int:
    """Most SWA pages one request ever holds."""
    return -(-(window - 1) // page_size) + 1


class Scheduler:
    def __init__(self, page_size: int, full: PageAllocator, swa: PageAllocator | None, window: int | None,
                 max_batch_tokens: int, max_running: int, chunk_size: int) -> None:
        self.ps = page_size
        self.full = full
        self.swa = swa if window is not None else None
        self.window = window
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

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
        self.full.free(req.full_pages)
        req.full_pages = []
        if self.swa is not None:
            self.swa.free(req.owned_swa_pages())
        req.swa_pages = []

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
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            n = min(req.remaining, budget, self.chunk_size)
            seq = self._reserve(req, n)
            if seq is None:
                break  # wait for pages to come back; FIFO keeps long prompts from starving
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(seq)
            scheduled.add(req.rid)
            budget -= n
        return out

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
            return None
        retire: list[int] = []
        new_logical: list[int] = []
        swa_lo = s
        if self.swa is not None:
            w = self.window
            swa_lo = max(0, s - w + 1)
            keep_from = max(0, e - w + 1)
            first_write = max(s, keep_from)
            if first_write < e:
                for a in range(first_write // ps, (e - 1) // ps + 1):
                    if a >= len(req.swa_pages) or req.swa_pages[a] is None:
                        new_logical.append(a)
            retire = [a for a, p in enumerate(req.swa_pages) if p is not None and (a + 1) * ps <= keep_from]
            if not self.swa.can_alloc(len(new_logical) - len(retire)):
                return None
        # Commit: nothing below can fail.
        req.full_pages += self.full.alloc(max(0, need_full))
        swa_read: list[int] = []
        swa_write: list[tuple[int, int, int]] = []
        if self.swa is not None:
            swa_read = [req.swa_pages[a] for a in range(swa_lo // ps, -(-s // ps))] if s > swa_lo else []
            # Pages leaving the window go back first so the new positions can reuse them this step:
            # every layer reads its window before it writes.
            self.swa.free([req.swa_pages[a] for a in retire])
            for a in retire:
                req.swa_pages[a] = None
            fresh = self.swa.alloc(len(new_logical))
            for a, p in zip(new_logical, fresh):
                if a >= len(req.swa_pages):
                    req.swa_pages += [None] * (a + 1 - len(req.swa_pages))
                req.swa_pages[a] = p
            first_write = max(s, max(0, e - self.window + 1))
            swa_write = [(pos, req.swa_pages[pos // ps], pos % ps) for pos in range(first_write, e)]
        return ScheduledSeq(req, s, n, req.full_pages[:-(-e // ps)], swa_lo, swa_read, swa_write)

    def check_integrity(self) -> None:
        owners_full = {r.rid: r.full_pages for r in self.running}
        self.full.check_integrity(owners_full)
        if self.swa is not None:
            owners_swa = {r.rid: r.owned_swa_pages() for r in self.running}
            self.swa.check_integrity(owners_swa)
            bound = swa_pages_bound(self.window, self.ps)
            for r in self.running:
                if len(r.owned_swa_pages()) > bound:
                    raise AssertionError(f"{r.rid} holds {len(r.owned_swa_pages())} SWA pages > bound {bound}")
        for r in self.waiting:
            if r.full_pages or r.owned_swa_pages():
                raise AssertionError(f"waiting request {r.rid} holds pages")
