"""The embedded L3 store: one file per page under a directory, shared by the processes of one machine.

Layout: ``<path>/v1/<2 hex>/<30 hex>``, the name being the key's digest (so any key maps to a safe file
name, and 256 fan-out directories keep each one small). A file is the page header then the page bytes.

Why it is safe to share:

* writers write a private temp file next to the target and ``os.replace`` it in: a published file is
  never modified again, so a reader that opened it reads one complete version whatever other writers of
  the same key do (the last replace wins, both versions being complete);
* an evicted or deleted file that a reader has open stays readable until closed (POSIX unlink);
* anything else (a crash mid-write with ``fsync`` off, a disk flipping bits) fails the checksum: a miss.

Capacity: an LRU over files by last access. Hits bump the file's mtime, so the order survives restarts
and is shared: each process keeps an in-memory index (rebuilt from the directory on start and on every
eviction pass, which also runs every ``rescan_interval_s`` of writes) and evicts under an flock. With
several writers the cap can be overshot by what the others wrote since the last rescan.

A rescan lists again only the fan-out directories whose mtime moved since their last listing (a file
created, replaced or removed there), so an owner's pass over an idle store costs 256 ``stat`` calls, not
one per page (~3 us each here: 20,000 pages took ~65 ms of CPU a pass, every second in the StorageActor).
What that does not see is a hit's mtime bump, i.e. the LRU order: a pass that evicts lists everything.
"""
from __future__ import annotations

import errno
import fcntl
import itertools
import os
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

try:   # the batch system calls, compiled by the install (storage/l3/_fileio.c); else Python makes them
    from storage.l3 import _fileio
except ImportError:   # pragma: no cover - exercised only without a C compiler
    _fileio = None
from storage.l3.base import HEADER_BYTES, L3Store, encode_header, key_digest, log, page_bytes

LOW_WATER = 0.9            # an eviction pass frees down to this fraction of the cap (amortizes the scan)
STALE_TEMP_S = 3600.0      # a temp file this old belongs to a crashed writer
# A directory whose mtime is this recent may change again within one tick of it (file systems keep mtimes
# to 1 s, or to the kernel's coarse clock): it is listed again at the next rescan, whatever its mtime says.
RACY_NS = 2_000_000_000
FULL_SCAN_S = 60.0         # every directory is listed at least this often (dead writers' temp files)
# A batch goes through the I/O threads only when it moves this much: below it the hand-offs cost more than
# the overlap gains (2-core machine, ext4: 2-32 pages of 8-128 KB took 1.2-2x the CPU and 1.0-1.7x the wall
# time through 4 threads; 8 pages of 1 MiB took 0.7x the wall time).
POOL_MIN_BYTES = 1 << 20
_seq = itertools.count()   # unique temp names across the threads of one process


class FileStore(L3Store):
    backend = "file"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.root = cfg.resolved_path()
        self.location = f"file://{socket.gethostname()}{os.path.realpath(self.root)}"   # a local directory
        self._objdir = os.path.join(self.root, "v1")
        os.makedirs(self._objdir, exist_ok=True)
        self._lock = threading.Lock()              # the index
        self._evict_lock = threading.Lock()        # flock does not exclude threads sharing one fd
        self._lockfd = os.open(os.path.join(self.root, ".evict.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._index: OrderedDict[str, int] = OrderedDict()   # name -> bytes (LRU order as of the last eviction)
        self._used = 0
        self._scanned_at = 0.0
        self._listed: dict[str, tuple[int, list]] = {}   # directory -> (its mtime_ns when listed, its entries)
        self._dirs: set[str] = set()                     # the directories the last rescan found
        self._full_at = float("-inf")                    # monotonic time of the last listing of everything
        threads = cfg.io_threads or min(4, os.cpu_count() or 1)   # more threads than cores only add GIL churn
        self._threads = threads
        self._fileio = _fileio   # the compiled batch system calls (None: Python makes them, one by one)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="l3-file") if threads > 1 else None
        self._rescan()

    # ---- names ---------------------------------------------------------------------------------------
    def _path(self, name: str) -> str:
        return f"{self._objdir}/{name[:2]}/{name[2:]}"

    def _map(self, fn, idx: list[int], page_nbytes: int) -> list:
        if self._pool is None or len(idx) < 2 or len(idx) * page_nbytes < POOL_MIN_BYTES:
            return [fn(i) for i in idx]
        return list(self._pool.map(fn, idx))

    # ---- raw I/O (the NIXL store replaces these two) ---------------------------------------------------
    def _io_read(self, fds: list, headers: np.ndarray, pages: list[torch.Tensor], idx: list[int]) -> list[bool]:
        return self._map(lambda i: _io(os.preadv, fds[i], headers[i], pages[i]), idx, pages[0].nbytes)

    def _io_write(self, fds: list, headers: np.ndarray, pages: list[torch.Tensor], idx: list[int]) -> list[bool]:
        return self._map(lambda i: _io(os.pwritev, fds[i], headers[i], pages[i]), idx, pages[0].nbytes)

    # ---- contract ------------------------------------------------------------------------------------
    def _exists(self, keys: list[str]) -> int:
        for n, k in enumerate(keys):
            if not os.path.exists(self._path(key_digest(k).hex())):
                return n
        return len(keys)

    def _get(self, keys: list[str], pages: list[torch.Tensor]) -> list[bool]:
        n, want = len(keys), HEADER_BYTES + pages[0].nbytes
        digests = [key_digest(k) for k in keys]
        names = [d.hex() for d in digests]
        fds: list = [None] * n
        ok = [False] * n
        try:
            for i, name in enumerate(names):
                try:
                    fd = os.open(self._path(name), os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                except OSError as e:   # unreadable: that page is a miss, the others are still served
                    log.warning("l3 file: %s", e)
                    self._count(errors=1)
                    continue
                fds[i] = fd
                if os.fstat(fd).st_size != want:   # truncated, or not a page of this geometry
                    self._count(corrupt=1)
                    self._drop(name, fd)
                    os.close(fd)
                    fds[i] = None
            idx = [i for i in range(n) if fds[i] is not None]
            headers = np.zeros((n, HEADER_BYTES), np.uint8)
            for i, done in zip(idx, self._io_read(fds, headers, pages, idx) if idx else []):
                if not done:
                    self._count(errors=1)
                elif self._verify(headers[i], digests[i], pages[i]):
                    ok[i] = True
                    _touch(fds[i])
                else:
                    self._drop(names[i], fds[i])
        finally:
            for fd in fds:
                if fd is not None:
                    os.close(fd)
        with self._lock:
            for i in range(n):
                if ok[i]:
                    self._note(names[i], want)
        return ok

    def _set(self, keys: list[str], pages: list[torch.Tensor]) -> list[bool]:
        n, size = len(keys), HEADER_BYTES + pages[0].nbytes
        if size > self.cfg.capacity_bytes:
            return [False] * n
        names = [key_digest(k).hex() for k in keys]
        # A key names its bytes (the chained hash of its tokens, the model, the component), so an object
        # already there is this page: another worker of the cluster wrote it (P/D: the prefill worker, before
        # the decode worker inserts the same prompt). Only its access time is bumped, for the LRU: a stat
        # and a utime instead of creating, writing and renaming a file. A corrupt one fails its checksum
        # when read, is dropped there, and the next set writes it again.
        paths = [os.fsencode(self._path(name)) for name in names]
        ok = _present_many(paths, size, self._fileio)
        idx = [i for i in range(n) if not ok[i]]
        if idx and not self._make_room(size * len(idx)):
            return [False] * n
        headers = {i: encode_header(bytes.fromhex(names[i]), pages[i]) for i in idx}
        if idx:
            for i, done in zip(idx, self._write_new(names, paths, headers, pages, idx)):
                ok[i] = done
        with self._lock:
            for i in range(n):
                if ok[i]:
                    self._note(names[i], size)
        return ok

    def _write_new(self, names: list[str], paths: list[bytes], headers: dict[int, bytes],
                   pages: list[torch.Tensor], idx: list[int]) -> list[bool]:
        """Publish objects ``idx`` (a temp file each, header then page, renamed onto its path): whether
        each is in place. Through the compiled helper, one GIL hand-over per batch (or per I/O thread's
        share of it), unless a subclass does its own raw I/O."""
        fio = self._fileio
        if fio is None or type(self)._io_write is not FileStore._io_write:
            rows = np.zeros((len(names), HEADER_BYTES), np.uint8)
            for i in idx:
                rows[i] = np.frombuffer(headers[i], np.uint8)
            return self._write_new_py(names, rows, pages, idx)
        items = [(os.fsencode(self._temp_path(names[i])), paths[i], headers[i], page_bytes(pages[i])) for i in idx]
        if self._pool is None or len(items) < 2 or len(items) * pages[0].nbytes < POOL_MIN_BYTES:
            errs = fio.write_new(items, self.cfg.fsync)
        else:
            k = -(-len(items) // self._threads)
            parts = [items[j:j + k] for j in range(0, len(items), k)]
            errs = [e for part in self._pool.map(lambda it: fio.write_new(it, self.cfg.fsync), parts)
                    for e in part]
        for e in errs:
            if e:   # e.g. out of inodes: that page is not stored
                log.warning("l3 file: %s", os.strerror(e))
                self._count(errors=1)
        return [not e for e in errs]

    def _write_new_py(self, names: list[str], headers: np.ndarray, pages: list[torch.Tensor],
                      idx: list[int]) -> list[bool]:
        """``_write_new`` from Python: its temp files opened here, their bytes through ``_io_write``."""
        n = len(names)
        ok = [False] * n
        fds: list = [None] * n
        temps: list = [None] * n
        try:
            for i in idx:
                try:
                    temps[i], fds[i] = self._open_temp(names[i])
                except OSError as e:   # e.g. out of inodes: that page is not stored
                    log.warning("l3 file: %s", e)
                    self._count(errors=1)
            opened = [i for i in idx if fds[i] is not None]
            for i, done in zip(opened, self._io_write(fds, headers, pages, opened) if opened else []):
                if done and self.cfg.fsync:
                    os.fsync(fds[i])
                os.close(fds[i])
                fds[i] = None
                if not done:
                    continue
                try:
                    os.replace(temps[i], self._path(names[i]))
                except OSError as e:   # e.g. a concurrent clear() removed the temp file
                    log.warning("l3 file: %s", e)
                    self._count(errors=1)
                    continue
                temps[i] = None
                ok[i] = True
        finally:
            for fd, tmp in zip(fds, temps):
                if fd is not None:
                    os.close(fd)
                if tmp is not None:
                    _unlink(tmp)
        return [ok[i] for i in idx]

    def _delete(self, keys: list[str]) -> None:
        for k in keys:
            name = key_digest(k).hex()
            _unlink(self._path(name))
            with self._lock:
                self._used -= self._index.pop(name, 0)

    def _clear(self) -> None:
        with self._evict_lock:
            fcntl.flock(self._lockfd, fcntl.LOCK_EX)
            try:
                for sub in _subdirs(self._objdir):
                    for e in os.scandir(sub):
                        _unlink(e.path)
                with self._lock:
                    self._index.clear()
                    self._used = 0
            finally:
                fcntl.flock(self._lockfd, fcntl.LOCK_UN)

    def _clear_prefix(self, prefix: str) -> int:
        # File names are key digests, so a namespace cannot be picked out: the directory is this
        # cluster's (the storage actor owns and evicts it), and all of it goes.
        with self._lock:
            before = len(self._index)
        self._rescan()
        with self._lock:
            n = len(self._index)
        self._clear()
        return max(n, before)

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        os.close(self._lockfd)

    def used_bytes(self) -> int:
        """Bytes of the pages this process knows of (exact after a rescan)."""
        with self._lock:
            return self._used

    # ---- LRU -----------------------------------------------------------------------------------------
    def _note(self, name: str, size: int) -> None:
        """Record an access (caller holds ``_lock``)."""
        self._used += size - self._index.get(name, 0)
        self._index[name] = size
        self._index.move_to_end(name)

    def _drop(self, name: str, fd: int) -> None:
        """Remove a corrupt object so the next set rewrites it, unless a writer already replaced it."""
        path = self._path(name)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        except OSError:
            pass
        with self._lock:
            self._used -= self._index.pop(name, 0)

    def _temp_path(self, name: str) -> str:
        """A writer's private temp file beside ``name``'s object (unique across this process's threads)."""
        return f"{self._objdir}/{name[:2]}/.{name[2:]}.{os.getpid()}.{next(_seq)}.tmp"

    def _open_temp(self, name: str):
        final = self._path(name)
        tmp = self._temp_path(name)
        for attempt in range(2):
            try:
                return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:
                if attempt:
                    raise
                os.makedirs(os.path.dirname(final), exist_ok=True)
        raise AssertionError("unreachable")

    def _make_room(self, incoming: int) -> bool:
        """True when ``incoming`` more bytes fit under the cap (evicting if this store may)."""
        cap = self.cfg.capacity_bytes
        with self._lock:
            stale = time.monotonic() - self._scanned_at > self.cfg.rescan_interval_s
            if self._used + incoming <= cap and not stale:
                return True
        if not self.cfg.evict:   # the owner of the directory evicts; refusing keeps the cap
            self._rescan()
            with self._lock:
                return self._used + incoming <= cap
        self._rescan(evict_for=incoming)
        return True

    def refresh(self) -> None:
        """Rebuild the index from the directory now (exact ``used_bytes``), evicting nothing."""
        self._rescan()

    def evict(self, high_water: float, low_water: float) -> list[str]:
        """The evictor of a directory owner (actors/storage.py): rescan and, if more than ``high_water``
        of the cap is used, evict least recently used pages down to ``low_water`` of it. Returns the
        object names (``key_digest(key).hex()``) removed."""
        cap = self.cfg.capacity_bytes
        return self._rescan(evict_for=max(0, int(cap * (1 - high_water))), target=int(cap * low_water))

    def _rescan(self, evict_for: int | None = None, target: int | None = None) -> list[str]:
        """Rebuild the index from the directory (other processes' writes and hits) and, if the cap would
        be exceeded by ``evict_for`` more bytes, evict least recently used files down to ``target`` bytes
        (default: LOW_WATER of the cap less ``evict_for``). Returns the names evicted."""
        cap = self.cfg.capacity_bytes
        gone: list[str] = []
        with self._evict_lock:
            fcntl.flock(self._lockfd, fcntl.LOCK_EX)
            try:
                entries, listed = self._scan()
                with self._lock:
                    fits = evict_for is None or self._used + evict_for <= cap
                    if not listed and fits:   # no file came or went anywhere since the last rescan
                        self._scanned_at = time.monotonic()
                        return gone
                if evict_for is not None and sum(size for _, _, size, _ in entries) + evict_for > cap:
                    entries = self._scan(full=True)[0]   # the access times: a hit bumps its file, not its directory
                    entries.sort()
                with self._lock:
                    self._index = OrderedDict((name, size) for _, name, size, _ in entries)
                    self._used = sum(size for _, _, size, _ in entries)
                    self._scanned_at = time.monotonic()
                if evict_for is None or self._used + evict_for <= cap:
                    return gone
                target = max(0, int(cap * LOW_WATER) - evict_for) if target is None else target
                evicted = 0
                for mtime, name, size, path in entries:
                    if self._used <= target:
                        break
                    try:
                        if os.stat(path).st_mtime_ns == mtime:   # not read or rewritten since the scan
                            os.unlink(path)
                            evicted += 1
                            gone.append(name)
                    except OSError:
                        pass
                    with self._lock:
                        self._used -= self._index.pop(name, 0)
                self._count(evictions=evicted)
            finally:
                fcntl.flock(self._lockfd, fcntl.LOCK_UN)
        return gone

    def _scan(self, full: bool = False) -> tuple[list[tuple[int, str, int, str]], int]:
        """Every page file as (mtime_ns, name, bytes, path), and how many directories were listed for it. A
        directory whose mtime is the one it had when it was last listed keeps that listing (unless ``full``,
        or FULL_SCAN_S has passed): the set of files and their sizes are exact, their mtimes may be older
        than a later hit left them. Caller holds ``_evict_lock``."""
        now, out, listed, fresh, seen = time.time_ns(), [], {}, 0, set()
        if full or time.monotonic() - self._full_at > FULL_SCAN_S:
            full, self._full_at = True, time.monotonic()
        for sub in _subdirs(self._objdir):
            try:
                mtime = os.stat(sub).st_mtime_ns   # before the listing: a change during it moves the mtime
            except OSError:
                continue
            seen.add(sub)
            known = None if full else self._listed.get(sub)
            if known is not None and known[0] == mtime:
                entries = known[1]
            else:
                entries, fresh = _list(sub, now / 1e9), fresh + 1
            if now - mtime > RACY_NS:
                listed[sub] = (mtime, entries)
            out += entries
        fresh += len(self._dirs - seen)   # directories removed, with their files
        self._listed, self._dirs = listed, seen
        return out, fresh


# ---- small OS helpers -------------------------------------------------------------------------------
def _io(call, fd: int, header: np.ndarray, page: torch.Tensor) -> bool:
    """Header then page in one preadv/pwritev (looping over short transfers); False on any OS error."""
    views = [memoryview(header).cast("B"), memoryview(page_bytes(page)).cast("B")]
    want, off = HEADER_BYTES + page.nbytes, 0
    try:
        while views:
            n = call(fd, views, off)
            if n <= 0:
                break
            off += n
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]
    except OSError as e:
        log.warning("l3 file: %s", e)
        return False
    return off == want


def _present_many(paths: list[bytes], size: int, fileio=None) -> list[bool]:
    """``_present`` of each path (through the compiled helper ``fileio``: one GIL hand-over for all)."""
    if fileio is None:
        return [_present(p, size) for p in paths]
    return fileio.present(paths, size)


def _present(path: str | bytes, size: int) -> bool:
    """Whether a complete-sized object is at ``path``; if so its access time is bumped (the LRU clock)."""
    try:
        if os.stat(path).st_size != size:
            return False
        os.utime(path)
    except OSError:   # absent, or evicted between the two calls: write it
        return False
    return True


def _touch(fd: int) -> None:
    try:
        os.utime(fd)            # the LRU clock other processes and the next start see
    except OSError as e:        # a read-only store still serves hits
        log.debug("l3 file: cannot touch: %s", e)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        pass


def _list(sub: str, now: float) -> list[tuple[int, str, int, str]]:
    """The page files of fan-out directory ``sub``; a dead writer's temp file there is removed."""
    out, prefix = [], os.path.basename(sub)
    for e in os.scandir(sub):
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if e.name.startswith("."):
            if _stale_temp(e.name, st.st_mtime, now):
                _unlink(e.path)
            continue
        out.append((st.st_mtime_ns, prefix + e.name, st.st_size, e.path))
    return out


def _subdirs(objdir: str) -> list[str]:
    try:
        return [e.path for e in os.scandir(objdir) if e.is_dir(follow_symlinks=False) and len(e.name) == 2]
    except FileNotFoundError:
        return []


def _stale_temp(name: str, mtime: float, now: float) -> bool:
    """A temp file is garbage when its writer is dead or it is older than any write could take."""
    parts = name.split(".")
    try:
        os.kill(int(parts[2]), 0)
    except (IndexError, ValueError):
        return True
    except OSError as e:
        if e.errno == errno.ESRCH:
            return True
    return now - mtime > STALE_TEMP_S
