"""The one interface the tiers below L1 share, and the objects that stand in for an absent one.

L2 (``HostTier``, storage/hicache/host_tier.py) and L3 (``L3Tier``, storage/hicache/l3_tier.py) each
take nodes' data from the tier above (``write_many``: (node, component) pieces, as one batch), hold
pages outside the tree while copies are in flight (``owners``, for check_integrity), run background work
(``poll`` / ``busy``) and report what they hold (``usage``). ``NoTier`` is a tier that holds nothing: a
cache without L2 or L3 carries one instead of ``None``, so no caller asks "is there a tier?" before every
call.
"""
from __future__ import annotations

from typing import Protocol

from storage.pools import FULL, SWA, KVPools
from storage.radix.node import L1, Freed, Node


class Tier(Protocol):
    present: bool

    def write_many(self, pieces: list[tuple[Node, str]], then=None) -> None:
        """Back up each (node, component) of ``pieces`` from the tier above, in the background and in one
        batch; ``then(landed)`` with the pieces that got their copy (the write to the next tier)."""

    def poll(self, block: bool = False) -> None: ...

    def busy(self) -> bool: ...

    def owners(self, c: str) -> dict[str, list[int]]:
        """Host pages of ``c`` held outside the tree, by holder (check_integrity)."""

    def usage(self) -> dict: ...

    def close(self) -> None: ...


class NoTier:
    """A tier that holds nothing: writes are refused, reads find nothing, nothing is ever pending."""

    present = False

    def write_many(self, pieces: list[tuple[Node, str]], then=None) -> None:
        pass

    def poll(self, block: bool = False) -> None:
        pass

    def busy(self) -> bool:
        return False

    def owners(self, c: str) -> dict[str, list[int]]:
        return {}

    def usage(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    # -- the L2 side (HostTier) --------------------------------------------------------------------
    def worth_loading(self, num_pages: int) -> bool:
        return False   # nothing to load from: an L2 hit cannot happen

    def free(self, c: str, pages: list[int]) -> None:
        if pages:
            raise AssertionError(f"{len(pages)} host pages freed into an absent L2")

    def check_integrity(self, others) -> None:
        pass

    # -- the L3 side (L3Tier) ----------------------------------------------------------------------
    def begin(self, page_keys: list[bytes], now: float):
        return None

    def ready(self, prefetch, now: float) -> bool:
        return True

    def take(self, prefetch, num_pages: int):
        return None

    def release(self, prefetch) -> None:
        pass

    def wait(self, timeout: float) -> None:
        pass

    def clear(self) -> int | None:
        return None    # no store: nothing was there to clear


class NoCopier:
    """The copier of a cache without L2: nothing is ever copied in the background."""

    num_pending = 0

    def poll(self, block: bool = False) -> int:
        return 0

    def pending(self) -> list:
        return []

    def close(self) -> None:
        pass


def pin_locks(c: str) -> tuple[str, ...]:
    """The tree locks that pin a node's data of component ``c`` while a copy reads or writes it (an SWA
    lock needs the full one)."""
    return (FULL, SWA) if c == SWA else (FULL,)


def free_pages(freed: Freed, l1: KVPools, l2) -> None:
    """Give pages the tree dropped back to their owners: L1 pages to the device pools, L2 pages to ``l2``."""
    for (c, t), pages in freed.items():
        if not pages:
            continue
        if t == L1:
            l1.pool(c).allocator.free(pages)
        else:
            l2.free(c, pages)
