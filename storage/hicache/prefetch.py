"""L3 -> L2 prefetch: pages a request's prefix needs past what L1/L2 hold are read from the L3 store on a
background thread while the request waits in the scheduler's queue (other requests keep stepping).

One ``Prefetch`` per waiting request, in two background jobs with an engine-thread step between them:

1. *lookup*: ``batch_exists`` of the full pages after the tree's L1/L2 prefix (``start``) gives ``end``.
   On a hybrid model a prefix is usable only up to a *cut*: a point whose last window of SWA pages L3
   holds too (SWA components store only each sequence's last window, so L3 has windows where earlier
   sequences ended). ``end`` becomes the last cut; no cut, nothing past ``start`` is usable;
2. the engine thread reserves host pages (L2) for ``[start, end)`` (full) and the cuts' windows (SWA);
3. *read*: the full pages in order, ``prefetch_batch_pages`` at a time, and after each batch the windows
   of the cuts it reached. ``arrived`` grows batch by batch; the first failed or corrupt full page ends
   it (a miss from that page on), a failed SWA page only rules out the cuts whose window holds it.

The prefetch policy (a strategy from ``L3Config.prefetch_policy``) decides when the request may start;
it then takes the longest usable prefix of what has arrived (``usable_end``: on a hybrid model the last
cut whose full pages and window both arrived) and the rest of the host pages go back to the pool when
the reads stop (``cancelled`` stops them after the current batch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from storage.l3.config import PREFETCH_POLICIES, L3Config
from storage.pools import FULL, SWA


# ---- policies (strategies, pure) -------------------------------------------------------------------
class PrefetchPolicy:
    """May a request whose prefetch is in flight start now? ``complete``: no more pages will arrive;
    ``checks``: how many schedules already held it back; ``now`` / ``deadline``: seconds, any clock."""

    def ready(self, complete: bool, checks: int, now: float, deadline: float) -> bool:
        raise NotImplementedError


class BestEffort(PrefetchPolicy):
    def ready(self, complete, checks, now, deadline):
        return complete or checks >= 1   # the schedule after the one that started it


class WaitComplete(PrefetchPolicy):
    def ready(self, complete, checks, now, deadline):
        return complete


class Timeout(PrefetchPolicy):
    def ready(self, complete, checks, now, deadline):
        return complete or now >= deadline


PREFETCH_STRATEGIES = {"best_effort": BestEffort(), "wait_complete": WaitComplete(), "timeout": Timeout()}


def prefetch_policy(name: str) -> PrefetchPolicy:
    if name not in PREFETCH_POLICIES:
        raise ValueError(f"policy must be one of {PREFETCH_POLICIES}, got {name!r}")
    return PREFETCH_STRATEGIES[name]


def prefetch_ready(policy: str, complete: bool, checks: int, now: float, deadline: float) -> bool:
    return prefetch_policy(policy).ready(complete, checks, now, deadline)


def usable_end(start: int, end: int, arrived: int, windows, window_pages: int) -> int:
    """One past the last page a request may take from a prefetch: full pages arrive in order; on a
    hybrid model (``window_pages``) only a cut whose window of SWA pages arrived (in ``windows``) is."""
    if end <= start:
        return start
    top = start + min(arrived, end - start)
    if not window_pages:
        return top
    return max((m for m in windows if start < m <= top), default=start)


def find_cuts(exists, start: int, end: int, wp: int) -> list[int]:
    """The points in (start, end] whose window [m - wp, m) of SWA pages the store holds, ascending.
    ``exists(lo, hi)``: how many of the SWA pages [lo, hi) are present from lo on."""
    cuts, m = [], end
    while m > start:
        lo = max(0, m - wp)
        k = exists(lo, m)
        if k >= m - lo:
            cuts.append(m)
            m -= 1
        else:
            m = lo + k   # page lo + k is missing: no window ending after it (up to it + wp) is whole
    return cuts[::-1]


class Fetched(NamedTuple):
    """What a request takes from its prefetch: full host pages of [m0, m), SWA host pages of [swa_lo, m)."""
    m0: int
    m: int
    swa_lo: int
    h_full: list[int]
    h_swa: list[int]


@dataclass(eq=False)
class Prefetch:
    keys: list[bytes]                  # page keys of the request's prefix (at most max_pages)
    start: int                         # first page read from L3: the tree's L1/L2 full depth at begin
    deadline: float                    # when the timeout policy lets the request go
    end: int = -1                      # one past the last page to read (-1: lookup not done)
    cuts: list[int] = field(default_factory=list)      # hybrid: usable ends, ascending (last: end)
    h_full: list[int] = field(default_factory=list)    # host pages of [start, end), owned until taken
    h_swa: dict[int, int] = field(default_factory=dict)  # page index -> host SWA page (the cuts' windows)
    arrived: int = 0                   # full pages [start, start + arrived) are verified in h_full
    windows: list[int] = field(default_factory=list)   # cuts whose window is verified in h_swa
    running: bool = True               # a background job may still write into the host pages
    complete: bool = False             # no more pages will arrive
    cancelled: bool = False            # stop reading after the current batch
    released: bool = False             # taken or dropped: the request no longer owns it
    checks: int = 0
    given: set[int] = field(default_factory=set)       # h_full pages handed to the tree
    given_swa: set[int] = field(default_factory=set)   # h_swa pages handed to the tree
    found: tuple[int, list[int]] = (0, [])  # lookup result (end, cuts), set on the background thread


class StoreIO(Protocol):
    """The L3 store as the prefetcher reads it (L3Tier)."""

    def keys(self, page_keys, component: str) -> list[str]: ...

    def exists(self, keys: list[str]) -> int: ...

    def read_pages(self, host, keys: list[str], pages: list[int]) -> int: ...


def l12_depth(tree, page_keys: list[bytes]) -> int:
    """Pages of ``page_keys`` whose full data the tree holds in L1 or L2 (read-only walk: no touch,
    no split): where an L3 prefetch starts."""
    cur, i = tree.root, 0
    while i < len(page_keys):
        child = cur.children.get(page_keys[i])
        if child is None or (child.l1[FULL] is None and child.l2[FULL] is None):
            break
        k = 0
        while k < child.num_pages and i + k < len(page_keys) and child.keys[k] == page_keys[i + k]:
            k += 1
        i += k
        if k < child.num_pages:
            break
        cur = child
    return i
