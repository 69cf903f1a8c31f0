"""Quality and cost of the EPLB placement algorithm (engine/eplb.py) on synthetic skewed loads.

For Zipf-skewed expert loads (a fresh random expert order per layer, as real routers have different hot
experts in each layer) over 64/128 experts, 24 layers, 8/16 ranks and 0/16/32 redundant slots it prints
the balancedness (mean rank load / max rank load, averaged over layers; min over layers in brackets) of
the identity placement and of the rebalanced one, the ideal (an upper bound for any placement with that
many slots: no rank can be under the mean, nor under the largest per-replica load, which greedy global
replication minimises; not tight without redundancy, as it ignores the hot expert's rank-mates), and the time
``rebalance`` takes. Global policy, and hierarchical with 8 groups on 2 nodes.

    python -m bench.eplb [--zipf 1.0 1.2] [--reps 3] [--threads N]

Writes bench/results/eplb.json.
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import table, write_json
from engine.eplb import balancedness, identity_placement, rebalance

LAYERS, TOKENS = 24, 4096 * 24 * 4          # tokens routed per layer in one window (4096-token batches)


def zipf_load(layers: int, experts: int, s: float, seed: int) -> torch.Tensor:
    """[layers, experts] token counts: TOKENS draws from Zipf(s) over a random expert order per layer."""
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** s
    rows = []
    for _ in range(layers):
        draws = torch.multinomial(p, TOKENS, replacement=True, generator=g)
        rows.append(torch.bincount(draws, minlength=experts)[torch.randperm(experts, generator=g)])
    return torch.stack(rows)


def ideal(weight: torch.Tensor, logcnt: torch.Tensor, ranks: int) -> torch.Tensor:
    """Upper bound on balancedness per layer [L] under the global policy's replica budget."""
    w = weight.to(torch.float64)
    mean = w.sum(1) / ranks
    return mean / torch.maximum(mean, (w / logcnt).max(1).values)


def run(zipfs: list[float], reps: int) -> list[dict]:
    rows = []
    for s in zipfs:
        for E in (64, 128):
            w = zipf_load(LAYERS, E, s, seed=E)
            for R in (8, 16):
                for red in (0, 16, 32):
                    ident = identity_placement(LAYERS, E, R, red // R)
                    before = balancedness(w, ident.phy2log, ident.logcnt, R)
                    for policy, (G, N) in (("global", (1, 1)), ("hier", (8, 2))):
                        best = float("inf")
                        for _ in range(reps):
                            t0 = time.perf_counter()
                            phy2log, _, logcnt = rebalance(w, E + red, G, N, R)
                            best = min(best, time.perf_counter() - t0)
                        after = balancedness(w, phy2log, logcnt, R)
                        row = dict(zipf=s, experts=E, ranks=R, redundant=red, policy=policy,
                                   before=before.mean().item(), before_min=before.min().item(),
                                   after=after.mean().item(), after_min=after.min().item(),
                                   ms=best * 1e3)
                        if policy == "global":     # greedy global replication: the bound holds for both
                            bound = ideal(w, logcnt, R).mean().item()
                        row["ideal"] = bound
                        row["gain"] = row["after"] / row["before"]
                        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zipf", type=float, nargs="+", default=[1.0, 1.2], help="Zipf exponents")
    ap.add_argument("--reps", type=int, default=3, help="timing: best of this many rebalances")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {LAYERS} layers, "
          f"{TOKENS} routed tokens per layer, best of {args.reps}")
    rows = run(args.zipf, args.reps)
    shown = [{**r, "before": f"{r['before']:.3f} ({r['before_min']:.2f})",
              "after": f"{r['after']:.3f} ({r['after_min']:.2f})",
              "ideal": f"{r['ideal']:.3f}", "gain": f"{r['gain']:.2f}x",
              "ms": f"{r['ms']:.1f}"} for r in rows]
    print(table(shown, ["zipf", "experts", "ranks", "redundant", "policy", "before", "after", "ideal",
                        "gain", "ms"]))
    path = write_json("eplb", {"layers": LAYERS, "tokens_per_layer": TOKENS, "reps": args.reps, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
