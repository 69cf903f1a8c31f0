"""Mooncake failure behaviour against a real mooncake_master: killed, frozen, restarted, absent."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from storage.l3 import make_store
from tests.l3.conftest import random_pages, store_config
from tests.l3.test_nixl import _wait_stopped


@pytest.fixture
def own_master(mooncake_master, tmp_path):
    """A master of this test alone (the session one must survive); needs the session one to exist
    only to reuse its skip logic."""
    from storage.l3.mooncake import MooncakeMaster

    m = MooncakeMaster(log_path=str(tmp_path / "master.log")).start()
    yield m
    m.kill()


def _wait_until(fn, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if fn():
            return True
        time.sleep(0.1)
    return False


def test_killed_master_means_misses_then_recovery(own_master, tmp_path, keys):
    s = make_store(store_config("mooncake", tmp_path, own_master))
    ks, pages = keys(4), random_pages(4)
    out = [torch.zeros_like(p) for p in pages]
    assert s.batch_set(ks, pages) == [True] * 4
    own_master.kill()
    t0 = time.monotonic()
    assert s.batch_get(ks, out) == [False] * 4
    assert s.batch_exists(ks) == 0
    assert s.batch_set(keys(2, start=10), pages[:2]) == [False, False]
    s.delete(ks)
    s.clear()
    assert time.monotonic() - t0 < 3 * s.mc.op_timeout_s
    assert s.stats()["sets_failed"] == 2 and s.stats()["hits"] == 0
    # A new master on the same address: the client reconnects and remounts its segment; the old
    # master's objects are gone, so everything starts as a miss.
    from storage.l3.mooncake import MooncakeMaster

    again = MooncakeMaster(port=own_master.port, log_path=str(tmp_path / "master2.log")).start()
    try:
        assert _wait_until(lambda: s.batch_set(ks[:1], pages[:1]) == [True], 15.0)
        assert s.batch_get(ks, out) == [True, False, False, False] and torch.equal(out[0], pages[0])
        s.close()
    finally:
        again.kill()


def test_frozen_master_times_out_instead_of_hanging(own_master, tmp_path, keys):
    s = make_store(store_config("mooncake", tmp_path, own_master))
    ks, pages = keys(3), random_pages(3)
    assert s.batch_set(ks, pages) == [True] * 3
    os.kill(own_master.proc.pid, signal.SIGSTOP)          # accepts nothing, answers nothing
    _wait_stopped(own_master.proc.pid)
    try:
        t0 = time.monotonic()
        assert s.batch_exists(ks) == 0
        took = time.monotonic() - t0
        assert s.mc.op_timeout_s * 0.9 <= took < s.mc.op_timeout_s + 1.0
        t0 = time.monotonic()                              # the breaker is open: no second wait
        assert s.batch_get(ks, [torch.zeros_like(p) for p in pages]) == [False] * 3
        assert s.batch_set(ks, pages) == [False] * 3
        assert time.monotonic() - t0 < 0.2
        assert s.stats()["timeouts"] == 1
    finally:
        os.kill(own_master.proc.pid, signal.SIGCONT)
    out = [torch.zeros_like(p) for p in pages]
    assert _wait_until(lambda: s.batch_get(ks, out) == [True] * 3, 15.0)
    assert all(torch.equal(a, b) for a, b in zip(out, pages))
    s.close()


def test_absent_master_fails_fast_at_open(mooncake_master, tmp_path):
    from storage.l3.mooncake import MooncakeMaster
    from storage.ports import free_port

    class Nowhere:
        addr = f"127.0.0.1:{free_port()}"

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="unreachable"):
        make_store(store_config("mooncake", tmp_path, Nowhere))
    assert time.monotonic() - t0 < 5
    assert MooncakeMaster  # the session master fixture proves the binary runs here


def test_zero_copy_from_registered_pool(mooncake_master, tmp_path, keys):
    """Pages inside a registered pool need no per-call registration; outside ones are pinned per call."""
    s = make_store(store_config("mooncake", tmp_path, mooncake_master))
    pool = torch.randn(4, 4096).to(torch.bfloat16)
    s.register(pool)
    s.register(pool)                                        # idempotent
    ks = keys(4)
    assert s.batch_set(ks, list(pool)) == [True] * 4
    back = torch.zeros_like(pool)
    s.register(back)
    assert s.batch_get(ks, list(back)) == [True] * 4 and torch.equal(back, pool)
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        s.register(pool.t())
    s.close()


_WRITER = """
import sys, torch
from storage.l3 import L3Config, make_store
from tests.l3.conftest import random_pages
addr, n, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
s = make_store(L3Config(backend="mooncake", capacity_bytes=64 << 20, mooncake=dict(master_addr=addr)))
from storage.l3 import l3_key
ks = [l3_key(model, "full", i.to_bytes(16, "big")) for i in range(n)]
print(sum(s.batch_set(ks, random_pages(n, seed=7))), flush=True)
sys.stdin.readline()          # keep the segment mounted until the reader is done
s.close()
"""


def test_pages_move_between_processes(own_master, tmp_path):
    """A second client process writes; the master places the objects in either client's segment, so
    reading them all here exercises the transfer engine over TCP, not only a local copy."""
    import subprocess
    import sys

    from storage.l3 import l3_key

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    n, model = 16, f"xproc-{os.getpid()}"
    reader = make_store(store_config("mooncake", tmp_path, own_master))   # mounts its segment first
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, own_master.addr, str(n), model], cwd=root,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONPATH=root))
    try:
        assert proc.stdout.readline().strip() == str(n)
        ks = [l3_key(model, "full", i.to_bytes(16, "big")) for i in range(n)]
        out = [torch.zeros_like(p) for p in random_pages(n, seed=7)]
        where = reader.raw.batch_get_replica_desc(ks)
        endpoints = {where[k][0].get_memory_descriptor().buffer_descriptor.transport_endpoint for k in ks}
        assert len(endpoints) == 2          # both clients' segments hold pages: some reads cross processes
        assert reader.batch_get(ks, out) == [True] * n
        assert all(torch.equal(a, b) for a, b in zip(out, random_pages(n, seed=7)))
    finally:
        proc.communicate("done\n", timeout=30)
        reader.close()


def test_pages_follow_the_preferred_segment_and_outlive_their_writer(own_master, tmp_path, keys):
    # A worker's client (small segment) writes into the storage actor's segment; when that actor restarts
    # with a new segment the worker switches (prefer_segment): its pages still outlive it.
    MiB = 1 << 20
    owners = [make_store(store_config("mooncake", tmp_path, own_master, mooncake={"segment_bytes": 64 * MiB}))
              for _ in range(2)]
    w = make_store(store_config("mooncake", tmp_path, own_master, mooncake={
        "segment_bytes": 16 * MiB, "preferred_segment": owners[0].segment_name()}))
    page = random_pages(1, numel=512 * 1024)[0]   # 1 MiB
    try:
        for i, owner in enumerate(owners):
            w.prefer_segment(owner.segment_name())
            assert w.preferred_segment == owner.segment_name()
            ks = keys(24, start=100 * i)
            assert w.batch_set(ks, [page] * 24) == [True] * 24   # 24 MiB: more than the writer's segment
            assert owner.present(ks) == [True] * 24
        w.close()   # its segment is gone: whatever it held is lost
        out = [torch.zeros_like(page) for _ in range(24)]
        for i, owner in enumerate(owners):
            assert owner.batch_get(keys(24, start=100 * i), out) == [True] * 24 and torch.equal(out[23], page)
    finally:
        for o in owners:
            o.close()
