"""Bandwidth of the CPU transfer path (kernels dispatch -> torch ops) against the memcpy bound.

For each L2 layout, page size (16, 64), direction (backup L1->L2, load L2->L1) and layer mode (all
layers, one layer) it moves a few hundred scattered pages and reports GB/s next to one contiguous copy
of the same number of bytes (the memcpy bound) and their ratio. The op and the bound are timed in
alternation and the best of several repetitions is kept, so a busy machine slows both alike.

    python -m bench.kernels [--pages 256] [--reps 9] [--methods] [--threads N]
                            [--page-sizes 16 64] [--layouts page_first_direct ...]

Writes bench/results/kernels.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from storage.kernels_path import transfer  # first: it puts kernels/ on the `kernels` package's path
from kernels.ref import RUN_BYTES_MIN, find_runs, ref_l1_to_l2, ref_l2_to_l1

RESULTS = Path(__file__).resolve().parent / "results" / "kernels.json"
LAYERS, HEADS, HEAD_DIM, DTYPE = 8, 8, 64, torch.bfloat16
PAGE_SIZES = (16, 64)
TARGET = dict(layout="page_first_direct", page_size=64, layers="all", min_ratio=0.7)


def _filled(shape, dtype) -> torch.Tensor:
    # Written, not just allocated: untouched pages read as the shared zero page and look impossibly fast.
    return torch.empty(shape, dtype=dtype).uniform_(-1, 1)


def _best_pair(op, bound, reps: int) -> tuple[float, float]:
    op(), bound()  # first touch of destination pages is not what we measure
    t_op = t_bound = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        op()
        t1 = time.perf_counter()
        bound()
        t2 = time.perf_counter()
        t_op, t_bound = min(t_op, t1 - t0), min(t_bound, t2 - t1)
    return t_op, t_bound


def _method(n_bytes: int, src: torch.Tensor, dst: torch.Tensor) -> str:
    runs = len(find_runs(src, dst))
    return "runs" if n_bytes / runs >= RUN_BYTES_MIN else "index"


def run(pages: int, reps: int, methods: bool, page_sizes=PAGE_SIZES, layouts=transfer.LAYOUTS) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for ps in page_sizes:
        E = 2 * ps * HEADS * HEAD_DIM
        pool_pages = 2 * pages
        l1 = _filled((LAYERS, pool_pages, E), DTYPE)
        for layout in layouts:
            l2 = _filled(transfer.l2_shape(layout, LAYERS, pool_pages, ps, E), DTYPE)
            for direction in ("backup", "load"):
                src = torch.randperm(pool_pages, generator=gen)[:pages]
                dst = torch.randperm(pool_pages, generator=gen)[:pages]
                for mode in ("all", "one"):
                    layer = None if mode == "all" else LAYERS // 2
                    n_bytes = pages * E * l1.element_size() * (LAYERS if layer is None else 1)
                    a = _filled((n_bytes // l1.element_size(),), DTYPE)
                    b = torch.zeros_like(a)
                    api = transfer.l1_to_l2 if direction == "backup" else transfer.l2_to_l1
                    t_op, t_mem = _best_pair(lambda: api(l1, l2, layout, src, dst, layer, page_size=ps),
                                             lambda: b.copy_(a), reps)
                    row = dict(layout=layout, page_size=ps, op=direction, layers=mode, mbytes=n_bytes / 2**20,
                               method=_method(n_bytes, src, dst), gbps=n_bytes / t_op / 1e9,
                               memcpy_gbps=n_bytes / t_mem / 1e9)
                    row["ratio"] = row["gbps"] / row["memcpy_gbps"]
                    if methods:
                        ref = ref_l1_to_l2 if direction == "backup" else ref_l2_to_l1
                        for m in ("index", "runs"):
                            t_m, _ = _best_pair(lambda: ref(l1, l2, layout, src, dst, layer, method=m),
                                                lambda: None, max(3, reps // 2))
                            row[f"{m}_gbps"] = n_bytes / t_m / 1e9
                    rows.append(row)
                    print(_fmt(row, methods), flush=True)
                    del a, b
            del l2
    return rows


def _header(methods: bool) -> str:
    extra = f" {'index':>7} {'runs':>7}" if methods else ""
    return (f"{'layout':<18} {'ps':>3} {'op':<6} {'layers':<6} {'MiB':>6} {'method':<6} {'GB/s':>7} "
            f"{'memcpy':>7} {'ratio':>6}{extra}")


def _fmt(r: dict, methods: bool) -> str:
    extra = f" {r['index_gbps']:7.2f} {r['runs_gbps']:7.2f}" if methods else ""
    return (f"{r['layout']:<18} {r['page_size']:>3} {r['op']:<6} {r['layers']:<6} {r['mbytes']:6.0f} "
            f"{r['method']:<6} {r['gbps']:7.2f} {r['memcpy_gbps']:7.2f} {r['ratio']:6.2f}{extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=256, help="scattered pages moved per op")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--methods", action="store_true", help="also time the index and runs methods alone")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--page-sizes", type=int, nargs="+", default=list(PAGE_SIZES))
    ap.add_argument("--layouts", nargs="+", default=list(transfer.LAYOUTS), choices=transfer.LAYOUTS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # Other processes on a small box stall multi-threaded copies badly; the load average tells the reader.
    load_before = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, L={LAYERS} H={HEADS} D={HEAD_DIM} "
          f"{str(DTYPE)[6:]}, {args.pages} scattered pages, best of {args.reps}, load avg {load_before:.2f}")
    print(_header(args.methods))
    rows = run(args.pages, args.reps, args.methods, tuple(args.page_sizes), tuple(args.layouts))
    hits = [r for r in rows if all(r[k] == TARGET[k] for k in ("layout", "page_size", "layers"))]
    load_after = os.getloadavg()[0]
    met = bool(hits) and all(r["ratio"] >= TARGET["min_ratio"] for r in hits)
    print(f"target: {TARGET['layout']} ps={TARGET['page_size']} all layers >= {TARGET['min_ratio']} of memcpy: "
          + (", ".join(f"{r['op']} {r['ratio']:.2f}" for r in hits) or "not measured")
          + (" -> met" if met else " -> MISSED" if hits else "") + f" (load avg now {load_after:.2f})")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(dict(
        config=dict(layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, dtype=str(DTYPE), pages=args.pages,
                    reps=args.reps, page_sizes=args.page_sizes, layouts=args.layouts,
                    run_bytes_min=RUN_BYTES_MIN),
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(), torch=torch.__version__,
                     threads=torch.get_num_threads(), loadavg_1min=[load_before, load_after]),
        target=dict(TARGET, met=met), rows=rows), indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
