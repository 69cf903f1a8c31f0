"""The prompts the router just sent to each worker, before that worker's KV events say it holds them.

A worker publishes its tree's events with its report, every ``report_interval`` (50 ms by default), so
the index lags what the workers hold by up to one interval, plus the prefill itself. A prompt repeated in
that window (a second sample, a retry, the next turn of a fast agent) would find the index empty for it,
see the first worker's queue grown by the first request, and go to another worker, where it is computed
again. SGLang's cache-aware router avoids that by inserting each routed prompt into its own tree; strata's
index stays the KV events' alone (what a restarted router or another consumer of the wire rebuilds), and
this overlay holds each routed prompt beside it until the worker's ``reports``-th report after the route.
The first may carry events taken before the route; the second's were taken after the first returned, so
they tell the prefill unless the request was still queued. From then on the index alone speaks, so a
prompt the worker evicted (or never got) misleads routing for one or two report intervals at most.
Plain, no Ray, no clock: reports count time.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Sequence


class RecentRoutes:
    """worker -> {block id: the report count that ends it}: the block ids (``prompt_blocks``) of the
    prompts routed to the worker since its ``reports``-th last report (0: off). A block id is chained (it
    names its page and every page before it), so a worker's blocks form prefixes, and a prompt's match is
    found by bisection."""

    def __init__(self, reports: int) -> None:
        self.reports = reports
        self._held: dict[str, dict[int, int]] = {}
        self._due: dict[str, deque[tuple[int, Sequence[int]]]] = {}   # worker -> (until, blocks), in order
        self._count: dict[str, int] = {}                                # worker -> reports seen

    def add(self, worker: str, keys: Sequence[int]) -> None:
        """``keys`` (a prompt's block ids) were just routed to ``worker``."""
        if self.reports <= 0 or not keys:
            return
        until = self._count.get(worker, 0) + self.reports
        self._held.setdefault(worker, {}).update(dict.fromkeys(keys, until))
        self._due.setdefault(worker, deque()).append((until, keys))

    def reported(self, worker: str) -> None:
        """A report of ``worker`` came (its events up to it are in the index): the routes it ends expire."""
        n = self._count[worker] = self._count.get(worker, 0) + 1
        due, held = self._due.get(worker), self._held.get(worker)
        if not due:
            return
        while due and due[0][0] <= n:
            until, keys = due.popleft()
            for k in keys:
                if held.get(k) == until:   # not routed there again since
                    del held[k]
        if not due:
            self.forget(worker)

    def pages(self, keys: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        """Per worker of ``workers`` holding any: how many leading pages of ``keys`` were routed to it."""
        out: dict[str, int] = {}
        for w in workers:
            held = self._held.get(w)
            if held and keys and keys[0] in held:
                lo, hi = 1, len(keys)    # keys[:lo] held; find the longest such prefix
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if keys[mid - 1] in held:
                        lo = mid
                    else:
                        hi = mid - 1
                out[w] = lo
        return out

    def forget(self, worker: str) -> None:
        """``worker`` is gone, restarted, silent or flushed: what it was sent says nothing of what it holds."""
        self._held.pop(worker, None)
        self._due.pop(worker, None)

    def check_integrity(self) -> None:
        """Each held block is due to expire at its count, within ``reports`` of the worker's count, and a
        worker's blocks form prefixes (a block held means the one before it in its prompt is, as long)."""
        if self._held.keys() != self._due.keys():
            raise AssertionError(f"held for {sorted(self._held)} but due for {sorted(self._due)}")
        for worker, held in self._held.items():
            count, due, last, ends = self._count.get(worker, 0), self._due[worker], 0, {}
            if not held or not due:
                raise AssertionError(f"{worker}: {len(held)} blocks held, {len(due)} routes due")
            for until, keys in due:
                if until < last or not count < until <= count + self.reports:
                    raise AssertionError(f"{worker}: a route due at report {until} (count {count}, after {last})")
                last = until
                ends.update(dict.fromkeys(keys, until))
                for a, b in zip(keys, keys[1:]):
                    if b in held and held.get(a, 0) < held[b]:
                        raise AssertionError(f"{worker}: block {b} held until {held[b]} past the block before it")
            for k, until in held.items():
                if ends.get(k) != until:
                    raise AssertionError(f"{worker}: block {k} held until {until}, due at {ends.get(k)}")
