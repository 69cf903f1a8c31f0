"""storage/tokens.py: the compiled same_run against its reference."""
from __future__ import annotations

import shutil
import sysconfig

import pytest
from hypothesis import given
from hypothesis import strategies as st

from storage import tokens
from storage.tokens import ref_same_run, same_run


@given(a=st.lists(st.integers(0, 5), max_size=12), b=st.lists(st.integers(0, 5), max_size=6),
       off=st.integers(0, 14), n=st.integers(0, 8), big=st.booleans())
def test_same_run_is_the_slice_comparison(a, b, off, n, big):
    if big:   # ids past the small-int cache: equal values, distinct objects
        a, b = [x + 10**6 for x in a], [int(str(x + 10**6)) for x in b]
    whole = off + len(b) <= len(a) and a[off:off + len(b)] == b
    assert same_run(a, off, b) == ref_same_run(a, off, b) == (whole or not b)
    first = n <= len(b) and off + n <= len(a) and a[off:off + n] == b[:n]
    assert same_run(a, off, b, n) == ref_same_run(a, off, b, n) == (first or n == 0)
    if off <= len(a):
        assert same_run(a, off, a[off:]) and same_run(a, off, a[off:off + len(b)])


def test_same_run_errors():
    class Boom:
        def __eq__(self, other):
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError):
        same_run([Boom()], 0, [1])
    with pytest.raises(ValueError):
        same_run([1], -1, [1])
    with pytest.raises(ValueError):
        ref_same_run([1], -1, [1])
    with pytest.raises(ValueError):
        same_run([1], 0, [1], -1)
    with pytest.raises(TypeError):
        same_run((1, 2), 0, [1])


def test_compare_that_shrinks_the_list_is_safe():
    a = [10**6 + 1, 10**6 + 2, 10**6 + 3]

    class Shrink:
        def __eq__(self, other):
            a.clear()
            return True
    assert same_run(a, 0, [Shrink(), 10**6 + 2]) is False   # the list is gone when the second is compared


@pytest.mark.skipif(not (shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC")
                                      else "cc")), reason="no C compiler: the Python fallback serves")
def test_the_helper_is_compiled_where_a_compiler_exists():
    """pip builds storage/_tokens.c; a silent fallback would cost bench/tree.py a fifth of its match rate."""
    assert tokens.COMPILED
