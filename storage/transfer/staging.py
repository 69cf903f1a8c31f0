"""The prefill side of a one-sided transfer: a registered host buffer of layer-pages (the "prefill side's
pages" of a send), held under a lease until the send completes, fails or times out.

On a GPU deployment the L1 pools themselves would be registered and read in place; here the prompt's KV
has already been exported from L1 (engine/disagg.py ``export_kv``, so the prefill engine's own pages
return to its tree at once) and one copy into this buffer makes it reachable by the NIC/UCX.

buf: [staging_pages, page_elems] in the pools' dtype; one staging page holds one page of one layer.
"""
from __future__ import annotations

import threading

import torch

from storage.allocator import PageAllocator
from storage.transfer.base import Destination, LeaseTable, PoolRegion, coalesce


class Staging:
    def __init__(self, num_pages: int, pools) -> None:
        self.page_elems = pools.full.page_elems
        self.buf = torch.zeros(num_pages, self.page_elems, dtype=pools.full.kv.dtype)
        self.page_bytes = self.page_elems * self.buf.element_size()
        self.leases = LeaseTable({"stage": PageAllocator(num_pages, "staging")}, "staging")
        self.lock = threading.Lock()      # sends run on several threads

    def stage(self, send_id: str, payload, now: float, ttl: float) -> tuple[list[int], list[int]]:
        """Copy a KVPayload into fresh staging pages; returns (full, swa) staging page indices, layer-major
        ([layer * n + page]). MemoryError when the buffer is short (nothing held)."""
        full = payload.full.reshape(-1, self.page_elems) if payload.full.numel() else payload.full.new_empty(0, self.page_elems)
        swa = payload.swa.reshape(-1, self.page_elems) if payload.swa.numel() else payload.swa.new_empty(0, self.page_elems)
        with self.lock:
            lease = self.leases.reserve(send_id, {"stage": full.shape[0] + swa.shape[0]}, now, ttl)
        pages = lease.pages["stage"]
        if pages:
            self.buf[torch.tensor(pages)] = torch.cat([full, swa]).to(self.buf.dtype)
        return pages[:full.shape[0]], pages[full.shape[0]:]

    def release(self, send_id: str) -> bool:
        with self.lock:
            return self.leases.cancel(send_id)

    def spans(self, full_idx: list[int], swa_idx: list[int], payload, dest: Destination,
              swa_off: int) -> list[tuple[int, int, int]]:
        """(local address, remote address, nbytes) of every staged layer-page into the destination's
        leased pages (remote pool layout [layers, num_pages, page_elems], bases in ``dest.peer.regions``),
        coalesced where both sides are contiguous."""
        pb, base = self.page_bytes, self.buf.data_ptr()
        out = []
        for comp, idx, pages in (("full", full_idx, dest.full_pages), ("swa", swa_idx, dest.swa_pages[swa_off:])):
            if not idx:
                continue
            region = dest.peer.regions[comp]
            if region.page_bytes != pb:
                raise ValueError(f"destination {comp} pages are {region.page_bytes} bytes, ours {pb}")
            n = len(pages)
            for k, s in enumerate(idx):
                layer, i = divmod(k, n)
                out.append((base + s * pb, region.base + (layer * region.num_pages + pages[i]) * pb, pb))
        return coalesce(out)

    def usage(self) -> tuple[int, int]:
        """(staging pages in use, staging pages in all)."""
        with self.lock:
            return self.leases.num_pages("stage"), self.leases.allocators["stage"].num_pages

    def check_integrity(self) -> None:
        with self.lock:
            self.leases.check_integrity()


def pool_regions(pools) -> dict[str, PoolRegion]:
    """What a decode side publishes about its L1 pools: base address, pages per layer and page bytes."""
    out = {}
    for comp in ("full", "swa"):
        p = pools.pool(comp)
        out[comp] = PoolRegion(p.kv.data_ptr(), p.num_pages, len(p.layer_ids), p.page_elems * p.kv.element_size(),
                               p.kv.numel() * p.kv.element_size())
    return out
