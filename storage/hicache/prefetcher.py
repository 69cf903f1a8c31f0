"""The background half of the L3 tier: one thread of reads (storage/hicache/prefetch.py tells the
steps), so a slow store never blocks a step. Given the store's I/O, the L2 tier it reads into, the tree
(read only, for where a prefetch starts) and the model's window in pages (0: no sliding layers)."""
from __future__ import annotations

from typing import Optional

from storage.copier import Copier, Job, LayerFuture
from storage.hicache.prefetch import (Fetched, Prefetch, StoreIO, find_cuts, l12_depth, prefetch_policy,
                                      usable_end)
from storage.l3.config import L3Config
from storage.pools import FULL, SWA


class Prefetcher:
    def __init__(self, io: StoreIO, l2, tree, window_pages: int, page_size: int, cfg: L3Config) -> None:
        self.io, self.l2, self.tree = io, l2, tree
        self.window_pages, self.page_size, self.cfg = window_pages, page_size, cfg
        self.policy = prefetch_policy(cfg.prefetch_policy)
        self.jobs = Copier("strata-l3-prefetch")
        self.live: set[Prefetch] = set()
        self.stats = {"started": 0, "pages_read": 0, "pages_taken": 0, "partial": 0, "failed_pages": 0}

    # ---- engine thread ----------------------------------------------------------------------------
    def begin(self, keys: list[bytes], now: float) -> Optional[Prefetch]:
        """Start fetching what L3 holds of ``keys`` past the tree's L1/L2 prefix; None if nothing can be,
        or if that is shorter than ``prefetch_min_tokens`` (recomputed, not waited for)."""
        start = l12_depth(self.tree, keys)
        if start >= len(keys) or (len(keys) - start) * self.page_size < self.cfg.prefetch_min_tokens:
            return None
        pf = Prefetch(list(keys), start, self.cfg.prefetch_deadline(now, (len(keys) - start) * self.page_size))
        self.live.add(pf)
        self.stats["started"] += 1
        self.jobs.submit(Job(lambda f: self._lookup(pf), LayerFuture({}), lambda: self._looked_up(pf),
                             tag="l3 lookup"))
        return pf

    def ready(self, pf: Prefetch, now: float) -> bool:
        go = self.policy.ready(pf.complete, pf.checks, now, pf.deadline)
        pf.checks += 1
        return go

    def _looked_up(self, pf: Prefetch) -> None:
        pf.running = False
        end, cuts = pf.found
        h_full = None if pf.released or end <= pf.start else self.l2.alloc(FULL, end - pf.start)
        h_swa = None
        # Every cut's window, so whatever prefix arrives can be used; when L2 has no room for them all,
        # only the last one's (all or nothing, as before partial prefixes).
        for tried in ((cuts, cuts[-1:]) if h_full is not None else ()):
            swa = self._window_pages(tried)
            h_swa = self.l2.alloc(SWA, len(swa))
            if h_swa is not None:
                cuts = tried
                break
        if h_full is None or h_swa is None:
            self.l2.free(FULL, h_full or [])
            pf.end, pf.complete = pf.start, True
            self._retire(pf)
            return
        pf.end, pf.cuts, pf.h_full, pf.h_swa = end, cuts, h_full, dict(zip(swa, h_swa))
        pf.running = True
        self.jobs.submit(Job(lambda f: self._read(pf), LayerFuture({}), lambda: self._read_done(pf),
                             tag="l3 prefetch"))

    def _window_pages(self, cuts: list[int]) -> list[int]:
        """The SWA pages of the windows that end at ``cuts``, ascending."""
        wp = self.window_pages
        return sorted({i for m in cuts for i in range(max(0, m - wp), m)}) if wp else []

    def _read_done(self, pf: Prefetch) -> None:
        pf.running, pf.complete = False, True
        self.stats["pages_read"] += pf.arrived
        if pf.end - pf.start > pf.arrived:
            self.stats["partial"] += 1
        if pf.released:
            self._retire(pf)

    def take(self, pf: Prefetch, m0: int) -> Optional[Fetched]:
        """Consume ``pf`` for a request whose L1/L2 prefix is ``m0`` pages: the host pages of the usable
        part past it that has arrived (never past what both components cover), now the caller's; the
        rest is freed once no read writes into it. None when nothing past ``m0`` is usable."""
        windows = list(pf.windows)   # before ``arrived``: a window is listed after its full pages arrived
        m = usable_end(pf.start, pf.end, pf.arrived, windows, self.window_pages)
        pf.released = pf.cancelled = True
        got = None
        if pf.start <= m0 < m:
            # The reads may still be running past m: the host pages stay where they are and those handed
            # over are only marked, so the rest is freed once the reads stop.
            h_full = pf.h_full[m0 - pf.start:m - pf.start]
            swa_lo = max(0, m - self.window_pages) if self.window_pages else m
            h_swa = [pf.h_swa[i] for i in range(swa_lo, m)]
            pf.given.update(h_full)
            pf.given_swa.update(h_swa)
            got = Fetched(m0, m, swa_lo, h_full, h_swa)
            self.stats["pages_taken"] += m - m0
        self._retire(pf)
        return got

    def release(self, pf: Prefetch) -> None:
        """The request went away (aborted, or its hit was given up): drop what was fetched for it."""
        pf.released = pf.cancelled = True
        self._retire(pf)

    def _retire(self, pf: Prefetch) -> None:
        """Free the host pages of a released prefetch once no job writes into them any more."""
        if pf.running or not pf.released:
            return
        self.l2.free(FULL, [p for p in pf.h_full if p not in pf.given])
        self.l2.free(SWA, [p for p in pf.h_swa.values() if p not in pf.given_swa])
        pf.h_full, pf.h_swa = [], {}
        self.live.discard(pf)

    def owned(self, component: str) -> list[int]:
        """Host pages of ``component`` prefetches still own (for check_integrity)."""
        if component == FULL:
            return [p for pf in self.live for p in pf.h_full if p not in pf.given]
        return [p for pf in self.live for p in pf.h_swa.values() if p not in pf.given_swa]

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
        io, keys, wp = self.io, pf.keys, self.window_pages
        end = pf.start + io.exists(io.keys(keys[pf.start:], FULL))
        cuts: list[int] = []
        if wp and end > pf.start:
            cuts = find_cuts(lambda lo, hi: io.exists(io.keys(keys[lo:hi], SWA)), pf.start, end, wp)
            end = cuts[-1] if cuts else pf.start   # past the last cut no full page is usable
        pf.found = (end, cuts)

    def _read(self, pf: Prefetch) -> None:
        io, wp, batch = self.io, self.window_pages, self.cfg.prefetch_batch_pages
        h_full, full, swa = list(pf.h_full), self.l2.pool(FULL), self.l2.pool(SWA)
        tried, ok_swa = set(), set()
        cuts = iter(pf.cuts)
        cut = next(cuts, None)
        for lo in range(pf.start, pf.end, batch):
            if pf.cancelled:
                return
            hi = min(lo + batch, pf.end)
            got = io.read_pages(full, io.keys(pf.keys[lo:hi], FULL), h_full[lo - pf.start:hi - pf.start])
            pf.arrived += got
            while cut is not None and cut <= lo + got:   # the windows of the cuts these pages reach
                need = [i for i in range(max(0, cut - wp), cut) if i not in tried]
                if need:
                    n = io.read_pages(swa, io.keys([pf.keys[i] for i in need], SWA), [pf.h_swa[i] for i in need])
                    tried.update(need)
                    ok_swa.update(need[:n])
                    if n < len(need):
                        self.stats["failed_pages"] += 1
                if all(i in ok_swa for i in range(max(0, cut - wp), cut)):
                    pf.windows.append(cut)
                cut = next(cuts, None)
            if got < hi - lo:
                self.stats["failed_pages"] += 1
                return
