"""L2 host-pool layouts, the copy geometry every backend shares, and the torch reference ops.

Shapes (``L`` pool layers, ``E = 2 * page_size * H * D`` elements per page of one layer)::

    l1                    : [L, P1, E]                          (KVPool.flat())
    layer_first        l2 : [L, P2, E]                          one layer of all pages contiguous
    page_first         l2 : [P2, page_size, L, E // page_size]  slot-major, like SGLang's page_first
    page_first_direct  l2 : [P2, L, E]                          one contiguous object per page

In ``page_first`` slot ``s`` of a page holds, for every layer side by side, chunk ``s`` of that layer's
page: its flat elements ``[s * E/page_size, (s+1) * E/page_size)`` in L1's ``[2, page_size, H, D]``
order. A page (all layers) is one contiguous region; one layer of it is ``page_size`` strided chunks.
L2 contents are only meaningful through these ops (L3 stores pages as opaque bytes).

A page of one layer is then ``n_chunks`` contiguous chunks of ``chunk`` elements: one chunk of ``E`` for
``layer_first``/``page_first_direct``, and ``page_size`` chunks of ``E // page_size`` for ``page_first``
(in L1 those chunks are adjacent, in L2 they are ``L * E // page_size`` apart). ``plan()`` reduces every
(direction, layout, layer) case to that one strided description, which the Triton and CUDA kernels take.

The ``ref_*`` ops are the CPU fallback and the oracle of the other backends. They do no validation (the
dispatch in ``kernels/transfer.py`` does); ``src_pages``/``dst_pages`` are 1-D int64 tensors.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

LAYER_FIRST = "layer_first"
PAGE_FIRST = "page_first"
PAGE_FIRST_DIRECT = "page_first_direct"
LAYOUTS = (LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT)

L1_TO_L2 = "l1_to_l2"
L2_TO_L1 = "l2_to_l1"

# "runs" pays ~5 us of Python and TensorIterator setup per run of consecutive pages, then copies at near
# memcpy speed, but a copy below ~64 KiB runs on one thread; "index" (a gather and a scatter pass over
# 2 MiB batches) runs at ~40% of memcpy on all threads whatever the page size. On the 2-core dev box, at
# 32 KiB per run they tie on one thread and index wins ~2x on two; from 128 KiB on runs win either way
# (bench/kernels.py --methods prints both).
RUN_BYTES_MIN = 128 * 1024


def l2_shape(layout: str, num_layers: int, num_pages: int, page_size: int, page_elems: int) -> tuple[int, ...]:
    """Shape of an L2 pool of ``num_pages`` pages in ``layout`` (see the module docstring)."""
    if layout == LAYER_FIRST:
        return (num_layers, num_pages, page_elems)
    if layout == PAGE_FIRST:
        if page_size < 1 or page_elems % page_size:
            raise ValueError(f"page_elems {page_elems} is not a multiple of page_size {page_size}")
        return (num_pages, page_size, num_layers, page_elems // page_size)
    if layout == PAGE_FIRST_DIRECT:
        return (num_pages, num_layers, page_elems)
    raise ValueError(f"unknown L2 layout {layout!r}; expected one of {LAYOUTS}")


def alloc_l2(layout: str, num_layers: int, num_pages: int, page_size: int, page_elems: int,
             dtype: torch.dtype, device: torch.device | str = "cpu", pin_memory: bool = False) -> torch.Tensor:
    """A zeroed L2 pool. Pin it (``pin_memory=True``) when the L1 pool lives on a GPU: the GPU kernels
    read and write host memory directly through its device mapping."""
    shape = l2_shape(layout, num_layers, num_pages, page_size, page_elems)
    return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)


def l2_num_pages(l2: torch.Tensor, layout: str) -> int:
    return l2.shape[1] if layout == LAYER_FIRST else l2.shape[0]


def l2_num_layers(l2: torch.Tensor, layout: str) -> int:
    return l2.shape[{LAYER_FIRST: 0, PAGE_FIRST: 2, PAGE_FIRST_DIRECT: 1}[layout]]


def l2_page_elems(l2: torch.Tensor, layout: str) -> int:
    return l2.shape[1] * l2.shape[3] if layout == PAGE_FIRST else l2.shape[2]


def chunking(l2: torch.Tensor, layout: str) -> tuple[int, int]:
    """(n_chunks, chunk): a page of one layer is n_chunks contiguous runs of chunk elements in both tiers."""
    if layout == PAGE_FIRST:
        return l2.shape[1], l2.shape[3]
    return 1, l2.shape[2]


class Strides(NamedTuple):
    """Element strides of one tier: between pages, between layers, between a page's chunks."""
    page: int
    layer: int
    chunk: int


class CopyPlan(NamedTuple):
    """Copy item i, layer l (l in [layer0, layer0 + n_layers)), chunk c, element w (w < chunk):
    ``dst[dst_idx[i]*dst.page + l*dst.layer + c*dst.chunk + w] = src[same with src strides]``."""
    src: torch.Tensor
    dst: torch.Tensor
    src_strides: Strides
    dst_strides: Strides
    layer0: int
    n_layers: int
    n_chunks: int
    chunk: int


def _l1_strides(l1: torch.Tensor, chunk: int) -> Strides:
    return Strides(l1.stride(1), l1.stride(0), chunk)


def _l2_strides(l2: torch.Tensor, layout: str) -> Strides:
    if layout == LAYER_FIRST:
        return Strides(l2.stride(1), l2.stride(0), l2.shape[2])
    if layout == PAGE_FIRST:
        return Strides(l2.stride(0), l2.stride(2), l2.stride(1))
    return Strides(l2.stride(0), l2.stride(1), l2.shape[2])


def plan(l1: torch.Tensor, l2: torch.Tensor, layout: str, direction: str, layer: int | None) -> CopyPlan:
    """The strided description of one op (shared by the Triton and CUDA backends)."""
    n_chunks, chunk = chunking(l2, layout)
    s1, s2 = _l1_strides(l1, chunk), _l2_strides(l2, layout)
    layer0, n_layers = (0, l1.shape[0]) if layer is None else (int(layer), 1)
    if direction == L1_TO_L2:
        return CopyPlan(l1, l2, s1, s2, layer0, n_layers, n_chunks, chunk)
    return CopyPlan(l2, l1, s2, s1, layer0, n_layers, n_chunks, chunk)


def page_view(t: torch.Tensor, tier: str, layout: str, n_chunks: int, layer: int | None) -> torch.Tensor:
    """A strided (never copied) view with the page index first:
    ``[P, L, n_chunks, chunk]`` for all layers, ``[P, n_chunks, chunk]`` for one ``layer``."""
    if tier == "l1" or layout == LAYER_FIRST:                   # [L, P, E]
        v = t.unflatten(2, (n_chunks, -1)).transpose(0, 1)
    elif layout == PAGE_FIRST:                                  # [P, ps, L, E/ps]
        v = t.transpose(1, 2)
    else:                                                       # [P, L, E]
        v = t.unflatten(2, (n_chunks, -1))
    return v if layer is None else v[:, layer]


def find_runs(src_pages: torch.Tensor, dst_pages: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs (src0, dst0, length) over which both index lists step by +1, in order."""
    n = src_pages.numel()
    if n == 0:
        return []
    s, d = src_pages.cpu(), dst_pages.cpu()
    brk = torch.ones(n, dtype=torch.bool)
    brk[1:] = (s[1:] != s[:-1] + 1) | (d[1:] != d[:-1] + 1)
    starts = brk.nonzero().flatten()
    lens = torch.diff(starts, append=torch.tensor([n]))
    return list(zip(s[starts].tolist(), d[starts].tolist(), lens.tolist()))


# The index method moves rows through a temporary this big: it stays in the L2 cache between the gather
# and the scatter, and the allocator reuses it instead of faulting in fresh pages for every batch.
INDEX_BATCH_BYTES = 2 * 1024 * 1024
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _rows(t: torch.Tensor, unit: torch.dtype, row_len: int) -> torch.Tensor:
    """t (contiguous) as [rows, row_len] of ``unit``: a bit-level view, whatever t's dtype."""
    return t.reshape(-1).view(unit).view(-1, row_len)


def _row_index(pages: torch.Tensor, st: Strides, p: CopyPlan) -> torch.Tensor:
    """[n * n_layers * n_chunks] row numbers (rows of ``p.chunk`` elements), item-major."""
    for name, v in zip(Strides._fields, st):
        if v % p.chunk:
            raise ValueError(f"{name} stride {v} is not a multiple of the chunk {p.chunk}: need contiguous pools")
    layers = torch.arange(p.layer0, p.layer0 + p.n_layers, device=pages.device)
    chunks = torch.arange(p.n_chunks, device=pages.device)
    rows = (pages[:, None, None] * (st.page // p.chunk) + layers[None, :, None] * (st.layer // p.chunk)
            + chunks[None, None, :] * (st.chunk // p.chunk))
    return rows.reshape(-1)


def _copy_index(p: CopyPlan, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    """Vectorised gather/scatter of whole chunks viewed as the widest integer they divide into (the
    copy is bit-exact, and 8-byte rows let index_copy_ vectorise where bf16 rows would not)."""
    chunk_bytes = p.chunk * p.src.element_size()
    offs = {t.storage_offset() * t.element_size() for t in (p.src, p.dst)}
    width = next(w for w in _BITS if chunk_bytes % w == 0 and all(o % w == 0 for o in offs))
    row_len = chunk_bytes // width
    src2d, dst2d = _rows(p.src, _BITS[width], row_len), _rows(p.dst, _BITS[width], row_len)
    src_rows = _row_index(src_pages.to(p.src.device), p.src_strides, p)
    dst_rows = _row_index(dst_pages.to(p.dst.device), p.dst_strides, p)
    step = max(1, INDEX_BATCH_BYTES // chunk_bytes)
    for i in range(0, src_rows.numel(), step):
        # Gather on the source device, scatter on the destination device (the tiers may differ).
        rows = src2d.index_select(0, src_rows[i:i + step])
        dst2d.index_copy_(0, dst_rows[i:i + step], rows.to(dst2d.device))


def _copy_runs(l1, l2, layout, direction, src_pages, dst_pages, layer, runs) -> None:
    """One slice copy per run of consecutive pages: memcpy speed once runs are large."""
    n_chunks, _ = chunking(l2, layout)
    v1, v2 = page_view(l1, "l1", layout, n_chunks, layer), page_view(l2, "l2", layout, n_chunks, layer)
    src_v, dst_v = (v1, v2) if direction == L1_TO_L2 else (v2, v1)
    for s, d, k in runs:
        if k == 1:  # integer indexing is a few microseconds cheaper than slicing, per page
            dst_v[d].copy_(src_v[s], non_blocking=True)
        else:
            dst_v[d:d + k].copy_(src_v[s:s + k], non_blocking=True)


def _transfer(l1, l2, layout, direction, src_pages, dst_pages, layer, method) -> None:
    n = src_pages.numel()
    if n == 0 or l1.shape[0] == 0:
        return
    if method not in ("auto", "runs", "index"):
        raise ValueError(f"unknown method {method!r}; expected 'auto', 'runs' or 'index'")
    runs = find_runs(src_pages, dst_pages) if method != "index" else []
    if method == "auto":
        item_bytes = l1.shape[2] * l1.element_size() * (l1.shape[0] if layer is None else 1)
        method = "runs" if n * item_bytes / len(runs) >= RUN_BYTES_MIN else "index"
    if method == "runs":
        _copy_runs(l1, l2, layout, direction, src_pages, dst_pages, layer, runs)
    else:
        _copy_index(plan(l1, l2, layout, direction, layer), src_pages, dst_pages)


def ref_l1_to_l2(l1: torch.Tensor, l2: torch.Tensor, layout: str, src_pages: torch.Tensor,
                 dst_pages: torch.Tensor, layer: int | None = None, *, method: str = "auto") -> None:
    """Backup: l2 page dst_pages[i] <- l1 page src_pages[i] (one pool layer, or all when layer is None).

    l1: [L, P1, E] and l2 (see l2_shape), both contiguous. method: "index" (vectorised gather/scatter of
    chunk rows), "runs" (one slice copy per run of consecutive pages), "auto" (runs when they are large
    enough for the per-copy overhead to vanish, index otherwise).
    """
    _transfer(l1, l2, layout, L1_TO_L2, src_pages, dst_pages, layer, method)


def ref_l2_to_l1(l1: torch.Tensor, l2: torch.Tensor, layout: str, src_pages: torch.Tensor,
                 dst_pages: torch.Tensor, layer: int | None = None, *, method: str = "auto") -> None:
    """Load: l1 page dst_pages[i] <- l2 page src_pages[i]. Same shapes and methods as ref_l1_to_l2."""
    _transfer(l1, l2, layout, L2_TO_L1, src_pages, dst_pages, layer, method)
