"""The SWA-oblivious host backup, a baseline for the benches: host memory is taken for the sliding
layers of every backed-up token, as a host pool that treats every layer alike would. Where the window
has slid past there is no data to put in it, so the room is reserved beside each full L2 page, never
served; the SWA-aware copy of the last window is made as usual.

Production carries nothing for it: the bench builds its cache itself, ``ObliviousHiCache`` (a HiCache
whose L2 tier is ``ObliviousHostTier``) over a ``HiCacheConfig`` sized by ``oblivious_config`` (an SWA
host pool as large as the full one). An engine builds its cache in its constructor, so the bench has
the engines of a process build this one instead (``install``, or ``installed()`` around in-process
engines); a Ray worker process does so through ``runtime_env={"worker_process_setup_hook": SETUP_HOOK}``
(bench/compare.py, for the oblivious variant's cluster only).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

from storage.config import HiCacheConfig
from storage.hicache import HiCache, HostTier
from storage.pools import FULL, SWA
from storage.radix.node import L2, Node

SETUP_HOOK = "bench.swa_oblivious.install"


class ObliviousHostTier(HostTier):
    """HostTier that backs up every sliding page it is given and keeps room for the sliding layers of
    every backed-up token: an SWA host page reserved beside each full L2 page of a node whose sliding
    KV is gone, until that full page is freed or the node's real SWA copy takes its place."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.oblivious: dict[int, int] = {}   # full L2 page -> the host SWA page reserved beside it

    def backs_up(self, node: Node) -> bool:
        return True   # every sliding page it has, kept window or not: it does not tell them apart

    def write(self, node: Node, c: str, sync: bool = False, then=None) -> bool:
        before = self._copy_of(node, c)
        ok = super().write(node, c, sync, then)
        dst = self._copy_of(node, c) if before is None else None
        if dst is None:
            return ok   # no new copy started here: nothing to reserve or give back
        if c == FULL:
            if SWA in self.components and node.l1[SWA] is None and node.l2[SWA] is None \
                    and self.room(SWA, len(dst)):
                self.oblivious.update(zip(dst, self.pool(SWA).allocator.alloc(len(dst))))
        else:   # the real SWA copy takes the reserved room's place (the full copy may still be in flight)
            full = self._copy_of(node, FULL)
            if full:
                self._unreserve(list(full))
        return ok

    def write_many(self, pieces: list[tuple[Node, str]], then=None) -> None:
        for node, c in pieces:   # one at a time, through ``write``: each copy reserves its own SWA room
            self.write(node, c, then=then)

    def _copy_of(self, node: Node, c: str) -> list[int] | None:
        """The L2 pages of ``node``'s copy of ``c``: done, or in flight; None when there is none."""
        return node.l2[c] if node.l2[c] is not None else self._backing_up.get((node.id, c))

    def free(self, c: str, pages: list[int]) -> None:
        super().free(c, pages)
        if c == FULL and pages:
            self._unreserve(pages)

    def _unreserve(self, full_pages: list[int]) -> None:
        room = [self.oblivious.pop(p) for p in full_pages if p in self.oblivious]
        if room:
            self.pool(SWA).allocator.free(room)

    def owners(self, c: str) -> dict[str, list[int]]:
        out = super().owners(c)
        if c == SWA:
            out["oblivious reservations"] = list(self.oblivious.values())
        return out

    def check_integrity(self, others) -> None:
        super().check_integrity(others)
        live_full = set(self.tree.all_pages(FULL, L2)) | set(self.in_flight(FULL))
        stray = [p for p in self.oblivious if p not in live_full]
        if stray:
            raise AssertionError(f"oblivious SWA room reserved beside freed full L2 pages {stray[:5]}")


class ObliviousHiCache(HiCache):
    """A HiCache whose L2 tier is the oblivious one (the same constructor otherwise)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, host_tier=ObliviousHostTier, **kw)


def oblivious_config(cfg: HiCacheConfig) -> HiCacheConfig:
    """``cfg`` with an SWA host pool as large as the full one (room for every backed-up token)."""
    return dataclasses.replace(cfg, host_swa_ratio=1.0)


def install() -> None:
    """Every engine this process builds from now on caches with ``ObliviousHiCache`` (a Ray worker
    process's setup hook: the engine builds its cache itself, from its config)."""
    import engine.engine
    engine.engine.HiCache = ObliviousHiCache


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """``install`` for the engines built inside the block only (in-process benches and tests)."""
    import engine.engine
    saved = engine.engine.HiCache
    engine.engine.HiCache = ObliviousHiCache
    try:
        yield
    finally:
        engine.engine.HiCache = saved
