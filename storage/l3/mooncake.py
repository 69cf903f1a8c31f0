"""L3 on a Mooncake store (``mooncake-transfer-engine`` / ``-non-cuda`` from PyPI) and a ``mooncake_master``.

Pages move zero-copy: each object is written from and read into two buffers, a small header buffer and
the page itself (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``), so a page inside a
``register()``-ed host pool goes straight between the pool and the store. Pages outside registered memory
are registered for the duration of the call (a few microseconds each).

Failure policy. The client retries a dead master for seconds per call (and ``setup`` for ~90 s), so:

* every call runs on a helper thread and is abandoned after ``op_timeout_s`` (a miss / a failed set);
* a timeout or an RPC failure opens a breaker: calls return misses at once for ``retry_after_s``, then
  one call probes the master again;
* an abandoned get may still write into its destination pages until the client gives up (it fails in
  the master lookup, before any data moves, when the master is down); the header buffers and temporary
  registrations of abandoned calls are kept alive for that reason;
* ``close()`` with the master down parks the client instead of tearing it down: Mooncake's teardown
  retries the unmount for ~13 s while holding the GIL.

A put of a key that already exists succeeds without rewriting it (keys name contents); a page that
fails its checksum is removed so the next set stores it again.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from bisect import bisect_right

from typing import TYPE_CHECKING

import numpy as np

from storage.l3.base import (HEADER_BYTES, KEY_PREFIX, L3Store, check_host_buffer, encode_header,
                             host_location, key_digest, load_torch, log)

if TYPE_CHECKING:
    import torch
from storage.ports import free_port

OBJECT_NOT_FOUND = -704
# Present but unreadable as this page: larger than the buffers (INVALID_PARAMS) or smaller (TRANSFER_FAIL).
_WRONG_SIZE = (-600, -800)
_MASTER_DOWN = (-900, -901)          # RPC_FAIL, RPC_TIMEOUT
_PARKED: list = []                   # clients closed while the master was down (see module docstring)


class _Unavailable(Exception):
    pass


class MooncakeStore(L3Store):
    backend = "mooncake"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        mc = cfg.mooncake
        self.mc = mc
        self.location = host_location("mooncake", mc.master_addr)
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as e:
            raise RuntimeError(f"mooncake store bindings unavailable ({e}); install "
                               "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine") from e
        host, port = mc.master_addr.rsplit(":", 1)
        try:  # fail fast: setup() retries an absent master for ~90 s
            socket.create_connection((host, int(port)), timeout=min(2.0, mc.setup_timeout_s)).close()
        except OSError as e:
            raise RuntimeError(f"mooncake master {mc.master_addr} unreachable: {e}") from e
        self._client = MooncakeDistributedStore()
        self._rc = ReplicateConfig()
        self._rc.replica_num = mc.replicas
        if mc.preferred_segment:   # a long-lived owner's memory: pages outlive the worker that wrote them
            self._rc.preferred_segment = mc.preferred_segment
        self._down_until = 0.0
        self._abandoned: list = []
        self._reg_lock = threading.Lock()
        self._regions: list[tuple[int, int, torch.Tensor]] = []   # (start, end, owner), sorted by start
        segment = mc.segment_bytes or cfg.capacity_bytes
        rc = self._call(lambda: self._client.setup(mc.local_hostname, mc.metadata_server, segment,
                                                   mc.local_buffer_bytes, mc.protocol, mc.rdma_devices,
                                                   mc.master_addr), mc.setup_timeout_s, ())
        if rc != 0:
            raise RuntimeError(f"mooncake setup against {mc.master_addr} failed with code {rc}")

    # ---- registration ------------------------------------------------------------------------------------
    def register(self, buf: torch.Tensor) -> None:
        check_host_buffer(buf)
        start = buf.data_ptr()
        with self._reg_lock:
            if self._covered(start, buf.nbytes):
                return
            rc = self._client.register_buffer(start, buf.nbytes)
            if rc != 0:
                raise RuntimeError(f"mooncake register_buffer({buf.nbytes} bytes) failed with code {rc}")
            self._regions.append((start, start + buf.nbytes, buf))   # the ref keeps the memory alive
            self._regions.sort(key=lambda r: r[0])

    def _covered(self, ptr: int, n: int) -> bool:
        i = bisect_right([r[0] for r in self._regions], ptr) - 1
        return i >= 0 and self._regions[i][1] >= ptr + n

    def _pin(self, tensors: list[torch.Tensor]) -> list[int]:
        """Register what no pool covers, for one call; returns the pointers to unregister after it."""
        temps = []
        with self._reg_lock:
            for t in tensors:
                if not self._covered(t.data_ptr(), t.nbytes) and self._client.register_buffer(t.data_ptr(), t.nbytes) == 0:
                    temps.append(t.data_ptr())
        return temps

    def _unpin(self, temps: list[int]) -> None:
        with self._reg_lock:
            for p in temps:
                self._client.unregister_buffer(p)

    # ---- calls with a deadline -------------------------------------------------------------------------
    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _trip(self, why: str) -> None:
        if self._available():
            log.warning("mooncake L3: %s; treating the store as down for %.1fs", why, self.mc.retry_after_s)
        self._down_until = time.monotonic() + self.mc.retry_after_s

    def _call(self, fn, timeout: float, keepalive):
        box: dict = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["v"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["e"] = e
            finally:
                done.set()

        worker = threading.Thread(target=run, name="l3-mooncake", daemon=True)
        worker.start()
        if not done.wait(timeout):
            self._count(timeouts=1)
            self._trip(f"call exceeded {timeout}s")
            self._abandoned.append((worker, keepalive))   # buffers the abandoned call may still touch
            raise _Unavailable
        if "e" in box:
            raise box["e"]
        return box["v"]

    def _io(self, fn, tensors: list[torch.Tensor], n: int):
        """Run a data call over ``tensors`` with temporary registrations; None when the store is down."""
        if not self._available():
            return None
        temps = self._pin(tensors)
        try:
            res = list(self._call(fn, self.mc.op_timeout_s, (tensors, temps)))
        except _Unavailable:
            return None            # temps stay registered: the abandoned call may still use them
        self._unpin(temps)
        if len(res) != n or any(r in _MASTER_DOWN for r in res):
            self._trip(f"master call failed: {res[:4]}")
        return res if len(res) == n else None

    # ---- contract ----------------------------------------------------------------------------------------
    def _exists(self, keys: list[str]) -> int:
        if not self._available():
            return 0
        try:
            res = self._call(lambda: self._client.batch_is_exist(keys), self.mc.op_timeout_s, ())
        except _Unavailable:
            return 0
        if res and all(r < 0 for r in res):
            self._trip("batch_is_exist failed")
        n = 0
        while n < len(res) and res[n] == 1:
            n += 1
        return n

    def _get(self, keys: list[str], pages: list[torch.Tensor]) -> list[bool]:
        n, want = len(keys), HEADER_BYTES + pages[0].nbytes
        torch = load_torch()
        hdrs = torch.zeros((n, HEADER_BYTES), dtype=torch.uint8)
        ptrs = [[hdrs[i].data_ptr(), p.data_ptr()] for i, p in enumerate(pages)]
        sizes = [[HEADER_BYTES, pages[0].nbytes]] * n
        res = self._io(lambda: self._client.batch_get_into_multi_buffers(keys, ptrs, sizes), [hdrs, *pages], n)
        if res is None:
            return [False] * n
        ok, bad = [False] * n, []
        h = hdrs.numpy()
        for i, r in enumerate(res):
            if r == want and self._verify(h[i], key_digest(keys[i]), pages[i]):
                ok[i] = True
            elif r >= 0 or r in _WRONG_SIZE:   # present but not this page: bad checksum (counted) or size
                if r != want:
                    self._count(corrupt=1)
                bad.append(keys[i])
            elif r not in (OBJECT_NOT_FOUND, *_MASTER_DOWN):
                log.debug("mooncake L3: get %s -> %d", keys[i], r)
        if bad:   # let the next set store a good copy (a put never overwrites an existing key)
            self._delete(bad)
        return ok

    def _set(self, keys: list[str], pages: list[torch.Tensor]) -> list[bool]:
        n = len(keys)
        raw = b"".join(encode_header(key_digest(k), p) for k, p in zip(keys, pages))
        hdrs = load_torch().from_numpy(np.frombuffer(raw, np.uint8).reshape(n, HEADER_BYTES).copy())
        ptrs = [[hdrs[i].data_ptr(), p.data_ptr()] for i, p in enumerate(pages)]
        sizes = [[HEADER_BYTES, pages[0].nbytes]] * n
        res = self._io(lambda: self._client.batch_put_from_multi_buffers(keys, ptrs, sizes, self._rc),
                       [hdrs, *pages], n)
        return [False] * n if res is None else [r == 0 for r in res]

    def _delete(self, keys: list[str]) -> None:
        if self._available():
            try:
                self._call(lambda: self._client.batch_remove(keys, True), self.mc.op_timeout_s, ())
            except _Unavailable:
                pass

    def _clear(self) -> None:
        if self._available():
            try:
                self._call(lambda: self._client.remove_by_regex("^" + re.escape(KEY_PREFIX), True),
                           self.mc.op_timeout_s, ())
            except _Unavailable:
                pass

    def _clear_prefix(self, prefix: str) -> int:
        # A Mooncake master may be shared with other clusters and other tools: only this namespace goes.
        if not self._available():
            raise RuntimeError(f"mooncake master {self.mc.master_addr} is unreachable")
        n = self._call(lambda: self._client.remove_by_regex("^" + re.escape(prefix), True), self.mc.op_timeout_s, ())
        if isinstance(n, int) and n < 0:
            raise RuntimeError(f"mooncake remove_by_regex failed (code {n})")
        return n if isinstance(n, int) else -1

    def _close(self) -> None:
        self._abandoned = [a for a in self._abandoned if a[0].is_alive()]
        if not self._available() or self._abandoned:
            _PARKED.append((self._client, self._regions, self._abandoned))
            return
        with self._reg_lock:
            for start, _, _ in self._regions:
                self._client.unregister_buffer(start)
            self._regions.clear()
        self._client.close()

    def present(self, keys: list[str]) -> list[bool] | None:
        """Per key, whether the store holds it (an audit, unlike the prefix ``batch_exists``); None when
        the master cannot answer."""
        if not self._available():
            return None
        try:
            res = self._call(lambda: self._client.batch_is_exist(keys), self.mc.op_timeout_s, ())
        except _Unavailable:
            return None
        if len(res) != len(keys) or (res and all(r < 0 for r in res)):
            return None
        return [r == 1 for r in res]

    def prefer_segment(self, name: str) -> None:
        """Place new objects in the segment ``name`` from now on ("" any): the storage actor's, after it
        restarted with a new one. Objects already stored stay where they are."""
        self._rc.preferred_segment = name

    @property
    def preferred_segment(self) -> str:
        return self._rc.preferred_segment

    def segment_name(self) -> str:
        """The name other clients use to prefer this client's segment (``preferred_segment``)."""
        return self._client.get_hostname()

    @property
    def raw(self):
        """The underlying MooncakeDistributedStore (tests use it to plant corrupt objects)."""
        return self._client


# ---- a master process for tests, benches and single-node deployments ----------------------------------
def master_binary() -> str:
    """The mooncake_master executable shipped inside the wheel (the console script only execs it)."""
    spec = importlib.util.find_spec("mooncake")
    if spec and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "mooncake_master")
        if os.path.isfile(path):
            return path
    found = shutil.which("mooncake_master")
    if not found:
        raise RuntimeError("mooncake_master not found: install mooncake-transfer-engine-non-cuda")
    return found


def die_with_parent() -> None:
    """``preexec_fn`` of helper servers: the kernel kills the child when the thread that started it
    exits, so a crashed test run or bench leaves no server behind (Linux; elsewhere a no-op)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)   # PR_SET_PDEATHSIG, SIGKILL
    except OSError:
        pass


class MooncakeMaster:
    """A ``mooncake_master`` child process bound to ``host`` (loopback by default)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, log_path: str | None = None,
                 extra_args: tuple[str, ...] = (), tied: bool = True) -> None:
        self.host, self.port = host, port or free_port(host)
        self.log_path = log_path
        self.extra_args = tuple(extra_args)
        self.tied = tied           # die with the starting thread (see die_with_parent)
        self.proc: subprocess.Popen | None = None
        self.metrics_port = 0

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "MooncakeMaster":
        self.metrics_port = free_port(self.host)
        args = [master_binary(), f"--rpc_port={self.port}", f"--rpc_address={self.host}",
                f"--metrics_port={self.metrics_port}", f"--metrics_host={self.host}",
                "--enable_metric_reporting=false", *self.extra_args]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=die_with_parent if self.tied else None)
        finally:
            if self.log_path:
                out.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with code {self.proc.returncode} ({args})")
            try:
                socket.create_connection((self.host, self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mooncake_master did not listen on {self.addr} within {timeout}s")

    def metrics(self, timeout: float = 2.0) -> dict[str, float]:
        """The master's unlabelled Prometheus gauges and counters (``master_allocated_bytes``,
        ``master_total_capacity_bytes``, ``master_key_count``, ``master_evicted_key_count``...); {} if it
        does not answer."""
        import urllib.request
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.metrics_port}/metrics", timeout=timeout) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if line.startswith("#") or "{" in name or not value:
                continue
            try:
                out[name] = float(value)
            except ValueError:
                pass
        return out

    def kill(self) -> None:
        """SIGKILL: what a crashed master looks like to its clients."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
