"""Glue between the scheduler and the prefix cache (storage/hicache/): a queued request's prefix is
prefetched from slow tiers and matched at admission (its pages are then borrowed through the
KVManager, engine/kv_manager.py, which also hands them to the cache at commit and eviction)."""
from __future__ import annotations

import time

from engine.kv_manager import KVManager
from engine.request import Request
from engine.scheduler import SchedulerHooks
from storage.hicache import HiCache


class PrefixCacheHooks(SchedulerHooks):
    def __init__(self, cache: HiCache, kv: KVManager, clock, wall_clock=time.monotonic) -> None:
        self.cache = cache
        self.kv = kv
        self.clock = clock  # () -> float, the engine's logical time
        self.wall_clock = wall_clock  # () -> seconds, for prefetch deadlines

    def prefetch(self, req: Request) -> None:
        """Start the L3 prefetch of a queued request's prefix once (the scheduler asks for the first
        requests of its queue every step), so the pages arrive while it waits behind others."""
        if self.cache.l3 is None or req.prefetch_checked or req.hit is not None or req.num_computed:
            return
        req.prefetch_checked = True
        req.prefetch = self.cache.prefetch_begin(req.tokens(0, req.seq_len), self._max_pages(req),
                                                 self.wall_clock())

    def ready(self, req: Request) -> bool:
        """A request whose prefix continues in L3 waits while the pages are prefetched into L2, until
        the prefetch policy lets it go (storage/hicache/prefetch.py)."""
        if self.cache.l3 is None or req.hit is not None or req.num_computed:
            return True
        if req.prefetch is None:
            if req.prefetch_checked:
                return True   # L3 had nothing past L1/L2 for it
            self.prefetch(req)
            return req.prefetch is None
        return self.cache.prefetch_ready(req.prefetch, self.wall_clock())

    def _max_pages(self, req: Request) -> int:
        # At least one token must run through the model to produce the next token's logits; prompt
        # logprobs still to compute need the logits of every position from the one before their first.
        n = req.seq_len - 1
        if req.prompt_logprobs is not None:
            n = min(n, max(req.params.logprob_start_len, 1) - 1 + req.num_prompt_logprobs_done())
        return n // self.cache.page_size

    def on_admit(self, req: Request, room=None) -> bool:
        if req.num_computed or (req.hit is not None and not req.hit.deferred):
            return True
        if req.hit is not None:   # waited for room to load its L2 pages: ask again
            hit = self.cache.resume(req.hit, self.clock(), req.prefetch, room)
        else:
            hit = self.cache.match(req.tokens(0, req.seq_len), self._max_pages(req), self.clock(),
                                   prefetch=req.prefetch, room=room)
        if hit.deferred:
            req.hit = hit   # locked but not loaded; keeps its prefetch until it completes
            return False
        req.prefetch = None
        req.hit = None
        if hit.num_pages == 0:
            req.cached_tokens = 0
            req.cached_by_tier = dict(hit.tokens_by_tier)
            return True
        self.kv.borrow(req, hit)
        req.num_computed = hit.num_pages * self.cache.page_size
        req.cached_tokens = req.num_computed
        req.cached_by_tier = dict(hit.tokens_by_tier)
        return True

    def drop_hold(self, req: Request) -> None:
        if req.hit is not None and req.hit.deferred:   # nothing loaded for it yet: nothing wasted
            self.cache.release(req.hit)
            req.hit = None

    def after_forward(self, reqs) -> None:
        """A forward ran for ``reqs``: the pages loaded for their hits have been read."""
        for req in reqs:
            if req.hit is not None and req.hit.unread:
                self.cache.mark_read(req.hit)

    def on_release(self, req: Request) -> None:
        """The KVManager gave back its pages and hit; what was prefetched for it goes too."""
        req.prefetch_checked = False   # preempted: L3 is asked again when it is queued again
        if req.prefetch is not None:
            self.cache.prefetch_release(req.prefetch)
            req.prefetch = None
