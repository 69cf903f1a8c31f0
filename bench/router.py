"""Routing decisions/s and p99 decision latency of the pure router at 10k and 100k indexed pages.
Writes bench/results/router.json.

    python -m bench.router
"""
from __future__ import annotations

import random
import statistics
import time

from actors.routing import PrefixIndex, RouterConfig, prompt_blocks, prompt_keys, route
from bench.common import table, write_json
from storage.radix.node import KVEvent
from storage.geometry import KVGeometry


def build(n_pages: int, workers: int, cfg: RouterConfig, geom: KVGeometry, rng: random.Random):
    """Conversations of 64 pages spread over the workers, with the SWA window of each conversation."""
    idx = PrefixIndex()
    convs = []
    per = 64
    for c in range(n_pages // per):
        toks = [rng.randrange(256) for _ in range(per * geom.page_size + 1)]
        keys = prompt_keys(toks, geom, cfg)
        w = f"p{c % workers}"
        idx.apply(w, [KVEvent("stored", "L1", "full", tuple(keys)),
                      KVEvent("stored", "L1", "swa", tuple(keys[-geom.window_pages:]))])
        convs.append(toks)
    return idx, convs


def main() -> None:
    cfg = RouterConfig()
    geom = KVGeometry(page_size=16, window=64)   # 4 window pages
    rng = random.Random(0)
    rows = []
    for n_pages in (10_000, 100_000):
        workers = 4
        idx, convs = build(n_pages, workers, cfg, geom, rng)
        loads = {f"p{i}": {"queued_tokens": rng.randrange(2000), "running": rng.randrange(8)} for i in range(workers)}
        # Each request: a cached conversation plus a new turn (hashing the prompt is part of a decision).
        reqs = [c + [rng.randrange(256) for _ in range(64)] for c in rng.sample(convs, min(len(convs), 500))]
        # The router actor decides on keys the ingress hashed; hashing is timed apart (it runs on the
        # ingress replicas, in parallel).
        keyed = [prompt_blocks(r, geom, cfg) for r in reqs]
        t = time.perf_counter()
        for r in reqs:
            prompt_blocks(r, geom, cfg)
        hash_us = 1e6 * (time.perf_counter() - t) / len(reqs)
        lat = []
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < 3.0:
            t = time.perf_counter()
            route(idx, keyed[n % len(keyed)], len(reqs[0]), loads, cfg, geom)
            lat.append(time.perf_counter() - t)
            n += 1
        total = time.perf_counter() - t0
        lat.sort()
        rows.append({"indexed_pages": len(idx), "workers": workers, "prompt_tokens": len(reqs[0]),
                     "decisions_per_s": n / total, "p50_us": 1e6 * statistics.median(lat),
                     "p99_us": 1e6 * lat[int(0.99 * (len(lat) - 1))], "ingress_hash_us": hash_us})
    print(table(rows, ["indexed_pages", "workers", "prompt_tokens", "decisions_per_s", "p50_us", "p99_us",
                       "ingress_hash_us"]))
    print(f"wrote {write_json('router', {'rows': rows})}")


if __name__ == "__main__":
    main()
