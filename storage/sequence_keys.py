"""The page keys of one request, computed on demand (storage/hashing.py defines a key).

A request's keys serve its match and then its insert: one ``SequenceKeys`` object carries them, so no
page is hashed twice. The radix tree recognises most pages by their tokens and hands over the keys its
edges already hold; those are *borrowed*, kept as references to the edges' key lists and copied out
only when someone reads them (most requests never do: a match needs its keys only to hash the pages
after them, which takes the last one). Copying them eagerly reference-counted every key object of
the matched prefix, scattered in memory, on every request.
"""
from __future__ import annotations

import struct
from typing import Iterator, Optional, Sequence, overload

from storage.hashing import (_LITTLE, _NON_NEGATIVE_TOP, _PAGE_HASHER, DEFAULT_SEED, Seed, Tokens, _chain,
                             _check_page_size, encode_tokens, root_key)
from storage.tokens import same_run

__all__ = ["SequenceKeys"]

_FIRST_PAGE_MEMO = 1 << 14
_FIRST_PAGE_KEYS: dict[tuple, bytes] = {}
"""(root key, first page's tokens) -> that page's key: a radix walk starts by looking the first page up
among the root's children, which are too many to tell apart by tokens, and the first pages of a workload
(system prompts, conversations) come back again and again. Pure memoisation: the same key either way."""

Run = tuple  # (source list, start, stop): keys source[start:stop], borrowed


class SequenceKeys(Sequence[bytes]):
    """The page keys of one token sequence, computed on demand and remembered: a ``Sequence[bytes]`` of
    ``num_pages`` keys (default: every full page), equal element for element to ``page_keys``.

    The known keys are ``_keys`` (held) followed by ``_runs`` (borrowed from lists their owner never
    changes in place, as the tree's node keys; ``borrow``); ``num_known`` counts both. ``tokens`` is
    kept as a list (what the tree compares with the tokens it stores).
    """

    __slots__ = ("tokens", "page_size", "num_pages", "_keys", "_runs", "_known", "_root")

    def __init__(self, tokens: Tokens, page_size: int, *, seed: Seed = DEFAULT_SEED, salt: Seed | None = None,
                 num_pages: Optional[int] = None) -> None:
        self.page_size = _check_page_size(page_size)
        if type(tokens) is not list:
            tokens = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        self.tokens: list = tokens
        full = len(tokens) // page_size
        if num_pages is not None and (isinstance(num_pages, bool) or not isinstance(num_pages, int)
                                      or not 0 <= num_pages <= full):
            raise ValueError(f"num_pages must be an int in [0, {full}], got {num_pages!r}")
        self.num_pages = full if num_pages is None else num_pages
        self._root = root_key(seed, salt)
        self._keys: list[bytes] = []
        self._runs: list[Run] = []
        self._known = 0

    @classmethod
    def trusted(cls, tokens: list, page_size: int, root: bytes, num_pages: int) -> "SequenceKeys":
        """The same object without the argument checks, for a caller that derived ``num_pages`` from
        ``tokens`` itself and holds the chain root (a tree matching on every request)."""
        out = cls.__new__(cls)
        out.tokens, out.page_size, out.num_pages, out._root = tokens, page_size, num_pages, root
        out._keys, out._runs, out._known = [], [], 0
        return out

    def __len__(self) -> int:
        return self.num_pages

    @property
    def num_known(self) -> int:
        """Pages whose key is already known (computed, recognised or borrowed)."""
        return self._known

    # ---- reading -------------------------------------------------------------------------------------

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> list[bytes]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            lo, hi, step = i.indices(self.num_pages)
            if step != 1:
                return [self[j] for j in range(lo, hi, step)]
            if lo >= hi:
                return []
            self._ensure(hi)
            return self._span(lo, hi)
        if i < 0:
            i += self.num_pages
        if not 0 <= i < self.num_pages:
            raise IndexError(f"page {i} of {self.num_pages}")
        keys = self._keys
        if i < len(keys):
            return keys[i]
        if i < self._known:
            self._hold()
            return keys[i]
        if i == self._known and _LITTLE:  # the next page alone (a tree walk's step): skip the general path
            return self._next_key(i)
        self._ensure(i + 1)
        return self._span(i, i + 1)[0]

    def __iter__(self) -> Iterator[bytes]:
        self._ensure(self.num_pages)
        self._hold()
        return iter(self._keys[:self.num_pages])

    def _span(self, lo: int, hi: int) -> list[bytes]:
        """Known keys ``[lo, hi)`` (``hi <= num_known``), copying only those."""
        keys = self._keys
        if hi <= len(keys):
            return keys[lo:hi]
        if lo < len(keys):
            self._hold()
            return keys[lo:hi]
        out, pos = [], len(keys)
        for src, start, stop in self._runs:
            end = pos + stop - start
            if end > lo:
                out += src[start + max(lo - pos, 0):start + min(hi, end) - pos]
            if end >= hi:
                break
            pos = end
        return out

    def _hold(self) -> None:
        """Copy the borrowed runs into ``_keys``."""
        for src, start, stop in self._runs:
            self._keys += src[start:stop]
        self._runs = []

    def _last(self) -> bytes:
        """The key the chain continues from: the last known one (the root before the first page)."""
        if self._runs:
            src, _, stop = self._runs[-1]
            return src[stop - 1]
        return self._keys[-1] if self._keys else self._root

    # ---- learning keys --------------------------------------------------------------------------------

    def _append(self, new: list[bytes]) -> None:
        if self._runs:
            self._runs.append((new, 0, len(new)))
        else:
            self._keys += new
        self._known += len(new)

    def _next_key(self, i: int) -> bytes:
        """Hash page ``i == num_known``."""
        ps = self.page_size
        if i == 0:   # every lookup starts here: the first pages of a workload repeat (memo above)
            memo_key = (self._root, tuple(self.tokens[:ps]))
            key = _FIRST_PAGE_KEYS.get(memo_key)
            if key is not None:
                self._append([key])
                return key
        page = self.tokens[i * ps:(i + 1) * ps]
        try:
            enc = struct.pack(f"<{ps}q", *page)
        except struct.error:
            enc = encode_tokens(page)   # raises the precise error
        if enc[7::8].translate(None, _NON_NEGATIVE_TOP):
            encode_tokens(page)
        h = _PAGE_HASHER.copy()
        h.update(self._last())
        h.update(enc)
        key = h.digest()
        self._append([key])
        if i == 0:
            if len(_FIRST_PAGE_KEYS) >= _FIRST_PAGE_MEMO:
                _FIRST_PAGE_KEYS.clear()   # crude bound; a repeat just hashes again
            _FIRST_PAGE_KEYS[memo_key] = key
        return key

    def _ensure(self, n: int) -> None:
        have = self._known
        if n <= have:
            return
        ps = self.page_size
        enc = encode_tokens(self.tokens[have * ps:n * ps])
        self._append(_chain(self._last(), enc, 8 * ps, n - have))

    def adopt(self, key: bytes) -> None:
        """The next page's key, known from elsewhere (a tree edge whose first page has this sequence's
        tokens under the same parent): taken, not computed."""
        if self._known >= self.num_pages:
            raise IndexError(f"all {self.num_pages} keys are known")
        self._append([key])

    def borrow(self, i: int, keys: list[bytes], n: int) -> None:
        """Pages ``[i, i + n)`` are known to have ``keys[:n]`` (a tree edge this sequence follows):
        borrow the ones not yet known. ``keys`` must never change in place."""
        known = self._known
        if i <= known < i + n:
            self._runs.append((keys, known - i, n))
            self._known = i + n

    def match_run(self, i: int, keys: Sequence[bytes], tokens: list) -> int:
        """Pages of a run (``keys`` and their ``tokens``, e.g. a tree edge) that this sequence shares
        from its page ``i``, given that page ``i`` is the run's first page (equal key, or equal tokens under
        the same parent). Equal tokens under an equal key mean equal keys, so the run's keys are
        borrowed, not computed."""
        ps, m = self.page_size, min(len(keys), self.num_pages - i)
        toks, a = self.tokens, i * ps
        if m == len(keys) and same_run(toks, a, tokens):  # the common case, compared in place
            k = m
        elif toks[a + ps:a + m * ps] == tokens[ps:m * ps]:
            k = m
        else:
            k = 1
            while k < m and toks[a + k * ps:a + (k + 1) * ps] == tokens[k * ps:(k + 1) * ps]:
                k += 1
        self.borrow(i, keys if isinstance(keys, list) else list(keys), k)
        return k

    def extended(self, tokens: Tokens, num_pages: Optional[int] = None) -> "SequenceKeys":
        """The keys of a longer sequence (e.g. prompt + output at insert time) keeping what is known
        here when ``tokens`` starts with this sequence's known pages (checked, cheaply: mostly the same
        int objects)."""
        out = SequenceKeys.__new__(SequenceKeys)
        out.page_size, out._root = self.page_size, self._root
        out.tokens = tokens if type(tokens) is list else (tokens.tolist() if hasattr(tokens, "tolist")
                                                          else list(tokens))
        full = len(out.tokens) // self.page_size
        if num_pages is not None and not 0 <= num_pages <= full:
            raise ValueError(f"num_pages must be in [0, {full}], got {num_pages!r}")
        out.num_pages = full if num_pages is None else num_pages
        n = min(self._known, out.num_pages)
        ps = self.page_size
        # The engine inserts prompt + output, a new list: compared in place, not sliced twice.
        same = out.tokens is self.tokens or same_run(out.tokens, 0, self.tokens, n * ps)
        out._keys, out._runs, out._known = self._keys[:n] if same else [], [], n if same else 0
        pos = len(self._keys)
        for src, start, stop in self._runs if same else ():   # the runs up to n, still borrowed
            if pos >= n:
                break
            take = min(stop - start, n - pos)
            out._runs.append((src, start, start + take))
            pos += take
        return out
