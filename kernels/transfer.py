"""KV page transfer between the L1 (device) pool and the L2 (host) pool -- the only entry point callers use
(import it as ``from storage.kernels_path import transfer``: kernels/ is a namespace package, see there).

Shapes (``L`` pool layers, ``E = 2 * page_size * H * D`` elements per page of one layer)::

    l1 : [L, P1, E]   KVPool.flat()
    l2 : layer_first [L, P2, E] | page_first [P2, page_size, L, E // page_size] | page_first_direct [P2, L, E]
         (allocate with ``alloc_l2``; pin it when l1 is on a GPU)

Ops, for every i (one pool layer ``layer``, or all layers when ``layer`` is None)::

    l1_to_l2(l1, l2, layout, src_pages, dst_pages)   backup:  l2 page dst_pages[i] <- l1 page src_pages[i]
    l2_to_l1(l1, l2, layout, src_pages, dst_pages)   load:    l1 page dst_pages[i] <- l2 page src_pages[i]

The tensors always come in tier order (l1, l2); the function name gives the direction, and
``src_pages`` index the tier the data comes from. Page indices: lists, ranges or 1-D integer tensors of
equal length; destinations must be distinct; empty lists are a no-op. ``layer`` is a pool slot
(``KVPool.layer_slot``), not a model layer id. ``page_size`` is optional (it is implied by a page_first
L2) and, when given, is checked against the shapes.

Backends (``backend="auto"``): the CUDA library (kernels/cuda) when l1 is on a GPU and it builds; else
Triton on a GPU; else the torch ops of kernels/ref.py. GPU copies are asynchronous on the current stream.
Every call validates its arguments and raises ValueError naming the problem; ``check=False`` skips only
the O(n) index checks (bounds, duplicate destinations), for callers whose indices come from an
allocator. Each op returns the name of the backend that ran.
"""
from __future__ import annotations

import numbers
from typing import Sequence, Union

import torch

from kernels import triton_copy
from kernels.ref import (L1_TO_L2, L2_TO_L1, LAYER_FIRST, LAYOUTS, PAGE_FIRST, PAGE_FIRST_DIRECT, alloc_l2,
                         l2_num_layers, l2_num_pages, l2_page_elems, l2_shape, ref_l1_to_l2, ref_l2_to_l1)

__all__ = ["LAYOUTS", "LAYER_FIRST", "PAGE_FIRST", "PAGE_FIRST_DIRECT", "BACKENDS", "l2_shape", "alloc_l2",
           "l1_to_l2", "l2_to_l1", "select_backend"]

BACKENDS = ("auto", "cuda", "triton", "torch")
Pages = Union[Sequence[int], torch.Tensor]


def select_backend(device: torch.device | str) -> str:
    """The backend ``auto`` picks for an L1 pool on ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        from kernels.cuda import loader
        if loader.available():
            return "cuda"
        if triton_copy.runnable(device):
            return "triton"
    return "torch"


def l1_to_l2(l1: torch.Tensor, l2: torch.Tensor, layout: str, src_pages: Pages, dst_pages: Pages,
             layer: int | None = None, *, page_size: int | None = None, backend: str = "auto",
             check: bool = True) -> str:
    """Backup: l2 page dst_pages[i] <- l1 page src_pages[i]. See the module docstring."""
    return _transfer(l1, l2, layout, src_pages, dst_pages, layer, page_size, backend, check, L1_TO_L2)


def l2_to_l1(l1: torch.Tensor, l2: torch.Tensor, layout: str, src_pages: Pages, dst_pages: Pages,
             layer: int | None = None, *, page_size: int | None = None, backend: str = "auto",
             check: bool = True) -> str:
    """Load: l1 page dst_pages[i] <- l2 page src_pages[i]. See the module docstring."""
    return _transfer(l1, l2, layout, src_pages, dst_pages, layer, page_size, backend, check, L2_TO_L1)


def _transfer(l1, l2, layout, src_pages, dst_pages, layer, page_size, backend, check, direction) -> str:
    _check_tensors(l1, l2, layout, layer, page_size)
    n_l1, n_l2 = l1.shape[1], l2_num_pages(l2, layout)
    n_src, n_dst = (n_l1, n_l2) if direction == L1_TO_L2 else (n_l2, n_l1)
    src = _as_index(src_pages, "src_pages")
    dst = _as_index(dst_pages, "dst_pages")
    if src.numel() != dst.numel():
        raise ValueError(f"src_pages and dst_pages differ in length ({src.numel()} vs {dst.numel()})")
    if check:
        src_tier, dst_tier = ("L1", "L2") if direction == L1_TO_L2 else ("L2", "L1")
        _check_index(src, n_src, "src_pages", src_tier, unique=False)
        _check_index(dst, n_dst, "dst_pages", dst_tier, unique=True)
    name = _resolve(backend, l1.device)
    if src.numel() == 0:
        return name
    if name == "torch":
        op = ref_l1_to_l2 if direction == L1_TO_L2 else ref_l2_to_l1
    elif name == "triton":
        op = triton_copy.triton_l1_to_l2 if direction == L1_TO_L2 else triton_copy.triton_l2_to_l1
    else:
        from kernels.cuda import loader
        op = loader.cuda_l1_to_l2 if direction == L1_TO_L2 else loader.cuda_l2_to_l1
    op(l1, l2, layout, src, dst, layer)
    return name


def _resolve(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return select_backend(device)
    if backend == "torch":
        return backend
    if backend == "triton":
        if not triton_copy.runnable(device):
            raise ValueError(f"backend 'triton' cannot run on {device} (needs a GPU or TRITON_INTERPRET=1)")
        return backend
    if backend == "cuda":
        from kernels.cuda import loader
        if device.type != "cuda" or not loader.available():
            raise ValueError(f"backend 'cuda' is unavailable for {device} (needs a GPU and an nvcc build)")
        return backend
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def _check_tensors(l1, l2, layout, layer, page_size) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown L2 layout {layout!r}; expected one of {LAYOUTS}")
    if not isinstance(l1, torch.Tensor) or not isinstance(l2, torch.Tensor):
        raise ValueError(f"l1 and l2 must be tensors, got {type(l1).__name__} and {type(l2).__name__}")
    want_dim = 4 if layout == PAGE_FIRST else 3
    if l1.dim() != 3:
        raise ValueError(f"l1 must be [L, P1, E] (KVPool.flat()), got shape {tuple(l1.shape)}")
    if l2.dim() != want_dim:
        raise ValueError(f"{layout} l2 must have {want_dim} dims, got shape {tuple(l2.shape)}")
    if l1.dtype != l2.dtype:
        raise ValueError(f"dtype mismatch: l1 is {l1.dtype}, l2 is {l2.dtype}")
    for name, t in (("l1", l1), ("l2", l2)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    L, E = l1.shape[0], l1.shape[2]
    if l2_num_layers(l2, layout) != L:
        raise ValueError(f"layer count mismatch: l1 has {L} layers, {layout} l2 {tuple(l2.shape)} has "
                         f"{l2_num_layers(l2, layout)}")
    if l2_page_elems(l2, layout) != E:
        raise ValueError(f"page size mismatch: l1 pages have E={E} elements, {layout} l2 {tuple(l2.shape)} "
                         f"has {l2_page_elems(l2, layout)}")
    if page_size is not None:
        if isinstance(page_size, bool) or not isinstance(page_size, numbers.Integral) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if E % (2 * page_size):
            raise ValueError(f"E={E} is not 2 * page_size * H * D for page_size {page_size}")
        if layout == PAGE_FIRST and l2.shape[1] != page_size:
            raise ValueError(f"page_size {page_size} disagrees with page_first l2 shape {tuple(l2.shape)}")
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, numbers.Integral)
                              or not 0 <= layer < L):
        raise ValueError(f"layer must be None or an int in [0, {L}), got {layer!r}")
    if l1.numel() and l2.numel() and l1.untyped_storage().data_ptr() == l2.untyped_storage().data_ptr():
        raise ValueError("l1 and l2 share storage; the tiers must be separate tensors")
    if l1.device.type == "cuda":
        if l2.device != l1.device and not (l2.device.type == "cpu" and l2.is_pinned()):
            raise ValueError(f"l2 must be pinned host memory or on {l1.device} when l1 is, got {l2.device}"
                             f"{' (not pinned)' if l2.device.type == 'cpu' else ''}")
    elif l2.device != l1.device:
        raise ValueError(f"l1 is on {l1.device} but l2 on {l2.device}")


def _as_index(pages: Pages, name: str) -> torch.Tensor:
    if isinstance(pages, torch.Tensor):
        if pages.dtype.is_floating_point or pages.dtype.is_complex or pages.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got dtype {pages.dtype}")
        if pages.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(pages.shape)}")
        return pages.to(torch.int64).contiguous()
    try:
        items = list(pages)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints or a 1-D tensor, got {type(pages).__name__}") from None
    bad = next((p for p in items if isinstance(p, bool) or not isinstance(p, numbers.Integral)), None)
    if bad is not None:
        raise ValueError(f"{name} must hold ints, got {bad!r} ({type(bad).__name__})")
    return torch.tensor([int(p) for p in items], dtype=torch.int64)


def _check_index(idx: torch.Tensor, n_pages: int, name: str, tier: str, unique: bool) -> None:
    if idx.numel() == 0:
        return
    cpu = idx.cpu()
    lo, hi = int(cpu.min()), int(cpu.max())
    if lo < 0 or hi >= n_pages:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} has page {bad} out of range [0, {n_pages}) for the {tier} pool")
    if unique:
        vals, counts = torch.unique(cpu, return_counts=True)
        if bool((counts > 1).any()):
            raise ValueError(f"{name} has duplicate destination page {int(vals[counts > 1][0])}")
