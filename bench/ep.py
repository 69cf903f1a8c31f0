"""Expert parallelism with real processes: a Zipf(1.2)-skewed workload on an EP group of 4 Ray rank
actors over gloo (actors/ep_group.py), before and after the EPLB rebalancer acts on the per-rank loads
the ranks measured.

The model is a seeded GPT-OSS-style MoE (4 layers, 8 experts top-2, hidden 128, expert width 512, so the
experts' work dominates a rank's MoE time); each layer's router bias is ``c * log p`` with p Zipf(1.2)
over the experts in identity order, which makes the experts' shares of the routed (token, choice) pairs
follow Zipf(1.2) (``c`` is fitted first on a single-process engine; the table prints target and
measured shares). Identity placement: rank r holds experts 2r, 2r+1 and a replica of expert r, so the hot
experts share rank 0.

Phases: ``before`` (identity placement) runs a batch of prompts and reads every rank's counters (pairs
served, expert compute wall and thread-CPU seconds); the rebalancer (actors/eplb.py ``EplbRebalancer``)
observes the group's reading (measured rank loads) and plans a migration-aware placement, which is
applied while a generation job is running (staging in the background, then one pause); ``after`` runs a
fresh batch from the same distribution. Greedy tokens are checked against the single-process engine.

A second table compares, on drifting Zipf(1.2) loads at a larger scale (64 experts, 8 ranks, 16
redundant slots, 2 nodes), the slots a rebalance moves applying the reference policy's plain output and
the migration-aware relabelling, and their balancedness.

    python -m bench.ep [--requests 24] [--prompt-len 96]

Writes bench/results/ep.json.
"""
from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch

from bench.common import table, write_json
from cluster import launch  # noqa: F401  (the Ray environment: loopback, no token auth)
from engine import Engine, EngineConfig, SamplingParams
from engine.eplb import EplbConfig, Placement, align_placement, balancedness, moved_slots, rebalance

R, E, REDUNDANT, ZIPF = 4, 8, 4, 1.2


def zipf_p(n: int, s: float) -> torch.Tensor:
    p = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** s
    return p / p.sum()


def make_model(root: Path, c: float) -> str:
    from engine.model.loader import random_state_dict, save_checkpoint, tiny_config
    cfg = tiny_config(hidden_size=128, intermediate_size=512, head_dim=32, num_local_experts=E)
    sd = random_state_dict(cfg, seed=11)
    bias = c * zipf_p(E, ZIPF).log().to(torch.float32)
    for name in sd:
        if name.endswith("router.bias"):
            sd[name] = (bias - bias.mean()).clone()
    path = root / f"ep-bench-c{c:g}"
    save_checkpoint(path, cfg, sd)
    return str(path)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


def shares(counts: torch.Tensor) -> torch.Tensor:
    """counts [L, E] -> each expert's share of the pairs, averaged over layers, sorted descending."""
    s = counts.to(torch.float64)
    return (s / s.sum(1, keepdim=True)).mean(0).sort(descending=True).values


def fit_bias(root: Path, sample: list[list[int]]) -> tuple[float, str, list[float]]:
    """The router-bias scale whose measured expert shares are closest to Zipf(1.2)."""
    target = zipf_p(E, ZIPF)
    best = None
    for c in (0.8, 1.0, 1.2, 1.5, 1.8, 2.2):
        path = make_model(root, c)
        eng = Engine(EngineConfig(model=path, num_pages=256, torch_threads=1))
        eng.generate(sample, SamplingParams(max_new_tokens=1, ignore_eos=True))
        got = shares(eng.expert_load())
        err = float((got - target).abs().sum())
        if best is None or err < best[0]:
            best = (err, c, path, got.tolist())
    return best[1], best[2], best[3]


def delta(after: list, before: list) -> dict:
    """Per-rank sums over layers between two stats snapshots."""
    out = {"pairs": [], "pairs_layers": [], "compute_s": [], "cpu_s": [], "wall_s": []}
    for a, b in zip(after, before):
        out["pairs_layers"].append([x - y for x, y in zip(a.pairs, b.pairs)])
        out["pairs"].append(sum(a.pairs) - sum(b.pairs))
        out["compute_s"].append(sum(a.compute_s) - sum(b.compute_s))
        out["cpu_s"].append(sum(a.cpu_s) - sum(b.cpu_s))
        out["wall_s"].append(sum(a.wall_s) - sum(b.wall_s))
    per_layer = torch.tensor(out["pairs_layers"], dtype=torch.float64).T            # [L, R]
    lay = per_layer.max(1).values / per_layer.mean(1)
    out["share_max_over_mean"] = max(out["pairs"]) / (sum(out["pairs"]) / len(out["pairs"]))
    out["share_max_over_mean_worst_layer"] = float(lay.max())
    out["share_max_over_mean_per_layer"] = lay.tolist()
    out["slowest_rank_moe_s"] = max(out["compute_s"])
    out["slowest_rank_moe_cpu_s"] = max(out["cpu_s"])
    return out


def phase(ray, ranks, batch, n_new) -> tuple[dict, list[list[int]], float]:
    before = ray.get([r.stats.remote() for r in ranks])
    t = time.perf_counter()
    toks = ray.get(ranks[0].generate.remote(batch, SamplingParams(max_new_tokens=n_new, ignore_eos=True)))
    secs = time.perf_counter() - t
    after = ray.get([r.stats.remote() for r in ranks])
    return delta(after, before), toks, secs


def same_tokens(ref: Engine, batch, n_new, got) -> bool:
    want = ref.generate(batch, SamplingParams(max_new_tokens=n_new, ignore_eos=True))
    return all(w.token_ids == g for w, g in zip(want, got))


def serving_section(args, root: Path) -> dict:
    import ray
    from actors.ep_group import create_ep_group, join_ep_group, stop_ep_group
    from actors.eplb import EplbRebalancer
    c, path, measured_shares = fit_bias(root, prompts(8, args.prompt_len, seed=99))
    eplb = EplbConfig(num_ranks=R, num_redundant_experts=REDUNDANT, interval_steps=1, threshold=0.95)
    cfg = EngineConfig(model=path, num_pages=1024, torch_threads=1, max_batch_tokens=args.batch_tokens,
                       max_running_requests=64, eplb=eplb)
    ref = Engine(EngineConfig(model=path, num_pages=1024, torch_threads=1, max_batch_tokens=args.batch_tokens))
    launch.start_local_ray(num_cpus=2)
    ranks = join_ep_group(create_ep_group(cfg, R, num_cpus=0.25))
    try:
        leader = ranks[0]
        ray.get(leader.generate.remote(prompts(2, 16, seed=7), SamplingParams(max_new_tokens=2)))   # warm up
        logic = EplbRebalancer(eplb, 4, E, time.monotonic())
        logic.observe({"ep0": ray.get(leader.expert_load.remote())}, time.monotonic())
        b_batch = prompts(args.requests, args.prompt_len, seed=1)
        before, b_toks, b_secs = phase(ray, ranks, b_batch, args.new_tokens)
        logic.observe({"ep0": ray.get(leader.expert_load.remote())}, time.monotonic())
        measured_before = logic.current_balancedness()
        d = logic.plan(time.monotonic(), force=True)
        assert d.apply, d.reason
        # Apply while a generation job runs: staging overlaps serving, then one pause for the switch.
        job = ray.get(leader.submit.remote(prompts(8, args.prompt_len, seed=3),
                                           SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)))
        while ray.get(leader.tokens_so_far.remote(job)) < 1:
            time.sleep(0.005)
        rep = ray.get(leader.apply_placement.remote(d.placement.phy2log))
        during = ray.get(leader.tokens_so_far.remote(job))
        d_toks = ray.get(leader.result.remote(job))
        logic.applied(d, rep.seconds, rep.pause_seconds, rep.moved_slots, 1)
        a_batch = prompts(args.requests, args.prompt_len, seed=2)
        after, a_toks, a_secs = phase(ray, ranks, a_batch, args.new_tokens)
        ok = {"before": same_tokens(ref, b_batch, args.new_tokens, b_toks),
              "during": same_tokens(ref, prompts(8, args.prompt_len, seed=3), args.new_tokens, d_toks),
              "after": same_tokens(ref, a_batch, args.new_tokens, a_toks)}
        status = logic.status()
    finally:
        stop_ep_group(ranks)
        ray.shutdown()
    return {"router_bias_scale": c, "zipf_target_shares": zipf_p(E, ZIPF).tolist(),
            "measured_expert_shares": measured_shares, "ranks": R, "experts": E, "redundant": REDUNDANT,
            "requests_per_phase": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "before": {**before, "seconds": b_secs}, "after": {**after, "seconds": a_secs},
            "measured_balancedness_before": measured_before.tolist(),
            "rebalance": {**rep._asdict(), "planned_moves": d.planned_moves, "reference_moves": d.reference_moves,
                          "predicted_balancedness": d.after.tolist(),
                          "tokens_done_at_switch": during, "job_tokens": 8 * args.new_tokens},
            "greedy_tokens_equal_single_process": ok,
            "rank_moe_seconds_reported": status["rank_moe_seconds"]}


def migration_section(rounds: int = 6) -> list[dict]:
    """Drifting Zipf(1.2) loads (a new random expert order per round and layer, 24 layers): moves and
    balancedness of the reference policy's plain output vs the migration-aware relabelling."""
    rows = []
    for E_, R_, red, G, N in ((64, 8, 16, 1, 1), (64, 8, 16, 8, 2), (128, 16, 32, 1, 1)):
        L, g = 24, torch.Generator().manual_seed(E_ + N)
        p = zipf_p(E_, ZIPF)
        cur = None
        ref_moves = aware_moves = 0
        worst = 0.0
        bal_ref, bal_aware = [], []
        for _ in range(rounds):
            w = torch.stack([torch.bincount(torch.multinomial(p, 50000, True, generator=g), minlength=E_)
                             [torch.randperm(E_, generator=g)] for _ in range(L)])
            ref = Placement(*rebalance(w, E_ + red, G, N, R_))
            if cur is None:
                cur = ref.phy2log
                continue
            aware = Placement.from_phy2log(align_placement(cur, ref.phy2log, R_, N), E_)
            br = balancedness(w, ref.phy2log, ref.logcnt, R_)
            ba = balancedness(w, aware.phy2log, aware.logcnt, R_)
            worst = max(worst, float((br - ba).abs().max()))
            bal_ref.append(float(br.mean()))
            bal_aware.append(float(ba.mean()))
            ref_moves += moved_slots(cur, ref.phy2log)
            aware_moves += moved_slots(cur, aware.phy2log)
            cur = aware.phy2log
        n = rounds - 1
        rows.append({"experts": E_, "ranks": R_, "redundant": red, "groups": G, "nodes": N, "layers": L,
                     "slots": L * (E_ + red), "ref_moved_per_rebalance": ref_moves / n,
                     "aware_moved_per_rebalance": aware_moves / n,
                     "ref_balancedness": sum(bal_ref) / n, "aware_balancedness": sum(bal_aware) / n,
                     "max_abs_balancedness_diff": worst})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--batch-tokens", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        serving = serving_section(args, Path(tmp))
    b, a, rb = serving["before"], serving["after"], serving["rebalance"]
    rows = [{"phase": k, "pairs per rank": str(v["pairs"]), "max/mean": v["share_max_over_mean"],
             "worst layer max/mean": v["share_max_over_mean_worst_layer"],
             "slowest MoE s": v["slowest_rank_moe_s"], "slowest MoE cpu s": v["slowest_rank_moe_cpu_s"],
             "MoE s per rank": str([round(x, 3) for x in v["compute_s"]]), "phase s": v["seconds"]}
            for k, v in (("before", b), ("after", a))]
    print(f"EP={R}, {E} experts + {REDUNDANT} redundant slots, Zipf({ZIPF}) router bias scale "
          f"{serving['router_bias_scale']}; expert shares measured "
          f"{[round(x, 3) for x in serving['measured_expert_shares']]} vs target "
          f"{[round(x, 3) for x in serving['zipf_target_shares']]}")
    print(table(rows, list(rows[0])))
    print(f"rebalance: {rb['moved_slots']} slots moved ({rb['reference_moves']} with the reference's plain "
          f"output), {rb['bytes_moved'] / 1e6:.2f} MB point to point, staged in {rb['stage_seconds'] * 1e3:.1f} ms "
          f"while serving, pause {rb['pause_seconds'] * 1e3:.1f} ms; tokens done at the switch "
          f"{rb['tokens_done_at_switch']}/{rb['job_tokens']}; greedy tokens equal: "
          f"{serving['greedy_tokens_equal_single_process']}")
    mig = migration_section()
    print(table(mig, list(mig[0])))
    path = write_json("ep", {"serving": serving, "migration": mig})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
