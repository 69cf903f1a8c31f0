"""What dequantizing GPT-OSS's MXFP4 experts at load costs and buys (engine/model/mxfp4.py).

One MoE layer shaped like gpt-oss-20b's (hidden 2880, expert width 2880, top-4) with fewer experts
(``--experts``, 8 by default; the real layer has 32), its weights random and stored as released (uint8
blocks + E8M0 scales). Two ways to serve it:

* **dequantize at load** (what strata does): the experts become bf16 (or fp32) tensors once; a step
  is plain matmuls over the chosen experts.
* **dequantize per step**: the packed bytes stay resident; every step dequantizes the experts its
  tokens chose, then runs the same matmuls.

Printed and written to bench/results/mxfp4.json: resident bytes of the experts, the one-off load time,
and the time of one MoE step for a decode batch (1 and 16 tokens) and a prefill chunk (256 tokens).

    python -m bench.mxfp4 [--experts 8] [--reps 5] [--threads N]
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import machine, table, write_json
from engine.model import mxfp4

HIDDEN, INTER, TOP_K = 2880, 2880, 4


def _packed(e: int, g: torch.Generator):
    gate_up = torch.randn(e, HIDDEN, 2 * INTER, generator=g) * HIDDEN ** -0.5
    down = torch.randn(e, INTER, HIDDEN, generator=g) * INTER ** -0.5
    return mxfp4.quantize_weight(gate_up), mxfp4.quantize_weight(down)


def _step(x, idx, gate_up, down):
    """x [T, H], idx [T, k]; gate_up(e) / down(e) give expert e's weights. A plain SiLU-gated expert."""
    out = torch.zeros_like(x)
    for e in idx.unique().tolist():
        rows = (idx == e).any(1).nonzero().squeeze(1)
        gu = x[rows] @ gate_up(e)
        out[rows] += (torch.nn.functional.silu(gu[:, ::2]) * gu[:, 1::2]) @ down(e)
    return out


def _time(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    (gu_b, gu_s), (dn_b, dn_s) = _packed(args.experts, g)
    packed_bytes = sum(t.numel() * t.element_size() for t in (gu_b, gu_s, dn_b, dn_s))
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        t = time.perf_counter()
        gate_up = mxfp4.dequantize_weight(gu_b, gu_s, dtype)
        down = mxfp4.dequantize_weight(dn_b, dn_s, dtype)
        load_s = time.perf_counter() - t
        dense_bytes = gate_up.numel() * gate_up.element_size() + down.numel() * down.element_size()
        for tokens in (1, 16, 256):
            x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
            idx = torch.stack([torch.randperm(args.experts, generator=g)[:TOP_K] for _ in range(tokens)])
            at_load = _time(lambda: _step(x, idx, lambda e: gate_up[e], lambda e: down[e]), args.reps)
            per_step = _time(lambda: _step(
                x, idx, lambda e: mxfp4.dequantize_weight(gu_b[e:e + 1], gu_s[e:e + 1], dtype)[0],
                lambda e: mxfp4.dequantize_weight(dn_b[e:e + 1], dn_s[e:e + 1], dtype)[0]), args.reps)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
                         "experts": args.experts, "packed_MB": round(packed_bytes / 2**20, 1),
                         "dequantized_MB": round(dense_bytes / 2**20, 1),
                         "memory_x": round(dense_bytes / packed_bytes, 2), "load_s": round(load_s, 2),
                         "step_ms_at_load": round(at_load, 2), "step_ms_per_step": round(per_step, 2),
                         "speedup": round(per_step / at_load, 1)})
        del gate_up, down
    print(table(rows, list(rows[0])))
    print(write_json("mxfp4", {"machine": machine(), "rows": rows,
                               "shape": {"hidden": HIDDEN, "intermediate": INTER, "top_k": TOP_K}}))


if __name__ == "__main__":
    main()
