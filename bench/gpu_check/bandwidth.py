"""The bandwidth part: L1 <-> L2 page moves per backend and layout against the host link and against one
``copy_`` per (page, layer) chunk."""
from __future__ import annotations

import torch

from bench.gpu_check.checks import Checks, timed


def run(dev: torch.device, quick: bool) -> dict:
    """GB/s (bytes moved / time, one direction) of L1 <-> L2 page moves."""
    from storage.kernels_path import transfer
    from kernels import ref
    if dev.type == "cuda":
        L, h, d, ps, n_pool, n_move, reps = 32, 8, 128, 16, 512, 256, 5
    else:
        L, h, d, ps, n_pool, n_move, reps = 4, 2, 32, 16, 64, 32, 3
    dtype = torch.bfloat16
    E = 2 * ps * h * d
    g = torch.Generator().manual_seed(1)
    l1 = torch.randn(L, n_pool, E, dtype=dtype, device=dev)
    nbytes = n_move * L * E * l1.element_size()
    backends = ["cuda", "triton", "torch"] if dev.type == "cuda" else ["torch"]
    rows: list[dict] = []
    checks = Checks()
    # The host link: one contiguous copy of the same bytes between the device and pinned memory.
    flat_dev = torch.empty(nbytes // 2, dtype=dtype, device=dev)
    flat_host = torch.empty(nbytes // 2, dtype=dtype, pin_memory=dev.type == "cuda")
    link = {"D2H": timed(lambda: flat_host.copy_(flat_dev, non_blocking=True), dev, reps),
            "H2D": timed(lambda: flat_dev.copy_(flat_host, non_blocking=True), dev, reps)}
    for k, s in link.items():
        rows.append({"what": f"contiguous {k} copy (host link)", "layout": "-", "backend": "torch",
                     "GB/s": nbytes / s / 1e9, "ms": s * 1e3})
    del flat_dev, flat_host
    src = torch.randperm(n_pool, generator=g)[:n_move]
    dst = torch.randperm(n_pool, generator=g)[:n_move]
    for layout in ref.LAYOUTS:
        l2 = transfer.alloc_l2(layout, L, n_pool, ps, E, dtype, pin_memory=dev.type == "cuda")
        v1 = ref.page_view(l1, "l1", layout, ref.chunking(l2, layout)[0], None)
        v2 = ref.page_view(l2, "l2", layout, ref.chunking(l2, layout)[0], None)
        for direction, link_key in ((ref.L1_TO_L2, "D2H"), (ref.L2_TO_L1, "H2D")):
            fn = transfer.l1_to_l2 if direction == ref.L1_TO_L2 else transfer.l2_to_l1
            s_idx, d_idx = (src, dst)
            for backend in backends:
                with checks.check(f"{layout} {direction} {backend}"):
                    s = timed(lambda: fn(l1, l2, layout, s_idx, d_idx, backend=backend, check=False), dev, reps)
                    per_layer = timed(lambda: [fn(l1, l2, layout, s_idx, d_idx, layer=i, backend=backend,
                                                  check=False) for i in range(L)], dev, reps)
                    rows.append({"what": f"{n_move} scattered pages, all layers", "layout": layout,
                                 "direction": direction, "backend": backend, "GB/s": nbytes / s / 1e9,
                                 "ms": s * 1e3, "vs_link": link[link_key] / s,
                                 "layer_by_layer_GB/s": nbytes / per_layer / 1e9})
            # One copy_ (a cudaMemcpyAsync) per contiguous chunk: what a page move costs without a kernel.
            a, b = (v1, v2) if direction == ref.L1_TO_L2 else (v2, v1)
            si = s_idx.tolist()
            di = d_idx.tolist()

            def per_chunk():
                for i, j in zip(si, di):
                    for layer in range(L):
                        b[j, layer].copy_(a[i, layer], non_blocking=True)
            with checks.check(f"{layout} {direction} copy_ per chunk"):
                s = timed(per_chunk, dev, max(1, reps // 2))
                rows.append({"what": "copy_ per (page, layer) chunk", "layout": layout, "direction": direction,
                             "backend": "memcpy", "GB/s": nbytes / s / 1e9, "ms": s * 1e3,
                             "vs_link": link[link_key] / s})
        del l2
    best = {}
    for r in rows:
        if r["backend"] in ("cuda", "triton"):
            key = (r["layout"], r["direction"])
            memcpy = next((x for x in rows if x["backend"] == "memcpy" and x["layout"] == r["layout"]
                           and x.get("direction") == r["direction"]), None)
            if memcpy:
                r["vs_copy_per_chunk"] = memcpy["ms"] / r["ms"]
            best[key] = max(best.get(key, 0.0), r["GB/s"])
    return {"checks": checks.rows, "rows": rows,
            "shape": {"layers": L, "kv_heads": h, "head_dim": d, "page_size": ps, "dtype": "bfloat16",
                      "bytes_per_layer_page": E * 2, "pages_moved": n_move, "bytes_moved": nbytes}}
