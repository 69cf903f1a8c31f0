"""Configuration of the prefill->decode KV transfer (one per cluster; every worker gets the same)."""
from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("ray_object", "nixl", "mooncake")
MOONCAKE_PROTOCOLS = ("tcp", "rdma")


def _pos(obj, name: str, zero_ok: bool = False) -> None:
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (v == 0 and not zero_ok):
        raise ValueError(f"TransferConfig.{name} must be a {'non-negative' if zero_ok else 'positive'} number, "
                         f"got {v!r}")


@dataclass(frozen=True)
class TransferConfig:
    """How a prompt's KV travels from the prefill worker to the decode worker.

    ``lease_seconds``: how long the decode side holds the pages it reserved for one request; past it the
    pages go back to the pool and the request fails. ``transfer_timeout``: the prefill side's bound on
    one send (it must end before the lease does, so a write never lands in pages given to someone else).
    ``staging_pages``: the prefill side's registered host buffer for one-sided backends, in layer-pages
    (one page of one layer); a request needs ``full_layers * prompt_pages + swa_layers * window_pages``.
    ``debug_send_delay``: test-only stall before each send (fault tests); keep 0 in production.
    """

    backend: str = "ray_object"
    lease_seconds: float = 30.0
    transfer_timeout: float = 20.0
    expiry_interval: float = 0.2          # how often the decode side expires leases
    staging_pages: int = 8192
    host: str = "127.0.0.1"               # address the transfer engines bind / advertise; "auto": the node's
    nixl_backend: str = "UCX"
    nixl_progress_s: float = 5e-4         # nap of the decode side's notification/progress pump
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""             # RDMA device names for protocol rdma (e.g. "mlx5_0")
    debug_send_delay: float = 0.0
    # test-only: a one-sided write posted this many seconds late and then waited for, deadline or not
    # (a transfer its sender could not abort: what lease quarantine exists for); keep 0 in production
    debug_write_delay: float = 0.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"TransferConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("lease_seconds", "transfer_timeout", "expiry_interval", "nixl_progress_s"):
            _pos(self, name)
        _pos(self, "debug_send_delay", zero_ok=True)
        _pos(self, "debug_write_delay", zero_ok=True)
        if self.transfer_timeout >= self.lease_seconds:
            raise ValueError(f"TransferConfig.transfer_timeout ({self.transfer_timeout}) must be below "
                             f"lease_seconds ({self.lease_seconds})")
        if isinstance(self.staging_pages, bool) or not isinstance(self.staging_pages, int) or self.staging_pages < 1:
            raise ValueError(f"TransferConfig.staging_pages must be a positive int, got {self.staging_pages!r}")
        if self.mooncake_protocol not in MOONCAKE_PROTOCOLS:
            raise ValueError(f"TransferConfig.mooncake_protocol must be one of {MOONCAKE_PROTOCOLS}, "
                             f"got {self.mooncake_protocol!r}")
        for name in ("host", "nixl_backend"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"TransferConfig.{name} must be a non-empty str")
        if not isinstance(self.mooncake_device, str):
            raise ValueError("TransferConfig.mooncake_device must be a str")
