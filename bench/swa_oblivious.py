"""The SWA-oblivious host backup, a baseline for the benches (``HiCacheConfig.swa_backup: all``): host
memory is taken for the sliding layers of every backed-up token, as a host pool that treats every layer
alike would. Where the window has slid past there is no data to put in it, so the room is reserved
beside each full L2 page, never served; the SWA-aware copy of the last window is made as usual.

Importing this module registers the tier (``register``); a Ray worker gets it through
``runtime_env={"worker_process_setup_hook": SETUP_HOOK}`` (bench/compare.py).
"""
from __future__ import annotations

from storage.hicache import HOST_TIERS, HostTier
from storage.pools import FULL, SWA
from storage.radix.node import Node, L2

SETUP_HOOK = "bench.swa_oblivious.register"


class ObliviousHostTier(HostTier):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.oblivious: dict[int, int] = {}   # full L2 page -> the host SWA page reserved beside it

    def backs_up(self, node: Node) -> bool:
        return True   # every sliding page it has, kept window or not: it does not tell them apart

    def reserved(self, node: Node, c: str, dst: list[int]) -> None:
        if c == FULL:
            if SWA in self.components and node.l1[SWA] is None and node.l2[SWA] is None \
                    and self.room(SWA, len(dst)):
                self.oblivious.update(zip(dst, self.pool(SWA).allocator.alloc(len(dst))))
        else:   # the real SWA copy takes the reserved room's place (the full copy may still be in flight)
            full = node.l2[FULL] if node.l2[FULL] is not None else self._backing_up.get((node.id, FULL))
            if full:
                self.released(FULL, list(full))

    def released(self, c: str, pages: list[int]) -> None:
        if c == FULL and self.oblivious:
            room = [self.oblivious.pop(p) for p in pages if p in self.oblivious]
            if room:
                self.pool(SWA).allocator.free(room)

    def owners(self, c: str) -> dict[str, list[int]]:
        out = super().owners(c)
        if c == SWA:
            out["oblivious reservations"] = list(self.oblivious.values())
        return out

    def check_extra(self) -> None:
        live_full = set(self.tree.all_pages(FULL, L2)) | set(self.in_flight(FULL))
        stray = [p for p in self.oblivious if p not in live_full]
        if stray:
            raise AssertionError(f"oblivious SWA room reserved beside freed full L2 pages {stray[:5]}")


def register() -> None:
    HOST_TIERS["all"] = ObliviousHostTier


register()
