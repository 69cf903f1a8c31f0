"""The page hash chain: the one definition of a KV page key, shared by the radix tree and the router.

Page ``i`` of a sequence has key ``h_i = H(h_{i-1} || bytes(tokens of page i))`` where ``h_{-1}`` is a
root derived from a seed and an optional per-tenant salt. So a key names a page *and its whole prefix*:
two sequences share key ``h_i`` iff they share the first ``(i + 1) * page_size`` tokens (and the seed and
salt). Only full pages get keys; a trailing partial page has none until it fills.

Encoding (stable across processes, platforms and Python versions):

* ``H`` is BLAKE2b with a 16-byte digest and a fixed personalization string;
* token ids are encoded as little-endian int64, ``page_size`` of them per page (the page size is thus
  implicit in the byte length, so chains of different page sizes never collide);
* the root is BLAKE2b over a tagged, length-prefixed encoding of the seed and the salt, so that
  ``(seed="a", salt="bc")`` and ``(seed="ab", salt="c")`` differ, and "no salt" differs from ``salt=b""``.
"""
from __future__ import annotations

import array
import functools
import hashlib
import struct
import sys
from typing import Iterable, Sequence, Union

KEY_BYTES = 16
"""Length of a page key in bytes."""

DEFAULT_SEED = b"strata/page-hash/v1"
"""Seed of every chain unless the deployment picks another; bump the suffix to invalidate all keys."""

_ROOT_PERSON = b"strata-root"
_PAGE_PERSON = b"strata-page"
_INT64_MAX = 2**63 - 1

Seed = Union[bytes, str, int]
Tokens = Union[Sequence[int], Iterable[int]]


def _tagged(value: Seed | None, what: str) -> bytes:
    """Canonical, unambiguous bytes for a seed or salt: one type tag, an 8-byte length, the payload."""
    if value is None:
        return b"N"
    if isinstance(value, bool):
        raise TypeError(f"{what} must be bytes, str or int, not bool")
    if isinstance(value, (bytes, bytearray, memoryview)):
        tag, payload = b"B", bytes(value)
    elif isinstance(value, str):
        tag, payload = b"S", value.encode("utf-8")
    elif isinstance(value, int):
        tag, payload = b"I", str(value).encode("ascii")
    else:
        raise TypeError(f"{what} must be bytes, str or int, got {type(value).__name__}")
    return tag + len(payload).to_bytes(8, "little") + payload


def root_key(seed: Seed = DEFAULT_SEED, salt: Seed | None = None) -> bytes:
    """The chain root ``h_{-1}`` (KEY_BYTES bytes). A different salt gives a disjoint key space."""
    if isinstance(seed, (bytearray, memoryview)) or isinstance(salt, (bytearray, memoryview)):
        return _root_key(seed, salt)  # unhashable: not cached
    return _cached_root_key(seed, salt)


def _root_key(seed: Seed, salt: Seed | None) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_ROOT_PERSON)
    h.update(_tagged(seed, "seed"))
    h.update(_tagged(salt, "salt"))
    return h.digest()


# typed: True and 1 are equal keys to a plain cache, but only one of them is a valid seed.
_cached_root_key = functools.lru_cache(maxsize=64, typed=True)(_root_key)


def _check_page_size(page_size: int) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    return page_size


def _check_key(key: bytes, what: str = "parent") -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise ValueError(f"{what} must be a {KEY_BYTES}-byte page key, got {key!r}")
    return bytes(key)


def _int64s(tokens: Tokens) -> array.array:
    """Token ids as an ``array('q')``, converting only what must be: an int64 array or buffer (numpy)
    is taken as is, anything else goes through one list."""
    if isinstance(tokens, array.array) and tokens.typecode == "q":
        return tokens
    if not isinstance(tokens, (list, tuple)):
        try:
            view = memoryview(tokens)
        except TypeError:
            view = None
        if view is not None and view.ndim == 1 and view.itemsize == 8 and view.format in ("q", "l", "<q", "<l"):
            out = array.array("q")
            out.frombytes(view.tobytes())
            return out
        tokens = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    try:
        # array() packs a list of ints in C; it rejects floats and bools pass as ints, like index().
        return array.array("q", tokens)
    except TypeError as e:
        raise TypeError(f"token ids must be integers: {e}") from None
    except OverflowError:
        bad = next(t for t in tokens if t < 0 or t > _INT64_MAX)
        raise ValueError(f"token id {bad} outside [0, 2**63)") from None


# Every byte value with the top bit clear: deleting them from the high bytes of little-endian int64s
# leaves something iff an id is negative (a C-speed scan, where min() boxes every id).
_NON_NEGATIVE_TOP = bytes(range(128))


def encode_tokens(tokens: Tokens) -> bytes:
    """Token ids -> little-endian int64 bytes (8 bytes per token).

    Accepts any iterable of integers, or a torch/numpy array (anything with ``tolist()``). Raises
    ValueError for ids outside [0, 2**63) and TypeError for non-integers (floats are not token ids).
    """
    if type(tokens) is list and _LITTLE:
        # struct packs a list of ints about twice as fast as array(); anything it refuses (floats,
        # ids past int64) takes the general path below for the precise error.
        try:
            enc = struct.pack(f"<{len(tokens)}q", *tokens)
        except struct.error:
            enc = None
        if enc is not None:
            if enc[7::8].translate(None, _NON_NEGATIVE_TOP):
                raise ValueError(f"token id {next(t for t in tokens if t < 0)} outside [0, 2**63)")
            return enc
    packed = _int64s(tokens)
    if sys.byteorder != "little":
        packed = array.array("q", packed)
        packed.byteswap()
    enc = packed.tobytes()
    if enc[7::8].translate(None, _NON_NEGATIVE_TOP):
        bad = next(t for t in packed if t < 0) if sys.byteorder == "little" else "< 0"
        raise ValueError(f"token id {bad} outside [0, 2**63)")
    return enc


_LITTLE = sys.byteorder == "little"
_PAGE_HASHER = hashlib.blake2b(digest_size=KEY_BYTES, person=_PAGE_PERSON)


def _chain(parent: bytes, encoded: bytes, page_bytes: int, n_pages: int) -> list[bytes]:
    out: list[bytes] = []
    h = parent
    # Copying a configured hasher is several times cheaper than building one with its parameters.
    copy, append = _PAGE_HASHER.copy, out.append
    for a in range(0, n_pages * page_bytes, page_bytes):
        x = copy()
        x.update(h)
        x.update(encoded[a:a + page_bytes])
        h = x.digest()
        append(h)
    return out


try:
    from storage._hashing import chain_ids as _c_chain_ids
except ImportError:   # built without a C compiler: the same ids from hashlib, slower
    _c_chain_ids = None
COMPILED = _c_chain_ids is not None


def block_id(key: bytes) -> int:
    """A page key's block id on the KV-event wire: its first 8 bytes, big-endian, as an unsigned int
    (storage/kv_events/translate.block_hash)."""
    return int.from_bytes(key[:8], "big")


def _chain_start(seed: Seed, salt: Seed | None, parent: bytes | None) -> bytes:
    """The key a chain continues from: ``parent``'s (which already encodes seed and salt), else the root."""
    if parent is None:
        return root_key(seed, salt)
    if salt is not None:
        raise ValueError("parent already encodes the salt; pass one of parent / salt")
    return _check_key(parent)


def page_ids(tokens: Tokens, page_size: int, *, seed: Seed = DEFAULT_SEED, salt: Seed | None = None,
             parent: bytes | None = None, num_pages: int | None = None) -> list[int]:
    """``[block_id(k) for k in page_keys(tokens, page_size, ...)]`` (same arguments, same errors),
    computed without the keys' bytes objects: the compiled chain (storage/_hashing.c) for a list of ints,
    else hashlib with the ids unpacked in one call. ``num_pages``: only the first ones (at most
    ``len(tokens) // page_size``; the ids of ``tokens[:num_pages * page_size]``, without the slice)."""
    _check_page_size(page_size)
    start = _chain_start(seed, salt, parent)
    if num_pages is not None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be an int >= 0, got {num_pages!r}")
        if num_pages * page_size < len(tokens):
            if _c_chain_ids is not None and type(tokens) is list and num_pages <= len(tokens) // page_size:
                ids = _c_chain_ids(start, tokens, page_size, num_pages, _PAGE_PERSON)
                if ids is not None:
                    return ids
            tokens = list(tokens)[:num_pages * page_size]
    if _c_chain_ids is not None and type(tokens) is list:
        ids = _c_chain_ids(start, tokens, page_size, len(tokens) // page_size, _PAGE_PERSON)
        if ids is not None:
            return ids
        # an id that is not an int in [0, 2**63): the Python path raises the precise error
    enc = encode_tokens(tokens)
    n_pages = len(enc) // (8 * page_size)
    return _ids(_chain(start, enc, 8 * page_size, n_pages))


def _ids(keys: list[bytes]) -> list[int]:
    """The block ids of ``keys`` (KEY_BYTES each): one unpack of the joined keys."""
    return list(struct.unpack(f">{len(keys)}Q", b"".join(k[:8] for k in keys))) if keys else []


def next_key(parent: bytes, page_tokens: Tokens) -> bytes:
    """One link of the chain: the key of a page whose predecessor has key ``parent``.

    ``page_tokens`` must be exactly one page; the caller knows the page size, this function only
    checks the page is not empty.
    """
    enc = encode_tokens(page_tokens)
    if not enc:
        raise ValueError("a page has at least one token")
    return _chain(_check_key(parent), enc, len(enc), 1)[0]


def page_keys(tokens: Tokens, page_size: int, *, seed: Seed = DEFAULT_SEED, salt: Seed | None = None,
              parent: bytes | None = None) -> list[bytes]:
    """Keys of the full pages of ``tokens``: ``len(tokens) // page_size`` keys of KEY_BYTES bytes.

    With ``parent`` the chain continues from that key (the key of the page just before
    ``tokens[0]``), so ``page_keys(a + b, ps)`` == ``page_keys(a, ps) + page_keys(b, ps,
    parent=page_keys(a, ps)[-1])`` when ``len(a)`` is a multiple of ``ps``. The parent already
    encodes seed and salt, so passing ``salt`` together with ``parent`` is an error.
    """
    _check_page_size(page_size)
    start = _chain_start(seed, salt, parent)
    enc = encode_tokens(tokens)
    n_pages = len(enc) // (8 * page_size)
    return _chain(start, enc, 8 * page_size, n_pages)


class PageHasher:
    """Incremental chain for a growing sequence (decode appends a token at a time).

    ``extend(tokens)`` returns the keys of the pages completed by those tokens; ``keys`` holds every
    key so far and ``last_key`` the key to continue from (the root before the first full page).
    """

    def __init__(self, page_size: int, *, seed: Seed = DEFAULT_SEED, salt: Seed | None = None,
                 parent: bytes | None = None) -> None:
        self.page_size = _check_page_size(page_size)
        if parent is not None and salt is not None:
            raise ValueError("parent already encodes the salt; pass one of parent / salt")
        self.last_key = _check_key(parent) if parent is not None else root_key(seed, salt)
        self.keys: list[bytes] = []
        # Encoded bytes of the current partial page; kept encoded so validation happens once.
        self._pending = b""

    @property
    def num_pending(self) -> int:
        """Tokens seen after the last full page (0 <= n < page_size)."""
        return len(self._pending) // 8

    def extend(self, tokens: Tokens) -> list[bytes]:
        buf = self._pending + encode_tokens(tokens)
        page_bytes = 8 * self.page_size
        n_pages = len(buf) // page_bytes
        new = _chain(self.last_key, buf, page_bytes, n_pages)
        self._pending = buf[n_pages * page_bytes:]
        if new:
            self.keys.extend(new)
            self.last_key = new[-1]
        return new
