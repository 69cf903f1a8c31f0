"""The default backend: the KV travels as one object through the Ray object store.

Only the pure part lives here -- ``pack`` (the payload, trimmed to and checked against the destination's
leased pages) and ``unpack`` (copy into those pages). The ``ray.put`` / ``ray.get`` part lives in the actor
shell (actors/worker.py: the packed payload is the prefill task's second return value, and the decode
task receives it as an argument), because storage/ never imports ray (DESIGN "Arrows").

The prefill side's pages are released as soon as the payload is exported (the object store holds the
copy); the decode side's leased pages are only written at commit, on the decode worker's engine thread.
"""
from __future__ import annotations

import time

import torch

from storage.transfer.base import Destination, Receipt, TransferBackend, TransferError, check_fits, receipt


def pack(payload, dest: Destination):
    """The payload to put in the object store for ``dest`` (checked to fit its leased pages).
    full: [full_layers, n_full, page_elems], swa: [swa_layers, n_swa, page_elems], contiguous."""
    check_fits(payload, dest)
    payload.full = payload.full.contiguous()
    payload.swa = payload.swa.contiguous()
    return payload


def unpack(payload, full_pages: list[int], swa_pages: list[int], swa_first_page: int, pools) -> None:
    """Copy a packed payload into leased pages: ``full_pages`` for logical pages [0, n_full) and
    ``swa_pages`` for [swa_first_page, n_full) (the payload's window may start later; its leading pages
    are left untouched for the caller to free)."""
    n_full = len(full_pages)
    if payload.full.numel():
        if payload.full.shape[1] != n_full:
            raise TransferError(f"kv has {payload.full.shape[1]} full pages, lease {n_full}")
        dev = pools.full.kv.device
        pools.full.flat()[:, torch.tensor(full_pages, device=dev)] = payload.full.to(dev, pools.full.kv.dtype)
    if payload.swa.numel():
        off = payload.swa_first_page - swa_first_page
        n = payload.swa.shape[1]
        if off < 0 or off + n != len(swa_pages):
            raise TransferError(f"kv SWA pages [{payload.swa_first_page}, +{n}) do not fit the lease's "
                                f"[{swa_first_page}, +{len(swa_pages)})")
        dev = pools.swa.kv.device
        pools.swa.flat()[:, torch.tensor(swa_pages[off:], device=dev)] = payload.swa.to(dev, pools.swa.kv.dtype)


class RayObjectBackend(TransferBackend):
    """Two-sided: ``send`` only packs; the shell returns the result through the object store."""

    name = "ray_object"

    def __init__(self) -> None:
        self.counts = {"sends": 0, "failed": 0, "bytes": 0}

    def peer_info(self) -> dict:
        return {}

    def send(self, payload, dest: Destination, timeout: float) -> Receipt:
        t0 = time.perf_counter()
        try:
            packed = pack(payload, dest)
        except TransferError:
            self.counts["failed"] += 1
            raise
        self.counts["sends"] += 1
        self.counts["bytes"] += packed.nbytes
        return receipt(packed, seconds=time.perf_counter() - t0, packed=packed)

    def stats(self) -> dict:
        return dict(self.counts)
