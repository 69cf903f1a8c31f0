"""The default backend: the KV travels as one object through the Ray object store.

Only the pure part lives here -- ``pack`` (the payload, trimmed to and checked against the destination's
leased pages) and ``fill`` (check it against the decode side's pools and copy it into the leased pages).
The ``ray.put`` / ``ray.get`` part lives in the actor shell (actors/worker.py: the packed payload is the
prefill task's second return value, and the decode task receives it as an argument), because storage/
never imports ray (DESIGN "Arrows").

The prefill side's pages are released as soon as the payload is exported (the object store holds the
copy); the decode side's leased pages are only written at admission, on the decode worker's engine thread.
"""
from __future__ import annotations

import time

import torch

from storage.transfer.base import (Destination, LeasedPages, Receipt, SendStats, TransferBackend, TransferError,
                                   check_fits, receipt)
from storage.transfer.payload import KVPayload


def pack(payload: KVPayload, dest: Destination) -> KVPayload:
    """The payload to put in the object store for ``dest`` (checked to fit its leased pages).
    full: [full_layers, n_full, page_elems], swa: [swa_layers, n_swa, page_elems], contiguous."""
    check_fits(payload, dest)
    payload.full = payload.full.contiguous()
    payload.swa = payload.swa.contiguous()
    return payload


def _check_shape(what: str, kv: torch.Tensor, pool, n_pages: int) -> None:
    want = (len(pool.layer_ids), n_pages, pool.page_elems)
    if tuple(kv.shape) != want:
        raise TransferError(f"kv payload: {what} shape {tuple(kv.shape)} != the decode pools' {want}")
    if kv.dtype != pool.kv.dtype:
        raise TransferError(f"kv payload: {what} dtype {kv.dtype} != the decode pools' {pool.kv.dtype}")


class RayObjectBackend(TransferBackend):
    """Two-sided: ``send`` only packs; the shell returns the result through the object store."""

    name = "ray_object"

    def __init__(self) -> None:
        self.counts = {"sends": 0, "failed": 0, "bytes": 0}

    def send(self, payload: KVPayload, dest: Destination, timeout: float) -> Receipt:
        t0 = time.perf_counter()
        try:
            packed = pack(payload, dest)
        except TransferError:
            self.counts["failed"] += 1
            raise
        self.counts["sends"] += 1
        self.counts["bytes"] += packed.nbytes
        return receipt(packed, seconds=time.perf_counter() - t0, packed=packed)

    def fill(self, pools, pages: LeasedPages, rec: Receipt) -> None:
        """Copy the packed payload ``rec`` carries into the leased pages: full pages for logical pages
        [0, n_full), SWA pages for [pages.swa_first_page, n_full) (the payload's window may start later;
        its leading pages are left untouched for the caller to free). The payload is checked against the
        pools (layers, page size, dtype) and the lease first: a bad one is a clear TransferError."""
        p = rec.packed
        if p is None:
            raise TransferError(f"lease {pages.lease_id}: the receipt carries no KV (nothing was sent)")
        if p.prompt_len != pages.prompt_len:
            raise TransferError(f"kv payload: covers {p.prompt_len} tokens, the lease {pages.prompt_len}")
        if pools.full.layer_ids:
            _check_shape("full", p.full, pools.full, len(pages.full))
        off = p.swa_first_page - pages.swa_first_page
        n_swa = p.swa.shape[1] if p.swa.numel() else 0
        if pools.swa.layer_ids and (pages.swa or n_swa):
            if off < 0 or off + n_swa != len(pages.swa):
                raise TransferError(f"kv payload: SWA pages [{p.swa_first_page}, +{n_swa}) do not fit the lease's "
                                    f"[{pages.swa_first_page}, +{len(pages.swa)})")
            _check_shape("swa", p.swa, pools.swa, n_swa)
        if pools.full.layer_ids:
            dev = pools.full.kv.device
            pools.full.flat()[:, torch.tensor(pages.full, device=dev)] = p.full.to(dev)
        if pools.swa.layer_ids and n_swa:
            dev = pools.swa.kv.device
            pools.swa.flat()[:, torch.tensor(pages.swa[off:], device=dev)] = p.swa.to(dev)

    def stats(self) -> SendStats:
        return SendStats(**self.counts)
