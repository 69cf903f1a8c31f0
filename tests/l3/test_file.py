"""The directory stores (file, and nixl which shares its layout): LRU cap, restarts, several processes."""
from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sysconfig
import time

import pytest
import torch

from storage.l3 import HEADER_BYTES, make_store
from storage.l3.base import key_digest
from storage.l3.file import _fileio
from tests.l3.conftest import _nixl_or_skip, random_pages, store_config

NUMEL = 1 << 16                      # 128 KiB bf16 pages
FILE = HEADER_BYTES + 2 * NUMEL      # bytes of one stored page
TICK = 0.02                          # > the kernel's coarse file-timestamp granularity


@pytest.fixture(params=["file", "file-py", "nixl"])
def dir_backend(request):
    """The directory stores: file (its batch system calls compiled, storage/l3/_fileio.c), file-py (the
    same store making them from Python, as where nothing could compile), nixl."""
    if request.param == "nixl":
        _nixl_or_skip()
    if request.param == "file" and _fileio is None:
        pytest.skip("storage/l3/_fileio.c did not compile here (no C compiler): file-py covers the store")
    return request.param


def _open(backend, path, **kw):
    store = make_store(store_config("file" if backend == "file-py" else backend, path, **kw))
    if backend == "file-py":
        store._fileio = None
    return store


def _present(store, ks) -> list[bool]:
    return [store.batch_exists([k]) == 1 for k in ks]


def _fill(store, ks, pages) -> None:
    for k, p in zip(ks, pages):          # one by one, TICK apart: distinct access times
        assert store.batch_set([k], [p]) == [True]
        time.sleep(TICK)


def test_cap_evicts_least_recently_used(dir_backend, tmp_path, keys):
    s = _open(dir_backend, tmp_path, capacity_bytes=4 * FILE + 100)
    ks, pages = keys(5), random_pages(5, numel=NUMEL)
    _fill(s, ks[:4], pages[:4])
    assert s.batch_get(ks[:1], [torch.empty_like(pages[0])]) == [True]   # A becomes the most recent
    time.sleep(TICK)
    assert s.batch_set(ks[4:], pages[4:]) == [True]
    # Down to LOW_WATER (90%) minus the incoming page: B and C (least recent) go, A survives.
    assert _present(s, ks) == [True, False, False, True, True]
    assert s.stats()["evictions"] == 2
    assert s.used_bytes() == 3 * FILE
    assert s.batch_set(ks[:1], [torch.zeros(2 * s.cfg.capacity_bytes, dtype=torch.uint8)]) == [False]
    s.close()


def test_lru_order_and_pages_survive_a_restart(dir_backend, tmp_path, keys):
    ks, pages = keys(5), random_pages(5, numel=NUMEL)
    s = _open(dir_backend, tmp_path, capacity_bytes=4 * FILE + 100)
    _fill(s, ks[:4], pages[:4])
    assert s.batch_get(ks[:1], [torch.empty_like(pages[0])]) == [True]
    s.close()
    time.sleep(TICK)
    s = _open(dir_backend, tmp_path, capacity_bytes=4 * FILE + 100)
    assert s.used_bytes() == 4 * FILE                                    # rebuilt from the directory
    out = [torch.empty_like(p) for p in pages[:4]]
    assert s.batch_get([ks[3]], out[3:]) == [True] and torch.equal(out[3], pages[3])
    time.sleep(TICK)
    assert s.batch_set(ks[4:], pages[4:]) == [True]
    assert _present(s, ks) == [True, False, False, True, True]         # the hit before the restart counts
    s.close()


def test_two_stores_share_one_cap(dir_backend, tmp_path, keys):
    a = _open(dir_backend, tmp_path, capacity_bytes=4 * FILE + 100, rescan_interval_s=0.05)
    b = _open(dir_backend, tmp_path, capacity_bytes=4 * FILE + 100, rescan_interval_s=0.05)
    ks, pages = keys(6), random_pages(6, numel=NUMEL)
    _fill(a, ks[:2], pages[:2])
    _fill(b, ks[2:4], pages[2:4])
    assert b.batch_get(ks[:1], [torch.empty_like(pages[0])]) == [True]   # b's hit on a's page
    time.sleep(0.1)
    _fill(a, ks[4:6], pages[4:6])        # a rescans (its view is stale), sees b's pages and b's hit
    assert sum(_present(a, ks)) * FILE <= a.cfg.capacity_bytes
    assert _present(a, ks)[0] and _present(a, ks)[5]
    a.close()
    b.close()


def test_dead_writers_temp_files_are_removed_on_start(tmp_path):
    sub = tmp_path / "v1" / "ab"
    sub.mkdir(parents=True)
    dead = sub / ".cdef.999999999.0.tmp"          # no such pid
    live = sub / f".cdef.{os.getpid()}.0.tmp"
    dead.write_bytes(b"x")
    live.write_bytes(b"x")
    _open("file", tmp_path).close()
    assert not dead.exists() and live.exists()



def _age_directories(root, seconds: float = 10.0) -> None:
    """Set the fan-out directories' mtimes ``seconds`` back: past RACY_NS, so a rescan may keep their
    listings (a directory changed just now is listed again whatever its mtime)."""
    old = time.time_ns() - int(seconds * 1e9)
    for d in (root / "v1").iterdir():
        os.utime(d, ns=(d.stat().st_atime_ns, old))


@pytest.fixture
def listings(monkeypatch):
    """The directories each rescan lists (storage.l3.file._list calls), in order."""
    import storage.l3.file as file_mod
    seen: list[str] = []
    real = file_mod._list

    def counted(sub, now):
        seen.append(os.path.basename(sub))
        return real(sub, now)
    monkeypatch.setattr(file_mod, "_list", counted)
    return seen


def test_a_rescan_lists_only_the_directories_where_files_came_or_went(dir_backend, tmp_path, keys, listings):
    """The StorageActor's pass every second over an idle store: 256 stats, not one per page. What another
    process writes or deletes is still counted at the next pass."""
    owner = _open(dir_backend, tmp_path, capacity_bytes=64 * FILE)
    other = _open(dir_backend, tmp_path, capacity_bytes=64 * FILE)
    ks, pages = keys(9), random_pages(9, numel=NUMEL)
    assert other.batch_set(ks[:8], pages[:8]) == [True] * 8
    _age_directories(tmp_path)
    dirs = {p.name for p in (tmp_path / "v1").iterdir() if any(p.iterdir())}
    listings.clear()
    owner.refresh()                       # listed once more: they were changed (so possibly racy) at its last rescan
    assert set(listings) >= dirs and owner.used_bytes() == 8 * FILE
    listings.clear()
    for _ in range(3):
        owner.refresh()
        assert owner.evict(0.9, 0.8) == []
    assert listings == [] and owner.used_bytes() == 8 * FILE
    assert other.batch_set(ks[8:], pages[8:]) == [True]          # a new file: its directory's mtime moves
    owner.refresh()
    assert len(listings) == 1 and owner.used_bytes() == 9 * FILE
    listings.clear()
    owner.refresh()                       # changed within RACY_NS: listed again, its mtime the same
    assert len(listings) == 1
    _age_directories(tmp_path)
    owner.refresh()                       # the directory written just now is listed again, then kept
    listings.clear()
    other.delete(ks[:1])
    owner.refresh()
    assert len(listings) == 1 and owner.used_bytes() == 8 * FILE
    owner.close()
    other.close()


def test_a_rescan_counts_directories_that_went_away(dir_backend, tmp_path, keys):
    """Pages gone with their directory (the store removed by hand) are not counted on, even where the
    directory was changed so recently that its listing was not kept."""
    s = _open(dir_backend, tmp_path, capacity_bytes=64 * FILE)
    assert s.batch_set(keys(1), random_pages(1, numel=NUMEL)) == [True]
    s.refresh()
    assert s.used_bytes() == FILE
    shutil.rmtree(tmp_path / "v1")
    s.refresh()
    assert s.used_bytes() == 0
    s.close()


def test_an_eviction_orders_by_hits_its_directories_do_not_show(dir_backend, tmp_path, keys, listings):
    """A hit bumps its file's mtime, not its directory's: the listing an idle rescan kept says the hit page
    is the oldest. The pass that evicts lists everything first, so the hit page stays."""
    owner = _open(dir_backend, tmp_path, capacity_bytes=4 * FILE + 100)
    other = _open(dir_backend, tmp_path, capacity_bytes=64 * FILE)
    ks, pages = keys(5), random_pages(5, numel=NUMEL)
    _fill(other, ks[:4], pages[:4])
    _age_directories(tmp_path)
    owner.refresh()
    owner.refresh()                       # kept: A the least recently used in this listing
    time.sleep(TICK)
    assert other.batch_get(ks[:1], [torch.empty_like(pages[0])]) == [True]   # A becomes the most recent
    time.sleep(TICK)
    listings.clear()
    assert owner.evict(0.5, 0.5) != []    # over half of the cap: down to half
    assert len(listings) == len(list((tmp_path / "v1").iterdir()))   # everything listed
    assert _present(owner, ks[:4]) == [True, False, False, True]
    owner.close()
    other.close()

# ---- several processes -----------------------------------------------------------------------------------
def _versions(ks_n: int):
    return [random_pages(ks_n, numel=NUMEL, seed=s) for s in (11, 22)]


def _writer(path, ks, fillers, v, seconds) -> None:
    torch.set_num_threads(1)
    s = _open("file", path, capacity_bytes=8 * FILE, rescan_interval_s=0.05)
    pages, filler = _versions(len(ks))[v], random_pages(1, numel=NUMEL, seed=v)[0]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s.batch_set(ks, pages)
        s.batch_set(fillers, [filler] * len(fillers))     # churn: keeps the cap evicting
    s.close()


def _reader(path, ks, seconds, out) -> None:
    torch.set_num_threads(1)
    s = _open("file", path, capacity_bytes=8 * FILE, rescan_interval_s=0.05)
    versions = _versions(len(ks))
    bufs = [torch.empty_like(p) for p in versions[0]]
    hits = torn = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for i, ok in enumerate(s.batch_get(ks, bufs)):
            if ok:
                hits += 1
                torn += not any(torch.equal(bufs[i], v[i]) for v in versions)
    out.put((hits, torn, s.stats()["corrupt"]))
    s.close()


def test_processes_never_read_a_torn_page(tmp_path, keys):
    ks, fillers = keys(4), keys(6, component="filler")
    # spawn, not fork: a forked child shares the epoll instances of any UCX (NIXL) endpoint this test
    # process holds from earlier tests, and its clean-up there aborted the parent.
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(tmp_path, ks, fillers[3 * v:3 * v + 3], v, 3.0)) for v in (0, 1)]
    procs.append(ctx.Process(target=_reader, args=(tmp_path, ks, 3.0, out)))
    for p in procs:
        p.start()
    hits, torn, corrupt = out.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert hits > 0 and torn == 0 and corrupt == 0


def test_a_page_already_stored_is_not_written_again(dir_backend, tmp_path, keys):
    """P/D's two workers insert the same prompt: the second set of a key finds the object (same key, same
    bytes) and only bumps its access time; an object of the wrong size is written again."""
    s = _open(dir_backend, tmp_path)
    ks, pages = keys(2), random_pages(2, numel=NUMEL)
    assert s.batch_set(ks, pages) == [True, True]
    paths = sorted(p for p in (tmp_path / "v1").rglob("*") if p.is_file())
    assert len(paths) == 2
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}
    time.sleep(TICK)
    written = s.stats()["bytes_written"]
    assert s.batch_set(ks, pages) == [True, True]
    after = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}
    assert all(after[p][0] == before[p][0] and after[p][1] > before[p][1] for p in paths)   # same file, newer
    assert s.stats()["bytes_written"] - written == 2 * 2 * NUMEL     # counted as stored
    os.truncate(paths[0], FILE // 2)                                 # torn: the next set rewrites it
    assert s.batch_set(ks, pages) == [True, True]
    assert all(p.stat().st_size == FILE for p in paths)
    out = [torch.empty_like(p) for p in pages]
    assert s.batch_get(ks, out) == [True, True] and all(torch.equal(o, p) for o, p in zip(out, pages))
    s.close()


def test_compiled_and_python_system_calls_store_the_same_objects(tmp_path, keys):
    """The compiled batch (storage/l3/_fileio.c) and Python's calls one by one leave the same bytes under
    the same names, each reads the other's, and neither leaves a temp file."""
    if _fileio is None:
        pytest.skip("storage/l3/_fileio.c did not compile here (no C compiler)")
    ks, pages = keys(6), random_pages(6, numel=NUMEL)
    stores = {b: _open(b, tmp_path / b) for b in ("file", "file-py")}
    for b, s in stores.items():
        assert s.batch_set(ks, pages) == [True] * 6
    trees = {b: {p.relative_to(tmp_path / b): p.read_bytes() for p in (tmp_path / b / "v1").rglob("*") if p.is_file()}
             for b in stores}
    assert len(trees["file"]) == 6 and trees["file"] == trees["file-py"]
    for b in stores:   # each directory read by the other path
        other = _open("file-py" if b == "file" else "file", tmp_path / b)
        out = [torch.empty_like(p) for p in pages]
        assert other.batch_get(ks, out) == [True] * 6 and all(torch.equal(o, p) for o, p in zip(out, pages))
        other.close()
    for s in stores.values():
        s.close()


def test_a_page_that_cannot_be_written_is_not_stored_and_leaves_nothing(dir_backend, tmp_path, keys):
    """A page whose fan-out directory is not a directory (here a file in its place) fails alone: False for
    it, an error counted, no temp file left, the batch's other pages stored and readable."""
    s = _open(dir_backend, tmp_path)
    ks, pages = keys(8), random_pages(8, numel=NUMEL)
    fan = {key_digest(k).hex()[:2] for k in ks}
    blocked = sorted(fan)[0]
    (tmp_path / "v1" / blocked).write_bytes(b"not a directory")
    ok = s.batch_set(ks, pages)
    bad = [key_digest(k).hex()[:2] == blocked for k in ks]
    assert ok == [not b for b in bad] and any(bad)
    assert s.stats()["errors"] == sum(bad)
    assert not [p for p in (tmp_path / "v1").rglob(".*.tmp")]
    out = [torch.empty_like(p) for p in pages]
    assert s.batch_get(ks, out) == ok
    assert all(torch.equal(o, p) for o, p, good in zip(out, pages, ok) if good)
    s.close()


def test_the_compiled_batch_refuses_what_is_not_an_item():
    if _fileio is None:
        pytest.skip("storage/l3/_fileio.c did not compile here (no C compiler)")
    with pytest.raises(TypeError):
        _fileio.write_new([("a", b"b", b"", b"")])            # a path as str, not bytes
    with pytest.raises(TypeError):
        _fileio.write_new([(b"a", b"b", b"")])                # three fields
    with pytest.raises(TypeError):
        _fileio.write_new([(b"a", b"b", b"", object())])      # a page without the buffer protocol
    with pytest.raises(TypeError):
        _fileio.present(["/tmp"], 1)
    assert _fileio.write_new([]) == [] and _fileio.present([], 0) == []


def test_a_store_whose_tree_was_removed_writes_it_again(dir_backend, tmp_path, keys):
    """Someone removed the store's directory tree while it ran: the next set makes it again."""
    s = _open(dir_backend, tmp_path)
    ks, pages = keys(3), random_pages(3, numel=NUMEL)
    shutil.rmtree(tmp_path / "v1")
    assert s.batch_set(ks, pages) == [True] * 3
    out = [torch.empty_like(p) for p in pages]
    assert s.batch_get(ks, out) == [True] * 3 and all(torch.equal(o, p) for o, p in zip(out, pages))
    s.close()


@pytest.mark.skipif(not shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]),
                    reason="no C compiler: Python makes the system calls")
def test_the_batch_helper_is_compiled_where_a_compiler_exists():
    """pip builds storage/l3/_fileio.c; a silent fallback would hand the GIL over five times a page."""
    assert _fileio is not None
