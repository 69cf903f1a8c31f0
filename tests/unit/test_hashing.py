"""Page hash chain (storage/hashing.py)."""
from __future__ import annotations

import hashlib
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.hashing import (DEFAULT_SEED, KEY_BYTES, PageHasher, encode_tokens, next_key,
                             page_keys, root_key)

token_lists = st.lists(st.integers(0, 2**31), max_size=64)


def test_shape_and_determinism():
    toks = list(range(100))
    a = page_keys(toks, 16)
    assert len(a) == 6 and all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in a)
    assert a == page_keys(toks, 16)
    assert len(set(a)) == 6


def test_golden_definition():
    # The chain is exactly h_i = blake2b16(h_{i-1} || int64le tokens), personalised: pin it so a
    # refactor can never silently change what every router and worker agrees a key means.
    root = root_key()
    h = hashlib.blake2b(root + struct.pack("<4q", 1, 2, 3, 4), digest_size=16, person=b"strata-page")
    assert page_keys([1, 2, 3, 4], 4) == [h.digest()]
    assert next_key(root, [1, 2, 3, 4]) == h.digest()


def test_stable_across_processes():
    code = ("from storage.hashing import page_keys; "
            "print(page_keys(list(range(40)), 8, salt='tenant-a')[-1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == page_keys(list(range(40)), 8, salt="tenant-a")[-1].hex()


@settings(max_examples=200, deadline=None)
@given(token_lists, st.integers(1, 8), st.integers(0, 64))
def test_prefix_property(toks, page_size, cut):
    full = page_keys(toks, page_size)
    assert page_keys(toks[:cut], page_size) == full[:cut // page_size]


@settings(max_examples=200, deadline=None)
@given(token_lists, token_lists, st.integers(1, 8))
def test_continue_from_parent(a, b, page_size):
    a = a[:len(a) - len(a) % page_size]
    ka = page_keys(a, page_size)
    parent = ka[-1] if ka else root_key()
    assert ka + page_keys(b, page_size, parent=parent) == page_keys(a + b, page_size)


@settings(max_examples=100, deadline=None)
@given(st.lists(token_lists, max_size=6), st.integers(1, 8))
def test_incremental_hasher_matches_batch(chunks, page_size):
    h = PageHasher(page_size, salt=b"t")
    got: list[bytes] = []
    for c in chunks:
        got += h.extend(c)
    flat = [t for c in chunks for t in c]
    assert got == h.keys == page_keys(flat, page_size, salt=b"t")
    assert h.num_pending == len(flat) % page_size
    assert h.last_key == (got[-1] if got else root_key(salt=b"t"))


def test_partial_page_gets_no_key():
    assert page_keys([1, 2, 3], 4) == []
    assert len(page_keys(list(range(7)), 4)) == 1
    assert page_keys([], 1) == []


def test_salt_and_seed_separate_key_spaces():
    toks = list(range(32))
    plain, a, b = (page_keys(toks, 4, salt=s) for s in (None, "a", "b"))
    assert not (set(plain) & set(a)) and not (set(a) & set(b)) and not (set(plain) & set(b))
    assert page_keys(toks, 4, salt=b"") != plain  # an empty salt is still a salt
    assert page_keys(toks, 4, seed=b"other") != plain
    # Length-prefixed encoding: moving bytes between seed and salt changes the root.
    assert root_key(seed="ab", salt="c") != root_key(seed="a", salt="bc")
    assert root_key(seed=1) != root_key(seed="1")
    assert page_keys(toks, 4, seed=DEFAULT_SEED) == plain


def test_page_size_and_content_matter():
    assert page_keys([1, 2, 3, 4], 2)[0] != page_keys([1, 2, 3, 4], 4)[0]
    assert page_keys([1, 2], 2) != page_keys([2, 1], 2)
    # Same page contents under different prefixes -> different keys (the chain carries the prefix).
    k = page_keys([5, 5, 5, 5, 7, 7], 2)
    assert k[0] != k[1]


def test_tensor_and_numpy_inputs():
    np = pytest.importorskip("numpy")
    toks = list(range(1, 33))
    ref = page_keys(toks, 8)
    assert page_keys(torch.tensor(toks, dtype=torch.int64), 8) == ref
    assert page_keys(torch.tensor(toks, dtype=torch.int32), 8) == ref
    assert page_keys(np.array(toks, dtype=np.int32), 8) == ref
    assert page_keys(tuple(toks), 8) == ref
    assert page_keys(iter(toks), 8) == ref


@pytest.mark.parametrize("ps", [0, -1, 1.5, True, "4"])
def test_bad_page_size(ps):
    with pytest.raises(ValueError):
        page_keys([1, 2, 3, 4], ps)
    with pytest.raises(ValueError):
        PageHasher(ps)


def test_bad_tokens():
    with pytest.raises(ValueError):
        page_keys([1, -2, 3, 4], 2)
    with pytest.raises(ValueError):
        page_keys([2**63], 1)
    with pytest.raises(ValueError):
        PageHasher(2).extend([0, -1])
    with pytest.raises(TypeError):
        page_keys([1.0, 2.0], 2)
    assert encode_tokens([2**63 - 1]) == struct.pack("<q", 2**63 - 1)


def test_bad_parent_and_salt_combination():
    with pytest.raises(ValueError):
        page_keys([1, 2], 2, parent=b"short")
    with pytest.raises(ValueError):
        page_keys([1, 2], 2, parent=root_key(), salt="x")
    with pytest.raises(ValueError):
        next_key(root_key(), [])
    with pytest.raises(TypeError):
        root_key(seed=1.5)


def test_encode_takes_numpy_ids():
    np = pytest.importorskip("numpy")
    assert encode_tokens(np.arange(8, dtype=np.int64)) == encode_tokens(list(range(8)))
    with pytest.raises(ValueError):
        encode_tokens(np.array([3, -3], dtype=np.int64))


@pytest.mark.parametrize("compiled", [True, False])
def test_page_ids_are_the_keys_first_8_bytes_big_endian(compiled, monkeypatch):
    import random

    from storage import hashing
    if not compiled:
        monkeypatch.setattr(hashing, "_c_chain_ids", None)
    elif not hashing.COMPILED:
        pytest.skip("storage/_hashing.c did not build here")
    rng = random.Random(5)
    for ps in (1, 3, 14, 15, 16, 17, 64):    # 14: parent + page fill one BLAKE2b block exactly
        toks = [rng.randrange(2**63) if rng.random() < 0.1 else rng.randrange(50000) for _ in range(rng.randrange(5 * ps))]
        ids = [hashing.block_id(k) for k in page_keys(toks, ps)]
        assert hashing.page_ids(toks, ps) == ids
        assert hashing.page_ids(tuple(toks), ps) == ids
        parent = page_keys([9] * ps, ps, seed="s")[0]
        assert hashing.page_ids(toks, ps, parent=parent) == [hashing.block_id(k) for k in page_keys(toks, ps, parent=parent)]
        assert hashing.page_ids(toks, ps, seed=7, salt="t") == [hashing.block_id(k) for k in page_keys(toks, ps, seed=7, salt="t")]
    assert hashing.page_ids([True, 2], 2) == [hashing.block_id(page_keys([1, 2], 2)[0])]
    for bad, err in (([1, -1], ValueError), ([1, 2**63], ValueError), ([1, 2.0], TypeError), ([1, "a"], TypeError)):
        with pytest.raises(err):
            hashing.page_ids(bad, 2)
    with pytest.raises(ValueError):
        hashing.page_ids([1, 2], 0)


def test_page_ids_num_pages_is_the_prefix():
    from storage import hashing
    toks = list(range(1000, 1000 + 7 * 4 + 3))
    for n in range(0, 8):
        assert hashing.page_ids(toks, 4, num_pages=n) == hashing.page_ids(toks[:4 * n], 4)
        assert hashing.page_ids(tuple(toks), 4, num_pages=n) == hashing.page_ids(toks[:4 * n], 4)
    assert hashing.page_ids(toks, 4, num_pages=99) == hashing.page_ids(toks, 4)
    with pytest.raises(ValueError):
        hashing.page_ids(toks[:3] + [-1] + toks, 4, num_pages=1)    # a bad id in the pages hashed
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError):
            hashing.page_ids(toks, 4, num_pages=bad)
