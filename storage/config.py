"""Configuration of the KV hierarchy (L1 pools; later tiers add their own dataclasses here)."""
from __future__ import annotations

import math
from dataclasses import dataclass


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
