"""The Triton kernels, run by the CPU interpreter, against the naive oracle.

Triton reads TRITON_INTERPRET when a kernel is defined; kernels/triton_copy.py defines its kernel on
first use and caches it per interpreter mode, so setting the variable here is enough no matter what was
imported earlier in the session. It is set only while these tests run.
"""
from __future__ import annotations

import pytest
import torch

from kernels import triton_copy
from kernels.ref import L1_TO_L2, LAYOUTS, plan
from storage.kernels_path import transfer
from tests.kernels.conftest import (CASES, assert_same, index_sets, layer_of, make_pools, naive_copy, seed_of,
                                    src_dst_sizes)

pytest.importorskip("triton")


@pytest.fixture(scope="module", autouse=True)
def interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.mark.parametrize("direction,layout,dtype,page_size,mode", CASES)
def test_triton_matches_oracle(direction, layout, dtype, page_size, mode):
    seed = seed_of(direction, layout, dtype, page_size, mode)
    layer = layer_of(mode, seed)
    l1, l2 = make_pools(layout, dtype, page_size, seed)
    op = transfer.l1_to_l2 if direction == L1_TO_L2 else transfer.l2_to_l1
    for src, dst in index_sets(*src_dst_sizes(direction), seed):
        want = (l1.clone(), l2.clone())
        naive_copy(*want, layout, direction, src, dst, layer)
        got = (l1.clone(), l2.clone())
        assert op(*got, layout, src, dst, layer, page_size=page_size, backend="triton") == "triton"
        assert_same(got, want, f"triton n={len(src)}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_tiles_and_many_programs(layout):
    """More items than one program's PAGES and pages longer than one BLOCK: exercises both loops/masks."""
    l1, l2 = make_pools(layout, torch.float16, 64, seed=7, num_layers=2)
    src = [8, 0, 3, 1, 2, 7, 6, 5, 4]
    dst = [10, 0, 9, 1, 2, 3, 4, 5, 6]
    want = (l1.clone(), l2.clone())
    naive_copy(*want, layout, L1_TO_L2, src, dst, None)
    got = (l1.clone(), l2.clone())
    p = plan(*got, layout, L1_TO_L2, None)
    triton_copy.launch(p, torch.tensor(src), torch.tensor(dst), pages_per_program=2, block=128)
    assert_same(got, want, "small tiles")


def test_triton_needs_gpu_or_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    l1, l2 = make_pools("layer_first", torch.float32, 1, seed=0)
    with pytest.raises(ValueError, match="triton"):
        transfer.l1_to_l2(l1, l2, "layer_first", [0], [0], backend="triton")
