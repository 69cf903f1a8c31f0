"""Every argument problem the dispatch catches raises ValueError naming it, and leaves the pools alone."""
from __future__ import annotations

import pytest
import torch

from kernels.ref import l2_shape
from storage.kernels_path import transfer

L, P1, P2, PS, E = 2, 6, 5, 4, 32  # E = 2 * PS * H * D with H * D = 4


def pools(layout="page_first", dtype=torch.float32):
    return torch.randn(L, P1, E).to(dtype), torch.randn(l2_shape(layout, L, P2, PS, E)).to(dtype)


def _unchanged_after(fn, l1, l2):
    before = (l1.clone(), l2.clone())
    fn()
    return torch.equal(l1, before[0]) and torch.equal(l2, before[1])


@pytest.mark.parametrize("kwargs,match", [
    (dict(layout="token_first"), "unknown L2 layout"),
    (dict(src=[0, 1], dst=[0]), "differ in length"),
    (dict(src=[0, P1], dst=[0, 1]), f"src_pages has page {P1} out of range \\[0, {P1}\\) for the L1 pool"),
    (dict(src=[-1], dst=[0]), "src_pages has page -1 out of range"),
    (dict(src=[0], dst=[P2]), f"dst_pages has page {P2} out of range \\[0, {P2}\\) for the L2 pool"),
    (dict(src=[0, 1, 2], dst=[3, 1, 3]), "duplicate destination page 3"),
    (dict(src=[0.0], dst=[1]), "src_pages must hold ints"),
    (dict(src=torch.tensor([0.0]), dst=[1]), "src_pages must hold integers"),
    (dict(src=torch.tensor([[0]]), dst=[1]), "src_pages must be 1-D"),
    (dict(src=[True], dst=[1]), "src_pages must hold ints"),
    (dict(src=3, dst=[1]), "src_pages must be a sequence"),
    (dict(layer=L), "layer must be None or an int in \\[0, 2\\)"),
    (dict(layer=-1), "layer must be None"),
    (dict(layer=True), "layer must be None"),
    (dict(page_size=8), "page_size 8 disagrees with page_first l2"),
    (dict(page_size=3), "is not 2 \\* page_size"),
    (dict(page_size=0), "page_size must be a positive int"),
    (dict(backend="cuda"), "backend 'cuda' is unavailable"),
    (dict(backend="gpu"), "unknown backend"),
])
def test_bad_arguments(kwargs, match):
    l1, l2 = pools()
    args = dict(layout="page_first", src=[0, 1], dst=[2, 3], layer=None, page_size=None, backend="auto")
    args.update(kwargs)

    def call():
        with pytest.raises(ValueError, match=match):
            transfer.l1_to_l2(l1, l2, args["layout"], args["src"], args["dst"], args["layer"],
                             page_size=args["page_size"], backend=args["backend"])
    assert _unchanged_after(call, l1, l2)


def test_load_direction_bounds_use_l2_for_sources():
    l1, l2 = pools()
    with pytest.raises(ValueError, match=f"src_pages has page {P2} out of range .* L2 pool"):
        transfer.l2_to_l1(l1, l2, "page_first", [P2], [0])
    with pytest.raises(ValueError, match=f"dst_pages has page {P1} out of range .* L1 pool"):
        transfer.l2_to_l1(l1, l2, "page_first", [0], [P1])
    with pytest.raises(ValueError, match="duplicate destination page 0"):
        transfer.l2_to_l1(l1, l2, "page_first", [1, 2], [0, 0])


def test_duplicate_sources_are_allowed():
    l1, l2 = pools()
    transfer.l1_to_l2(l1, l2, "page_first", [1, 1], [0, 4])
    assert torch.equal(l2[0], l2[4])


def test_dtype_mismatch():
    l1, _ = pools()
    _, l2 = pools(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype mismatch: l1 is torch.float32, l2 is torch.bfloat16"):
        transfer.l1_to_l2(l1, l2, "page_first", [0], [0])


@pytest.mark.parametrize("layout", transfer.LAYOUTS)
def test_non_contiguous(layout):
    l1, l2 = pools(layout)
    wide = torch.randn(L, P1, 2 * E)
    with pytest.raises(ValueError, match="l1 must be contiguous"):
        transfer.l1_to_l2(wide[:, :, :E], l2, layout, [0], [0])
    big = torch.randn(*l2.shape[:-1], 2 * l2.shape[-1])
    with pytest.raises(ValueError, match="l2 must be contiguous"):
        transfer.l2_to_l1(l1, big[..., :l2.shape[-1]], layout, [0], [0])


@pytest.mark.parametrize("layout,bad_shape,match", [
    ("layer_first", (L + 1, P2, E), "layer count mismatch"),
    ("page_first", (P2, PS, L + 1, E // PS), "layer count mismatch"),
    ("page_first_direct", (P2, L + 1, E), "layer count mismatch"),
    ("layer_first", (L, P2, E * 2), "page size mismatch: l1 pages have E=32"),
    ("page_first", (P2, PS, L, E // PS + 1), "page size mismatch"),
    ("page_first", (P2, PS * 2, L, E // PS), "page size mismatch"),
    ("page_first_direct", (P2, L, E - 8), "page size mismatch"),
    ("page_first", (P2, L, E), "page_first l2 must have 4 dims"),
    ("page_first_direct", (P2, PS, L, E // PS), "page_first_direct l2 must have 3 dims"),
])
def test_shape_disagreement(layout, bad_shape, match):
    l1, _ = pools()
    with pytest.raises(ValueError, match=match):
        transfer.l1_to_l2(l1, torch.zeros(bad_shape), layout, [0], [0])


def test_l1_shape_and_types():
    _, l2 = pools()
    with pytest.raises(ValueError, match="l1 must be \\[L, P1, E\\]"):
        transfer.l1_to_l2(torch.zeros(L, P1, 2, PS, 4), l2, "page_first", [0], [0])
    with pytest.raises(ValueError, match="must be tensors"):
        transfer.l1_to_l2(None, l2, "page_first", [0], [0])


def test_shared_storage_rejected():
    buf = torch.zeros(2 * L * P1 * E)
    l1, l2 = buf[: L * P1 * E].view(L, P1, E), buf[L * P1 * E:].view(L, P1, E)
    with pytest.raises(ValueError, match="share storage"):
        transfer.l1_to_l2(l1, l2, "layer_first", [0], [0])


def test_empty_lists_are_a_noop():
    for layout in transfer.LAYOUTS:
        l1, l2 = pools(layout)
        assert _unchanged_after(lambda: transfer.l1_to_l2(l1, l2, layout, [], []), l1, l2)
        assert _unchanged_after(lambda: transfer.l2_to_l1(l1, l2, layout, torch.tensor([], dtype=torch.int32),
                                                         (), layer=1), l1, l2)


def test_check_false_skips_only_index_checks():
    l1, l2 = pools()
    transfer.l1_to_l2(l1, l2, "page_first", [0, 1], [2, 3], check=False)
    assert torch.equal(l2[2].transpose(0, 1).reshape(L, E), l1[:, 0])
    with pytest.raises(ValueError, match="dtype mismatch"):
        transfer.l1_to_l2(l1, l2.half(), "page_first", [0], [0], check=False)


def test_index_tensor_dtypes_accepted():
    l1, l2 = pools()
    transfer.l1_to_l2(l1, l2, "page_first", torch.tensor([1], dtype=torch.int32), torch.tensor([2], dtype=torch.int16))
    assert torch.equal(l2[2].transpose(0, 1).reshape(L, E), l1[:, 1])


def test_dispatch_on_cpu_is_torch():
    assert transfer.select_backend("cpu") == "torch"


def test_l2_shape_and_alloc():
    assert transfer.l2_shape("layer_first", 3, 7, 16, 256) == (3, 7, 256)
    assert transfer.l2_shape("page_first", 3, 7, 16, 256) == (7, 16, 3, 16)
    assert transfer.l2_shape("page_first_direct", 3, 7, 16, 256) == (7, 3, 256)
    with pytest.raises(ValueError, match="unknown L2 layout"):
        transfer.l2_shape("nope", 1, 1, 1, 2)
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        transfer.l2_shape("page_first", 1, 1, 3, 8)
    t = transfer.alloc_l2("page_first_direct", 2, 3, 4, 8, torch.bfloat16)
    assert t.shape == (3, 2, 8) and t.dtype == torch.bfloat16 and not t.any()
