"""Shared cases and the naive oracle for the kernel tests.

The oracle copies one page of one layer at a time through an independent reading of each layout's
shape, so it checks the layout definitions themselves, not just agreement between backends.
"""
from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from kernels.ref import L1_TO_L2, L2_TO_L1, LAYOUTS, PAGE_FIRST, l2_shape

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PAGE_SIZES = (1, 16, 64)
DIRECTIONS = (L1_TO_L2, L2_TO_L1)
LAYER_MODES = ("all", "one")

# Small pools keep the Triton interpreter fast; H*D = 4 still gives E = 8 * page_size.
NUM_LAYERS, L1_PAGES, L2_PAGES, HEADS, HEAD_DIM = 3, 9, 11, 2, 2

CASES = [
    pytest.param(d, lay, dt, ps, mode, id=f"{d}-{lay}-{str(dt)[6:]}-ps{ps}-{mode}")
    for d, lay, dt, ps, mode in itertools.product(DIRECTIONS, LAYOUTS, DTYPES, PAGE_SIZES, LAYER_MODES)
]


def seed_of(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def make_pools(layout: str, dtype: torch.dtype, page_size: int, seed: int,
               num_layers: int = NUM_LAYERS) -> tuple[torch.Tensor, torch.Tensor]:
    """Random l1 [L, P1, E] and l2 (layout shape) with distinct contents."""
    g = torch.Generator().manual_seed(seed)
    E = 2 * page_size * HEADS * HEAD_DIM
    l1 = torch.randn(num_layers, L1_PAGES, E, generator=g).to(dtype)
    l2 = torch.randn(l2_shape(layout, num_layers, L2_PAGES, page_size, E), generator=g).to(dtype)
    return l1, l2


def index_sets(n_src: int, n_dst: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """Empty, scattered (random, distinct destinations, repeated sources allowed) and run-shaped lists."""
    g = torch.Generator().manual_seed(seed)
    n = min(n_src, n_dst) - 2
    scattered = (torch.randint(0, n_src, (n,), generator=g).tolist(),
                 torch.randperm(n_dst, generator=g)[:n].tolist())
    runs = ([2, 3, 4, 0, 7, 8], [5, 6, 7, 1, 2, 3])  # two runs of 3 around a lone page
    return [([], []), scattered, runs]


def layer_of(mode: str, seed: int) -> int | None:
    return None if mode == "all" else seed % NUM_LAYERS


def _l2_page(l2: torch.Tensor, layout: str, page: int, layer: int) -> torch.Tensor:
    """A view of page ``page`` of layer ``layer`` in l2, shaped like the layout stores it."""
    if layout == "layer_first":
        return l2[layer, page]
    if layout == PAGE_FIRST:
        return l2[page, :, layer, :]          # [page_size, E // page_size]: token-major chunks
    return l2[page, layer]


def naive_copy(l1: torch.Tensor, l2: torch.Tensor, layout: str, direction: str, src: list[int],
               dst: list[int], layer: int | None) -> None:
    layers = range(l1.shape[0]) if layer is None else [layer]
    for s, d in zip(src, dst):
        for lay in layers:
            if direction == L1_TO_L2:
                view = _l2_page(l2, layout, d, lay)
                view.copy_(l1[lay, s].view(view.shape))
            else:
                l1[lay, d].copy_(_l2_page(l2, layout, s, lay).reshape(-1))


def src_dst_sizes(direction: str) -> tuple[int, int]:
    return (L1_PAGES, L2_PAGES) if direction == L1_TO_L2 else (L2_PAGES, L1_PAGES)


def assert_same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...], what: str) -> None:
    for name, x, y in zip(("l1", "l2"), a, b):
        # Copies are bit moves: equal bits, not approximately equal values.
        assert torch.equal(x.view(-1), y.view(-1)), f"{what}: {name} differs from the oracle"
