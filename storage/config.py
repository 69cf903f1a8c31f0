"""Configuration of the KV hierarchy (L1 pools; later tiers add their own dataclasses here)."""
from __future__ import annotations

import math
from dataclasses import dataclass

FULL = "full"
SWA = "swa"
COMPONENTS = (FULL, SWA)
"""The KV components a page has: the full-attention layers' and the sliding-window layers'. Each has its
own pool in every tier; the radix tree, the router and the event stream name them too (and need no torch)."""


@dataclass(frozen=True)
class KVPoolConfig:
    """Sizing of the L1 (device) KV pools.

    ``num_pages`` pages of ``page_size`` tokens back the full-attention layers; the sliding-window
    layers get their own, smaller pool of ``ceil(num_pages * swa_full_ratio)`` pages, because a
    request only ever keeps about one window of SWA KV.
    """

    page_size: int = 16
    num_pages: int = 1024
    swa_full_ratio: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {self.page_size!r}")
        if not isinstance(self.num_pages, int) or self.num_pages < 1:
            raise ValueError(f"num_pages must be a positive int, got {self.num_pages!r}")
        if not (0.0 < float(self.swa_full_ratio) <= 1.0):
            raise ValueError(f"swa_full_ratio must be in (0, 1], got {self.swa_full_ratio!r}")

    @property
    def num_swa_pages(self) -> int:
        return max(1, math.ceil(self.num_pages * self.swa_full_ratio))


WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
L2_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class HiCacheConfig:
    """The L2 (host) tier and how L1 data reaches it.

    ``host_pages`` pages back the full component in host memory; the SWA component gets
    ``ceil(host_pages * host_swa_ratio)`` because the SWA-aware backup keeps only the windows the tree
    keeps (each sequence's last window, branch points, checkpoints). ``write_through_threshold`` is the
    hit count at which ``write_through_selective`` backs a node up.
    """

    host_pages: int = 4096
    host_swa_ratio: float = 0.5
    write_policy: str = "write_through"
    write_through_threshold: int = 2
    layout: str = "page_first_direct"
    load_back_threshold_pages: int = 1   # L2 hits shorter than this are recomputed, not loaded
    l3: "L3Config | None" = None         # the shared store below L2 (storage/l3); None: no L3

    def __post_init__(self) -> None:
        if isinstance(self.host_pages, bool) or not isinstance(self.host_pages, int) or self.host_pages < 1:
            raise ValueError(f"host_pages must be a positive int, got {self.host_pages!r}")
        if not (0.0 < float(self.host_swa_ratio) <= 1.0):
            raise ValueError(f"host_swa_ratio must be in (0, 1], got {self.host_swa_ratio!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if not isinstance(self.write_through_threshold, int) or self.write_through_threshold < 1:
            raise ValueError(f"write_through_threshold must be an int >= 1, got {self.write_through_threshold!r}")
        if self.layout not in L2_LAYOUTS:
            raise ValueError(f"layout must be one of {L2_LAYOUTS}, got {self.layout!r}")
        if not isinstance(self.load_back_threshold_pages, int) or self.load_back_threshold_pages < 1:
            raise ValueError("load_back_threshold_pages must be an int >= 1")
        from storage.l3.config import L3Config
        if self.l3 is not None and not isinstance(self.l3, L3Config):
            raise ValueError("l3 must be an L3Config or None")

    @property
    def host_swa_pages(self) -> int:
        return max(1, math.ceil(self.host_pages * self.host_swa_ratio))
