"""From the radix tree's KV events (storage/radix/node.py ``KVEvent``) to the wire's (wire.py): block ids,
KV-cache groups and media.

* **Block ids.** ``block_hash(page_key)``: the first 8 bytes of strata's page key (storage/hashing.py, a
  BLAKE2b digest over the whole prefix) read big-endian as an unsigned 64-bit int. Stable across processes
  and machines, and like the key it names a page *and its prefix*. Unsigned, as vLLM's ints and Dynamo's
  u64 (which folds signed producers onto it).
* **Groups.** The full component is group 0 ``full_attention``; the sliding component is group 1
  ``sliding_window`` with ``kv_cache_spec_sliding_window`` = the window in tokens. A group-1
  ``BlockRemoved`` is a tombstone: those pages' window is gone from that medium while their full KV
  may stay (a full-only consumer, Dynamo, ignores group 1).
* **Media.** One per tier the publisher owns (``media``): a worker publishes L1 (``GPU`` by default: the engine's
  device tier, whatever the device; KVEventsConfig.l1_medium) and L2 (``CPU_PINNED``); L3 is shared, published once by the storage actor (``DISK`` for
  the file store, ``EXTERNAL`` for Mooncake / NIXL). Events of other tiers are skipped.

Order is the tree's, which emits a stored node after its parent (inserts walk down; an L1 load needs the
parent loaded first) and a removed node before its parent (eviction takes leaves first).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from storage.kv_events.wire import (CPU, CPU_PINNED, DISK, EXTERNAL, FULL_ATTENTION, GPU, MEDIA, SLIDING_WINDOW,
                                    BlockRemoved, BlockStored, KVWireEvent)
from storage.radix.node import FULL, L1, L2, L3, SWA, TIERS, KVEvent

FULL_GROUP, SLIDING_GROUP = 0, 1


def block_hash(page_key: bytes) -> int:
    """The wire's block id of a page: an unsigned 64-bit int derived from its page key."""
    if len(page_key) < 8:
        raise ValueError(f"a page key has at least 8 bytes, got {len(page_key)}")
    return int.from_bytes(page_key[:8], "big")


def l3_medium(backend: str) -> str:
    """``DISK`` for the file store, ``EXTERNAL`` for a remote one (mooncake, nixl)."""
    return DISK if backend == "file" else EXTERNAL


def worker_media(l1: str = GPU) -> dict[str, str]:
    """The media a worker publishes: its own tiers, L1 as ``l1`` (KVEventsConfig.l1_medium) and L2 as
    host memory. L3 is the storage actor's."""
    return {L1: l1, L2: CPU_PINNED}


@dataclass(frozen=True)
class WireMapping:
    """How one publisher names its tree's events on the wire: ``block_size`` (the page size), the sliding
    ``window`` in tokens (0: the model has no sliding layer, group 1 is never published) and ``media``
    (tier -> medium, as a tuple of pairs: only these tiers are published)."""

    block_size: int
    window: int
    media: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"window must be an int >= 0, got {self.window!r}")
        for tier, medium in self.media:
            if tier not in TIERS or medium not in MEDIA:
                raise ValueError(f"media: ({tier!r}, {medium!r}) is not (one of {TIERS}, one of {MEDIA})")

    @classmethod
    def of(cls, block_size: int, window: int, media: dict[str, str]) -> "WireMapping":
        return cls(block_size, window, tuple(sorted(media.items())))


def to_wire(events: Iterable[KVEvent], mapping: WireMapping) -> list[KVWireEvent]:
    """The wire events of ``events`` (oldest first), one per tree event of a published tier. A
    ``BlockStored``'s ``token_ids`` is the tree node's own list (never changed in place): read it, or
    encode it at once, never change it."""
    media = dict(mapping.media)
    size, window = mapping.block_size, mapping.window
    out: list[KVWireEvent] = []
    for ev in events:
        medium = media.get(ev.tier)
        if medium is None or (ev.component == SWA and not window):
            continue
        full = ev.component == FULL
        group = FULL_GROUP if full else SLIDING_GROUP
        hashes = [int.from_bytes(k[:8], "big") for k in ev.page_keys]   # block_hash, inlined
        if ev.kind == "stored":
            parent: Optional[int] = int.from_bytes(ev.parent[:8], "big") if ev.parent else None
            out.append(BlockStored(hashes, parent, ev.tokens if ev.tokens is not None else [], size, None,
                                   medium, None, None, group, FULL_ATTENTION if full else SLIDING_WINDOW,
                                   None if full else window))
        else:
            out.append(BlockRemoved(hashes, medium, group))
    return out


__all__ = ["FULL_GROUP", "SLIDING_GROUP", "block_hash", "l3_medium", "worker_media", "WireMapping",
           "to_wire"]
