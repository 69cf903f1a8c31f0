"""SequenceKeys (storage/sequence_keys.py): lazily computed page keys, equal to page_keys element for
element however they were learned (hashed, adopted, borrowed from tree edges)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.hashing import page_keys
from storage.sequence_keys import SequenceKeys

token_lists = st.lists(st.integers(0, 2**31), max_size=64)


@settings(max_examples=60, deadline=None)
@given(toks=token_lists, page_size=st.integers(1, 5), cut=st.integers(0, 64))
def test_sequence_keys_equal_page_keys(toks, page_size, cut):
    ref = page_keys(toks, page_size, salt="t")
    sk = SequenceKeys(toks, page_size, salt="t")
    assert len(sk) == len(ref) and sk.num_known == 0
    if ref:
        assert sk[len(ref) // 2] == ref[len(ref) // 2] and sk.num_known == len(ref) // 2 + 1
        assert sk[-1] == ref[-1]
    assert sk[1:3] == ref[1:3] and sk[::2] == ref[::2] and list(sk) == ref
    n = min(cut // page_size, len(ref))
    part = SequenceKeys(toks, page_size, salt="t", num_pages=n)
    assert list(part) == ref[:n]
    longer = part.extended(toks + [7] * page_size)   # the known keys carry over
    assert longer.num_known == n and list(longer) == page_keys(toks + [7] * page_size, page_size, salt="t")
    other = part.extended([t + 1 for t in toks])     # a different prefix: nothing carries over
    assert other.num_known == 0 and list(other) == page_keys([t + 1 for t in toks], page_size, salt="t")


@settings(max_examples=150, deadline=None)
@given(data=st.data(), pages=st.integers(1, 24), page_size=st.integers(1, 4))
def test_borrowed_runs_read_as_page_keys(data, pages, page_size):
    """Learn the keys in a random mix of hashing, adopting and borrowing runs of the true keys (as tree
    edges hand them over), reading in between: every read, slice and extension equals page_keys."""
    toks = data.draw(st.lists(st.integers(0, 999), min_size=pages * page_size,
                             max_size=(pages + 1) * page_size - 1))   # a partial page at the end
    ref = page_keys(toks, page_size)
    sk = SequenceKeys(toks, page_size)
    while sk.num_known < pages:
        k = sk.num_known
        how = data.draw(st.sampled_from(["borrow", "borrow", "hash", "adopt", "read"]))
        if how == "borrow":   # an edge starting at or before k, reaching past it
            i = data.draw(st.integers(max(0, k - 3), k))
            n = data.draw(st.integers(k - i + 1, pages - i))
            sk.borrow(i, ref[i:i + n] + [b"x" * 16] * data.draw(st.integers(0, 2)), n)
            assert sk.num_known == i + n
        elif how == "hash":
            assert sk[k] == ref[k] and sk.num_known == k + 1
        elif how == "adopt":
            sk.adopt(ref[k])
        else:
            lo = data.draw(st.integers(0, pages))
            hi = data.draw(st.integers(lo, pages))
            assert sk[lo:hi] == ref[lo:hi]
            assert sk.num_known >= hi or lo == hi
        j = data.draw(st.integers(0, sk.num_known))
        cut = data.draw(st.integers(0, pages))
        assert sk.extended(toks + [5] * page_size)[j:] == page_keys(toks + [5] * page_size, page_size)[j:]
        assert list(sk.extended(toks, cut)) == ref[:cut]
    assert list(sk) == ref and [sk[i] for i in range(pages)] == ref
    sk.borrow(0, ref[:1], 1)   # nothing new: a no-op
    assert sk.num_known == pages
    with pytest.raises(IndexError):
        sk.adopt(ref[0])


def test_sequence_keys_take_a_matching_runs_keys_without_hashing():
    toks = list(range(40))
    ref = page_keys(toks, 4)
    sk = SequenceKeys(toks, 4)
    assert sk[2] == ref[2] and sk.num_known == 3
    # A run of 5 pages starting at page 2 whose first key matched: its tokens agree for 3 pages.
    run_tokens = toks[8:20] + [99] * 8
    run = ref[2:7]
    assert sk.match_run(2, run, run_tokens) == 3 and sk.num_known == 5
    run[1] = b"\0" * 16   # borrowed, not computed: a wrong run key shows
    assert sk[3] == b"\0" * 16
    with pytest.raises(ValueError):
        SequenceKeys(toks, 4, num_pages=11)
    with pytest.raises(IndexError):
        sk[10]
    with pytest.raises(ValueError):
        list(SequenceKeys([1, -1], 1))
