"""L1 KV pools: one paged pool for the full-attention layers and one for the sliding-window layers.

Layout of one pool (the "L1 pool shape" every kernel and tier relies on)::

    kv: [num_layers, num_pages, 2, page_size, num_kv_heads, head_dim]   (contiguous)

so ``kv[l, p]`` -- the K and V of page ``p`` in pool layer ``l`` -- is one contiguous block of
``page_elems = 2 * page_size * num_kv_heads * head_dim`` elements, and ``kv.view(L, P, page_elems)``
is the flat view the transfer kernels use.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from storage.allocator import PageAllocator
from storage.config import COMPONENTS, FULL, SWA, KVPoolConfig

POISON = 1.0e4
"""What ``poison`` fills fresh pages with: finite, so masked slots still contribute exactly 0, but far
from any real K/V, so reading a position nobody wrote changes the tokens."""


class KVPool:
    """One component's paged KV storage plus its allocator.

    ``layer_ids`` are the model layer indices stored here, in pool order.
    """

    def __init__(self, name: str, layer_ids: Sequence[int], num_pages: int, page_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 poison: bool = False) -> None:
        self.name = name
        self.layer_ids = list(layer_ids)
        self.layer_slot = {lid: i for i, lid in enumerate(self.layer_ids)}
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        n = num_pages if self.layer_ids else 0
        self.allocator = PageAllocator(n, name)
        self.kv = torch.zeros(len(self.layer_ids), n, 2, page_size, num_kv_heads, head_dim,
                              dtype=dtype, device=device)
        if poison:  # debug: every page handed out starts as garbage until written
            self.allocator.on_alloc = self._poison

    def _poison(self, pages: list[int]) -> None:
        self.kv[:, torch.tensor(pages, device=self.kv.device)] = POISON

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def page_elems(self) -> int:
        """Elements of one page of one layer (K and V)."""
        return 2 * self.page_size * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        return len(self.layer_ids) * 2 * self.num_kv_heads * self.head_dim * self.kv.element_size()

    def flat(self) -> torch.Tensor:
        """[num_layers, num_pages, page_elems] view for the transfer kernels."""
        return self.kv.view(len(self.layer_ids), self.num_pages, self.page_elems)

    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of T tokens. pages, offsets: [T] long; k, v: [T, num_kv_heads, head_dim]."""
        s = self.layer_slot[layer]
        self.kv[s, pages, 0, offsets] = k.to(self.kv.dtype)
        self.kv[s, pages, 1, offsets] = v.to(self.kv.dtype)

    def read(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of whole pages in order: pages [n] long -> two [n * page_size, num_kv_heads, head_dim]."""
        kv = self.kv[self.layer_slot[layer]]  # [N, 2, ps, H, D]
        # K and V each by index_select on its own: one copy of each page (splitting a gathered [n, 2, ps, H,
        # D] would copy it again, as its K or V half is no view of that shape), and the cheaper gather.
        return (kv[:, 0].index_select(0, pages).reshape(-1, self.num_kv_heads, self.head_dim),
                kv[:, 1].index_select(0, pages).reshape(-1, self.num_kv_heads, self.head_dim))


class KVPools:
    """The full pool and the SWA pool of one worker."""

    def __init__(self, cfg: KVPoolConfig, layer_types: Sequence[str], num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 poison: bool = False) -> None:
        self.cfg = cfg
        full_ids = [i for i, t in enumerate(layer_types) if t != "sliding_attention"]
        swa_ids = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
        self.full = KVPool(FULL, full_ids, cfg.num_pages, cfg.page_size, num_kv_heads, head_dim, dtype, device,
                           poison)
        self.swa = KVPool(SWA, swa_ids, cfg.num_swa_pages, cfg.page_size, num_kv_heads, head_dim, dtype, device,
                          poison)

    def pool(self, component: str) -> KVPool:
        if component == FULL:
            return self.full
        if component == SWA:
            return self.swa
        raise ValueError(f"unknown component {component!r}")

    def pool_for_layer(self, layer: int) -> KVPool:
        return self.full if layer in self.full.layer_slot else self.swa

    def all_free(self) -> bool:
        return all(p.allocator.num_free == p.num_pages for p in (self.full, self.swa))

    def check_integrity(self, owners: Mapping[str, Mapping[str, Iterable[int]]] | None = None) -> None:
        for comp in COMPONENTS:
            self.pool(comp).allocator.check_integrity(None if owners is None else owners.get(comp, {}))
