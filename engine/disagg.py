"""Prefill/decode disaggregation inside one engine: a prefill-only request leaves its prompt's KV as a
``KVPayload`` (full layers: every prompt page; sliding layers: only the pages of the last window), and
a decode engine admits a request straight into decode from leased pages a transfer filled with it
(engine/pd.py, the one admission path for KV computed elsewhere)."""
from __future__ import annotations

import torch

from engine.kv_manager import KVManager
from engine.request import Request, Status
from storage.geometry import KVGeometry
from storage.pools import KVPools
from storage.transfer.base import LeasedPages, Receipt
from storage.transfer.payload import KVPayload


def export_kv(req: Request, pools: KVPools, geom: KVGeometry, offloads_to: str = "") -> KVPayload:
    """Copy a request's prompt KV out of the pools (call before its pages are released). ``offloads_to``:
    the L3 store this engine's cache writes the prompt's whole pages through to, once it inserts them
    (HiCache.offloads_to; "" none)."""
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
    return KVPayload(n, req.output_ids[0], ps, full, swa, first, max(t.swa_valid_from, first * ps),
                     n // ps if offloads_to else 0, offloads_to)


def admit_leased(req: Request, pages: LeasedPages, rec: Receipt, kv: KVManager) -> None:
    """Make a request of the pages of a committed lease that a transfer filled (storage/transfer);
    ``rec``: the sender's receipt. The payload's window may start after the lease's
    ``swa_first_page``: those leading pages are freed. Raises ValueError (pages untouched, still the
    caller's) when the receipt does not fit them."""
    geom = kv.geom
    window = geom.window
    n = rec.prompt_len
    n_full = geom.pages(n)
    first = rec.swa_first_page if window else 0
    off = first - pages.swa_first_page
    if len(pages.full) != n_full:
        raise ValueError(f"kv transfer: {len(pages.full)} full pages leased for {n_full}")
    if window:
        lo, hi = geom.swa_aligned_first_page(n), geom.swa_needed_first_page(n)
        if not (lo <= first <= hi and 0 <= off <= len(pages.swa) and len(pages.swa) - off == n_full - first):
            raise ValueError(f"kv transfer: SWA window from page {first} does not fit the lease "
                             f"({len(pages.swa)} pages from {pages.swa_first_page})")
        if rec.swa_valid_from > geom.swa_lo(n):
            raise ValueError(f"kv transfer: swa data starts at {rec.swa_valid_from}, after the window")
    if not isinstance(rec.offloaded_pages, int) or not 0 <= rec.offloaded_pages <= n // geom.page_size:
        raise ValueError(f"kv transfer: offloaded_pages {rec.offloaded_pages!r} outside [0, {n // geom.page_size}]")
    if not isinstance(rec.offloaded_to, str):
        raise ValueError(f"kv transfer: offloaded_to must be a store's location (str), got {rec.offloaded_to!r}")
    kv.import_leased(req, pages, first, rec.swa_valid_from)
    # The sender writes the prompt through to L3; where that is this cache's store too, this side's offload
    # of the finished sequence skips those pages (its own copy would be the same bytes under the same keys).
    same = rec.offloaded_to != "" and rec.offloaded_to == kv.cache.offloads_to
    req.offloaded_pages = rec.offloaded_pages if same else 0
    req.num_computed = n
    req.output_ids = [rec.first_token]
    req.status = Status.RUNNING
