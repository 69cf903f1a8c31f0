"""Engine throughput on this machine: prefill tokens/s, decode tokens/s at batch 1/8/32, and KV bytes
per token (full vs SWA layers) for strata-tiny. Writes bench/results/engine.json.

    python -m bench.engine [--quick]
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import table, write_json
from engine import Engine, SamplingParams


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


def bench_prefill(eng: Engine, n: int, length: int) -> float:
    t = time.perf_counter()
    eng.generate(_prompts(n, length, 1), SamplingParams(max_new_tokens=1, ignore_eos=True))
    return n * length / (time.perf_counter() - t)


def bench_decode(eng: Engine, batch: int, prompt_len: int, new: int) -> float:
    """Decode tokens/s once every request of the batch is decoding (prefill steps excluded)."""
    rids = [eng.add_request(p, SamplingParams(max_new_tokens=new, ignore_eos=True))
            for p in _prompts(batch, prompt_len, 2)]
    tokens, elapsed = 0, 0.0
    while eng.has_unfinished():
        decoding = all(eng.requests[r].output_ids for r in rids)
        t = time.perf_counter()
        outs = eng.step()
        if decoding:
            elapsed += time.perf_counter() - t
            tokens += len(outs)
    for r in rids:
        eng.pop_finished(r)
    return tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=4096, max_batch_tokens=2048,
                                 max_running_requests=64, torch_threads=1)
    w = eng.model_config.sliding_window
    new = 16 if args.quick else 64
    bench_decode(eng, 2, 16, 4)  # warm-up
    rows = [{"metric": "prefill tok/s (8 x 1024)",
             "value": bench_prefill(eng, 8 if not args.quick else 2, 1024)}]
    for b in (1, 8, 32):
        rows.append({"metric": f"decode tok/s batch {b}", "value": bench_decode(eng, b, 128, new)})
    full_b, swa_b = eng.pools.full.bytes_per_token, eng.pools.swa.bytes_per_token
    ps = eng.cfg.page_size
    seq = 8 * w
    # SWA layers keep at most one window plus one page, whatever the length.
    swa_kept = swa_b * min(seq, w + ps)
    rows += [{"metric": "KV bytes/token, full layers", "value": full_b},
             {"metric": "KV bytes/token, SWA layers (per token held)", "value": swa_b},
             {"metric": f"KV bytes of a {seq}-token sequence (SWA-aware)", "value": full_b * seq + swa_kept},
             {"metric": f"KV bytes of a {seq}-token sequence (SWA-oblivious)", "value": (full_b + swa_b) * seq}]
    print(table(rows, ["metric", "value"]))
    path = write_json("engine", {"model": "strata-tiny", "quick": args.quick,
                                 "results": {r["metric"]: r["value"] for r in rows}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
