"""The L3 store contract, run against every backend (file, mooncake against a real master, nixl)."""
from __future__ import annotations

import dataclasses
import os
import threading

import pytest
import torch

from storage.host import HostPool
from storage.kernels_path import transfer
from storage.l3 import HEADER_BYTES, STAT_KEYS, L3Config, l3_key, make_store
from storage.l3.base import key_digest
from storage.pools import KVPool
from tests.l3.conftest import random_pages


def _slab_io(store, op: str, buf: torch.Tensor, addr: int) -> None:
    """A raw one-sided UCX transfer between ``buf`` and the slab server's memory at ``addr``."""
    from storage.l3.nixl import wait_xfer

    a = store._agent
    reg = a.register_memory([(buf.data_ptr(), buf.nbytes, 0, "")], "DRAM", ["UCX"])
    try:
        assert wait_xfer(store, op, a.get_xfer_descs([(buf.data_ptr(), buf.nbytes, 0)], "DRAM"),
                         a.get_xfer_descs([(addr, buf.nbytes, 0)], "DRAM"), store._remote, ["UCX"], 5.0)
    finally:
        a.deregister_memory(reg, ["UCX"])


def corrupt(store, key: str, how: str) -> None:
    """Damage the stored object of ``key`` behind the store's back."""
    if store.backend == "nixl" and store.cfg.nixl.mode == "ucx":
        slot, base, slot_bytes = store.slot_of(key)
        assert slot >= 0
        blob = torch.zeros(slot_bytes, dtype=torch.uint8)
        _slab_io(store, "READ", blob, base + slot * slot_bytes)
        if how == "flip":
            blob[HEADER_BYTES + 100] ^= 0x40
        elif how == "header":
            blob[8:24] = 0
        elif how == "truncate":   # a slot has a fixed size: zero the tail instead
            blob[HEADER_BYTES + 64:] = 0
        _slab_io(store, "WRITE", blob, base + slot * slot_bytes)
        return
    if store.backend == "mooncake":
        raw = store.raw
        blob = bytearray(raw.get(key))
        assert len(blob) > HEADER_BYTES
        if how == "flip":
            blob[HEADER_BYTES + len(blob) // 3] ^= 0x40
        elif how == "header":
            blob[8:24] = bytes(16)
        elif how == "truncate":
            blob = blob[:len(blob) // 2]
        assert raw.remove(key, True) == 0
        assert raw.put(key, bytes(blob)) == 0
        return
    path = store._path(key_digest(key).hex())
    with open(path, "r+b") as f:
        if how == "flip":
            size = os.fstat(f.fileno()).st_size
            f.seek(HEADER_BYTES + (size - HEADER_BYTES) // 3)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x40]))
        elif how == "header":
            f.seek(8)
            f.write(bytes(16))
        elif how == "truncate":
            f.truncate(os.fstat(f.fileno()).st_size // 2)


def host_pool(layout: str, dtype, pages: int = 6) -> HostPool:
    l1 = KVPool("full", [0, 1, 2], num_pages=1, page_size=4, num_kv_heads=2, head_dim=8, dtype=dtype, device="cpu")
    return HostPool(l1, pages, layout)


@pytest.mark.parametrize("layout", transfer.LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_roundtrip_host_layouts(store, keys, layout, dtype):
    src, dst = host_pool(layout, dtype), host_pool(layout, dtype)
    src.data.copy_(torch.randn(src.data.shape).to(dtype))
    store.register(src.data)
    store.register(dst.data)
    ks = keys(src.num_pages, component=f"{layout}-{dtype}")
    assert store.batch_set(ks, [src.page(p) for p in range(src.num_pages)]) == [True] * src.num_pages
    if layout == transfer.PAGE_FIRST_DIRECT:
        # page() is a view: the store fills the pool in place (zero-copy into registered memory)
        assert store.batch_get(ks, [dst.page(p) for p in range(dst.num_pages)]) == [True] * dst.num_pages
    else:
        bufs = [torch.empty_like(src.page(0)) for _ in range(dst.num_pages)]
        assert store.batch_get(ks, bufs) == [True] * dst.num_pages
        for p, b in enumerate(bufs):
            dst.set_page(p, b)
    assert torch.equal(dst.data, src.data)
    s = store.stats()
    assert s["hits"] == src.num_pages and s["bytes_read"] == s["bytes_written"] == src.num_pages * src.page_bytes


def test_exists_is_a_prefix(store, keys):
    ks = keys(5)
    pages = random_pages(5)
    assert store.batch_exists(ks) == 0
    assert store.batch_set([ks[0], ks[1], ks[3]], [pages[0], pages[1], pages[3]]) == [True] * 3
    assert store.batch_exists(ks) == 2
    assert store.batch_exists(ks[:2]) == 2
    assert store.batch_exists([ks[3]]) == 1
    assert store.batch_exists([ks[2], ks[3]]) == 0
    assert store.batch_exists([]) == 0


def test_miss_and_partial_batch(store, keys):
    ks, pages = keys(4), random_pages(4)
    assert store.batch_set(ks[:2], pages[:2]) == [True, True]
    out = [torch.zeros_like(p) for p in pages]
    assert store.batch_get(ks, out) == [True, True, False, False]
    assert torch.equal(out[0], pages[0]) and torch.equal(out[1], pages[1])
    s = store.stats()
    assert (s["hits"], s["misses"], s["corrupt"]) == (2, 2, 0)
    assert set(s) == set(STAT_KEYS)


def test_models_and_components_never_collide(store):
    pk = bytes(range(16))
    a, b, c = l3_key("model-a", "full", pk), l3_key("model-b", "full", pk), l3_key("model-a", "swa", pk)
    assert len({a, b, c, l3_key("a/b", "c", pk), l3_key("a", "b/c", pk)}) == 5
    page = random_pages(1)[0]
    assert store.batch_set([a], [page]) == [True]
    out = torch.zeros_like(page)
    assert store.batch_get([b], [out]) == [False] and store.batch_get([c], [out]) == [False]
    assert store.batch_exists([b]) == 0


@pytest.mark.parametrize("how", ["flip", "header", "truncate"])
def test_corrupt_object_is_a_counted_miss(store, keys, how):
    ks, pages = keys(3), random_pages(3, seed=1)
    assert store.batch_set(ks, pages) == [True] * 3
    corrupt(store, ks[1], how)
    out = [torch.zeros_like(p) for p in pages]
    assert store.batch_get(ks, out) == [True, False, True]
    assert torch.equal(out[0], pages[0]) and torch.equal(out[2], pages[2])
    assert store.stats()["corrupt"] == 1
    # The bad object was dropped, so the next write stores a good copy again.
    assert store.batch_set(ks[1:2], pages[1:2]) == [True]
    assert store.batch_get(ks[1:2], out[1:2]) == [True] and torch.equal(out[1], pages[1])


def test_geometry_mismatch_is_a_miss(store, keys):
    ks = keys(1)
    assert store.batch_set(ks, random_pages(1, numel=4096)) == [True]
    assert store.batch_get(ks, [torch.zeros(2048, dtype=torch.bfloat16)]) == [False]
    assert store.batch_get(ks, [torch.zeros(2048, dtype=torch.float32)]) == [False]   # same bytes, other dtype


def test_delete_and_clear(store, keys):
    ks, pages = keys(4), random_pages(4)
    assert all(store.batch_set(ks, pages))
    store.delete(ks[1:2])
    assert store.batch_exists(ks) == 1
    store.clear()
    assert store.batch_exists(ks) == 0
    assert store.batch_get(ks[:1], [torch.zeros_like(pages[0])]) == [False]


def test_concurrent_threads_never_see_a_torn_page(store, keys):
    ks = keys(4)
    versions = [random_pages(4, numel=1 << 16, seed=s) for s in (1, 2)]
    assert all(store.batch_set(ks, versions[0]))
    stop, seen, bad = threading.Event(), [0], []

    def writer(v):
        while not stop.is_set():
            store.batch_set(ks, versions[v])
            store.delete(ks[3:])

    def reader():
        out = [torch.empty_like(p) for p in versions[0]]
        for _ in range(40):
            for i, ok in enumerate(store.batch_get(ks, out)):
                if ok:
                    seen[0] += 1
                    if not any(torch.equal(out[i], v[i]) for v in versions):
                        bad.append(i)

    threads = [threading.Thread(target=writer, args=(v,)) for v in (0, 1)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    threads[2].join()
    stop.set()
    for t in threads[:2]:
        t.join()
    assert not bad and seen[0] > 0


def test_bad_input_names_the_field(store, keys):
    ks = keys(2)
    good = random_pages(2)
    cases = [
        ([torch.zeros(4096, dtype=torch.int64)] * 2, r"pages\[0\]\.dtype"),
        ([good[0], torch.zeros(100, dtype=torch.bfloat16)], r"pages\[1\]\.numel"),
        ([good[0], good[1].float()], r"pages\[1\]\.dtype"),
        ([good[0].view(64, 64), good[1]], r"pages\[0\]\.shape"),
        ([good[0][::2], good[1][::2]], r"pages\[0\]\.shape"),
        ([good[0], "x"], r"pages\[1\] must be a torch.Tensor"),
        (good[:1], r"pages: 1 tensors for 2 keys"),
        ([torch.zeros(0, dtype=torch.bfloat16)] * 2, r"pages\[0\]\.nbytes"),
    ]
    for pages, match in cases:
        with pytest.raises(ValueError, match=match):
            store.batch_set(ks, pages)
        with pytest.raises(ValueError, match=match):
            store.batch_get(ks, pages)
    with pytest.raises(ValueError, match=r"keys\[1\]"):
        store.batch_get([ks[0], b"raw"], good)
    with pytest.raises(ValueError, match="keys must be a list"):
        store.batch_exists(ks[0])
    with pytest.raises(ValueError, match=r"pages\[0\]\.nbytes"):
        store.batch_set(ks[:1], [torch.zeros(store.cfg.max_page_bytes // 2 + 1, dtype=torch.bfloat16)])
    assert store.stats()["errors"] == 0


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="backend"):
        L3Config(backend="s3")
    with pytest.raises(ValueError, match="capacity_bytes"):
        L3Config(capacity_bytes=0)
    with pytest.raises(ValueError, match="master_addr"):
        L3Config(backend="mooncake", mooncake=dict(master_addr="nohost"))
    with pytest.raises(ValueError, match="protocol"):
        L3Config(mooncake=dict(protocol="udp"))
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['bogus'\]"):
        L3Config(nixl=dict(bogus=1))
    with pytest.raises(ValueError, match="op_timeout_s"):
        L3Config(mooncake=dict(op_timeout_s=0))
    with pytest.raises(ValueError, match="cfg must be an L3Config"):
        make_store({"backend": "file"})
    with pytest.raises(ValueError, match="model_id"):
        l3_key("", "full", b"k")
    with pytest.raises(ValueError, match="page_key"):
        l3_key("m", "full", "not-bytes")
    assert L3Config(path=str(tmp_path)).resolved_path() == str(tmp_path)


def test_clients_of_one_store_name_one_location(open_store, tmp_path):
    """P/D's decode worker skips offloading what the prefill worker wrote through to the same store
    (engine/disagg.py): two clients of one store name the same location, a directory elsewhere another."""
    a, b = open_store(), open_store()
    assert a.location and b.location == a.location
    if a.backend == "file" or (a.backend == "nixl" and a.cfg.nixl.mode != "ucx"):
        elsewhere = make_store(dataclasses.replace(a.cfg, path=str(tmp_path / "elsewhere")))
        try:
            assert elsewhere.location and elsewhere.location != a.location
        finally:
            elsewhere.close()


def test_a_loopback_store_address_is_this_machines_alone():
    import socket
    from storage.l3.base import host_location
    assert host_location("mooncake", "127.0.0.1:50051") == f"mooncake://{socket.gethostname()}/127.0.0.1:50051"
    assert host_location("mooncake", "10.0.0.7:50051") == "mooncake://10.0.0.7:50051"
