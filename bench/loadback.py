"""L2 -> L1 load-back through the Engine: pages loaded against pages the hits use, and the time to first
token of an L2 hit against recomputing the prefix and against the same hit already in L1, per L2 layout
(the load runs layer by layer beside the forward). Writes bench/results/loadback.json.

    python -m bench.loadback [--quick]

Counts: strata-tiny, 6 conversations x 5 rounds submitted a round at a time (first prompt 150 random
tokens, each round adds the 16 generated + 40 new), L1 of 64 pages (page 16: too small for the working
set), L2 of 4000 pages, max_batch_tokens 128. The same engine without L2 is the token reference
(tests/numerics.py rule). TTFT: a prompt of 8 windows (512 tokens) + 16 new tokens whose 512-token
prefix is cached (forced down to L2 for the L2 case, flushed for recompute), max_new_tokens 1, median
of the repetitions.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from bench.common import table, write_json
from engine import Engine, SamplingParams
from storage.config import HiCacheConfig
from storage.copier import LayerFuture
from storage.kernels_path import transfer
from tests import numerics
from tests.unit.test_loadback import conversations, run_rounds

SMALL = dict(page_size=16, num_pages=64, max_batch_tokens=128, enable_prefix_cache=True)
BEFORE = {"loaded": 785, "hit_pages_L2": 277, "hits_given_up": 59, "preemptions": 25, "wall_s": 3.41}
"""This workload at commit 2dbed10 (before the load rule), same machine: loads for requests that could
not run were evicted and loaded again, and 59 hits were given up for lack of L1 room."""


def counts(rounds: int = 5) -> dict:
    convs = conversations(6, rounds)
    ref_eng = Engine.from_pretrained("strata-tiny", **SMALL)
    ref = run_rounds(ref_eng, convs, numerics.with_logits(run_sp()))
    eng = Engine.from_pretrained("strata-tiny", **SMALL, hicache=HiCacheConfig(host_pages=4000))
    t = time.perf_counter()
    got = run_rounds(eng, convs)
    wall = time.perf_counter() - t
    departures = 0
    for r, (g, w) in enumerate(zip(got, ref)):
        departures += sum(d is not None for d in numerics.assert_same_outputs(g, w, eng.model_config, f"round {r}"))
    st = eng.stats()
    c = st["cache"]
    lb = c["loadback"]
    ps = eng.cfg.page_size
    out = {**lb, "hit_pages_L2": c["hit_tokens"]["L2"] // ps, "hit_tokens": c["hit_tokens"],
           "hits_given_up": c["hits_given_up"], "preemptions": st["preemptions"], "wall_s": wall,
           "loaded/used": lb["loaded"] / max(1, lb["used"]),
           "loaded_full/hit_pages_L2": lb["loaded_full"] / max(1, c["hit_tokens"]["L2"] // ps),
           "token_departures_excused": departures}
    eng.close()
    return out


def run_sp() -> SamplingParams:
    return SamplingParams(max_new_tokens=16, ignore_eos=True)


def _first_token_s(eng: Engine, prompt: list[int]) -> float:
    t = time.perf_counter()
    rid = eng.add_request(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
    while not eng.step():
        pass
    dt = time.perf_counter() - t
    eng.pop_finished(rid)
    return dt


def ttft(layout: str, reps: int, link_ms: float = 0.0) -> dict:
    """TTFT of the 8-window prompt per case. ``link_ms`` > 0 emulates a slower L2 link: every per-layer
    copy of a load takes that much longer (a sleep, which releases the GIL like a DMA would), so the
    overlap of the copy with the forward is visible on a model whose copy is otherwise ~1 ms."""
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256, max_batch_tokens=1024,
                                 enable_prefix_cache=True, hicache=HiCacheConfig(host_pages=1024, layout=layout))
    w = eng.geometry.window
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 256, (8 * w,), generator=g).tolist()
    tail = lambda: torch.randint(0, 256, (16,), generator=g).tolist()
    for _ in range(2):   # warm the kernels on both paths
        eng.flush_cache()
        _first_token_s(eng, prefix + tail())
    times: dict[str, list[float]] = {"L1 hit": [], "L2 hit": [], "L2 hit, whole load first": [], "recompute": []}
    loaded = 0
    for _ in range(reps):
        times["L1 hit"].append(_first_token_s(eng, prefix + tail()))
        for case, whole in (("L2 hit", False), ("L2 hit, whole load first", True)):
            eng.cache.poll(block=True)
            for c in ("full", "swa"):
                eng.cache.evict_l1(c, 1 << 30)
            before = eng.cache.stats["loadback"]["loaded"]
            with _link(link_ms), _whole_load(whole):
                times[case].append(_first_token_s(eng, prefix + tail()))
                eng.cache.poll(block=True)
            loaded = eng.cache.stats["loadback"]["loaded"] - before
        eng.flush_cache()
        times["recompute"].append(_first_token_s(eng, prefix + tail()))
    with _link(link_ms):
        copy = _copy_s(eng, len(prefix) // eng.cfg.page_size, reps)
    eng.close()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"layout": layout, "link_ms_per_layer": link_ms, "prompt_tokens": len(prefix) + 16,
            "pages_loaded": loaded, "ttft_ms_L1_hit": med["L1 hit"], "ttft_ms_L2_hit": med["L2 hit"],
            "ttft_ms_L2_hit_whole_load_first": med["L2 hit, whole load first"],
            "ttft_ms_recompute": med["recompute"], "copy_ms_alone": copy * 1e3}


@contextlib.contextmanager
def _link(ms: float):
    orig = transfer.l2_to_l1
    if ms > 0:
        def slow(*a, **kw):
            time.sleep(ms / 1e3)
            return orig(*a, **kw)
        transfer.l2_to_l1 = slow
    try:
        yield
    finally:
        transfer.l2_to_l1 = orig


@contextlib.contextmanager
def _whole_load(on: bool):
    """The forward waits for every layer of a load before its first layer (no overlap)."""
    orig = LayerFuture.wait_layer
    if on:
        def whole(self, component, slot, timeout=None):
            self.wait(timeout)
            return orig(self, component, slot, timeout)
        LayerFuture.wait_layer = whole
    try:
        yield
    finally:
        LayerFuture.wait_layer = orig


def _copy_s(eng: Engine, n_pages: int, reps: int) -> float:
    """The load of ``n_pages`` full pages + one window of SWA pages alone, layer by layer (as the copier
    does), into free L1 pages (nothing reads them)."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for c, n in (("full", n_pages), ("swa", eng.cache.tree.window_pages)):
            pool, host = eng.pools.pool(c), eng.cache.host.pool(c)
            src, dst = list(range(n)), list(range(pool.num_pages - n, pool.num_pages))
            for slot in range(len(pool.layer_ids)):
                transfer.l2_to_l1(pool.flat(), host.data, host.layout, src, dst, layer=slot, check=False)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    reps = 3 if args.quick else 7
    c = counts(3 if args.quick else 5)
    rows = [{"": "before", **BEFORE}, {"": "now", **c}]
    print(table(rows, ["", "loaded", "used", "wasted", "hit_pages_L2", "loaded_full", "loaded_swa",
                       "hits_given_up", "preemptions", "deferred", "wall_s"]))
    layouts = ("layer_first", "page_first", "page_first_direct")
    lat = [ttft(layout, reps, link) for link in (0.0, 2.0) for layout in layouts]
    print(table(lat, ["layout", "link_ms_per_layer", "ttft_ms_L1_hit", "ttft_ms_L2_hit",
                      "ttft_ms_L2_hit_whole_load_first", "ttft_ms_recompute", "copy_ms_alone", "pages_loaded"]))
    if not args.quick:
        write_json("loadback", {"counts": c, "before": BEFORE, "ttft": lat,
                                "done_when": {"loaded <= 1.05 x used": c["loaded"] <= 1.05 * c["used"],
                                              "hits given up": c["hits_given_up"],
                                              "tokens equal to the engine without L2": True}})


if __name__ == "__main__":
    main()
