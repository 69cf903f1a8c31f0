"""Multi-turn conversations through the Engine API (no HTTP): N conversations x R rounds, each round
= the history + the last answer + a new sub-question. Prints the per-round cache hit rate and time to
first token for: no cache, L1 only, and L1+L2 with an L1 deliberately too small for all conversations;
then the host bytes per cached conversation with SWA-aware backup against the bound
(full*S + swa*(W + page)) / ((full + swa) * S). Writes bench/results/multiturn_offline.json.

    python -m bench.multiturn_offline [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import table, write_json
from engine import Engine, SamplingParams
from storage.config import HiCacheConfig


def run_config(name: str, engine_kw: dict, n_conv: int, rounds: int, first: int, extra: int,
               out_len: int, concurrency: int) -> list[dict]:
    eng = Engine.from_pretrained("strata-tiny", page_size=16, max_batch_tokens=512, torch_threads=1,
                                 max_running_requests=concurrency, **engine_kw)
    g = torch.Generator().manual_seed(0)
    hist = [torch.randint(0, 256, (first,), generator=g).tolist() for _ in range(n_conv)]
    sp = SamplingParams(max_new_tokens=out_len, ignore_eos=True)
    rows = []
    for r in range(rounds):
        if r:
            hist = [h + torch.randint(0, 256, (extra,), generator=g).tolist() for h in hist]
        t0 = time.perf_counter()
        rids = [eng.add_request(h, sp) for h in hist]
        ttft: dict[str, float] = {}
        while eng.has_unfinished():
            for o in eng.step():
                ttft.setdefault(o.rid, time.perf_counter() - t0)
        outs = [eng.pop_finished(rid) for rid in rids]
        prompt = sum(o.prompt_tokens for o in outs)
        rows.append({
            "config": name, "round": r + 1,
            "hit_rate": sum(o.cached_tokens for o in outs) / prompt,
            "L1": sum(o.cached_tokens_by_tier["L1"] for o in outs) / prompt,
            "L2": sum(o.cached_tokens_by_tier["L2"] for o in outs) / prompt,
            "ttft_mean_ms": 1e3 * statistics.mean(ttft[rid] for rid in rids),
            "prompt_tokens": prompt,
        })
        hist = [h + o.token_ids for h, o in zip(hist, outs)]
    eng.close()
    return rows


def host_bytes_ratio(window_multiple: int = 8) -> dict:
    """One conversation of ``window_multiple`` x W tokens, backed up write-through: measured host bytes
    vs the bytes of a backup that keeps every SWA token, next to the bound."""
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256, enable_prefix_cache=True,
                                 hicache=HiCacheConfig(host_pages=256, write_policy="write_through"))
    mc, ps = eng.model_config, 16
    w, s = mc.sliding_window, window_multiple * mc.sliding_window
    eng.generate([[i % 256 for i in range(s)]], SamplingParams(max_new_tokens=1, ignore_eos=True))
    eng.cache.poll(block=True)
    used = eng.cache.host.bytes_used()
    measured = used["full"] + used["swa"]
    full_l, swa_l = len(mc.full_layers), len(mc.sliding_layers)
    per_layer_token = eng.pools.full.bytes_per_token // max(1, full_l)
    oblivious = (full_l + swa_l) * s * per_layer_token
    bound = (full_l * s + swa_l * (w + ps)) / ((full_l + swa_l) * s)
    eng.close()
    return {"tokens": s, "window": w, "host_bytes_swa_aware": measured, "host_bytes_keep_every_swa_token": oblivious,
            "ratio": measured / oblivious, "bound": bound}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n_conv, rounds = (8, 4) if args.quick else (16, 6)
    first, extra, out_len, conc = 512, 64, 32, 4
    # L1 holds the running requests plus about two conversations: far too small for all of them.
    small_l1 = conc * (first + rounds * (extra + out_len)) // 16 + 2 * 48
    configs = [
        ("no cache", dict(num_pages=4096)),
        ("L1 only (L1 too small)", dict(num_pages=small_l1, enable_prefix_cache=True)),
        ("L1+L2 (L1 too small)", dict(num_pages=small_l1, enable_prefix_cache=True,
                                      hicache=HiCacheConfig(host_pages=4096, write_policy="write_through"))),
        ("L1 only (L1 holds all)", dict(num_pages=4096, enable_prefix_cache=True)),
    ]
    rows = []
    for name, kw in configs:
        rows += run_config(name, kw, n_conv, rounds, first, extra, out_len, conc)
    print(table(rows, ["config", "round", "hit_rate", "L1", "L2", "ttft_mean_ms", "prompt_tokens"]))
    hb = host_bytes_ratio()
    print(f"\nhost bytes per cached conversation of {hb['tokens']} tokens (window {hb['window']}): "
          f"SWA-aware {hb['host_bytes_swa_aware']:,} vs keep-every-SWA-token "
          f"{hb['host_bytes_keep_every_swa_token']:,}: ratio {hb['ratio']:.3f} (bound {hb['bound']:.3f})")
    path = write_json("multiturn_offline", {"quick": args.quick, "n_conversations": n_conv, "rounds": rounds,
                                            "first_prompt": first, "new_tokens_per_round": extra,
                                            "output_tokens": out_len, "l1_pages_small": small_l1,
                                            "rounds_table": rows, "host_bytes": hb})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
