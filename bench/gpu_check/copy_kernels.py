"""The kernels part: every copy kernel against its ``ref_*`` torch oracle, bit for bit over the whole
destination tensor (layouts, directions, all layers or one, scattered pages and runs, L2 pinned on the
host or on the device, bf16, fp32 and narrow page shapes)."""
from __future__ import annotations

import itertools

import torch

from bench.gpu_check.checks import Checks, sync


# (name, layers, L1 pages, L2 pages, page_size, kv heads, head dim): a page of every vector width the
# CUDA kernel picks (16, 8, 4 bytes and narrower) and short page_first chunks (Triton's CHUNKS > 1).
KERNEL_SHAPES = (("wide", 3, 48, 64, 16, 2, 64), ("narrow", 2, 24, 40, 4, 1, 8), ("odd", 2, 20, 24, 4, 1, 3))


def _rand_bits(shape, dtype, dev, g) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs and infinities included): the kernels move bits, not numbers."""
    bits = {2: torch.int16, 4: torch.int32}[torch.empty(0, dtype=dtype).element_size()]
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max, shape, dtype=bits, generator=g).view(dtype).to(dev)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).cpu()


def _case(backend: str, dev: torch.device, g, shape, dtype, layout: str, place: str, direction: str,
          layer, pattern: str) -> dict | None:
    """One copy through ``backend`` against ref_* on CPU copies of the same tiers; None when equal."""
    from storage.kernels_path import transfer
    from kernels import ref
    name, L, p1, p2, ps, h, d = shape
    E = 2 * ps * h * d
    n = min(p1, p2) // 2
    n_src, n_dst = (p1, p2) if direction == ref.L1_TO_L2 else (p2, p1)
    if pattern == "scattered":
        src, dst = torch.randperm(n_src, generator=g)[:n], torch.randperm(n_dst, generator=g)[:n]
    else:
        src, dst = torch.arange(3, 3 + n), torch.arange(1, 1 + n)
    l1 = _rand_bits((L, p1, E), dtype, dev, g)
    l2 = _rand_bits(ref.l2_shape(layout, L, p2, ps, E), dtype, "cpu", g)
    if place == "pinned" and dev.type == "cuda":
        l2 = l2.pin_memory()
    elif place == "device":
        l2 = l2.to(dev)
    want1, want2 = l1.cpu().clone(), l2.cpu().clone()
    (ref.ref_l1_to_l2 if direction == ref.L1_TO_L2 else ref.ref_l2_to_l1)(want1, want2, layout, src, dst, layer)
    fn = transfer.l1_to_l2 if direction == ref.L1_TO_L2 else transfer.l2_to_l1
    ran = fn(l1, l2, layout, src, dst, layer, page_size=ps, backend=backend)
    sync(dev)
    ok1, ok2 = torch.equal(_bits(l1), _bits(want1)), torch.equal(_bits(l2), _bits(want2))
    if ran == backend and ok1 and ok2:
        return None
    return {"shape": name, "dtype": str(dtype), "layout": layout, "l2": place, "direction": direction,
            "layer": layer, "pattern": pattern, "ran": ran, "l1_equal": ok1, "l2_equal": ok2}


def run(dev: torch.device, quick: bool) -> dict:
    import storage.kernels_path  # noqa: F401  (kernels/ on the `kernels` package's path)
    from kernels import ref, triton_copy
    from kernels.cuda import loader
    backends = ["torch"]
    if dev.type == "cuda":
        backends = ["cuda", "triton", "torch"]
    elif triton_copy.runnable(dev):
        backends.append("triton")   # the CPU under TRITON_INTERPRET=1
    checks = Checks()
    if dev.type == "cuda":
        with checks.check("cuda library builds and loads"):
            loader.build()
            if not loader.available():
                raise RuntimeError("kernels.cuda.loader.available() is False after a build")
        with checks.check("triton runnable"):
            if not triton_copy.runnable(dev):
                raise RuntimeError("triton is not runnable on this device")
    g = torch.Generator().manual_seed(0)
    dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32)
    places = ("pinned",) if dev.type != "cuda" else ("pinned", "device")
    for backend in backends:
        with checks.check(f"{backend}: equals ref_* bit for bit") as row:
            cases = list(itertools.product(KERNEL_SHAPES, dtypes, ref.LAYOUTS, places,
                                           (ref.L1_TO_L2, ref.L2_TO_L1), (None, "last"), ("scattered", "runs")))
            bad = [m for shape, dtype, layout, place, direction, layer, pattern in cases
                   if (m := _case(backend, dev, g, shape, dtype, layout, place, direction,
                                  None if layer is None else shape[1] - 1, pattern)) is not None]
            row["cases"] = len(cases)
            row["mismatches"] = bad[:20]
            if bad:
                raise AssertionError(f"{len(bad)} of {len(cases)} cases differ from ref_*")
    return {"checks": checks.rows}
