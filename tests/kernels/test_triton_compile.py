"""The Triton kernel compiles for a real GPU (sm_80) without one, with 16-byte cache-hinted accesses.

The interpreter accepts things ptxas rejects (e.g. an eviction policy on a ``.cs`` store), so the
GPU compile path is checked here by compiling to PTX with the divisibility facts a real launch of
aligned pools supplies.
"""
from __future__ import annotations

import re

import pytest

from kernels import triton_copy

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")


@pytest.mark.parametrize("chunks,block", [(1, 1024), (8, 128)])
def test_compiles_to_vectorised_cache_hinted_ptx(monkeypatch, chunks, block):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # silences a 3.9 deprecation warning
    fn = triton_copy._kernel(False)
    ints = {a: "i64" for a in ("s_page", "s_layer", "s_chunk", "d_page", "d_layer", "d_chunk")}
    sig = {"src": "*i16", "dst": "*i16", "src_idx": "*i64", "dst_idx": "*i64", "n_items": "i32",
           "layer0": "i32", **ints, "n_chunks": "i32", "chunk": "i32", "PAGES": "constexpr", "CHUNKS": "constexpr",
           "BLOCK": "constexpr"}
    aligned = ["src", "dst", "src_idx", "dst_idx", *ints, "chunk"]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs={"PAGES": 8, "CHUNKS": chunks, "BLOCK": block}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 80, 32)).asm["ptx"]
    accesses = set(re.findall(r"(?:ld|st)\.global[.\w:]*", ptx))
    assert "ld.global.cg.v4.b32" in accesses, accesses
    assert "st.global.cs.v4.b32" in accesses, accesses
