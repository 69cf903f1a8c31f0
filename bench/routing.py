"""How the prefix router balances cached overlap against load (actors/routing.py's cost rule), measured:

    python -m bench.routing [--repeats 2]

2 prefill workers + 1 decode worker (L1+L2), bench.compare's quick multi-turn workload (concurrent
clients), once per routing setting and repeat (each repeat a different workload seed):
``load_weight`` 0 (cache only), 0.25, 1 (the default: a queued prefill token costs what a recomputed one
does) and 4, and round-robin as the cache-blind baseline. Reports the hit rate and TTFT of rounds 2+ and
how far apart the repeats are. Writes bench/results/routing.json. A shared 2-core box: relative only.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile

from cluster import launch  # noqa: F401  (the Ray environment first)
from actors.routing import RouterConfig
from bench.common import table, write_json
from bench.compare import QUICK, run_variant, variants


def _later(summary: dict) -> tuple[float, float]:
    rs = [r for r in summary["per_round"] if r["round"] > 0]
    n = sum(r["requests"] for r in rs)
    ttft = sum(r["ttft_mean_s"] * r["requests"] for r in rs) / max(1, n)
    hit = statistics.fmean(r["hit_rate"] for r in rs) if rs else 0.0
    return hit, ttft * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    wl0 = QUICK
    longest = wl0.request_length + wl0.num_rounds * (wl0.sub_question_length + wl0.output_length) + 64
    num_pages = (wl0.max_parallel + 1) * (longest // 16 + 1)
    with tempfile.TemporaryDirectory() as d:
        base = next(v for v in variants(num_pages, 8192, d) if v.name == "2P prefix router")
    settings = [(f"prefix, load_weight {w:g}", RouterConfig(load_weight=w)) for w in (0.0, 0.25, 1.0, 4.0)]
    settings.append(("round-robin", RouterConfig(policy="round_robin")))
    rows = []
    for name, rc in settings:
        for seed in range(args.repeats):
            var = dataclasses.replace(base, name=name, cluster=dataclasses.replace(base.cluster, router=rc))
            res = run_variant(var, dataclasses.replace(wl0, seed=seed), None)
            hit, ttft = _later(res["summary"])
            rows.append({"routing": name, "seed": seed, "hit_r2+": hit, "ttft_r2+_ms": ttft,
                         "errors": res["summary"]["errors"]})
            print(table(rows[-1:], list(rows[-1])), flush=True)
    agg = []
    for name, _ in settings:
        rs = [r for r in rows if r["routing"] == name]
        hits = [r["hit_r2+"] for r in rs]
        agg.append({"routing": name, "hit_r2+_mean": statistics.fmean(hits), "hit_spread": max(hits) - min(hits),
                    "ttft_r2+_ms_mean": statistics.fmean(r["ttft_r2+_ms"] for r in rs)})
    print("\n" + table(agg, list(agg[0])))
    path = write_json("routing", {"workload": dataclasses.asdict(wl0), "repeats": args.repeats, "l1_pages": num_pages,
                                  "runs": rows, "summary": agg})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
