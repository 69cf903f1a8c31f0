"""Quality and cost of the EPLB placement algorithm (engine/eplb.py) on synthetic skewed loads.

For Zipf-skewed expert loads (a fresh random expert order per layer, as real routers have different hot
experts in each layer) over 64/128 experts, 24 layers, 8/16 ranks and 0/16/32 redundant slots it prints
the balancedness (mean rank load / max rank load, averaged over layers; min over layers in brackets) of
the identity placement and of the rebalanced one, the ideal (an upper bound for any placement with that
many slots: no rank can be under the mean, nor under the largest per-replica load, which greedy global
replication minimises; not tight without redundancy, as it ignores the hot expert's rank-mates), and the time
``rebalance`` takes. Global policy, and hierarchical with 8 groups on 2 nodes.

A second section drives real models through the Engine with a skewed workload (a few hot tokens
repeated in most prompts) and the rebalancer's logic (actors/eplb.py) on a forward-pass schedule: it
prints the per-rank balancedness measured from the slot counters per collection interval before and after
the schedule acts, how long applying a placement takes (weights copied into the changed slots, then the
mapping switched), and checks the greedy tokens equal those of the same model without slots.

    python -m bench.eplb [--zipf 1.0 1.2] [--reps 3] [--threads N] [--section algorithm model] [--quick]

Writes bench/results/eplb.json ("rows": the algorithm section, "model": the model section).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.common import RESULTS, table, write_json
from engine.eplb import EplbConfig, balancedness, identity_placement, rebalance

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


# ------------------------------------------------------------------------------------- model section

# (name, model overrides of tiny_config (None: strata-tiny itself), ranks, redundant slots)
MODELS = [("strata-tiny", None, 4, 4),
          ("e32-h128", dict(num_local_experts=32, num_experts_per_tok=4, hidden_size=128,
                            intermediate_size=256, num_attention_heads=4, head_dim=32), 8, 8)]
HOT = (7, 9, 11)


def skewed_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts of 32..96 tokens, ~80% of them drawn from a few hot tokens: a skewed expert load."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(32, 97, (1,), generator=g))
        hot = torch.tensor(HOT)[torch.randint(0, len(HOT), (length,), generator=g)]
        cold = torch.randint(0, 256, (length,), generator=g)
        out.append(torch.where(torch.rand(length, generator=g) < 0.8, hot, cold).tolist())
    return out


def _model_path(name: str, overrides: dict | None) -> str:
    if overrides is None:
        return name
    from engine.model.loader import random_state_dict, save_checkpoint, tiny_config
    path = Path(tempfile.gettempdir()) / f"strata-bench-eplb-{name}"
    if not (path / "config.json").is_file():
        cfg = tiny_config(**overrides)
        save_checkpoint(path, cfg, random_state_dict(cfg, seed=5))
    return str(path)


def drive(name: str, overrides: dict | None, ranks: int, redundant: int, n_req: int) -> dict:
    """One model: the skewed workload arriving in waves through Engine.step, counters collected every 4
    steps, a rebalance due every 16 forward passes (window: the last 6 collections)."""
    from actors.eplb import EplbRebalancer
    from engine import Engine, EngineConfig, SamplingParams
    path = _model_path(name, overrides)
    ecfg = EplbConfig(num_ranks=ranks, num_redundant_experts=redundant, window=6, interval_seconds=0,
                      interval_steps=16, threshold=0.95, dispatch="torch")
    kw = dict(model=path, page_size=16, num_pages=1024, max_batch_tokens=256)
    eng = Engine(EngineConfig(**kw, eplb=ecfg))
    mc = eng.model_config
    rb = EplbRebalancer(ecfg, len(mc.moe_layer_ids), mc.num_local_experts, now=0.0)
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = skewed_prompts(n_req, seed=1)
    rids, phase, intervals, applies = [], "before", [], []
    t0 = time.perf_counter()
    while len(rids) < n_req or eng.has_unfinished():
        if eng.counters["steps"] % 6 == 0 and len(rids) < n_req:     # 4 new requests every 6 steps
            rids += [eng.add_request(p, sp) for p in prompts[len(rids):len(rids) + 4]]
        eng.step()
        step = eng.counters["steps"]
        if step % 4 == 0:
            rb.observe({"w": eng.expert_reading()}, float(step))
            intervals.append((phase, rb.status()["measured_balancedness_last"]))
            if rb.due(float(step)):
                d = rb.plan(float(step))
                if d.apply:
                    res = eng.apply_placement(d.placement.phy2log)
                    rb.applied(d, res.seconds, res.seconds, res.moved_slots, 1)
                    applies.append({**res._asdict(), "before": float(d.before.mean()), "after": float(d.after.mean())})
                    phase = "after"
                else:
                    rb.skip(d)
    wall = time.perf_counter() - t0
    got = [eng.pop_finished(r).token_ids for r in rids]
    plain = Engine(EngineConfig(**kw))
    same = got == [o.token_ids for o in plain.generate(prompts, sp)]
    row = {"model": name, "experts": mc.num_local_experts, "layers": mc.num_hidden_layers, "ranks": ranks,
           "slots": mc.num_local_experts + redundant, "requests": n_req, "steps": eng.counters["steps"],
           "rebalances": len(applies), "tokens_identical": same, "wall_s": wall}
    for ph in ("before", "after"):
        vals = torch.tensor([b for p, bs in intervals if p == ph for b in bs], dtype=torch.float64)
        row[f"measured_{ph}"] = float(vals.mean()) if vals.numel() else None
        row[f"measured_{ph}_min"] = float(vals.min()) if vals.numel() else None
    # Apply cost on its own: swap between two full placements (every slot may move), best of 5.
    L, P = eng.expert_reading().phy2log.shape
    swaps = []
    for i in range(10):
        g = torch.Generator().manual_seed(i % 2)
        res = eng.apply_placement(rebalance(torch.rand(L, mc.num_local_experts, generator=g) ** 4, P, 1, 1,
                                            ranks)[0])
        swaps.append((res.seconds, res.moved_slots))
    best = min(swaps[1:])
    row.update(swap_ms_best=best[0] * 1e3, swap_moved=best[1])
    if applies:
        secs = sorted(a["seconds"] for a in applies)
        row.update(predicted_before=applies[0]["before"], predicted_after=applies[0]["after"],
                   apply_ms=1e3 * secs[len(secs) // 2], moved_slots=applies[0]["moved_slots"],
                   moved_later=[a["moved_slots"] for a in applies[1:]],
                   expert_mb=sum(p.numel() * p.element_size() for m in eng.moe_layers
                                 for p in m.experts.parameters()) / 2 ** 20)
    return row


def model_section(quick: bool) -> list[dict]:
    n = 16 if quick else 40
    rows = [drive(name, ov, r, red, n) for name, ov, r, red in MODELS]
    shown = [{**r, **{k: f"{r[k]:.3f}" for k in ("measured_before", "measured_after", "predicted_before",
                                                    "predicted_after") if r.get(k) is not None},
              "min b/a": f"{r['measured_before_min'] or 0:.2f}/{r['measured_after_min'] or 0:.2f}",
              "apply_ms": f"{r.get('apply_ms', 0):.2f}", "expert_mb": f"{r.get('expert_mb', 0):.1f}",
              "swap_ms": f"{r['swap_ms_best']:.2f} ({r['swap_moved']})"}
             for r in rows]
    print("\nper-rank balancedness (mean/max rank load, per layer and 4-step interval, measured from the slot "
          "counters) before and after the schedule acts; apply_ms: median wall time of the schedule's\n"
          "applies (copy changed slots + switch, between steps); swap_ms: best of 9 swaps between two\n"
          "unrelated placements (slots moved)")
    print(table(shown, ["model", "experts", "ranks", "slots", "steps", "rebalances", "measured_before",
                        "measured_after", "min b/a", "predicted_before", "predicted_after", "moved_slots",
                        "expert_mb", "apply_ms", "swap_ms", "tokens_identical"]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zipf", type=float, nargs="+", default=[1.0, 1.2], help="Zipf exponents")
    ap.add_argument("--reps", type=int, default=3, help="timing: best of this many rebalances")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--section", nargs="+", default=["algorithm", "model"], choices=["algorithm", "model"])
    ap.add_argument("--quick", action="store_true", help="model section: fewer requests")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    payload = {}
    if "algorithm" in args.section:
        payload.update(algorithm_section(args))
    if "model" in args.section:
        payload["model"] = model_section(args.quick)
    if set(args.section) != {"algorithm", "model"} and (RESULTS / "eplb.json").is_file():
        old = json.loads((RESULTS / "eplb.json").read_text())   # keep the section not rerun
        payload = {**{k: v for k, v in old.items() if k != "machine"}, **payload}
    path = write_json("eplb", payload)
    print(f"wrote {path}")


def algorithm_section(args) -> dict:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {LAYERS} layers, "
          f"{TOKENS} routed tokens per layer, best of {args.reps}")
    rows = run(args.zipf, args.reps)
    shown = [{**r, "before": f"{r['before']:.3f} ({r['before_min']:.2f})",
              "after": f"{r['after']:.3f} ({r['after_min']:.2f})",
              "ideal": f"{r['ideal']:.3f}", "gain": f"{r['gain']:.2f}x",
              "ms": f"{r['ms']:.1f}"} for r in rows]
    print(table(shown, ["zipf", "experts", "ranks", "redundant", "policy", "before", "after", "ideal",
                        "gain", "ms"]))
    return {"layers": LAYERS, "tokens_per_layer": TOKENS, "reps": args.reps, "rows": rows}


if __name__ == "__main__":
    main()
