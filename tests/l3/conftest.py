"""Fixtures of the L3 contract suite: one store per backend that can run on this machine.

The Mooncake fixtures start a real ``mooncake_master`` on a free loopback port. A backend is skipped
only when its package cannot be imported or its binary cannot start, and the skip reason carries the
exact error.
"""
from __future__ import annotations

import uuid

import pytest
import torch

from storage.l3 import L3Config, l3_key, make_store

BACKENDS = ("file", "mooncake", "nixl", "nixl-ucx")
CAPACITY = 64 << 20
SLOT_BYTES = (256 << 10) + 64        # the slab server's slots hold the largest test page
# Short deadlines so a dead master costs the suite a second, not the client's default retries.
MOONCAKE_TEST = dict(op_timeout_s=1.0, retry_after_s=0.5, setup_timeout_s=20.0)


def _import_error(module: str) -> str | None:
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001 - any import failure means the backend cannot run here
        return f"{type(e).__name__}: {e}"
    return None


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory):
    err = _import_error("mooncake.store")
    if err:
        pytest.skip(f"mooncake store bindings cannot load: {err}")
    from storage.l3.mooncake import MooncakeMaster

    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    master = MooncakeMaster(log_path=str(log))
    try:
        master.start()
    except (RuntimeError, OSError) as e:
        pytest.skip(f"mooncake_master cannot start: {e}; log: {log.read_text()[-2000:] if log.exists() else ''}")
    yield master
    master.stop()


def _nixl_or_skip() -> None:
    from storage.l3.nixl import _load_nixl

    try:
        _load_nixl()
    except RuntimeError as e:
        pytest.skip(f"NIXL cannot load: {e}")


@pytest.fixture(scope="session")
def slab_server(tmp_path_factory):
    """A NIXL/UCX slab server process (the remote memory of the nixl backend's ``ucx`` mode)."""
    _nixl_or_skip()
    from storage.l3.nixl_ucx import SlabServerProcess

    log = tmp_path_factory.mktemp("slab") / "server.log"
    server = SlabServerProcess(CAPACITY, SLOT_BYTES, log_path=str(log)).start()
    yield server
    server.kill()


def store_config(backend: str, path, server=None, **kw) -> L3Config:
    """``server``: the mooncake master or the slab server the backend talks to."""
    kw.setdefault("capacity_bytes", CAPACITY)
    kw.setdefault("prefetch_policy", "wait_complete")   # tests that count L3 hits must not race a clock
    if backend == "mooncake":
        kw["mooncake"] = dict(master_addr=server.addr, **MOONCAKE_TEST, **kw.pop("mooncake", {}))
    if backend == "nixl-ucx":
        backend = "nixl"
        kw["nixl"] = dict(mode="ucx", remote_addr=server.addr, op_timeout_s=2.0, retry_after_s=0.5)
    return L3Config(backend=backend, path=str(path), **kw)


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


def backend_server(backend: str, request):
    """The real server a backend talks to (mooncake_master, the UCX slab server), or None; skips with
    the exact reason where the backend cannot run here."""
    if backend == "mooncake":
        return request.getfixturevalue("mooncake_master")
    if backend == "nixl-ucx":
        return request.getfixturevalue("slab_server")
    if backend == "nixl":
        _nixl_or_skip()
    return None


@pytest.fixture
def open_store(backend, tmp_path, request):
    """A factory of stores of the current backend (several may share one directory or master)."""
    stores = []
    server = backend_server(backend, request)

    def make(**kw):
        s = make_store(store_config(backend, tmp_path / "l3", server, **kw))
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


class _SharedStore:
    """One Mooncake client serves every test (its teardown sleeps 1-2 s); ``stats()`` is per test."""

    def __init__(self, inner) -> None:
        self._inner, self._base = inner, inner.stats()

    def stats(self) -> dict[str, int]:
        return {k: v - self._base[k] for k, v in self._inner.stats().items()}

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.fixture(scope="session")
def shared_mooncake_store(mooncake_master, tmp_path_factory):
    s = make_store(store_config("mooncake", tmp_path_factory.mktemp("unused"), mooncake_master))
    yield s
    s.close()


@pytest.fixture
def store(backend, request):
    if backend == "mooncake":
        return _SharedStore(request.getfixturevalue("shared_mooncake_store"))
    return request.getfixturevalue("open_store")()


@pytest.fixture
def keys():
    """Keys of a model id unique to the test, so tests sharing one Mooncake master never collide."""
    model = f"test-{uuid.uuid4().hex[:8]}"

    def make(n: int, component: str = "full", start: int = 0) -> list[str]:
        return [l3_key(model, component, i.to_bytes(16, "big")) for i in range(start, start + n)]

    return make


def random_pages(n: int, numel: int = 4096, dtype=torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g).to(dtype) for _ in range(n)]
