"""The L3 store contract, the key namespace and the page header every backend stores.

A store maps string keys (``l3_key``) to pages: flat, contiguous CPU tensors, one per L2 host page
(``HostPool.page(p)``). Every operation is a batch:

* ``batch_exists(keys) -> n``: the length of the present prefix (pages of a sequence are looked up in
  chain order, so the first absent page ends the usable hit);
* ``batch_get(keys, pages) -> [bool]``: fills the given tensors in place. False means a miss, whatever
  the reason (absent, I/O error, timeout, failed checksum): a store never raises on a data path and never
  returns True with wrong bytes. The contents of a page reported False are unspecified;
* ``batch_set(keys, pages) -> [bool]``: True when the page is stored and readable;
* ``delete(keys)``, ``clear()``, ``stats()``, ``close()``.

Bad *input* (not a tensor, wrong dtype, ragged batch, a key that is not a str) raises ValueError naming
the field: that is a caller bug, not a cache miss.

Each object is ``HEADER_BYTES`` of header followed by the page bytes. The header carries a magic, the
dtype and size of the page, a digest of the key (an object copied or renamed under another key fails) and
an xxh3-64 checksum over the header fields and the payload, so a torn, truncated, bit-flipped or foreign
object reads as a miss and is counted in ``stats()["corrupt"]``.
"""
from __future__ import annotations

import abc
import functools
import hashlib
import logging
import socket
import struct
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import quote

import numpy as np

if TYPE_CHECKING:
    import torch

try:  # xxh3 runs at memory speed (~11 GB/s here); crc32 (~1.3 GB/s) only if xxhash is missing
    import xxhash

    def _checksum(parts) -> int:
        h = xxhash.xxh3_64()
        for p in parts:
            h.update(p)
        return h.intdigest()

    _ALGO = 1
except ImportError:  # pragma: no cover - exercised only without the dependency
    import zlib

    def _checksum(parts) -> int:
        c = 0
        for p in parts:
            c = zlib.crc32(p, c)
        return c

    _ALGO = 2

log = logging.getLogger("strata.l3")

KEY_PREFIX = "strata/"
MAX_KEY_CHARS = 512
HEADER_BYTES = 64
_MAGIC = b"SL3P"
_VERSION = 1
# magic, version, algo, dtype code, reserved, nbytes, numel, key digest | checksum | padding
_HEAD = struct.Struct("<4sBBBBQQ16s")
_SUM = struct.Struct("<Q")
_PAD = bytes(HEADER_BYTES - _HEAD.size - _SUM.size)

# KV page dtypes. A code, not the dtype's name, goes into the header so the format does not depend on
# torch's spelling; anything else (int64 token ids, float64, bool) is not a KV page and is refused.
_DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "uint8": 4, "int8": 5, "float8_e4m3fn": 6,
                "float8_e5m2": 7}


@functools.cache
def load_torch():
    # On first use, not at import: the storage actor opens stores only to evict, audit and report, and the
    # slab server only holds bytes; neither moves a page, and torch would cost each ~2 s and ~180 MiB.
    import torch
    return torch


@functools.cache
def dtype_codes() -> dict:
    """{torch dtype: header code} of the KV page dtypes."""
    return {getattr(load_torch(), name): code for name, code in _DTYPE_CODES.items()}

STAT_KEYS = ("hits", "misses", "corrupt", "bytes_read", "bytes_written", "sets_ok", "sets_failed",
             "evictions", "timeouts", "errors")

OK, ABSENT, CORRUPT = "ok", "absent", "corrupt"


def l3_key(model_id: str, component: str, page_key: bytes) -> str:
    """The store key of one page. ``model_id`` must name everything that changes a page's bytes (model,
    dtype, page size, L2 layout, tensor-parallel rank...), ``component`` the KV component ("full",
    "swa"). Both are percent-escaped so "a/b"+"c" and "a"+"b/c" stay distinct keys."""
    if not isinstance(page_key, (bytes, bytearray)) or not page_key:
        raise ValueError(f"page_key must be non-empty bytes, got {page_key!r}")
    key = _key_head(model_id, component) if type(model_id) is str and type(component) is str \
        else _check_names(model_id, component)
    key += page_key.hex()
    if len(key) > MAX_KEY_CHARS:
        raise ValueError(f"model_id/component too long: key of {len(key)} chars > {MAX_KEY_CHARS}")
    return key


@functools.lru_cache(maxsize=64)
def _key_head(model_id: str, component: str) -> str:
    """``strata/<model_id>/<component>/``, escaped: the same for every page of a write-through batch, and
    the two ``quote`` calls were ~4 of a key's ~4.2 us (on the engine thread: ~4 keys per short prompt)."""
    return _check_names(model_id, component)


def _check_names(model_id, component) -> str:
    for name, v in (("model_id", model_id), ("component", component)):
        if not isinstance(v, str) or not v:
            raise ValueError(f"{name} must be a non-empty str, got {v!r}")
    return f"{KEY_PREFIX}{quote(model_id, safe='')}/{quote(component, safe='')}/"


def key_digest(key: str) -> bytes:
    """16 bytes naming a key: the file name of its object and the key check in its header."""
    return hashlib.blake2b(key.encode(), digest_size=16, person=b"strata-l3").digest()


def page_bytes(page: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a page's memory (no copy): what file and network I/O read and write."""
    return page.view(load_torch().uint8).numpy()


def encode_header(digest: bytes, page: torch.Tensor) -> bytes:
    head = _HEAD.pack(_MAGIC, _VERSION, _ALGO, dtype_codes()[page.dtype], 0, page.nbytes, page.numel(), digest)
    return head + _SUM.pack(_checksum((head, page_bytes(page)))) + _PAD


def check_header(header, digest: bytes, page: torch.Tensor) -> bool:
    """True iff ``header`` + the bytes now in ``page`` are the object stored under ``digest``'s key."""
    header = bytes(header)
    if len(header) != HEADER_BYTES:
        return False
    magic, version, algo, dtype, _, nbytes, numel, kd = _HEAD.unpack_from(header)
    if (magic != _MAGIC or version != _VERSION or algo != _ALGO or kd != digest
            or dtype != dtype_codes()[page.dtype] or nbytes != page.nbytes or numel != page.numel()):
        return False
    (stored,) = _SUM.unpack_from(header, _HEAD.size)
    return stored == _checksum((header[:_HEAD.size], page_bytes(page)))


def check_host_buffer(buf) -> None:
    """What ``L3Store.register`` takes: a contiguous CPU tensor (an L2 pool's data)."""
    if not isinstance(buf, load_torch().Tensor) or buf.device.type != "cpu" or not buf.is_contiguous():
        raise ValueError("buf must be a contiguous CPU tensor (an L2 pool's data)")


def check_keys(keys) -> list[str]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise ValueError(f"keys must be a list of str, got {type(keys).__name__}")
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not k or len(k) > MAX_KEY_CHARS or not k.isascii() or not k.isprintable():
            raise ValueError(f"keys[{i}] must be a printable ASCII str of 1..{MAX_KEY_CHARS} chars, got {k!r}")
    return list(keys)


def check_pages(keys: list[str], pages, max_page_bytes: int) -> list[torch.Tensor]:
    """One batch is pages of one pool: same dtype and size, flat, contiguous, in host memory."""
    tensor, codes = load_torch().Tensor, dtype_codes()
    if isinstance(pages, tensor) or not isinstance(pages, Sequence):
        raise ValueError(f"pages must be a list of tensors, got {type(pages).__name__}")
    if len(pages) != len(keys):
        raise ValueError(f"pages: {len(pages)} tensors for {len(keys)} keys")
    for i, p in enumerate(pages):
        if not isinstance(p, tensor):
            raise ValueError(f"pages[{i}] must be a torch.Tensor, got {type(p).__name__}")
        if p.device.type != "cpu":
            raise ValueError(f"pages[{i}].device must be cpu (an L2 host page), got {p.device}")
        if p.dtype not in codes:
            raise ValueError(f"pages[{i}].dtype {p.dtype} is not a KV page dtype {sorted(map(str, codes))}")
        if p.dim() != 1 or not p.is_contiguous():
            raise ValueError(f"pages[{i}].shape must be flat and contiguous (HostPool.page), got "
                             f"{tuple(p.shape)} stride {p.stride()}")
        if not 0 < p.nbytes <= max_page_bytes:
            raise ValueError(f"pages[{i}].nbytes must be in (0, {max_page_bytes}], got {p.nbytes}")
        if p.dtype != pages[0].dtype:
            raise ValueError(f"pages[{i}].dtype {p.dtype} differs from pages[0].dtype {pages[0].dtype}")
        if p.numel() != pages[0].numel():
            raise ValueError(f"pages[{i}].numel {p.numel()} differs from pages[0].numel {pages[0].numel()}")
    return list(pages)


class L3Store(abc.ABC):
    """Validation, accounting and the never-raise policy; backends implement the underscored methods."""

    backend = "abstract"
    # Where the pages live, the same string for every client of one store ("" unknown: no other client's
    # writes are taken to be this store's). P/D's decode side compares it with the prefill worker's.
    location = ""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self._stats_lock = threading.Lock()
        self._stats = dict.fromkeys(STAT_KEYS, 0)
        self._closed = False

    # ---- contract ----------------------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[str]) -> int:
        keys = check_keys(keys)
        if not keys or self._closed:
            return 0
        try:
            return max(0, min(int(self._exists(keys)), len(keys)))
        except Exception:  # noqa: BLE001 - a lookup failure is "nothing cached", never a crash
            log.exception("%s: batch_exists failed", self.backend)
            self._count(errors=1)
            return 0

    def batch_get(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        keys = check_keys(keys)
        pages = check_pages(keys, pages, self.cfg.max_page_bytes)
        ok = [False] * len(keys)
        if keys and not self._closed:
            try:
                ok = [bool(x) for x in self._get(keys, pages)]
            except Exception:  # noqa: BLE001
                log.exception("%s: batch_get failed", self.backend)
                self._count(errors=1)
                ok = [False] * len(keys)
        hits = sum(ok)
        self._count(hits=hits, misses=len(ok) - hits, bytes_read=sum(p.nbytes for p, o in zip(pages, ok) if o))
        return ok

    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        keys = check_keys(keys)
        pages = check_pages(keys, pages, self.cfg.max_page_bytes)
        ok = [False] * len(keys)
        if keys and not self._closed:
            try:
                ok = [bool(x) for x in self._set(keys, pages)]
            except Exception:  # noqa: BLE001
                log.exception("%s: batch_set failed", self.backend)
                self._count(errors=1)
                ok = [False] * len(keys)
        done = sum(ok)
        self._count(sets_ok=done, sets_failed=len(ok) - done,
                    bytes_written=sum(p.nbytes for p, o in zip(pages, ok) if o))
        return ok

    def delete(self, keys: Sequence[str]) -> None:
        keys = check_keys(keys)
        if keys and not self._closed:
            try:
                self._delete(keys)
            except Exception:  # noqa: BLE001 - a page that survives a delete is only a stale cache entry
                log.exception("%s: delete failed", self.backend)
                self._count(errors=1)

    def clear(self) -> None:
        """Remove every page of this store (every ``strata/`` key of a shared one)."""
        if not self._closed:
            try:
                self._clear()
            except Exception:  # noqa: BLE001
                log.exception("%s: clear failed", self.backend)
                self._count(errors=1)

    def clear_model(self, model_id: str) -> int:
        """Remove the pages of ``model_id``'s namespace (``l3_key``'s ``strata/<model_id>/`` prefix) and
        nothing else a shared store holds. Returns the objects removed (-1: the store cannot say).
        A backend that cannot tell namespaces apart (a file directory: object names are digests) empties
        what it owns, which is the whole directory: strata gives each cluster its own."""
        l3_key(model_id, "full", b"\0")     # validates model_id
        if self._closed:
            return 0
        try:
            return int(self._clear_prefix(f"{KEY_PREFIX}{quote(model_id, safe='')}/"))
        except Exception:  # noqa: BLE001 - the caller reports a failed clear; the store keeps serving
            log.exception("%s: clear of %s failed", self.backend, model_id)
            self._count(errors=1)
            raise

    def stats(self) -> dict[str, int]:
        """Counters since this store was opened (``STAT_KEYS``); bytes count page bytes, not headers."""
        with self._stats_lock:
            return dict(self._stats)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._close()
            except Exception:  # noqa: BLE001 - closing is best effort
                log.exception("%s: close failed", self.backend)

    def register(self, buf: torch.Tensor) -> None:
        """Register host memory (an L2 pool's ``data``) so pages inside it move without a bounce copy.
        Backends without registration ignore it."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- helpers for backends ------------------------------------------------------------------------
    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                self._stats[k] += v

    def _verify(self, header, digest: bytes, page: torch.Tensor) -> bool:
        if check_header(header, digest, page):
            return True
        self._count(corrupt=1)
        return False

    # ---- backend ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _exists(self, keys: list[str]) -> int: ...

    @abc.abstractmethod
    def _get(self, keys: list[str], pages: list[torch.Tensor]) -> list[bool]: ...

    @abc.abstractmethod
    def _set(self, keys: list[str], pages: list[torch.Tensor]) -> list[bool]: ...

    @abc.abstractmethod
    def _delete(self, keys: list[str]) -> None: ...

    @abc.abstractmethod
    def _clear(self) -> None: ...

    def _clear_prefix(self, prefix: str) -> int:
        """Remove every key starting with ``prefix``; returns how many (-1 unknown)."""
        raise NotImplementedError(f"{self.backend}: clearing one namespace is not supported")

    def _close(self) -> None:
        pass


def host_location(scheme: str, addr: str) -> str:
    """``scheme://addr`` naming one store cluster-wide: a loopback address is this machine's alone."""
    host = addr.rsplit(":", 1)[0].strip("[]")
    local = host in ("localhost", "::1") or host.startswith("127.")
    return f"{scheme}://{socket.gethostname()}/{addr}" if local else f"{scheme}://{addr}"
