"""The torch path (kernels/ref.py and the dispatch on CPU) against the naive per-page oracle."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.ref import L1_TO_L2, LAYOUTS, find_runs, l2_shape, ref_l1_to_l2, ref_l2_to_l1
from storage.kernels_path import transfer
from tests.kernels.conftest import (CASES, assert_same, index_sets, layer_of, make_pools, naive_copy, seed_of,
                                    src_dst_sizes)


def _ref(direction):
    return ref_l1_to_l2 if direction == L1_TO_L2 else ref_l2_to_l1


@pytest.mark.parametrize("direction,layout,dtype,page_size,mode", CASES)
def test_ref_matches_oracle(direction, layout, dtype, page_size, mode):
    seed = seed_of(direction, layout, dtype, page_size, mode)
    layer = layer_of(mode, seed)
    l1, l2 = make_pools(layout, dtype, page_size, seed)
    for src, dst in index_sets(*src_dst_sizes(direction), seed):
        want = (l1.clone(), l2.clone())
        naive_copy(*want, layout, direction, src, dst, layer)
        si, di = torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)
        for method in ("index", "runs", "auto"):
            got = (l1.clone(), l2.clone())
            _ref(direction)(*got, layout, si, di, layer, method=method)
            assert_same(got, want, f"ref method={method} n={len(src)}")
        got = (l1.clone(), l2.clone())
        op = transfer.l1_to_l2 if direction == L1_TO_L2 else transfer.l2_to_l1
        assert op(*got, layout, src, dst, layer, page_size=page_size) == "torch"
        assert_same(got, want, f"dispatch n={len(src)}")


def test_round_trip_all_layouts():
    """Backup then load into other pages gives back the original pages, in every layout."""
    for layout in LAYOUTS:
        l1, l2 = make_pools(layout, torch.bfloat16, 16, seed=1)
        transfer.l1_to_l2(l1, l2, layout, [0, 5, 3], [10, 2, 4])
        back = torch.zeros_like(l1)
        transfer.l2_to_l1(back, l2, layout, [10, 2, 4], [1, 2, 8])
        assert torch.equal(back[:, [1, 2, 8]], l1[:, [0, 5, 3]])
        assert not back[:, [0, 3, 4, 5, 6, 7]].any()


def test_find_runs():
    s = torch.tensor([2, 3, 4, 0, 7, 8, 9])
    d = torch.tensor([5, 6, 7, 1, 2, 3, 9])
    assert find_runs(s, d) == [(2, 5, 3), (0, 1, 1), (7, 2, 2), (9, 9, 1)]
    assert find_runs(s[:0], d[:0]) == []


def test_empty_pool_without_layers():
    """A component with no layers (e.g. no SWA layers) has [0, 0, E] pools; empty copies are fine."""
    l1 = torch.zeros(0, 0, 32)
    for layout in LAYOUTS:
        l2 = torch.zeros(l2_shape(layout, 0, 0, 4, 32))
        assert transfer.l1_to_l2(l1, l2, layout, [], []) == "torch"
        assert transfer.l2_to_l1(l1, l2, layout, torch.empty(0, dtype=torch.int64), []) == "torch"


@settings(max_examples=40, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), page_size=st.sampled_from([1, 2, 4, 8]),
       layers=st.integers(1, 4), data=st.data())
def test_ref_random_shapes(layout, page_size, layers, data):
    """Arbitrary pool sizes and index lists (including runs) for both directions."""
    p1, p2 = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12))
    E = 2 * page_size * data.draw(st.sampled_from([1, 2, 3]))
    l1 = torch.arange(layers * p1 * E, dtype=torch.float32).view(layers, p1, E)
    l2 = -torch.arange(layers * p2 * E, dtype=torch.float32).view(l2_shape(layout, layers, p2, page_size, E)) - 1
    layer = data.draw(st.none() | st.integers(0, layers - 1))
    for direction, (n_src, n_dst) in ((L1_TO_L2, (p1, p2)), ("l2_to_l1", (p2, p1))):
        dst = data.draw(st.lists(st.integers(0, n_dst - 1), unique=True, max_size=n_dst))
        src = data.draw(st.lists(st.integers(0, n_src - 1), min_size=len(dst), max_size=len(dst)))
        want = (l1.clone(), l2.clone())
        naive_copy(*want, layout, direction, src, dst, layer)
        got = (l1.clone(), l2.clone())
        op = transfer.l1_to_l2 if direction == L1_TO_L2 else transfer.l2_to_l1
        op(*got, layout, src, dst, layer)
        assert_same(got, want, f"{direction} {layout}")
