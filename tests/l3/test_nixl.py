"""NIXL specifics: the UCX slab server killed, frozen or restarted; pages larger than a slot."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from storage.l3 import make_store
from tests.l3.conftest import SLOT_BYTES, random_pages, store_config


@pytest.fixture
def own_server(slab_server, tmp_path):
    """A slab server of this test alone (the session one must survive)."""
    from storage.l3.nixl_ucx import SlabServerProcess

    s = SlabServerProcess(8 * SLOT_BYTES, SLOT_BYTES, log_path=str(tmp_path / "slab.log")).start()
    yield s
    s.kill()


def _wait_stopped(pid: int) -> None:
    """SIGSTOP lands asynchronously on a running process; a request sent before it would be answered."""
    end = time.monotonic() + 5
    while time.monotonic() < end:
        with open(f"/proc/{pid}/status") as f:
            if "\nState:\tT" in f.read():
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def test_killed_server_means_misses_then_reconnect(own_server, tmp_path, keys):
    from storage.l3.nixl_ucx import SlabServerProcess

    s = make_store(store_config("nixl-ucx", tmp_path, own_server))
    ks, pages = keys(3), random_pages(3)
    out = [torch.zeros_like(p) for p in pages]
    assert s.batch_set(ks, pages) == [True] * 3
    own_server.kill()
    t0 = time.monotonic()
    assert s.batch_get(ks, out) == [False] * 3
    assert s.batch_exists(ks) == 0
    assert s.batch_set(ks, pages) == [False] * 3
    assert time.monotonic() - t0 < 1.0
    again = SlabServerProcess(8 * SLOT_BYTES, SLOT_BYTES, port=own_server.port).start()
    try:
        time.sleep(s.nc.retry_after_s)
        assert s.batch_set(ks, pages) == [True] * 3            # reconnected to the new server
        assert s.batch_get(ks, out) == [True] * 3 and all(torch.equal(a, b) for a, b in zip(out, pages))
    finally:
        s.close()
        again.kill()


def test_frozen_server_times_out(own_server, tmp_path, keys):
    s = make_store(store_config("nixl-ucx", tmp_path, own_server))
    ks, pages = keys(2), random_pages(2)
    assert s.batch_set(ks, pages) == [True] * 2
    os.kill(own_server.proc.pid, signal.SIGSTOP)
    _wait_stopped(own_server.proc.pid)
    try:
        t0 = time.monotonic()
        assert s.batch_get(ks, [torch.zeros_like(p) for p in pages]) == [False] * 2
        assert time.monotonic() - t0 < s.nc.op_timeout_s + 1.0
        assert s.batch_exists(ks) == 0 and s.stats()["timeouts"] == 1
    finally:
        os.kill(own_server.proc.pid, signal.SIGCONT)
    s.close()


def test_slab_evicts_lru_and_refuses_oversized_pages(own_server, tmp_path, keys):
    s = make_store(store_config("nixl-ucx", tmp_path, own_server))
    ks, pages = keys(9), random_pages(9, numel=1 << 16)          # 8 slots
    for k, p in zip(ks[:8], pages[:8]):
        assert s.batch_set([k], [p]) == [True]
    assert s.batch_get(ks[:1], [torch.empty_like(pages[0])]) == [True]   # key 0 becomes most recent
    assert s.batch_set(ks[8:], pages[8:]) == [True]
    assert s.batch_exists(ks[:1]) == 1 and s.batch_exists(ks[1:2]) == 0 and s.stats()["evictions"] == 1
    big = torch.zeros(SLOT_BYTES, dtype=torch.uint8)
    assert s.batch_set(keys(1, start=100), [big]) == [False]
    s.close()


def test_the_slab_server_holds_bytes_without_torch(own_server, tmp_path, keys):
    """The slab server only holds bytes (numpy), so its process maps no libtorch (~2 s and ~180 MiB a start),
    and pages still round-trip through it."""
    s = make_store(store_config("nixl-ucx", tmp_path, own_server))
    ks, pages = keys(2), random_pages(2)
    assert s.batch_set(ks, pages) == [True, True]
    back = [torch.empty_like(p) for p in pages]
    assert s.batch_get(ks, back) == [True, True] and all(torch.equal(a, b) for a, b in zip(back, pages))
    s.close()
    with open(f"/proc/{own_server.proc.pid}/maps") as f:
        assert "libtorch" not in f.read()
