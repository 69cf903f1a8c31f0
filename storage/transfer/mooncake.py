"""Prefill->decode transfer over the Mooncake TransferEngine (tcp here; rdma configurable).

Each worker runs one TransferEngine in P2P-handshake mode (no metadata server): the decode side
registers its L1 pool tensors once and publishes its session id ("host:rpc_port") and the pools' base
addresses in ``peer_info`` (put into every Destination); the prefill side registers its staging buffer
once and ``send`` writes the staged pages straight into the decode side's leased pages with one
``batch_transfer_sync_write`` (descriptors from page indices, coalesced where contiguous). The call
returns only once the data is in place, so the decode side needs no separate notification: the prefill
task's completion is the signal, and the lease bounds how long the decode side waits for it.

The synchronous call cannot be interrupted, so it runs on a helper thread bounded by the deadline; one
that overruns keeps its staging pages (``abandoned``) until it returns, so nothing reuses them mid-read.
"""
from __future__ import annotations

import threading
import time
import uuid

from storage.transfer.base import (Destination, PeerInfo, Receipt, SendStats, TransferBackend, TransferError,
                                   check_fits, receipt)
from storage.transfer.payload import KVPayload
from storage.transfer.staging import Staging, pool_regions


MAX_BATCH = 256     # descriptors per batch_transfer_sync_write


def _engine_cls():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise RuntimeError(f"Mooncake transfer engine unavailable ({e}); install "
                           "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine") from None
    return TransferEngine


class MooncakeBackend(TransferBackend):
    name = "mooncake"
    one_sided = True

    def __init__(self, cfg, role: str, pools, name: str) -> None:
        self.cfg, self.role, self.worker = cfg, role, name
        self.engine = _engine_cls()()
        rc = self.engine.initialize(cfg.host, "P2PHANDSHAKE", cfg.mooncake_protocol, cfg.mooncake_device)
        if rc != 0:
            raise RuntimeError(f"mooncake: TransferEngine.initialize({cfg.host!r}, P2PHANDSHAKE, "
                               f"{cfg.mooncake_protocol!r}) returned {rc}")
        self.session = f"{cfg.host}:{self.engine.get_rpc_port()}"
        self.counts = {"sends": 0, "failed": 0, "timeouts": 0, "abandoned": 0, "bytes": 0}
        self._regs: list[int] = []
        self._running: set[str] = set()       # leases of overrun sends still writing
        self.staging = None
        if role == "decode":
            for comp in ("full", "swa"):
                kv = pools.pool(comp).kv
                if kv.numel():
                    self._register(kv.data_ptr(), kv.numel() * kv.element_size())
            self._info = PeerInfo(session=self.session, regions=pool_regions(pools))
        else:
            self.staging = Staging(cfg.staging_pages, pools)
            self._register(self.staging.buf.data_ptr(), self.staging.buf.numel() * self.staging.buf.element_size())
            self._info = PeerInfo()

    def _register(self, ptr: int, n: int) -> None:
        rc = self.engine.register_memory(ptr, n)
        if rc != 0:
            raise RuntimeError(f"mooncake: register_memory of {n} bytes returned {rc}")
        self._regs.append(ptr)

    def peer_info(self) -> PeerInfo:
        return self._info

    def send(self, payload: KVPayload, dest: Destination, timeout: float) -> Receipt:
        if self.staging is None:
            raise TransferError("mooncake: this worker has no staging buffer (not a prefill worker)")
        t0 = time.monotonic()
        off = check_fits(payload, dest)
        send_id = f"send-{uuid.uuid4().hex[:12]}"
        try:
            full_idx, swa_idx = self.staging.stage(send_id, payload, t0, timeout + 1.0)
        except MemoryError as e:
            raise TransferError(f"mooncake: staging buffer full: {e}") from None
        try:
            spans = self.staging.spans(full_idx, swa_idx, payload, dest, off)
        except Exception as e:  # noqa: BLE001 - a destination that does not describe our pages
            self.staging.release(send_id)
            raise TransferError(f"mooncake: bad destination from {dest.worker_id}: {e}") from None
        result: dict = {}
        gate = threading.Lock()      # decides, once, who frees the staging pages of an overrun

        def run() -> None:
            try:
                # Bounded batches: the tcp transport rejects a batch past its lane queue (rc -1, observed
                # between 1024 and 3200 descriptors with mooncake-transfer-engine 0.3.13).
                rc = 0
                if self.cfg.debug_write_delay:
                    time.sleep(self.cfg.debug_write_delay)     # test-only: a write that lands late
                for i in range(0, len(spans), MAX_BATCH):
                    part = spans[i:i + MAX_BATCH]
                    rc = self.engine.batch_transfer_sync_write(
                        dest.peer.session, [s for s, _, _ in part], [d for _, d, _ in part], [n for _, _, n in part])
                    if rc != 0:
                        break
                result["rc"] = rc
            except Exception as e:  # noqa: BLE001 - reported below
                result["error"] = repr(e)
            finally:
                with gate:
                    result["done"] = True
                    late = result.get("abandoned")
                    if late:
                        self.staging.release(send_id)   # the overrun returned: its pages are safe now
                        self._running.discard(dest.lease_id)
                if late:
                    self._ended(dest.lease_id)          # the decode side may free the lease's pages now

        th = threading.Thread(target=run, name="mooncake-send", daemon=True)
        th.start()
        th.join(max(0.0, timeout - (time.monotonic() - t0)))
        with gate:
            overrun = not result.get("done")
            result["abandoned"] = overrun
            if overrun:
                self._running.add(dest.lease_id)
        if overrun:
            self.counts["timeouts"] += 1
            self.counts["abandoned"] += 1
            raise TransferError(f"mooncake: write to {dest.worker_id} did not finish within {timeout:.1f}s "
                                "(still in flight: its pages stay quarantined until it returns)", in_flight=True)
        self.staging.release(send_id)
        if "error" in result or result.get("rc", -1) != 0:
            self.counts["failed"] += 1
            raise TransferError(f"mooncake: write to {dest.worker_id} ({dest.peer.session}) failed: "
                                f"{result.get('error') or 'rc=%s' % result.get('rc')}")
        nbytes = sum(n for _, _, n in spans)
        self.counts["sends"] += 1
        self.counts["bytes"] += nbytes
        return receipt(payload, bytes=nbytes, seconds=time.monotonic() - t0, descriptors=len(spans))

    def in_flight(self) -> set[str]:
        return set(self._running)

    def stats(self) -> SendStats:
        used, total = self.staging.usage() if self.staging is not None else (0, 0)
        return SendStats(**self.counts, staging_pages_used=used, staging_pages=total)

    def close(self) -> None:
        for ptr in self._regs:
            try:
                self.engine.unregister_memory(ptr)
            except Exception:  # noqa: BLE001
                pass
        self._regs.clear()
