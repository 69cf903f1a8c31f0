"""Prefill->decode KV transfer (DESIGN "One request, end to end", step 3): base.py (interface, leases),
payload.py (the KV handed over, as tensors; base.py needs no torch), ray_object.py (default), nixl.py,
mooncake.py, staging.py (the prefill side's registered host buffer)."""
from storage.transfer.base import (Destination, Lease, LeasedPages, LeaseInfo, LeaseStats, LeaseTable,
                                   PeerInfo, PoolRegion, Receipt, SendStats, TransferBackend, TransferError,
                                   TransferStats)
from storage.transfer.config import TransferConfig


def make_backend(cfg: TransferConfig, role: str, pools, name: str) -> TransferBackend:
    """The backend end of one worker: a decode side registers ``pools``; a prefill side stages from
    a host buffer shaped like them. One-sided backends are imported only when chosen."""
    if cfg.backend == "ray_object":
        from storage.transfer.ray_object import RayObjectBackend
        return RayObjectBackend()
    if cfg.backend == "nixl":
        from storage.transfer.nixl import NixlBackend
        return NixlBackend(cfg, role, pools, name)
    if cfg.backend == "mooncake":
        from storage.transfer.mooncake import MooncakeBackend
        return MooncakeBackend(cfg, role, pools, name)
    raise ValueError(f"transfer.backend: unknown {cfg.backend!r}")


__all__ = ["Destination", "Lease", "LeasedPages", "LeaseInfo", "LeaseStats", "LeaseTable", "PeerInfo",
           "PoolRegion", "Receipt", "SendStats", "TransferBackend", "TransferConfig", "TransferError", "TransferStats",
           "make_backend"]
