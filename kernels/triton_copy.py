"""Triton page-copy kernels between the L1 pool and the L2 pool (all three layouts, both directions).

One kernel serves every case: ``kernels.ref.plan()`` turns (direction, layout, layer) into strides, and
each program copies ``PAGES`` page items of one layer in ``[PAGES, CHUNKS, BLOCK]`` tiles. Loads bypass L1
(``.cg``) and stores are streaming (``.cs``, evict-first): a page is touched exactly once, so caching it
would only evict the attention working set. (ptxas rejects an extra ``eviction_policy`` on either.)

Triton is imported on first use, never at import time: the package must import without it, and the
kernel must be (re)defined after ``TRITON_INTERPRET`` is set for the CPU interpreter (Triton reads the
flag when ``@triton.jit`` runs), so the compiled kernel is cached per interpreter mode.
"""
import functools
import importlib.util
import os

import torch

from kernels.ref import L1_TO_L2, L2_TO_L1, CopyPlan, plan

triton = None
tl = None

# Same-width integer views: the kernel only moves bits, and the interpreter has no bfloat16.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def available() -> bool:
    """Triton is installed (whether it can run depends on the device, see ``runnable``)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    if triton is not None and hasattr(triton, "knobs"):
        return bool(triton.knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runnable(device: torch.device) -> bool:
    """Triton can run on tensors of ``device``: a GPU, or the CPU under TRITON_INTERPRET=1."""
    return available() and (device.type == "cuda" or interpreting())


@functools.cache
def _kernel(interpret: bool):
    """The kernel, defined for (interpret=True) the CPU interpreter or (False) real compilation."""
    global triton, tl
    import triton
    import triton.language as tl

    # @triton.jit reads the flag from the environment: pin it so the cache key is the truth.
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        return _define()
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def _define():
    """Defined here, not at import, so that triton stays optional (uses the module globals above)."""
    @triton.jit
    def copy_pages(src, dst, src_idx, dst_idx, n_items, layer0,
                   s_page, s_layer, s_chunk, d_page, d_layer, d_chunk, n_chunks, chunk,
                   PAGES: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
        # Program (p, l) copies items [p*PAGES, (p+1)*PAGES) of layer layer0 + l, in
        # [PAGES, CHUNKS, BLOCK] tiles: CHUNKS > 1 only when chunks are short (page_first, small heads).
        items = tl.program_id(0) * PAGES + tl.arange(0, PAGES)
        live = items < n_items
        sp = tl.load(src_idx + items, mask=live, other=0).to(tl.int64)
        dp = tl.load(dst_idx + items, mask=live, other=0).to(tl.int64)
        layer = (layer0 + tl.program_id(1)).to(tl.int64)
        # 64-bit offsets: a pool is easily more than 2**31 elements.
        s_base = sp * s_page + layer * s_layer
        d_base = dp * d_page + layer * d_layer
        for c0 in range(0, n_chunks, CHUNKS):
            c = (c0 + tl.arange(0, CHUNKS)).to(tl.int64)
            s_c = (s_base[:, None] + c[None, :] * s_chunk)[:, :, None]
            d_c = (d_base[:, None] + c[None, :] * d_chunk)[:, :, None]
            rows = (live[:, None] & (c < n_chunks)[None, :])[:, :, None]
            # The innermost offsets are visibly contiguous and (with the strides' divisibility
            # specialisation) aligned: that is what lets Triton emit 16-byte vector accesses.
            for start in range(0, chunk, BLOCK):
                w = (start + tl.arange(0, BLOCK))[None, None, :]
                m = rows & (w < chunk)
                x = tl.load(src + (s_c + w), mask=m, cache_modifier=".cg")
                tl.store(dst + (d_c + w), x, mask=m, cache_modifier=".cs")

    return copy_pages


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch(p: CopyPlan, src_pages: torch.Tensor, dst_pages: torch.Tensor,
           pages_per_program: int = 8, block: int = 1024, tile: int = 4096) -> None:
    """Run one planned copy. src_pages/dst_pages: [n] int64 on a device the kernel can read."""
    n = src_pages.numel()
    if n == 0 or p.n_layers == 0:
        return
    bits = _BITS[p.src.element_size()]
    pages = min(_next_pow2(n), pages_per_program)
    blk = min(_next_pow2(p.chunk), block)
    # Short chunks are batched so one step still moves about `tile` elements per page.
    chunks = min(_next_pow2(p.n_chunks), max(1, tile // blk))
    grid = (_cdiv(n, pages), p.n_layers)
    _kernel(interpreting())[grid](
        p.src.view(bits), p.dst.view(bits), src_pages, dst_pages, n, p.layer0,
        *p.src_strides, *p.dst_strides, p.n_chunks, p.chunk, PAGES=pages, CHUNKS=chunks, BLOCK=blk)


def _run(l1: torch.Tensor, l2: torch.Tensor, layout: str, direction: str, src_pages: torch.Tensor,
         dst_pages: torch.Tensor, layer: int | None) -> None:
    p = plan(l1, l2, layout, direction, layer)
    # The kernel runs where L1 lives; a pinned host L2 is read/written through its device mapping.
    dev = l1.device
    launch(p, src_pages.to(dev, torch.int64), dst_pages.to(dev, torch.int64))


def triton_l1_to_l2(l1: torch.Tensor, l2: torch.Tensor, layout: str, src_pages: torch.Tensor,
                    dst_pages: torch.Tensor, layer: int | None = None) -> None:
    """Backup: l2 page dst_pages[i] <- l1 page src_pages[i]. l1: [L, P1, E]; l2: see ref.l2_shape."""
    _run(l1, l2, layout, L1_TO_L2, src_pages, dst_pages, layer)


def triton_l2_to_l1(l1: torch.Tensor, l2: torch.Tensor, layout: str, src_pages: torch.Tensor,
                    dst_pages: torch.Tensor, layer: int | None = None) -> None:
    """Load: l1 page dst_pages[i] <- l2 page src_pages[i]. Same shapes as triton_l1_to_l2."""
    _run(l1, l2, layout, L2_TO_L1, src_pages, dst_pages, layer)
