"""The CUDA source builds with nvcc, carries the L1::no_allocate hints, and exposes the C ABI.

No GPU is needed: nvcc compiles without one, and the library loads (the static CUDA runtime only looks
for the driver on the first CUDA call, which an empty copy never makes).
"""
from __future__ import annotations

import ctypes
import re

import pytest
import torch

from kernels.cuda import loader
from tests.kernels.conftest import assert_same, index_sets, make_pools, naive_copy, seed_of, src_dst_sizes

needs_nvcc = pytest.mark.skipif(loader.nvcc_path() is None, reason="nvcc not found")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STRATA_HOME", str(tmp_path_factory.mktemp("strata_home")))
        path = loader.build(arch="80")
        yield path


@needs_nvcc
def test_ptx_uses_no_allocate_vector_copies():
    ptx = loader.ptx(arch="80")
    assert "ld.global.L1::no_allocate" in ptx
    assert "st.global.L1::no_allocate" in ptx
    # The aligned fast path: 16-byte vector loads and stores.
    assert re.search(r"ld\.global\.L1::no_allocate\.v4\.u32", ptx)
    assert re.search(r"st\.global\.L1::no_allocate\.v4\.u32", ptx)


@needs_nvcc
def test_build_is_cached_by_source_hash(built, monkeypatch):
    monkeypatch.setenv("STRATA_HOME", str(built.parent.parent))
    assert built.exists() and built.parent == loader.cache_dir()
    mtime = built.stat().st_mtime_ns
    assert loader.build(arch="80") == built          # same source and flags: no rebuild
    assert built.stat().st_mtime_ns == mtime


@needs_nvcc
def test_library_abi(built):
    lib = loader.load(built)
    assert lib.strata_hicache_abi_version() == loader.ABI_VERSION
    # Empty work returns before any CUDA call, so this runs without a GPU or a driver.
    null = ctypes.c_void_p(0)
    assert lib.strata_copy_pages(null, null, null, null, 0, 0, 1, *([0] * 6), 1, 16, null) == 0


def test_library_unused_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert loader.library() is None and not loader.available()


def test_arch_selection(monkeypatch):
    monkeypatch.setenv("STRATA_CUDA_ARCH", "sm_90")
    assert loader.default_arch() == "90"
    assert loader.arch_flags("90") == ["-gencode", "arch=compute_90,code=[sm_90,compute_90]"]


class _HostEmulation:
    """The C ABI's contract, executed on host memory: checks what loader.copy_pages passes (pointers,
    byte strides, chunk sizes) without a GPU. The kernel itself implements the same formula."""

    def strata_copy_pages(self, src, dst, src_idx, dst_idx, n, layer0, n_layers,
                          sp, sl, sc, dp, dl, dc, n_chunks, chunk_bytes, stream):
        s_idx = (ctypes.c_int64 * n).from_address(src_idx)
        d_idx = (ctypes.c_int64 * n).from_address(dst_idx)
        for i in range(n):
            for lay in range(layer0, layer0 + n_layers):
                for c in range(n_chunks):
                    ctypes.memmove(dst + d_idx[i] * dp + lay * dl + c * dc,
                                   src + s_idx[i] * sp + lay * sl + c * sc, chunk_bytes)
        return 0


@pytest.mark.parametrize("direction", ["l1_to_l2", "l2_to_l1"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loader_marshalling_matches_oracle(monkeypatch, direction, layout, dtype):
    monkeypatch.setattr(loader, "library", lambda: _HostEmulation())
    seed = seed_of("abi", direction, layout, dtype)
    l1, l2 = make_pools(layout, dtype, 16, seed)
    for layer in (None, 2):
        for src, dst in index_sets(*src_dst_sizes(direction), seed):
            want = (l1.clone(), l2.clone())
            naive_copy(*want, layout, direction, src, dst, layer)
            got = (l1.clone(), l2.clone())
            op = loader.cuda_l1_to_l2 if direction == "l1_to_l2" else loader.cuda_l2_to_l1
            op(*got, layout, torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64), layer)
            assert_same(got, want, f"ABI emulation layer={layer} n={len(src)}")
