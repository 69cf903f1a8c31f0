"""SGLang 0.5.23's UnifiedRadixCache (FULL + SWA, its real pools and allocator; Python and Rust tree
cores) on bench/branch.py's requests, replayed from bench/results/branch_requests.json: the SGLang row of
the shared-prefix benchmark, on the same instance.

Each request is served as SGLang's scheduler serves it, on the tree alone: match the prompt (at most
(len - 1) // 16 pages) and lock, make room, allocate the rest of prompt + answer, free the request's own
sliding KV below its last window (``free_swa_out_of_window_slots``, SGLang >= PR #17220: it keeps
``ceil(window / page) + 1`` pages), insert prompt + answer, unlock. Pools as strata's rows: 2048 full pages,
the SWA pool of strata's default and small rows. Run under the side venv of bench/tree_sglang.py:

    cd <worktree> && PYTHONPATH=$PWD /tmp/sglvenv/bin/python -m bench.branch_sglang [--core python rust]

Writes bench/results/branch_sglang.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import bench.tree_sglang as ts

PAGE, WINDOW, FULL_PAGES = 16, 64, 2048   # strata-tiny's window, bench/branch.py's engine


def replay(requests: list[dict], swa_pages: int, core: str) -> dict:
    c = ts.SGLangSWA(FULL_PAGES, swa_pages, core)
    torch = ts.S.torch
    hits = ideal = prompt_tokens = 0
    swa_peak = 0
    for r in requests:
        tokens, plen = r["tokens"], r["prompt_len"]
        lock, m, hit = c.match(tokens[:plen], (plen - 1) // PAGE)
        n = len(tokens) // PAGE
        c.room((n - m) * PAGE, (n - m) * PAGE)
        own = c.alloc_tail(hit, m, n)
        lo = max(0, n - c.keep)
        evicted = 0
        if lo > m:
            c.alloc.free_swa_segment(own[:(lo - m) * PAGE], start_pos=m * PAGE)
            evicted = lo * PAGE
        c.insert(tokens[:n * PAGE], torch.cat([hit.to(torch.int64), own.to(torch.int64)]), m, evicted)
        c.cache.unlock(lock)
        swa_peak = max(swa_peak, swa_pages - c.alloc.swa_available_size() // PAGE)
        hits += m * PAGE
        ideal += r["ideal"]
        prompt_tokens += plen
    return {"hit_rate": hits / prompt_tokens, "ideal_hit_rate": ideal / prompt_tokens,
            "of_ideal": hits / ideal if ideal else 1.0, "swa_pages_peak": swa_peak, "swa_pool": swa_pages,
            "tree_core": c.core, "requests": len(requests)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--core", nargs="+", default=list(ts.CORES))
    args = ap.parse_args()
    ts.S = ts._import_sglang()
    ts.WINDOW, ts.KEEP_PAGES = WINDOW, -(-WINDOW // PAGE) + 1
    res = Path(__file__).parent / "results"
    data = json.loads((res / "branch_requests.json").read_text())
    rows = []
    for wl, w in data["workloads"].items():
        for pool, swa in w["swa_pools"].items():
            for core in args.core:
                r = {"workload": wl, "pools": pool, "row": f"sglang {core}", **replay(w["requests"], swa, core)}
                rows.append(r)
                print(f"{wl:5s} {pool:8s} {r['row']:14s} hit {r['hit_rate']:.3f} (ideal {r['ideal_hit_rate']:.3f}, "
                      f"{r['of_ideal']:.2f}x)  SWA pages peak {r['swa_pages_peak']} pool {swa}", flush=True)
    out = res / "branch_sglang.json"
    out.write_text(json.dumps({"sglang": ts._version(), "quick": data["quick"], "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
