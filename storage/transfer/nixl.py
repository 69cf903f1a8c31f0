"""Prefill->decode transfer over NIXL (UCX backend): one agent per worker.

Decode side: its L1 pool tensors are registered once; ``peer_info`` (put into every Destination) carries
the agent's metadata and the pools' base addresses, so a prefill worker loads the agent the first time it
sees it (and again after the decode worker restarted under a new agent name). A progress pump collects
the completion notifications (a lease id each) that ``wait_arrival`` waits for, bounded.

Prefill side: the staging buffer (staging.py) is registered once; ``send`` stages the payload, builds
descriptor lists from the page indices (coalesced where contiguous) and posts one WRITE straight into the
decode side's leased pages with the lease id as notification, then polls it until done, failed, or the
deadline. The staging pages are freed then -- unless the transfer is still in flight and NIXL refuses to
abort it: those pages stay held (``abandoned``) so UCX never reads memory someone else reuses.
"""
from __future__ import annotations

import threading
import time
import uuid

from storage.transfer.base import (Destination, PeerInfo, Receipt, SendStats, TransferBackend, TransferError,
                                   check_fits, receipt)
from storage.transfer.payload import KVPayload
from storage.transfer.staging import Staging, pool_regions


def _load_nixl():
    from storage.l3.nixl import _load_nixl as load   # the wheel-variant probing lives with the L3 backend
    return load()


class NixlBackend(TransferBackend):
    name = "nixl"
    one_sided = True

    def __init__(self, cfg, role: str, pools, name: str) -> None:
        nixl_agent, nixl_agent_config = _load_nixl()
        self.cfg, self.role, self.agent_name = cfg, role, name
        self.backends = [cfg.nixl_backend]
        # No NIXL progress thread (it spins a core); waiting on a transfer, or the pump, progresses UCX.
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=self.backends))
        self.lock = threading.Lock()          # the agent is not thread safe
        self._regs = []
        self._arrived: dict[str, float] = {}
        self._cond = threading.Condition()
        self._peers: dict[str, str] = {}       # decode agent name -> loaded
        self.counts = {"sends": 0, "failed": 0, "timeouts": 0, "abandoned": 0, "bytes": 0}
        self.staging = None
        self._abandoned: list = []
        self._stop = threading.Event()
        if role == "decode":
            for comp in ("full", "swa"):
                kv = pools.pool(comp).kv
                if kv.numel():
                    self._regs.append(self.agent.register_memory(
                        [(kv.data_ptr(), kv.numel() * kv.element_size(), 0, "")], "DRAM", self.backends))
            self._info = PeerInfo(agent=name, agent_meta=self.agent.get_agent_metadata(), regions=pool_regions(pools))
            threading.Thread(target=self._pump, name="nixl-notifs", daemon=True).start()
        else:
            self.staging = Staging(cfg.staging_pages, pools)
            buf = self.staging.buf
            self._regs.append(self.agent.register_memory([(buf.data_ptr(), buf.numel() * buf.element_size(), 0, "")],
                                                         "DRAM", self.backends))
            self._info = PeerInfo()

    # ---- decode side -------------------------------------------------------------------------------
    def peer_info(self) -> PeerInfo:
        return self._info

    def _pump(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                notifs = self.agent.get_new_notifs()   # also progresses the UCX workers
            got = [m.decode() for msgs in notifs.values() for m in msgs]
            if got:
                with self._cond:
                    now = time.monotonic()
                    for lease_id in got:
                        self._arrived[lease_id] = now
                    # a notice for a lease that ended before it came is never waited for: drop it later
                    stale = now - 2 * self.cfg.lease_seconds
                    for lease_id in [k for k, t in self._arrived.items() if t < stale]:
                        del self._arrived[lease_id]
                    self._cond.notify_all()
            time.sleep(self.cfg.nixl_progress_s)

    def wait_arrival(self, lease_id: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while lease_id not in self._arrived:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"nixl: no completion notice for {lease_id} within {timeout:.1f}s")
                self._cond.wait(left)
            del self._arrived[lease_id]

    def forget(self, lease_id: str) -> None:
        with self._cond:
            self._arrived.pop(lease_id, None)

    # ---- prefill side ------------------------------------------------------------------------------
    def _remote(self, peer: PeerInfo) -> str:
        name = peer.agent
        with self.lock:
            if name not in self._peers:
                self._peers[name] = self.agent.add_remote_agent(peer.agent_meta)
            return self._peers[name]

    def _drop_peer(self, name: str) -> None:
        with self.lock:
            if self._peers.pop(name, None) is not None:
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:  # noqa: BLE001
                    pass

    def send(self, payload: KVPayload, dest: Destination, timeout: float) -> Receipt:
        if self.staging is None:
            raise TransferError("nixl: this worker has no staging buffer (not a prefill worker)")
        t0 = time.monotonic()
        deadline = t0 + timeout
        off = check_fits(payload, dest)
        send_id = f"send-{uuid.uuid4().hex[:12]}"
        try:
            full_idx, swa_idx = self.staging.stage(send_id, payload, t0, timeout + 1.0)
        except MemoryError as e:
            raise TransferError(f"nixl: staging buffer full: {e}") from None
        keep = False
        try:
            spans = self.staging.spans(full_idx, swa_idx, payload, dest, off)
            remote = self._remote(dest.peer)
            if self.cfg.debug_write_delay:       # test-only: a write posted late and not aborted
                time.sleep(self.cfg.debug_write_delay)
                deadline = time.monotonic() + 60.0
            state = self._write(spans, remote, dest.lease_id, deadline, send_id)
            if state in ("PROC", "TIMEOUT"):
                self.counts["timeouts"] += 1
                keep = state == "PROC"
                raise TransferError(f"nixl: write to {dest.worker_id} did not finish within {timeout:.1f}s",
                                    in_flight=keep)
            if state != "DONE":
                self.counts["failed"] += 1
                self._drop_peer(dest.peer.agent)
                raise TransferError(f"nixl: write to {dest.worker_id} failed ({state})")
        except TransferError:
            raise
        except Exception as e:  # noqa: BLE001 - dead peer, bad metadata, UCX error
            self.counts["failed"] += 1
            self._drop_peer(dest.peer.agent)
            raise TransferError(f"nixl: write to {dest.worker_id} failed: {e!r}"[:400]) from None
        finally:
            if keep:
                self.counts["abandoned"] += 1
            else:
                self.staging.release(send_id)
        nbytes = sum(n for _, _, n in spans)
        self.counts["sends"] += 1
        self.counts["bytes"] += nbytes
        return receipt(payload, bytes=nbytes, seconds=time.monotonic() - t0, descriptors=len(spans))

    def _write(self, spans, remote: str, lease_id: str, deadline: float, send_id: str = "") -> str:
        """Post one WRITE of all spans with ``lease_id`` as notification; poll it. Returns DONE, ERR,
        TIMEOUT (aborted at the deadline) or PROC (still running and could not be aborted)."""
        a = self.agent
        with self.lock:
            local = a.get_xfer_descs([(s, n, 0) for s, _, n in spans], "DRAM")
            far = a.get_xfer_descs([(d, n, 0) for _, d, n in spans], "DRAM")
            handle = a.initialize_xfer("WRITE", local, far, remote, lease_id.encode(), backends=self.backends)
            state = a.transfer(handle)
        nap = 0.0
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(nap)
            nap = min(2e-4, nap + 2e-5)
            with self.lock:
                state = a.check_xfer_state(handle)
        with self.lock:
            try:
                a.release_xfer_handle(handle)        # aborts a transfer still in flight, when it can
            except Exception:  # noqa: BLE001 - could not abort: keep its buffers (and the handle)
                self._abandoned.append((handle, lease_id, send_id))
                return "PROC" if state == "PROC" else state
        return "TIMEOUT" if state == "PROC" else state

    def in_flight(self) -> set[str]:
        return {lease_id for _, lease_id, _ in self._abandoned}

    def reap(self) -> None:
        """Sends that could not be aborted: once UCX is done with one (or it failed), free its staging
        pages and report its end, so the decode side releases the quarantined lease."""
        ended = []
        with self.lock:
            for item in list(self._abandoned):
                handle, lease_id, send_id = item
                try:
                    if self.agent.check_xfer_state(handle) == "PROC":
                        continue
                    self.agent.release_xfer_handle(handle)
                except Exception:  # noqa: BLE001 - an errored handle is over too
                    pass
                self._abandoned.remove(item)
                ended.append((lease_id, send_id))
        for lease_id, send_id in ended:
            if send_id:
                self.staging.release(send_id)
            self._ended(lease_id)

    # ---- both ----------------------------------------------------------------------------------------
    def stats(self) -> SendStats:
        used, total = self.staging.usage() if self.staging is not None else (0, 0)
        return SendStats(**self.counts, staging_pages_used=used, staging_pages=total)

    def close(self) -> None:
        self._stop.set()
        with self.lock:
            for r in self._regs:
                try:
                    self.agent.deregister_memory(r, self.backends)
                except Exception:  # noqa: BLE001
                    pass
            self._regs.clear()
