"""Shared prefixes on a sliding-window model ([branch]): hit rate against the ideal, TTFT and SWA pages
held, for three retentions of the sliding KV on the same engine (strata-tiny: window 64, page 16):

* ``window-only``: what strata kept before [branch] (a request's last window; interior sliding KV never
  stored) -- ``KVManager.retain_interior = False``, set here only;
* ``strata``: interior sliding KV cached as evictable tree data, kept windows at sequence ends, branch
  points and checkpoints (storage/radix/tree.py, "Retention");
* ``swa-oblivious``: every sliding page kept as long as its full page (an SWA pool as large as the full
  one, so SWA pressure never evicts).

Workloads, requests sent one at a time (so "in flight together" never arises):

* ``gsp``: shaped like SGLang's generated-shared-prefix (``--gsp-num-groups 4 --gsp-prompts-per-group 12
  --gsp-system-prompt-len 384 --gsp-question-len 64``), groups interleaved;
* ``fork``: conversations (a 256-token first message, a 96-token second one, 16-token answers) that
  fork into 4 continuations inside their second message (edits of the last message, agent forks).

Ideal hit: for each request, the whole pages (at most ``(len - 1) // 16``) of its longest prefix shared
with a sequence an earlier request left (prompt + answer), as a cache with unbounded memory serves it.
Each workload runs with the default pools and with an SWA pool smaller than its working set. The router's
prediction (actors/routing.PrefixIndex fed the tree's KV events) is compared with the delivered hit on
every request. Writes bench/results/branch.json, and the requests (prompt + answer tokens) to
bench/results/branch_requests.json, which bench/branch_sglang.py replays through SGLang's
UnifiedRadixCache (its side venv, bench/tree_sglang.py) for the SGLang row.

    .venv/bin/python -m bench.branch [--quick]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from actors.routing import PrefixIndex
from engine import Engine, SamplingParams

PS = 16
ROWS = ("window-only", "strata", "swa-oblivious")


def gsp(groups: int = 4, per_group: int = 12, system: int = 384, question: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()   # noqa: E731
    systems = [r(system) for _ in range(groups)]
    return [(systems[k], r(question)) for _ in range(per_group) for k in range(groups)]


def fork_convs(convs: int = 4, k: int = 4, seed: int = 1):
    """(conversation, branch) -> the messages of each turn. Every branch sends the same first message;
    branch b's second message is branch 0's cut after ``96 - 24 * b`` tokens and continued differently
    (an edit of the last message, a fork at an earlier point of the conversation): branch points fall
    inside a cached prompt, not at its end."""
    g = torch.Generator().manual_seed(seed)
    r = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()   # noqa: E731
    out = []
    for c in range(convs):
        first, second = r(256), r(96)
        out.append([[first, second[:96 - 24 * b] + r(24 * b)] for b in range(k)])
    return out


def _engine(row: str, swa_pages: int | None) -> Engine:
    ratio = 1.0 if row == "swa-oblivious" else (swa_pages / 2048 if swa_pages else 0.5)
    eng = Engine.from_pretrained("strata-tiny", page_size=PS, num_pages=2048, enable_prefix_cache=True,
                                 swa_full_ratio=ratio, torch_threads=1)
    if row == "window-only":
        eng.kv.retain_interior = False
    return eng


class Ideal:
    """Longest shared whole-page prefix with any sequence seen so far (unbounded memory)."""

    def __init__(self) -> None:
        self.seen: set[tuple] = set()

    def hit(self, prompt: list[int]) -> int:
        n = (len(prompt) - 1) // PS
        while n and tuple(prompt[:n * PS]) not in self.seen:
            n -= 1
        return n * PS

    def add(self, seq: list[int]) -> None:
        for m in range(1, len(seq) // PS + 1):
            self.seen.add(tuple(seq[:m * PS]))


def serve(eng: Engine, gen, max_new: int = 16) -> dict:
    """Send the prompts ``gen`` yields one at a time (each answer is sent back into it)."""
    ideal, index = Ideal(), PrefixIndex()
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    hits = ideal_hits = prompt_tokens = 0
    ttft, mispredicted, swa_peak, requests = [], 0, 0, []
    wp = eng.geometry.window_pages
    prompt = next(gen, None)
    while prompt is not None:
        n = (len(prompt) - 1) // PS
        index.apply("w", eng.cache.tree.take_events())
        predicted = index.overlap([int.from_bytes(k[:8], "big") for k in eng.cache.tree.page_keys(prompt[:n * PS])], "w", wp).pages * PS
        t0 = time.perf_counter()
        rid = eng.add_request(prompt, sp)
        while not eng.requests[rid].output_ids:
            eng.step()
        ttft.append(time.perf_counter() - t0)
        while eng.has_unfinished():
            eng.step()
        out = eng.pop_finished(rid)
        mispredicted += predicted != out.cached_tokens
        hits += out.cached_tokens
        requests.append({"prompt_len": len(prompt), "tokens": prompt + out.token_ids, "ideal": ideal.hit(prompt)})
        ideal_hits += ideal.hit(prompt)
        prompt_tokens += len(prompt)
        ideal.add(prompt + out.token_ids)
        swa_peak = max(swa_peak, eng.cache.tree.num_pages("swa", "L1"))
        try:
            prompt = gen.send(out)
        except StopIteration:
            prompt = None
    kept = sum(len(x.l1_swa) for x in eng.cache.tree.iter_nodes() if x.l1_swa is not None and x.swa_keep)
    ttft.sort()
    return {"hit_rate": hits / prompt_tokens, "ideal_hit_rate": ideal_hits / prompt_tokens,
            "of_ideal": hits / ideal_hits if ideal_hits else 1.0, "ttft_p50_ms": 1e3 * ttft[len(ttft) // 2],
            "swa_pages_peak": swa_peak, "swa_pages_kept_end": kept,
            "swa_pool": eng.pools.swa.num_pages, "mispredicted": mispredicted, "requests": len(ttft),
            "_sequences": requests}


def run_gsp(eng: Engine, quick: bool) -> dict:
    reqs = gsp(per_group=4 if quick else 12)
    return serve(eng, (system + q for system, q in reqs))


def run_fork(eng: Engine, quick: bool) -> dict:
    convs = fork_convs(convs=2 if quick else 4)

    def prompts():
        for conv in convs:
            for turns in conv:
                ctx: list[int] = []
                for msg in turns:
                    out = yield ctx + msg
                    ctx = ctx + msg + out.token_ids
    return serve(eng, prompts())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    # The small SWA pool: 0.3x the sliding pages the SWA-oblivious row holds at its peak on the same
    # workload (so below the working set): what the retention keeps when it may hold no more than that.
    results, sequences = [], {}
    for wl, fn in (("gsp", run_gsp), ("fork", run_fork)):
        small = None
        for pool in ("default", "small"):
            for row in ("swa-oblivious",) + ROWS[:2]:
                if row == "swa-oblivious" and pool == "small":
                    continue   # it has no SWA pool of its own to shrink
                eng = _engine(row, small if pool == "small" else None)
                r = {"workload": wl, "pools": pool, "row": row, **fn(eng, args.quick)}
                eng.close()
                seqs = r.pop("_sequences")
                if row == "strata" and pool == "default":
                    sequences[wl] = {"requests": seqs, "swa_pools": {"default": r["swa_pool"]}}
                if row == "strata" and pool == "small":
                    sequences[wl]["swa_pools"]["small"] = r["swa_pool"]
                results.append(r)
                if row == "swa-oblivious":
                    small = max(eng.geometry.swa_pages_bound + 1, int(0.3 * r["swa_pages_peak"]))
                print(f"{wl:5s} {pool:8s} {row:14s} hit {r['hit_rate']:.3f} (ideal {r['ideal_hit_rate']:.3f}, "
                      f"{r['of_ideal']:.2f}x) ttft p50 {r['ttft_p50_ms']:.1f} ms  SWA pages peak {r['swa_pages_peak']} "
                      f"kept {r['swa_pages_kept_end']} pool {r['swa_pool']}  mispredicted {r['mispredicted']}/{r['requests']}",
                      flush=True)
    obl = {(r["workload"]): r["swa_pages_peak"] for r in results if r["row"] == "swa-oblivious"}
    for r in results:
        r["swa_peak_vs_oblivious"] = r["swa_pages_peak"] / obl[r["workload"]] if obl.get(r["workload"]) else None
    out = Path(__file__).parent / "results" / "branch.json"
    out.write_text(json.dumps({"quick": args.quick, "rows": results}, indent=1))
    # The same requests (prompt + answer tokens), for SGLang's tree on the same instance (bench/branch_sglang.py)
    (out.parent / "branch_requests.json").write_text(json.dumps({"quick": args.quick, "workloads": sequences}))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
