"""The radix tree alone on a multi-turn workload: match/s (with and without page hashing), insert/s,
requests/s and hit rate, on the bare tree and through HiCache (the path the engine uses, L1 only), with
a cProfile summary of where the time goes. Writes bench/results/tree.json.

    python -m bench.tree [--quick]

The engine's default path is "hicache slru" (``engine.prefix_eviction: slru``); "tree" and "hicache"
are plain LRU, the policy SGLang's tree applies.

Workload: 100 conversations x 6 rounds, page 16, window 128, random tokens over a 32,000 vocabulary
(seeded). The first prompt is uniform in 512..1024 tokens, each later one adds uniform 204..409 tokens
(both cut to whole pages); round by round, conversations in shuffled order. The full pool holds 3/4 of
the unique tokens, the SWA pool max(64 pages, 1/4 of that). Each request: match, lock, evict to make
room, allocate its tail, free its own out-of-window SWA pages, insert, unlock.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import random
import time
from typing import Optional

import torch

from bench.common import table, write_json
from storage.geometry import KVGeometry
from storage.hicache import HiCache
from storage.config import KVPoolConfig
from storage.pools import KVPools, PageAllocator
from storage.radix import FULL, L1, SWA, RadixTree

PAGE, WINDOW, VOCAB = 16, 128, 32_000
CONVS, ROUNDS = 100, 6
TARGETS = {"hit_rate": 0.578, "requests/s": 1140, "match/s hashed": 53_500, "insert/s": 13_100}
"""SGLang 0.5.23's radix cache on this workload and machine kind (issue #22)."""
BEFORE = {"tree": {"hit_rate": 0.5315, "requests/s": 4371, "match/s": 59668, "match/s hashed": 7360,
                   "insert/s": 21486},
          "hicache": {"hit_rate": 0.5315, "requests/s": 2737, "match/s": 52429, "match/s hashed": 6579,
                      "insert/s": 6184}}
"""This bench at commit 76d848b (before issue #22's changes), same machine. Its bare-tree insert/s is not
comparable: the match then hashed the whole prompt up front, so the insert it timed hashed nothing."""
PREVIOUS = {"tree": {"hit_rate": 0.575, "requests/s": 6104, "match/s hashed": 33_700, "insert/s": 10_700},
            "hicache": {"hit_rate": 0.575, "requests/s": 5738, "match/s hashed": 28_100, "insert/s": 10_500}}
"""This bench at commit 2dbed10 (the first round of issue #22's tree work), same machine."""


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
"""Rates by wall time (as the targets were taken), and by this thread's CPU time: on a shared machine
the latter is what a quiet one would show (other processes' load does not count)."""
_clock = "wall"


def workload(seed: int = 0, convs: int = CONVS, rounds: int = ROUNDS) -> list[list[list[int]]]:
    """``rounds`` lists of prompts (token lists), each round's conversations in shuffled order."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(convs):
        n = rng.randint(512, 1024) // PAGE * PAGE
        seq = [rng.randrange(VOCAB) for _ in range(n)]
        conv = [seq]
        for _ in range(rounds - 1):
            add = rng.randint(204, 409) // PAGE * PAGE
            conv.append(conv[-1] + [rng.randrange(VOCAB) for _ in range(add)])
        prompts.append(conv)
    out = []
    for r in range(rounds):
        order = list(range(convs))
        rng.shuffle(order)
        out.append([prompts[c][r] for c in order])
    return out


def pool_sizes(rounds: list[list[list[int]]]) -> tuple[int, int]:
    unique = sum(len(p) for p in rounds[-1]) // PAGE   # the last round's prompts extend all the others
    full = unique * 3 // 4
    return full, max(64, full // 4)


class _Timers:
    def __init__(self) -> None:
        self.t = {"match": 0.0, "insert": 0.0, "request": 0.0}
        self.requests = 0
        self.hit_tokens = 0
        self.prompt_tokens = 0


class BareTree:
    """The tree with two free lists, driven as the engine's cache would drive it."""

    name = "tree"

    eviction = "lru"

    def __init__(self, full: int, swa: int, geom: KVGeometry) -> None:
        self.tree = RadixTree(PAGE, geom.window_pages, eviction=self.eviction)
        self.alloc = {FULL: PageAllocator(full, "full"), SWA: PageAllocator(swa, "swa")}
        self.wp = geom.window_pages

    def match(self, tokens: list[int], max_pages: int, now: float):
        # Lazy keys: the pages the tree recognises by their tokens are not hashed; insert reuses them.
        keys = self.tree.sequence_keys(tokens, max_pages)
        m = self.tree.match_prefix(keys, now=now, lock=True)   # lock(m.node, FULL) and (.., SWA)
        return (m, keys), m.num_pages, m.l1_full, m.l1_swa

    def room(self, c: str, n: int) -> None:
        a = self.alloc[c]
        if not a.can_alloc(n):
            freed = self.tree.evict(c, L1, n - a.num_free)
            for comp in (FULL, SWA):
                if freed[comp, L1]:
                    self.alloc[comp].free(freed[comp, L1])

    def insert(self, handle, tokens: list[int], full: list[int], swa: list, now: float) -> None:
        m, keys = handle
        res = self.tree.insert(keys.extended(tokens), full, swa, now=now)
        self.alloc[FULL].free(res.free_full)
        self.alloc[SWA].free(res.free_swa)

    def release(self, handle) -> None:
        m, _ = handle
        self.tree.unlock(m.node, SWA)
        self.tree.unlock(m.node, FULL)

    def check(self) -> None:
        self.tree.check_integrity()
        for c in (FULL, SWA):
            self.alloc[c].check_integrity({"tree": self.tree.all_pages(c, L1)})


class ThroughHiCache(BareTree):
    """The same requests through storage/hicache/ (HiCache with no L2: ``cfg=None``)."""

    name = "hicache"

    def __init__(self, full: int, swa: int, geom: KVGeometry) -> None:
        pools = KVPools(KVPoolConfig(PAGE, full, swa / full), ("sliding_attention", "full_attention"), 1, 1,
                        torch.float32, "cpu")
        self.cache = HiCache(pools, geom, eviction=self.eviction)
        self.tree = self.cache.tree
        self.alloc = {FULL: pools.full.allocator, SWA: pools.swa.allocator}
        self.wp = geom.window_pages

    def match(self, tokens: list[int], max_pages: int, now: float):
        hit = self.cache.match(tokens, max_pages, now)
        return hit, hit.num_pages, hit.full_pages, hit.swa_pages

    def room(self, c: str, n: int) -> None:
        a = self.alloc[c]
        if not a.can_alloc(n):
            self.cache.evict_l1(c, n - a.num_free)

    def insert(self, handle, tokens: list[int], full: list[int], swa: list, now: float) -> None:
        dup_full, dup_swa = self.cache.insert(tokens, full, swa, now, keys=handle.keys)
        self.alloc[FULL].free(dup_full)
        self.alloc[SWA].free(dup_swa)

    def release(self, handle) -> None:
        if handle.locked:
            self.cache.release(handle)


class BareTreeSlru(BareTree):
    """The tree under segmented LRU (``prefix_eviction: slru``): never-reused pages are evicted first."""

    name = "tree slru"
    eviction = "slru"


class ThroughHiCacheSlru(ThroughHiCache):
    name = "hicache slru"
    eviction = "slru"


def serve(cache: BareTree, tokens: list[int], now: float, tm: _Timers) -> None:
    """One request, as the engine's prefix cache serves it (the tail is "computed" at once)."""
    clock = CLOCKS[_clock]
    t0 = clock()
    n = len(tokens) // PAGE
    handle, m, full_hit, swa_hit = cache.match(tokens, (len(tokens) - 1) // PAGE, now)
    t1 = clock()
    tail = n - m
    cache.room(FULL, tail)
    cache.room(SWA, tail)
    full = list(full_hit) + cache.alloc[FULL].alloc(tail)
    own_swa = cache.alloc[SWA].alloc(tail)
    lo = max(0, n - cache.wp)   # the SWA pages a continuation from page n reads
    swa = [p if i >= lo else None for i, p in enumerate(list(swa_hit) + own_swa)]
    cache.alloc[SWA].free([p for i, p in enumerate(own_swa, m) if i < lo])
    t2 = clock()
    cache.insert(handle, tokens, full, swa, now)
    t3 = clock()
    cache.release(handle)
    t4 = clock()
    tm.t["match"] += t1 - t0
    tm.t["insert"] += t3 - t2
    tm.t["request"] += t4 - t0
    tm.requests += 1
    tm.hit_tokens += m * PAGE
    tm.prompt_tokens += len(tokens)


def run(kind: type, rounds, check: bool = False, profile: Optional[cProfile.Profile] = None) -> dict:
    gc.collect()   # start from a clean heap: the last repetition's tree is cyclic garbage
    full, swa = pool_sizes(rounds)
    geom = KVGeometry(PAGE, WINDOW)
    cache, tm, now = kind(full, swa, geom), _Timers(), 0.0
    if profile is not None:
        profile.enable()
    for prompts in rounds:
        for tokens in prompts:
            now += 1.0
            serve(cache, tokens, now, tm)
            if check:
                cache.check()
    if profile is not None:
        profile.disable()
    # Matching without hashing: the last round's keys computed up front, matched against the final tree.
    last = rounds[-1]
    keys = [cache.tree.page_keys(t)[:(len(t) - 1) // PAGE] for t in last]
    clock = CLOCKS[_clock]
    t0 = clock()
    for k in keys:
        now += 1.0
        cache.tree.match_prefix(k, now=now)
    unhashed = clock() - t0
    return {"requests/s": tm.requests / tm.t["request"], "match/s hashed": tm.requests / tm.t["match"],
            "match/s": len(last) / unhashed, "insert/s": tm.requests / tm.t["insert"],
            "hit_rate": tm.hit_tokens / tm.prompt_tokens, "requests": tm.requests,
            "pool_pages": {"full": full, "swa": swa}}


def profile_summary(kind: type, rounds, top: int = 12) -> list[dict]:
    prof = cProfile.Profile()
    run(kind, rounds, profile=prof)
    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values())
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{fn.rsplit('/', 1)[-1]}:{line}({name})", "calls": v[1], "tottime_s": round(v[2], 4),
             "share": round(v[2] / total, 3), "cumtime_s": round(v[3], 4)} for (fn, line, name), v in rows]


def sglang_rows() -> list[dict]:
    """SGLang's own tree on this workload instance, as bench/tree_sglang.py last measured it (it needs a
    side venv with sglang; see its docstring): the baseline on the same instance and machine kind."""
    path = os.path.join(os.path.dirname(__file__), "results", "tree_sglang.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        seed0 = json.load(f)["seed0"]
    return [{"path": f"sglang {core} (tree_sglang.json)", **{k: r[k] for k in ("hit_rate", "requests/s",
             "match/s hashed", "insert/s")}} for core, r in seed0.items()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one repetition, no profile (smoke test)")
    ap.add_argument("--check", action="store_true", help="check_integrity after every request (slow)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per path and clock (best is kept)")
    args = ap.parse_args()
    rounds = workload()
    reps = 1 if args.quick else args.reps
    global _clock
    results, profiles, by_cpu = {}, {}, {}
    kinds = (BareTree, ThroughHiCache, BareTreeSlru, ThroughHiCacheSlru)
    runs: dict = {(k.name, c): [] for k in kinds for c in CLOCKS}
    for _ in range(reps):   # interleaved, so both paths see the same (shared) machine
        for kind in kinds:
            for _clock in CLOCKS:
                runs[kind.name, _clock].append(run(kind, rounds, check=args.check))
    _clock = "wall"
    for kind in kinds:
        for c, out in (("wall", results), ("cpu", by_cpu)):
            rs = runs[kind.name, c]
            out[kind.name] = {k: max(r[k] for r in rs) if k.endswith("/s") else rs[0][k] for k in rs[0]}
        if not args.quick:
            if kind.eviction == "lru":
                profiles[kind.name] = profile_summary(kind, rounds)
    cols = ["path", "hit_rate", "requests/s", "match/s", "match/s hashed", "insert/s"]
    rows = [{"path": f"{name} (before)", **BEFORE[name]} for name in results if name in BEFORE]
    rows += [{"path": f"{name} (2dbed10)", **PREVIOUS[name]} for name in results if name in PREVIOUS]
    rows += sglang_rows()
    rows += [{"path": name, **r} for name, r in results.items()]
    rows += [{"path": f"{name} (cpu time)", **r} for name, r in by_cpu.items()]
    rows.append({"path": "target", **TARGETS})
    print(table(rows, cols))
    for name, prof in profiles.items():
        print(f"\nprofile ({name}), top by own time:")
        print(table(prof, ["function", "calls", "tottime_s", "share"]))
    met = {name: {k: r[k] >= v for k, v in TARGETS.items()} for name, r in results.items()}
    met_cpu = {name: {k: r[k] >= v for k, v in TARGETS.items()} for name, r in by_cpu.items()}
    write_json("tree", {"workload": {"conversations": CONVS, "rounds": ROUNDS, "page_size": PAGE,
                                     "window": WINDOW, "vocab": VOCAB, "seed": 0},
                        "repetitions": reps, "note": "rates are the best of the repetitions",
                        "results": results, "results_cpu_time": by_cpu, "before": BEFORE,
                        "previous_2dbed10": PREVIOUS, "targets": TARGETS, "met": met, "met_cpu_time": met_cpu,
                        "load_average": os.getloadavg(),
                        "profile": profiles})


if __name__ == "__main__":
    main()
