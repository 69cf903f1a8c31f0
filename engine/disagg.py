"""Prefill/decode disaggregation inside one engine: a prefill-only request leaves its prompt's KV as a
``KVPayload`` (full layers: every prompt page; sliding layers: only the pages of the last window), and
a decode engine admits a request straight into decode from such a payload."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_manager import KVManager
from engine.request import Request, Status
from storage.geometry import KVGeometry
from storage.pools import KVPools


@dataclass
class KVPayload:
    """The prompt KV one request hands from prefill to decode.

    full: [full_layers, ceil(prompt_len / page_size), page_elems]
    swa:  [swa_layers, n_swa_pages, page_elems], logical pages [swa_first_page, swa_first_page + n)
    """

    prompt_len: int
    first_token: int
    page_size: int
    full: torch.Tensor
    swa: torch.Tensor
    swa_first_page: int
    swa_valid_from: int = 0   # first position whose SWA KV the payload holds

    @property
    def nbytes(self) -> int:
        return self.full.numel() * self.full.element_size() + self.swa.numel() * self.swa.element_size()


def export_kv(req: Request, pools: KVPools, geom: KVGeometry) -> KVPayload:
    """Copy a request's prompt KV out of the pools (call before its pages are released)."""
    ps, window = geom.page_size, geom.window
    n = req.num_computed
    t = req.pages
    full_idx = torch.tensor(t.full[:-(-n // ps)], dtype=torch.long, device=pools.full.kv.device)
    full = pools.full.flat().index_select(1, full_idx).cpu() if pools.full.layer_ids else torch.empty(0)
    first = geom.swa_needed_first_page(n)
    aligned = geom.swa_aligned_first_page(n)
    if window and all(a < len(t.swa) and t.swa[a] is not None for a in range(aligned, first)) \
            and aligned * ps >= t.swa_valid_from:
        first = aligned
    swa_logical = list(range(first, -(-n // ps))) if window else []
    if swa_logical and any(a >= len(t.swa) or t.swa[a] is None for a in swa_logical):
        raise RuntimeError(f"{req.rid}: SWA pages of the last window are missing")
    swa_idx = torch.tensor([t.swa[a] for a in swa_logical], dtype=torch.long, device=pools.swa.kv.device)
    swa = pools.swa.flat().index_select(1, swa_idx).cpu() if swa_logical else torch.empty(0)
    return KVPayload(n, req.output_ids[0], ps, full, swa, first, max(t.swa_valid_from, first * ps))


def check_payload(p: KVPayload, pools: KVPools, geom: KVGeometry) -> None:
    ps, window = geom.page_size, geom.window
    if p.page_size != ps:
        raise ValueError(f"kv payload: page_size {p.page_size} != {ps}")
    n_full = -(-p.prompt_len // ps)
    want_full = (len(pools.full.layer_ids), n_full, pools.full.page_elems)
    if pools.full.layer_ids and tuple(p.full.shape) != want_full:
        raise ValueError(f"kv payload: full shape {tuple(p.full.shape)} != {want_full}")
    if window:
        lo, hi = geom.swa_aligned_first_page(p.prompt_len), geom.swa_needed_first_page(p.prompt_len)
        want = (len(pools.swa.layer_ids), n_full - p.swa_first_page, pools.swa.page_elems)
        if not lo <= p.swa_first_page <= hi or tuple(p.swa.shape) != want:
            raise ValueError(f"kv payload: swa pages {tuple(p.swa.shape)} from page {p.swa_first_page}; "
                             f"expected {want} from a page in [{lo}, {hi}]")
        if p.swa_valid_from > geom.swa_lo(p.prompt_len):
            raise ValueError(f"kv payload: swa data starts at {p.swa_valid_from}, after the window")
    if p.full.dtype != pools.full.kv.dtype:
        raise ValueError(f"kv payload: dtype {p.full.dtype} != {pools.full.kv.dtype}")


def import_kv(req: Request, p: KVPayload, pools: KVPools, geom: KVGeometry, kv: KVManager) -> None:
    """Take the request's pages from ``kv``, copy the payload in and mark the prompt computed. Raises
    MemoryError (nothing allocated) when the pools cannot take it even after evicting cached pages."""
    n_swa = p.swa.shape[1] if geom.window else 0
    full_pages, swa_pages = kv.import_pages(req, geom.pages(p.prompt_len), p.swa_first_page, n_swa,
                                            p.swa_valid_from)
    dev = pools.full.kv.device
    try:
        if pools.full.layer_ids:
            pools.full.flat()[:, torch.tensor(full_pages, device=dev)] = p.full.to(dev)
        if n_swa:
            pools.swa.flat()[:, torch.tensor(swa_pages, device=dev)] = p.swa.to(dev)
    except BaseException:
        kv.release(req)
        raise
    req.num_computed = p.prompt_len
    req.output_ids = [p.first_token]
    req.status = Status.RUNNING


def admit_leased(req: Request, pages: dict, reserved_first: int, info, kv: KVManager) -> None:
    """Make a request of pages a transfer filled in place (storage/transfer): ``pages`` are a committed
    lease's {"full": [n_full], "swa": pages of logical [reserved_first, n_full)}; ``info`` the sender's
    receipt (storage/transfer.Receipt). The payload's window may start after ``reserved_first``: those leading pages are freed.
    Raises ValueError (pages untouched, still the caller's) when the receipt does not fit them."""
    geom = kv.geom
    window = geom.window
    n = info.prompt_len
    n_full = geom.pages(n)
    first = info.swa_first_page if window else 0
    off = first - reserved_first
    swa = list(pages.get("swa", []))
    if len(pages["full"]) != n_full:
        raise ValueError(f"kv transfer: {len(pages['full'])} full pages leased for {n_full}")
    if window:
        lo, hi = geom.swa_aligned_first_page(n), geom.swa_needed_first_page(n)
        if not (lo <= first <= hi and 0 <= off <= len(swa) and len(swa) - off == n_full - first):
            raise ValueError(f"kv transfer: SWA window from page {first} does not fit the lease "
                             f"({len(swa)} pages from {reserved_first})")
        if info.swa_valid_from > geom.swa_lo(n):
            raise ValueError(f"kv transfer: swa data starts at {info.swa_valid_from}, after the window")
    kv.import_leased(req, pages, reserved_first, first, info.swa_valid_from)
    req.num_computed = n
    req.output_ids = [info.first_token]
    req.status = Status.RUNNING
