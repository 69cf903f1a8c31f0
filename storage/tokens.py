"""Comparing a request's token ids with a tree edge's, in place: the tree walk's inner loop.

``same_run(a, off, b[, n])``: whether lists ``a`` and ``b`` are long enough and ``a[off:off + n] == b[:n]``
(``n`` defaults to ``len(b)``). The compiled helper
(storage/_tokens.c, built by ``pip install``) compares without building the slice: a slice copies and
reference-counts every id object, and on a large tree those writes to scattered objects were most of a
match's time (bench/tree.py). ``ref_same_run`` is the reference: the fallback where the extension did
not build (no C compiler), and the tests' oracle.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["same_run", "ref_same_run", "COMPILED"]


def ref_same_run(a: list, off: int, b: list, n: Optional[int] = None) -> bool:
    """Whether ``a`` holds the first ``n`` items of ``b`` (default: all) at offset ``off``."""
    n = len(b) if n is None else n
    if off < 0 or n < 0:
        raise ValueError("same_run: off and n must be >= 0")
    return n == 0 or (n <= len(b) and off + n <= len(a) and a[off:off + n] == b[:n])


try:
    from storage._tokens import same_run
    COMPILED = True
except ImportError:   # built without a C compiler: the same answers, slower
    same_run = ref_same_run
    COMPILED = False
