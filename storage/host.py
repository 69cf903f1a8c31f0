"""The L2 (host) pool: per component, pages of KV in host memory in one of three layouts.

Shapes (``L`` layers of the component, ``E = 2 * page_size * H * D``; see kernels/ref.py)::

    layer_first        [L, P2, E]
    page_first         [P2, page_size, L, E // page_size]
    page_first_direct  [P2, L, E]    one contiguous region per page (zero-copy L3 I/O)

The memory is pinned when the L1 pool lives on a GPU so copies can run asynchronously.
"""
from __future__ import annotations

import torch

from storage.config import HiCacheConfig
from storage.kernels_path import transfer
from storage.pools import COMPONENTS, FULL, KVPool, KVPools, PageAllocator


class HostPool:
    def __init__(self, l1: KVPool, num_pages: int, layout: str) -> None:
        self.name = f"L2-{l1.name}"
        self.layout = layout
        self.page_size = l1.page_size
        self.num_layers = len(l1.layer_ids)
        n = num_pages if self.num_layers else 0
        self.allocator = PageAllocator(n, self.name)
        pin = l1.kv.device.type == "cuda"
        self.data = transfer.alloc_l2(layout, self.num_layers, n, l1.page_size, l1.page_elems, l1.kv.dtype,
                                     "cpu", pin_memory=pin)
        self.page_bytes = self.num_layers * l1.page_elems * l1.kv.element_size()

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def page(self, p: int) -> torch.Tensor:
        """One page's bytes as a flat view (page_first_direct) or a copy (other layouts), for L3 I/O."""
        if self.layout == transfer.PAGE_FIRST_DIRECT or self.layout == transfer.PAGE_FIRST:
            return self.data[p].reshape(-1)
        return self.data[:, p].reshape(-1)

    def set_page(self, p: int, flat: torch.Tensor) -> None:
        if self.layout == transfer.LAYER_FIRST:
            self.data[:, p] = flat.view(self.data[:, p].shape)
        else:
            self.data[p] = flat.view(self.data[p].shape)


class HostPools:
    def __init__(self, l1: KVPools, cfg: HiCacheConfig) -> None:
        self.cfg = cfg
        self.full = HostPool(l1.full, cfg.host_pages, cfg.layout)
        self.swa = HostPool(l1.swa, cfg.host_swa_pages, cfg.layout)

    def pool(self, component: str) -> HostPool:
        return self.full if component == FULL else self.swa

    def all_free(self) -> bool:
        return all(self.pool(c).allocator.num_free == self.pool(c).num_pages for c in COMPONENTS)

    def bytes_used(self) -> dict[str, int]:
        return {c: self.pool(c).allocator.num_used * self.pool(c).page_bytes for c in COMPONENTS}
