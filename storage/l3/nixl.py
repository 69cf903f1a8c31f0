"""L3 through a NIXL agent: the file store's directory, LRU and atomic publish, with the page bytes moved
by NIXL's POSIX backend between registered host memory and the page files.

Everything about naming, temp files, ``os.replace``, eviction and verification is the file store's
(storage/l3/file.py); this class only replaces its two raw I/O hooks. A batch is one NIXL transfer of
``2 * n`` descriptors (header and page per file), so the plugin can queue the whole batch at once
(``backend_params`` selects its engine, e.g. ``{"use_uring": "true"}``). NIXL refuses unregistered
memory: ``register()`` a host pool once; other pages and the header buffer are registered per batch.

A failed batch transfer is retried page by page so one bad file costs one miss, not the batch.
The other mode of the backend, pages in a remote process's memory over UCX, is storage/l3/nixl_ucx.py.
"""
from __future__ import annotations

import importlib
import os
import threading
import time

from typing import TYPE_CHECKING

import numpy as np

from storage.l3.base import HEADER_BYTES, L3Store, check_host_buffer, log

if TYPE_CHECKING:
    import torch
from storage.l3.file import FileStore

_BACKEND = "POSIX"


def _load_nixl():
    """The meta package ``nixl`` picks a CUDA-variant wheel; either variant alone runs on CPU-only hosts
    too (the CUDA libraries are only loaded for VRAM), so one of them is enough."""
    errors = []
    for mod in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            api = importlib.import_module(mod)
            return api.nixl_agent, api.nixl_agent_config
        except ImportError as e:
            errors.append(f"{mod}: {e}")
    raise RuntimeError(f"NIXL unavailable ({'; '.join(errors)}); install nixl-cu12 (or nixl)")


class NixlStore(FileStore):
    backend = "nixl"

    def __init__(self, cfg) -> None:
        nixl_agent, nixl_agent_config = _load_nixl()
        nc = cfg.nixl
        self._agent_name = nc.agent_name or f"strata-l3-{os.getpid()}-{id(self):x}"
        # No listener and no progress thread: the POSIX backend needs no peer and we poll ourselves.
        self._agent = nixl_agent(self._agent_name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        if _BACKEND not in self._agent.get_plugin_list():
            raise RuntimeError(f"NIXL has no {_BACKEND} plugin (found {self._agent.get_plugin_list()})")
        self._agent.create_backend(_BACKEND, dict(nc.backend_params))
        self._agent_lock = threading.Lock()      # the agent is created without thread safety
        self._regions: list[tuple[int, int, object, torch.Tensor]] = []
        self._abandoned: list = []
        super().__init__(cfg)

    # ---- registration ------------------------------------------------------------------------------------
    def register(self, buf: torch.Tensor) -> None:
        check_host_buffer(buf)
        with self._agent_lock:
            if self._covered(buf.data_ptr(), buf.nbytes):
                return
            descs = self._agent.register_memory([(buf.data_ptr(), buf.nbytes, 0, "")], "DRAM", [_BACKEND])
            self._regions.append((buf.data_ptr(), buf.data_ptr() + buf.nbytes, descs, buf))

    def _covered(self, ptr: int, n: int) -> bool:
        return any(s <= ptr and ptr + n <= e for s, e, _, _ in self._regions)

    # ---- the two I/O hooks of the file store ---------------------------------------------------------
    def _io_read(self, fds, headers: np.ndarray, pages, idx: list[int]) -> list[bool]:
        return self._xfer("READ", fds, headers, pages, idx)

    def _io_write(self, fds, headers: np.ndarray, pages, idx: list[int]) -> list[bool]:
        return self._xfer("WRITE", fds, headers, pages, idx)

    def _xfer(self, op: str, fds, headers: np.ndarray, pages, idx: list[int]) -> list[bool]:
        with self._agent_lock:
            temps = self._register_batch(fds, headers, pages, idx)
            try:
                if self._run(op, fds, headers, pages, idx):
                    return [True] * len(idx)
                if len(idx) == 1:
                    return [False]
                return [self._run(op, fds, headers, pages, [i]) for i in idx]
            except _Abandoned:
                self._abandoned.append((temps, headers, pages))   # the plugin may still use them
                temps = []
                return [False] * len(idx)
            finally:
                for descs in temps:
                    self._agent.deregister_memory(descs, [_BACKEND])

    def _register_batch(self, fds, headers: np.ndarray, pages, idx: list[int]) -> list:
        a, temps = self._agent, []
        temps.append(a.register_memory([(headers.ctypes.data, headers.nbytes, 0, "")], "DRAM", [_BACKEND]))
        loose = {pages[i].data_ptr(): pages[i].nbytes for i in idx
                 if not self._covered(pages[i].data_ptr(), pages[i].nbytes)}
        if loose:
            temps.append(a.register_memory([(p, n, 0, "") for p, n in loose.items()], "DRAM", [_BACKEND]))
        # A file is registered by descriptor; offset/length 0 stands for the whole file.
        temps.append(a.register_memory([(0, 0, fds[i], "") for i in idx], "FILE", [_BACKEND]))
        return temps

    def _run(self, op: str, fds, headers: np.ndarray, pages, idx: list[int]) -> bool:
        a, base = self._agent, headers.ctypes.data
        local, remote = [], []
        for i in idx:
            n = pages[i].nbytes
            local += [(base + i * HEADER_BYTES, HEADER_BYTES, 0), (pages[i].data_ptr(), n, 0)]
            remote += [(0, HEADER_BYTES, fds[i]), (HEADER_BYTES, n, fds[i])]
        done = wait_xfer(self, op, a.get_xfer_descs(local, "DRAM"), a.get_xfer_descs(remote, "FILE"),
                         self._agent_name, [_BACKEND], self.cfg.nixl.op_timeout_s)
        if done is None:
            raise _Abandoned
        return done

    def _close(self) -> None:
        super()._close()
        with self._agent_lock:
            for _, _, descs, _ in self._regions:
                self._agent.deregister_memory(descs, [_BACKEND])
            self._regions.clear()


class _Abandoned(Exception):
    pass


def wait_xfer(store: L3Store, op: str, local, remote, peer: str, backends: list[str], timeout: float):
    """Post one NIXL transfer and poll it: True done, False failed (NIXL raises on a short read or a
    dead peer), None abandoned after ``timeout`` (its buffers must then stay alive and registered)."""
    a, handle = store._agent, None
    try:
        handle = a.initialize_xfer(op, local, remote, peer, backends=backends)
        state = a.transfer(handle)
        deadline, nap = time.monotonic() + timeout, 0.0
        while state == "PROC":
            if time.monotonic() > deadline:
                store._count(timeouts=1)
                log.warning("nixl L3: %s exceeded %.1fs", op, timeout)
                handle = None          # never release a handle the plugin still works on
                return None
            time.sleep(nap)
            nap = min(1e-4, nap + 1e-5)
            state = a.check_xfer_state(handle)
        return state == "DONE"
    except Exception as e:  # noqa: BLE001
        log.debug("nixl L3: %s failed: %s", op, e)
        return False
    finally:
        if handle is not None:
            try:
                a.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001
                pass

