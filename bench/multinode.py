"""Conversations that move between two prefill workers on different nodes (a 3-node local Ray cluster,
cluster/local_cluster.py: prefill-0, prefill-1 and decode-0 each on its own raylet, all on 127.0.0.1):

    python -m bench.multinode [--quick]

Every round, the router may send turns to only one prefill worker (the other is drained for that round),
so each conversation changes node at every turn -- what a load balancer, a scale-in or a lost node does
to a conversation. Three deployments, one after the other:

* ``moved, L3``: pd-2p1d with the shared L3 (file store): a moved turn finds its prefix in L3;
* ``moved, no L3``: the same without L3: a moved turn recomputes what its new worker never saw;
* ``sticky``: the prefix router left alone (no draining): turns return to the worker holding them.

Reports the hit rate by tier over turns 2+ and the TTFT (first streamed chunk, client side) of moved
turns with L3 against recompute. Writes bench/results/multinode.json. Timings come from a shared
2-core machine: read them as relative.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import tempfile
import time

from cluster import launch  # first: sets the Ray environment (loopback only) before ray is imported
from cluster.config import load_config
from cluster.local_cluster import LocalCluster

import httpx  # noqa: E402
import ray  # noqa: E402

from bench.common import table, write_json  # noqa: E402


def _cfg(port: int, l3_dir: str | None):
    cfg = load_config("cluster/configs/pd-2p1d.yaml")
    hc = cfg.engine.hicache
    hc = dataclasses.replace(hc, l3=dataclasses.replace(hc.l3, path=l3_dir)) if l3_dir else \
        dataclasses.replace(hc, l3=None)
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, hicache=hc),
                               server=dataclasses.replace(cfg.server, port=port))


def _turn(url: str, ids: list[int], n: int) -> dict:
    t0 = time.perf_counter()
    ttft, last = None, None
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                last = json.loads(line[6:])
    meta = last["meta_info"]
    return {"ttft": ttft, "output_ids": last["output_ids"], "prompt": len(ids),
            "by_tier": meta.get("cached_tokens_by_tier") or {}, "cached": meta.get("cached_tokens", 0),
            "prefill": meta["route"]["prefill"]}


def run(name: str, cfg, convs: int, rounds: int, first: int, step: int, out_len: int, move: bool) -> dict:
    handles = launch.deploy(cfg)
    router, url = handles["router"], handles["url"]
    rng = random.Random(0)
    hist = [[rng.randrange(3, 250) for _ in range(first)] for _ in range(convs)]
    turns = []
    try:
        _turn(url, [1, 2, 3], 2)      # warm up the path
        for r in range(rounds):
            if move:   # this round only prefill-(r % 2) takes turns: every conversation changes node
                ray.get(router.restore_worker.remote(f"prefill-{r % 2}"))
                ray.get(router.drain.remote(f"prefill-{(r + 1) % 2}"))
            for c in range(convs):
                t = _turn(url, hist[c], out_len)
                t.update(round=r, conv=c)
                turns.append(t)
                hist[c] = hist[c] + t["output_ids"] + [rng.randrange(3, 250) for _ in range(step)]
            time.sleep(1.0)    # write-through to L3 and the KV events settle between rounds
    finally:
        launch.shutdown(handles)
    later = [t for t in turns if t["round"] > 0]
    toks = sum(t["prompt"] for t in later)
    tier = {k: sum(t["by_tier"].get(k, 0) for t in later) / toks for k in ("L1", "L2", "L3")}
    moved = [t for t in later if move]
    return {"variant": name, "turns": len(turns), "hit_rate": sum(t["cached"] for t in later) / toks,
            **{f"hit_{k}": v for k, v in tier.items()},
            "ttft_ms_mean": 1e3 * statistics.mean(t["ttft"] for t in later),
            "ttft_ms_p50": 1e3 * statistics.median(t["ttft"] for t in later),
            "moved_turns": len(moved), "workers_used": sorted({t["prefill"] for t in turns}),
            "_turns": turns}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.multinode")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    convs, rounds, first, step, out_len = (4, 3, 512, 128, 8) if args.quick else (6, 4, 2048, 256, 16)
    lc = LocalCluster(nodes=3, cpus=3)
    lc.connect()
    rows = []
    try:
        from tests.util import free_port
        for name, l3, move in (("moved, L3", True, True), ("moved, no L3 (recompute)", False, True),
                               ("sticky (prefix router), L3", True, False)):
            l3_dir = tempfile.mkdtemp(prefix="strata-mn-l3-") if l3 else None
            rows.append(run(name, _cfg(free_port(), l3_dir), convs, rounds, first, step, out_len, move))
            print(table(rows[-1:], ["variant", "hit_rate", "hit_L1", "hit_L2", "hit_L3", "ttft_ms_mean"]), flush=True)
    finally:
        lc.shutdown()
    cols = ["variant", "turns", "hit_rate", "hit_L1", "hit_L2", "hit_L3", "ttft_ms_mean", "ttft_ms_p50"]
    print("\n" + table(rows, cols))
    l3, rec = rows[0], rows[1]
    # The turns whose prefix came from L3 (another node's work), against the same turns recomputed.
    keys = {(t["round"], t["conv"]) for t in l3["_turns"] if t["by_tier"].get("L3", 0) > 0}
    ttft = {name: 1e3 * statistics.mean(t["ttft"] for t in row["_turns"] if (t["round"], t["conv"]) in keys)
            for name, row in (("l3", l3), ("recompute", rec))} if keys else {"l3": 0.0, "recompute": 0.0}
    summary = {"l3_cross_worker_hit_rate": l3["hit_L3"], "l3_turns": len(keys),
               "l3_tokens_per_l3_turn": (sum(t["by_tier"]["L3"] for t in l3["_turns"] if (t["round"], t["conv"]) in keys)
                                         / max(1, len(keys))),
               "ttft_ms_moved_l3": ttft["l3"], "ttft_ms_moved_recompute": ttft["recompute"],
               "ttft_speedup_vs_recompute": ttft["recompute"] / ttft["l3"] if ttft["l3"] else 0.0}
    for row in rows:
        row.pop("_turns")
    print(f"\nmoved turns: L3 serves {summary['l3_cross_worker_hit_rate']:.3f} of prompt tokens; the "
          f"{summary['l3_turns']} turns served from L3: TTFT {summary['ttft_ms_moved_l3']:.0f} ms vs "
          f"{summary['ttft_ms_moved_recompute']:.0f} ms recomputing ({summary['ttft_speedup_vs_recompute']:.2f}x)")
    path = write_json("multinode", {"nodes": 3, "workload": {"conversations": convs, "rounds": rounds,
                                                              "first_prompt": first, "tokens_per_round": step,
                                                              "output": out_len, "quick": args.quick},
                                    "rows": rows, "summary": summary})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
