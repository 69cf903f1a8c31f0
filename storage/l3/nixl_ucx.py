"""L3 in another process's memory over NIXL/UCX: a slab server and the store that reads and writes it.

The server (``python -m storage.l3.nixl_ucx --port P --capacity-bytes N --slot-bytes S``) owns a slab of
fixed-size slots registered with its NIXL UCX agent, and the slot table: committed key -> slot in LRU
order, free slots, slots handed out for writing. The store asks the server, over a small authenticated
control connection, which slots to read or write, then moves header + page with one-sided UCX
READ/WRITE straight between its registered host pool and the slab; the server's CPU never touches data.

Why this is safe without locking slots during I/O: a slot being read can be evicted and rewritten by
another client at the same time; the reader then sees a torn object, whose checksum fails: a miss.
A written slot becomes visible only when the writer commits it after its WRITE completed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from multiprocessing.connection import Client, Listener

from typing import TYPE_CHECKING

import numpy as np

from storage.l3.base import (HEADER_BYTES, KEY_PREFIX, L3Store, check_host_buffer, encode_header, host_location,
                             key_digest, log)

if TYPE_CHECKING:
    import torch
from storage.l3.nixl import _load_nixl, wait_xfer


# ---- server -----------------------------------------------------------------------------------------------
class SlabServer:
    def __init__(self, capacity_bytes: int, slot_bytes: int, name: str = "", progress_s: float = 5e-4) -> None:
        nixl_agent, nixl_agent_config = _load_nixl()
        self.slot_bytes = slot_bytes
        self.n_slots = max(1, capacity_bytes // slot_bytes)
        self.slab = np.zeros(self.n_slots * slot_bytes, dtype=np.uint8)   # bytes only: no torch here
        # UCX needs the target to progress for the peers' one-sided operations to complete. NIXL's own
        # progress thread busy-polls a whole core; a pump that naps ``progress_s`` costs ~1% and, on
        # this 2-core class of machine, transfers faster than the spinning thread.
        self.agent = nixl_agent(name or f"strata-slab-{os.getpid()}",
                                nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.agent.register_memory([(self.slab.ctypes.data, self.slab.nbytes, 0, "")], "DRAM", ["UCX"])
        self.progress_s = progress_s
        self.lock = threading.Lock()
        self.lru: OrderedDict[str, int] = OrderedDict()     # committed key -> slot, least recent first
        self.free = list(range(self.n_slots - 1, -1, -1))
        self.pending: dict[int, str] = {}                  # slot -> key being written

    def handle(self, req: tuple, mine: set[int]):
        op, args = req[0], req[1:]
        with self.lock:
            if op == "hello":
                return self.agent.get_agent_metadata(), self.slab.ctypes.data, self.slot_bytes, self.n_slots
            if op == "exists":
                n = 0
                while n < len(args[0]) and args[0][n] in self.lru:
                    n += 1
                return n
            if op == "lookup":
                out = []
                for k in args[0]:
                    if k in self.lru:
                        self.lru.move_to_end(k)
                    out.append(self.lru.get(k, -1))
                return out
            if op == "alloc":
                out, evicted = [], 0
                for k in args[0]:
                    if not self.free and self.lru:
                        self.free.append(self.lru.popitem(last=False)[1])    # evict the LRU page
                        evicted += 1
                    slot = self.free.pop() if self.free else -1
                    if slot >= 0:
                        self.pending[slot] = k
                        mine.add(slot)
                    out.append(slot)
                return out, evicted
            if op == "commit":
                for slot, ok in zip(*args):
                    key = self.pending.pop(slot, None)
                    mine.discard(slot)
                    if key is None:
                        continue
                    if ok:
                        old = self.lru.pop(key, None)
                        if old is not None:
                            self.free.append(old)
                        self.lru[key] = slot
                    else:
                        self.free.append(slot)
                return True
            if op == "delete":
                for k in args[0]:
                    if k in self.lru:
                        self.free.append(self.lru.pop(k))
                return True
            if op == "clear":
                for k in [k for k in self.lru if k.startswith(KEY_PREFIX)]:
                    self.free.append(self.lru.pop(k))
                return True
        raise ValueError(f"unknown request {op!r}")

    def _pump(self) -> None:
        while True:
            self.agent.get_new_notifs()     # progresses the UCX workers
            time.sleep(self.progress_s)

    def serve(self, host: str, port: int, authkey: bytes) -> None:
        threading.Thread(target=self._pump, name="ucx-progress", daemon=True).start()
        with Listener((host, port), authkey=authkey) as listener:
            print(f"slab server on {host}:{listener.address[1]}: {self.n_slots} slots of {self.slot_bytes} bytes",
                  flush=True)
            while True:
                conn = listener.accept()
                threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _session(self, conn) -> None:
        mine: set[int] = set()
        try:
            while True:
                req = conn.recv()
                try:
                    conn.send(("ok", self.handle(req, mine)))
                except Exception as e:  # noqa: BLE001 - a bad request fails that request only
                    conn.send(("err", f"{type(e).__name__}: {e}"))
        except (EOFError, OSError):
            pass
        finally:   # a client that died mid-write leaves no slot behind
            with self.lock:
                for slot in mine:
                    if self.pending.pop(slot, None) is not None:
                        self.free.append(slot)
            conn.close()


class SlabServerProcess:
    """The server as a child process (tests, benches, single-node deployments)."""

    def __init__(self, capacity_bytes: int, slot_bytes: int, host: str = "127.0.0.1", port: int = 0,
                 authkey: str = "strata-l3", log_path: str | None = None) -> None:
        from storage.ports import free_port
        self.host, self.port = host, port or free_port(host)
        self.args = [sys.executable, "-m", "storage.l3.nixl_ucx", "--host", host, "--port", str(self.port),
                     "--capacity-bytes", str(capacity_bytes), "--slot-bytes", str(slot_bytes), "--authkey", authkey]
        self.authkey, self.log_path, self.proc = authkey, log_path, None

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "SlabServerProcess":
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        from storage.l3.mooncake import die_with_parent
        self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, preexec_fn=die_with_parent)
        if self.log_path:
            out.close()
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"slab server exited with code {self.proc.returncode}: {self.args}")
            try:
                Client((self.host, self.port), authkey=self.authkey.encode()).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"slab server did not listen on {self.addr} within {timeout}s")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# ---- store ------------------------------------------------------------------------------------------------
class NixlRemoteStore(L3Store):
    backend = "nixl"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        nc = cfg.nixl
        nixl_agent, nixl_agent_config = _load_nixl()
        self.nc = nc
        self.location = host_location("nixl", nc.remote_addr)
        self._lock = threading.Lock()                 # one request/transfer at a time on agent and socket
        # No progress thread (it spins a core): waiting on a transfer progresses it.
        self._agent = nixl_agent(nc.agent_name or f"strata-l3-{os.getpid()}-{id(self):x}",
                                 nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._regions: list = []
        self._abandoned: list = []
        self._down_until = 0.0
        self._conn = self._remote = None
        self._connect()

    def _connect(self) -> None:
        host, port = self.nc.remote_addr.rsplit(":", 1)
        try:
            conn = Client((host, int(port)), authkey=self.nc.authkey.encode())
            self._conn = conn
            meta, self._base, self._slot_bytes, self._n_slots = self._rpc_locked("hello")
            if self._remote is not None:          # a restarted server: forget the old one's memory
                self._agent.remove_remote_agent(self._remote)
                self._remote = None
            self._remote = self._agent.add_remote_agent(meta)
        except Exception as e:  # noqa: BLE001 - refused, reset, timeout, authkey or NIXL metadata error
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            raise RuntimeError(f"NIXL slab server {self.nc.remote_addr} unreachable: {e!r}") from e

    def _rpc_locked(self, *req):
        self._conn.send(req)
        if not self._conn.poll(self.nc.op_timeout_s):
            raise TimeoutError(f"slab server did not answer {req[0]!r} within {self.nc.op_timeout_s}s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"slab server: {value}")
        return value

    def _rpc(self, *req):
        """None when the server is down (then calls are skipped for ``retry_after_s``, then reconnect)."""
        if time.monotonic() < self._down_until:
            return None
        if self._conn is None:
            try:
                self._connect()
            except RuntimeError as e:
                log.warning("nixl-ucx L3: %s", e)
                self._down_until = time.monotonic() + self.nc.retry_after_s
                return None
        try:
            return self._rpc_locked(*req)
        except (OSError, EOFError, TimeoutError) as e:
            log.warning("nixl-ucx L3: %r; treating the server as down for %.1fs", e, self.nc.retry_after_s)
            self._count(timeouts=int(isinstance(e, TimeoutError)))
            self._conn.close()
            self._conn, self._down_until = None, time.monotonic() + self.nc.retry_after_s
            return None

    def register(self, buf: torch.Tensor) -> None:
        check_host_buffer(buf)
        with self._lock:
            if not any(s <= buf.data_ptr() and buf.data_ptr() + buf.nbytes <= e for s, e, _, _ in self._regions):
                descs = self._agent.register_memory([(buf.data_ptr(), buf.nbytes, 0, "")], "DRAM", ["UCX"])
                self._regions.append((buf.data_ptr(), buf.data_ptr() + buf.nbytes, descs, buf))

    def _xfer(self, op: str, headers: np.ndarray, pages, slots: list[int], idx: list[int]) -> bool:
        a, temps = self._agent, []
        loose = {pages[i].data_ptr(): pages[i].nbytes for i in idx
                 if not any(s <= pages[i].data_ptr() and pages[i].data_ptr() + pages[i].nbytes <= e
                            for s, e, _, _ in self._regions)}
        temps.append(a.register_memory([(headers.ctypes.data, headers.nbytes, 0, "")], "DRAM", ["UCX"]))
        if loose:
            temps.append(a.register_memory([(p, n, 0, "") for p, n in loose.items()], "DRAM", ["UCX"]))
        local, remote = [], []
        for i in idx:
            at = self._base + slots[i] * self._slot_bytes
            local += [(headers.ctypes.data + i * HEADER_BYTES, HEADER_BYTES, 0), (pages[i].data_ptr(), pages[i].nbytes, 0)]
            remote += [(at, HEADER_BYTES, 0), (at + HEADER_BYTES, pages[i].nbytes, 0)]
        done = wait_xfer(self, op, a.get_xfer_descs(local, "DRAM"), a.get_xfer_descs(remote, "DRAM"),
                         self._remote, ["UCX"], self.nc.op_timeout_s)
        if done is None:                  # still in flight: its buffers must outlive it
            self._abandoned.append((temps, headers, pages))
            self._down_until = time.monotonic() + self.nc.retry_after_s
            return False
        for d in temps:
            a.deregister_memory(d, ["UCX"])
        return done

    # ---- contract ----------------------------------------------------------------------------------------
    def _exists(self, keys):
        with self._lock:
            return self._rpc("exists", keys) or 0

    def _get(self, keys, pages):
        n = len(keys)
        headers = np.zeros((n, HEADER_BYTES), np.uint8)
        with self._lock:
            slots = self._rpc("lookup", keys)
            if not slots:
                return [False] * n
            idx = [i for i in range(n) if slots[i] >= 0 and HEADER_BYTES + pages[i].nbytes <= self._slot_bytes]
            if not idx or not self._xfer("READ", headers, pages, slots, idx):
                return [False] * n
        ok, bad = [False] * n, []
        for i in idx:
            if self._verify(headers[i], key_digest(keys[i]), pages[i]):
                ok[i] = True
            else:
                bad.append(keys[i])
        if bad:
            self._delete(bad)
        return ok

    def _set(self, keys, pages):
        n = len(keys)
        if HEADER_BYTES + pages[0].nbytes > getattr(self, "_slot_bytes", 0):
            return [False] * n
        headers = np.stack([np.frombuffer(encode_header(key_digest(k), p), np.uint8) for k, p in zip(keys, pages)])
        with self._lock:
            got = self._rpc("alloc", keys)
            if not got:
                return [False] * n
            slots, evicted = got
            self._count(evictions=evicted)
            idx = [i for i in range(n) if slots[i] >= 0]
            done = bool(idx) and self._xfer("WRITE", headers, pages, slots, idx)
            self._rpc("commit", [slots[i] for i in idx], [done] * len(idx))
        return [done and slots[i] >= 0 for i in range(n)]

    def _delete(self, keys):
        with self._lock:
            self._rpc("delete", keys)

    def _clear(self):
        with self._lock:
            self._rpc("clear")

    def _clear_prefix(self, prefix):
        # The slab server is this cluster's own process (its address is in the cluster's YAML): all of it.
        self._clear()
        return -1

    def _close(self):
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            for _, _, descs, _ in self._regions:
                self._agent.deregister_memory(descs, ["UCX"])
            self._regions.clear()

    def slot_of(self, key: str) -> tuple[int, int, int]:
        """(slot of ``key`` or -1, slab base address, slot bytes): where a raw UCX transfer finds it."""
        with self._lock:
            return (self._rpc("lookup", [key]) or [-1])[0], self._base, self._slot_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description="NIXL/UCX slab server for the L3 'nixl' backend, mode 'ucx'")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--capacity-bytes", type=int, required=True)
    ap.add_argument("--slot-bytes", type=int, required=True, help="header + the largest page it will hold")
    ap.add_argument("--authkey", default="strata-l3")
    a = ap.parse_args()
    if a.slot_bytes <= HEADER_BYTES or a.capacity_bytes < a.slot_bytes:
        raise SystemExit("need --capacity-bytes >= --slot-bytes > 64")
    SlabServer(a.capacity_bytes, a.slot_bytes).serve(a.host, a.port, a.authkey.encode())


if __name__ == "__main__":
    main()
