"""L3 -> L2 prefetch: pages a request's prefix needs past what L1/L2 hold are read from the L3 store on a
background thread while the request waits in the scheduler's queue (other requests keep stepping).

One ``Prefetch`` per waiting request, in two background jobs with an engine-thread step between them:

1. *lookup*: ``batch_exists`` of the full pages after the tree's L1/L2 prefix (``start``) gives ``end``;
   on a hybrid model the SWA pages of the last window before ``end`` must be present too (SWA components
   store and fetch only that window), else nothing past ``start`` is usable;
2. the engine thread reserves host pages (L2) for ``[start, end)`` (full) and the window (SWA);
3. *read*: the SWA window first (without it no full page past ``start`` is usable), then the full pages
   in order, ``prefetch_batch_pages`` at a time. ``arrived`` grows batch by batch; the first failed or
   corrupt page ends it (a miss from that page on).

The prefetch policy (``prefetch_ready``, pure) decides when the request may start; it then takes the usable
prefix of what has arrived (``L3Tier.install`` puts it into the tree as L2 + L1 pages) and the rest of the
host pages go back to the pool when the reads stop (``cancelled`` stops them after the current batch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from storage.copier import Copier, Job, LayerFuture
from storage.l3.config import PREFETCH_POLICIES
from storage.pools import FULL, SWA

if TYPE_CHECKING:
    from storage.hicache import PrefixHit
    from storage.hicache_l3 import L3Tier


def prefetch_ready(policy: str, complete: bool, checks: int, now: float, deadline: float) -> bool:
    """May a request whose prefetch is in flight start now? ``complete``: no more pages will arrive;
    ``checks``: how many schedules already held it back; ``now`` / ``deadline``: seconds, any clock."""
    if policy not in PREFETCH_POLICIES:
        raise ValueError(f"policy must be one of {PREFETCH_POLICIES}, got {policy!r}")
    if complete:
        return True
    if policy == "best_effort":
        return checks >= 1        # the schedule after the one that started it
    if policy == "timeout":
        return now >= deadline
    return False                  # wait_complete


def usable_end(start: int, end: int, arrived: int, swa_ok: bool, window_pages: int) -> int:
    """One past the last page a request may take from a prefetch: full pages arrive in order, and on a
    hybrid model only the point whose last window of SWA pages was fetched (``end``) is usable."""
    if end <= start:
        return start
    if window_pages:
        return end if swa_ok and arrived >= end - start else start
    return start + min(arrived, end - start)


@dataclass(eq=False)
class Prefetch:
    keys: list[bytes]                  # page keys of the request's prefix (at most max_pages)
    start: int                         # first page read from L3: the tree's L1/L2 full depth at begin
    deadline: float                    # when the timeout policy lets the request go
    end: int = -1                      # one past the last page to read (-1: lookup not done)
    swa_lo: int = 0                    # first page of the SWA window read with it
    h_full: list[int] = field(default_factory=list)   # host pages of [start, end), owned until taken
    h_swa: list[int] = field(default_factory=list)    # host pages of [swa_lo, end)
    arrived: int = 0                   # full pages [start, start + arrived) are verified in h_full
    swa_ok: bool = False               # the SWA window is verified in h_swa
    running: bool = True               # a background job may still write into the host pages
    complete: bool = False             # no more pages will arrive
    cancelled: bool = False            # stop reading after the current batch
    released: bool = False             # taken or dropped: the request no longer owns it
    checks: int = 0
    given: set[int] = field(default_factory=set)       # h_full pages handed to the tree
    given_swa: set[int] = field(default_factory=set)   # h_swa pages handed to the tree
    found: tuple[int, int] = (0, 0)    # lookup result (end, swa_lo), set on the background thread


class Prefetcher:
    """The background half of L3Tier: one thread of reads, so a slow store never blocks a step."""

    def __init__(self, tier: "L3Tier") -> None:
        self.tier = tier
        self.cfg = tier.cache.cfg.l3
        self.jobs = Copier("strata-l3-prefetch")
        self.live: set[Prefetch] = set()
        self.stats = {"started": 0, "pages_read": 0, "pages_taken": 0, "partial": 0, "failed_pages": 0}

    # ---- engine thread ----------------------------------------------------------------------------
    def begin(self, keys: list[bytes], now: float) -> Prefetch | None:
        """Start fetching what L3 holds of ``keys`` past the tree's L1/L2 prefix; None if nothing can be."""
        start = self.tier.l12_depth(keys)
        if start >= len(keys):
            return None
        ps = self.tier.cache.page_size
        pf = Prefetch(list(keys), start, self.cfg.prefetch_deadline(now, (len(keys) - start) * ps))
        self.live.add(pf)
        self.stats["started"] += 1
        self.jobs.submit(Job(lambda f: self._lookup(pf), LayerFuture({}), lambda: self._looked_up(pf),
                             tag="l3 lookup"))
        return pf

    def ready(self, pf: Prefetch, now: float) -> bool:
        go = prefetch_ready(self.cfg.prefetch_policy, pf.complete, pf.checks, now, pf.deadline)
        pf.checks += 1
        return go

    def _looked_up(self, pf: Prefetch) -> None:
        pf.running = False
        end, swa_lo = pf.found
        cache = self.tier.cache
        n_swa = end - swa_lo if cache.has_swa and end > pf.start else 0
        if pf.released or end <= pf.start or not cache._host_room(FULL, end - pf.start) \
                or (n_swa and not cache._host_room(SWA, n_swa)):
            pf.end, pf.complete = pf.start, True
            self._retire(pf)
            return
        pf.end, pf.swa_lo = end, swa_lo
        pf.h_full = cache.host.pool(FULL).allocator.alloc(end - pf.start)
        pf.h_swa = cache.host.pool(SWA).allocator.alloc(n_swa) if n_swa else []
        pf.running = True
        self.jobs.submit(Job(lambda f: self._read(pf), LayerFuture({}), lambda: self._read_done(pf),
                             tag="l3 prefetch"))

    def _read_done(self, pf: Prefetch) -> None:
        pf.running, pf.complete = False, True
        self.stats["pages_read"] += pf.arrived
        if pf.end - pf.start > pf.arrived:
            self.stats["partial"] += 1
        if pf.released:
            self._retire(pf)

    def take(self, pf: Prefetch, hit: "PrefixHit", now: float) -> "PrefixHit":
        """Consume ``pf`` for a request whose L1/L2 prefix is ``hit``: extend ``hit`` with the usable pages
        that have arrived (never past what both components cover); free or abandon the rest."""
        tier, cache = self.tier, self.tier.cache
        m = usable_end(pf.start, pf.end, pf.arrived, pf.swa_ok, cache.tree.window_pages if cache.has_swa else 0)
        m0 = hit.num_pages
        pf.released = pf.cancelled = True
        if pf.start <= m0 < m:
            # The reads may still be running past m (full-only models): the lists stay as they are and
            # the pages handed to the tree are only marked, so the rest is freed once the reads stop.
            h_full = pf.h_full[m0 - pf.start:m - pf.start]
            h_swa = list(pf.h_swa) if m == pf.end else []
            pf.given.update(h_full)
            pf.given_swa.update(h_swa)
            hit = tier.install(hit, pf.keys, m0, m, pf.swa_lo if h_swa else m, h_full, h_swa, now)
            self.stats["pages_taken"] += m - m0
        self._retire(pf)
        return hit

    def release(self, pf: Prefetch) -> None:
        """The request went away (aborted, or its hit was given up): drop what was fetched for it."""
        pf.released = pf.cancelled = True
        self._retire(pf)

    def _retire(self, pf: Prefetch) -> None:
        """Free the host pages of a released prefetch once no job writes into them any more."""
        if pf.running or not pf.released:
            return
        host = self.tier.cache.host
        host.pool(FULL).allocator.free([p for p in pf.h_full if p not in pf.given])
        host.pool(SWA).allocator.free([p for p in pf.h_swa if p not in pf.given_swa])
        pf.h_full, pf.h_swa = [], []
        self.live.discard(pf)

    def owned(self, component: str) -> list[int]:
        """Host pages of ``component`` prefetches still own (for check_integrity)."""
        if component == FULL:
            return [p for pf in self.live for p in pf.h_full if p not in pf.given]
        return [p for pf in self.live for p in pf.h_swa if p not in pf.given_swa]

    def pending(self) -> bool:
        return self.jobs.num_pending > 0

    def wait(self, timeout: float) -> None:
        """Block until the oldest background job finishes or ``timeout`` seconds pass."""
        jobs = self.jobs.pending()
        if jobs:
            jobs[0].future.wait(timeout)

    def close(self) -> None:
        for pf in list(self.live):
            pf.released = pf.cancelled = True
        self.jobs.close()
        for pf in list(self.live):
            self._retire(pf)

    # ---- background thread ---------------------------------------------------------------------------
    def _lookup(self, pf: Prefetch) -> None:
        tier, store = self.tier, self.tier.store
        n = len(pf.keys)
        end = pf.start + store.batch_exists(tier.keys(pf.keys[pf.start:n], FULL))
        swa_lo = end
        wp = tier.cache.tree.window_pages if tier.cache.has_swa else 0
        if wp and end > pf.start:
            swa_lo = max(0, end - wp)
            if store.batch_exists(tier.keys(pf.keys[swa_lo:end], SWA)) < end - swa_lo:
                end = pf.start   # without the last window the extension is unusable
        pf.found = (end, swa_lo)

    def _read(self, pf: Prefetch) -> None:
        tier, cache = self.tier, self.tier.cache
        h_full, h_swa = list(pf.h_full), list(pf.h_swa)
        if h_swa:
            ok = tier.read_pages(cache.host.pool(SWA), tier.keys(pf.keys[pf.swa_lo:pf.end], SWA), h_swa)
            pf.swa_ok = ok == len(h_swa)
            if not pf.swa_ok:
                self.stats["failed_pages"] += 1
                return
        batch = self.cfg.prefetch_batch_pages
        host = cache.host.pool(FULL)
        for lo in range(pf.start, pf.end, batch):
            if pf.cancelled:
                return
            hi = min(lo + batch, pf.end)
            got = tier.read_pages(host, tier.keys(pf.keys[lo:hi], FULL), h_full[lo - pf.start:hi - pf.start])
            pf.arrived += got
            if got < hi - lo:
                self.stats["failed_pages"] += 1
                return
