"""Glue between the scheduler and the prefix cache (storage/hicache.py): a request borrows its cached
prefix at admission, gives its pages to the cache when it finishes, and the cache yields L1 pages
before the scheduler preempts anyone."""
from __future__ import annotations

import time

from engine.request import Request
from engine.scheduler import SchedulerHooks
from storage.hicache import HiCache
from storage.pools import KVPools


class PrefixCacheHooks(SchedulerHooks):
    def __init__(self, cache: HiCache, pools: KVPools, clock, wall_clock=time.monotonic) -> None:
        self.cache = cache
        self.pools = pools
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
        the prefetch policy lets it go (storage/hicache_prefetch.py)."""
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
        req.hit = hit
        req.full_pages = list(hit.full_pages)
        req.num_shared_full = hit.num_pages
        req.swa_pages = list(hit.swa_pages)
        req.shared_swa = {a for a, p in enumerate(hit.swa_pages) if p is not None}
        req.num_computed = hit.num_pages * self.cache.page_size
        present = [a for a, x in enumerate(hit.swa_pages) if x is not None]
        req.swa_valid_from = present[0] * self.cache.page_size if present else req.num_computed
        req.cached_tokens = req.num_computed
        req.cached_by_tier = dict(hit.tokens_by_tier)
        return True

    def drop_hold(self, req: Request) -> None:
        if req.hit is not None and req.hit.deferred:   # nothing loaded for it yet: nothing wasted
            self.cache.release(req.hit)
            req.hit = None

    def reclaimable(self, component: str) -> int:
        return self.cache.reclaimable_l1(component)

    def after_forward(self, reqs) -> None:
        """A forward ran for ``reqs``: the pages loaded for their hits have been read."""
        for req in reqs:
            if req.hit is not None and req.hit.unread:
                self.cache.mark_read(req.hit)

    def on_release(self, req: Request) -> None:
        req.prefetch_checked = False   # preempted: L3 is asked again when it is queued again
        if req.prefetch is not None:
            self.cache.prefetch_release(req.prefetch)
            req.prefetch = None
        if req.hit is not None:
            self.cache.release(req.hit)
            req.hit = None

    def make_room(self, component: str, n_pages: int) -> None:
        if n_pages > 0:
            self.cache.evict_l1(component, n_pages)

    def cache_prompt(self, req: Request) -> None:
        """A prompt just finished prefilling and the request decodes on: hand its whole pages to the
        cache now, as borrowed pages, rather than at finish. By then decode has slid the SWA window
        past the prompt's end, so a repeat of the prompt (retry, regeneration, n>1 arriving
        separately) would find no usable window; the tree keeps it (locked while this request runs,
        then under its LRU), and the request's own SWA footprint shrinks to its tail."""
        ps = self.cache.page_size
        n = req.num_computed // ps
        if n <= req.num_shared_full:
            return  # the cache already holds every whole page (the prompt ends inside its hit's last)
        padded = (req.swa_pages + [None] * n)[:n]
        swa = [p if a * ps >= req.swa_valid_from else None for a, p in enumerate(padded)]
        keys = req.hit.keys if req.hit is not None else None
        hit, dup_full, dup_swa = self.cache.insert_and_hold(req.tokens(0, n * ps), req.full_pages[:n], swa,
                                                            self.clock(), keys)
        req.full_pages[:n] = hit.full_pages
        req.num_shared_full = n
        for a, p in enumerate(swa):
            if p is not None:  # the tree's now (kept or a duplicate); below the window the request never reads it
                req.swa_pages[a] = None
                req.shared_swa.discard(a)
        for a, q in enumerate(hit.swa_pages):
            if q is not None:
                req.swa_pages[a] = q
                req.shared_swa.add(a)
        self.pools.full.allocator.free(dup_full)
        if self.pools.swa.num_pages:
            self.pools.swa.allocator.free(dup_swa)
        if req.hit is not None:
            self.cache.release(req.hit)
        req.hit = hit

    def cache_finished(self, req: Request) -> None:
        """Hand the request's whole computed pages to the cache and free the rest it owns; its borrowed
        prefix stays locked until the scheduler releases it."""
        ps = self.cache.page_size
        n = req.num_computed // ps
        # Only pages written from their first position are whole SWA data the cache can serve.
        swa = [p if a * ps >= req.swa_valid_from else None for a, p in enumerate((req.swa_pages + [None] * n)[:n])]
        keys = req.hit.keys if req.hit is not None else None
        dup_full, dup_swa = self.cache.insert(req.tokens(0, n * ps), req.full_pages[:n], swa, self.clock(), keys)
        owned_tail_full = req.full_pages[max(n, req.num_shared_full):]
        owned_tail_swa = [p for a, p in enumerate(req.swa_pages)
                          if p is not None and a not in req.shared_swa and (a >= n or swa[a] is None)]
        self.pools.full.allocator.free(dup_full + owned_tail_full)
        if self.pools.swa.num_pages:
            self.pools.swa.allocator.free(dup_swa + owned_tail_swa)
        req.full_pages, req.swa_pages = [], []
        req.num_shared_full, req.shared_swa, req.swa_valid_from = 0, set(), 0
