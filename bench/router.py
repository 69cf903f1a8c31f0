"""The router's decision rate, latency and memory, side by side with NVIDIA Dynamo's indexer on the same
KV-event stream and the same prompts; and, on the tiny hybrid model, the hit each predicts against the hit
the worker delivers. Writes bench/results/router.json.

    .venv/bin/python -m bench.router [--quick]

**The stream.** Four workers, each a strata radix tree (storage/radix) of page size 16 and window 64 (4
window pages) serving multi-turn conversations (a 256-token first message, 128-token follow-ups, 64-token
answers; every turn inserts its whole sequence, full pages and the sliding KV it computed). Each tree
holds at most a quarter of the target in full L1 pages and a quarter of that in SWA pages: LRU evicts
conversations (group-0 ``BlockRemoved``) and interior sliding windows (group-1 tombstones). Each turn's
tree events go through ``storage/kv_events/translate.to_wire`` (medium GPU), as a worker publishes them,
to one interleaved stream of wire events. Built at 10k and 100k indexed pages.

**Both indexes read that stream.** strata: ``PrefixIndex.apply_wire`` on the wire events. Dynamo
(ai-dynamo-runtime 1.6.1, ``dynamo._core.RadixTree``): its ``apply_event`` takes Dynamo's own JSON
``KvCacheEvent``, not wire bytes, so this bench converts each wire event to that JSON the way Dynamo's
vLLM listener does (group 0 only; ``tokens_hash`` from Dynamo's ``compute_block_hash_for_seq`` over the
event's ``token_ids``; ``block_hash`` / ``parent_hash`` the wire's ids). That conversion is the bench's,
not timed: what is timed is the lookup path. (tests/interop/ feeds Dynamo the wire's bytes through its
own listener instead.) A check asserts that the two indexes agree: strata's full-only overlap
(``window_pages`` 0) equals Dynamo's per worker on every prompt.

**The same work, timed.** A prompt is a cached conversation plus a new 128-token turn. One decision =
token ids -> per-worker overlap, hashing included on both sides:

* ``strata route``: ``prompt_blocks`` (BLAKE2b page keys -> block ids) + ``route`` (``overlap_all``
  SWA-exact over the 4 workers, then the cost: what the router actor answers);
* ``strata overlap``: ``prompt_blocks`` + ``PrefixIndex.overlap_all`` (no cost: Dynamo's answer's kind);
* ``dynamo``: ``compute_block_hash_for_seq`` + ``RadixTree.find_matches`` (+ reading ``scores``).

The three take turns in short rounds (``time_rounds``: the machine is shared, a busy moment should hit
all alike); each call gets a fresh copy of its prompt (new int objects, as a just-deserialized request
brings them; made outside the timed call), the index is whatever 500 prompts over it leave in cache.
``decisions_per_s`` is an impl's best round (calls over their summed time), ``median_round_per_s`` its
median round, ``vs_dynamo`` the median over rounds of its rate over Dynamo's in the same round; p50/p99
over all its decisions. ``hash_us`` is the hashing alone (strata's ``ingress_hash_us`` of old: it runs on the ingress
and sat outside the decision), ``decide_us`` the rest (strata: ``route`` on hashed keys, the old
``p50_us``), each the best of 5 passes over the prompts. Memory: strata's index by tracemalloc while it
is rebuilt from the stream's msgpack batches (decoded as the router decodes them, so every int it keeps
is its own); Dynamo's by the process RSS growth while its tree is built (Rust memory, invisible to
tracemalloc). ``rss_mb`` is the RSS growth for both.

**The hybrid rows.** An in-process Engine on strata-tiny (sliding window 64 + full layers, page 16) with a
small SWA pool (0.15 and 0.08 of the full pool) serves 16 interleaved 5-turn conversations, one request
at a time; before each request the
tree's events since the last one go through ``to_wire`` into strata's index (SWA-exact: ``window_pages``)
and Dynamo's tree (full only: group 0). Per request each one's predicted cached tokens is compared with the
``cached_tokens`` the engine delivers. Without Dynamo the strata rows still run; the JSON says why Dynamo
was skipped.
"""
from __future__ import annotations

import argparse
import array
import gc
import itertools
import json
import os
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Callable

from actors.routing import PrefixIndex, RouterConfig, prompt_blocks, route
from bench.common import table, write_json
from engine.worker_load import WorkerLoad
from storage.geometry import KVGeometry
from storage.kv_events.translate import FULL_GROUP, WireMapping, to_wire, worker_media
from storage.kv_events.wire import (GPU, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch,
                                    decode_batch, encode_batch)
from storage.radix import FULL, L1, SWA, RadixTree

PS, WINDOW = 16, 64
WORKERS = 4
FIRST, FOLLOW, ANSWER, TURNS = 256, 128, 64, 4
NEW_TURN = 128
TIERS = {GPU: "L1"}

# Dynamo lives in a directory of its own (Makefile: pip install --no-deps --target .venv/interop).
_INTEROP = Path(__file__).resolve().parents[1] / ".venv" / "interop"
if _INTEROP.is_dir() and str(_INTEROP) not in sys.path:
    sys.path.append(str(_INTEROP))
try:
    from dynamo._core import RadixTree as DynamoTree
    from dynamo._core import compute_block_hash_for_seq
    DYNAMO_SKIPPED = ""
except ImportError as e:
    DynamoTree = compute_block_hash_for_seq = None
    DYNAMO_SKIPPED = (f"Dynamo is not importable ({e}); install ai-dynamo-runtime==1.6.1 with pip install "
                      f"--no-deps --target {_INTEROP}")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ----------------------------------------------------------------------------------------- the stream

def build_stream(target_pages: int, rng: random.Random) -> tuple[list[tuple[int, list]], list[list[int]]]:
    """(worker, wire events of one turn) in publishing order, and the token ids of every conversation
    still wholly cached at the end (see the module doc)."""
    full_cap = target_pages // WORKERS
    swa_cap = full_cap // 4
    mapping = WireMapping.of(PS, WINDOW, {L1: GPU})
    trees = [RadixTree(PS, -(-(WINDOW - 1) // PS)) for _ in range(WORKERS)]
    pages = [itertools.count() for _ in range(WORKERS)]
    stream: list[tuple[int, list]] = []
    clock = itertools.count(1)
    fresh = [0] * WORKERS   # pages each worker computed (a turn's new pages)
    convs: list[tuple[int, list[int], list[bytes]]] = []
    rand = lambda n: [rng.randrange(32000) for _ in range(n)]   # noqa: E731
    # Conversations come in groups of 4 per worker, turns interleaved, until the trees are 1.2x full.
    while min(fresh) < 1.2 * full_cap:
        group = [(c % WORKERS, []) for c in range(len(convs), len(convs) + 4 * WORKERS)]
        for turn in range(TURNS):
            for w, seq in group:
                before = len(seq) // PS
                seq += rand(FIRST if turn == 0 else FOLLOW) + rand(ANSWER)
                t, n = trees[w], len(seq) // PS
                keys = t.page_keys(seq[:n * PS])
                # the pages this turn computed get fresh pages; cached ones come back as duplicates
                full = [next(pages[w]) for _ in range(n)]
                t.insert(keys, full, [next(pages[w]) for _ in range(n)], now=float(next(clock)),
                         tokens=seq[:n * PS])
                fresh[w] += n - before
                over = t.num_pages(FULL, L1) - full_cap
                if over > 0:
                    t.evict(FULL, L1, over)
                over = t.num_pages(SWA, L1) - swa_cap
                if over > 0:
                    t.evict(SWA, L1, over)
                stream.append((w, to_wire(t.take_events(), mapping)))
        convs += [(w, seq, trees[w].page_keys(seq[:len(seq) // PS * PS])) for w, seq in group]
    # the conversations whose every page is still in their worker's tree
    alive = []
    for w, seq, keys in convs:
        m = trees[w].match_prefix(keys, now=float(next(clock)), window_pages=0)
        if m.num_pages == len(keys):
            alive.append(seq)
    return stream, alive


def to_dynamo(events: list, event_id: Callable[[], int]) -> list[bytes]:
    """Dynamo's JSON ``KvCacheEvent`` of each wire event it would index (group 0; see the module doc)."""
    out = []
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            data = "cleared"
        elif (ev.group_idx or 0) != FULL_GROUP:
            continue
        elif isinstance(ev, BlockStored):
            local = compute_block_hash_for_seq(ev.token_ids, ev.block_size)
            data = {"stored": {"parent_hash": ev.parent_block_hash,
                               "blocks": [{"block_hash": h, "tokens_hash": t}
                                          for h, t in zip(ev.block_hashes, local)]}}
        elif isinstance(ev, BlockRemoved):
            data = {"removed": {"block_hashes": ev.block_hashes}}
        else:
            continue
        out.append(json.dumps({"event_id": event_id(), "data": data}).encode())
    return out


def build_strata(stream) -> PrefixIndex:
    idx = PrefixIndex()
    for w, events in stream:
        idx.apply_wire(f"p{w}", events, TIERS)
    return idx


def strata_memory(stream) -> tuple[int, int]:
    """(tracemalloc bytes, RSS growth) of an index rebuilt from the stream's msgpack batches."""
    payloads = [(w, encode_batch(EventBatch(0.0, events))) for w, events in stream]
    gc.collect()
    rss0 = rss_bytes()
    tracemalloc.start()
    idx = PrefixIndex()
    for w, p in payloads:
        idx.apply_wire(f"p{w}", decode_batch(p).events, TIERS)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    rss = rss_bytes() - rss0
    del idx
    return traced, rss


def build_dynamo(stream):
    """Dynamo's tree fed the stream (converted first, so only apply_event runs while RSS is watched);
    -> (tree, RSS growth)."""
    ids = itertools.count(1)
    converted = [(w, to_dynamo(events, lambda: next(ids))) for w, events in stream]
    gc.collect()
    rss0 = rss_bytes()
    tree = DynamoTree()
    for w, evs in converted:
        for e in evs:
            tree.apply_event(w, e)
    tree.find_matches([1])   # its worker thread has applied everything before it answers
    return tree, rss_bytes() - rss0


# ----------------------------------------------------------------------------------------- timing

def fresh(prompt: list[int]) -> list[int]:
    """A new list of new int objects with ``prompt``'s ids: a prompt as the router receives it, just
    deserialized (the bench's stored prompts would otherwise be read cold from a 16 MB heap each time)."""
    return array.array("q", prompt).tolist()


def time_rounds(impls: dict[str, tuple[Callable, list]], seconds: float, rounds: int = 24) -> dict[str, dict]:
    """Each impl ``fn(a)`` cycling over its ``args`` for ``seconds`` in all, in ``rounds`` short rounds
    that alternate between the impls (the machine is shared: a busy moment should hit every impl alike).
    Every call gets a ``fresh`` copy of its prompt, made outside the timed call; a round's rate is its
    calls over their summed time. Per impl: the best round's and the median round's rate, p50/p99 over
    all its calls, and per round the rate (for ratios between impls taken in the same round)."""
    lat: dict[str, list[float]] = {k: [] for k in impls}
    rates: dict[str, list[float]] = {k: [] for k in impls}
    clock = time.perf_counter
    gc.collect()
    for r in range(rounds):
        order = list(impls)
        order = order[r % len(order):] + order[:r % len(order)]   # who goes first rotates
        for name in order:
            fn, args = impls[name]
            out = lat[name]
            n, spent = 0, 0.0
            end = clock() + seconds / rounds
            while True:
                a = fresh(args[n % len(args)])
                t = clock()
                fn(a)
                t1 = clock()
                out.append(t1 - t)
                spent += t1 - t
                n += 1
                if t1 >= end:
                    break
            rates[name].append(n / spent)
    res = {}
    for name in impls:
        lat[name].sort()
        xs = lat[name]
        res[name] = {"decisions_per_s": max(rates[name]), "median_round_per_s": statistics.median(rates[name]),
                     "p50_us": 1e6 * statistics.median(xs), "p99_us": 1e6 * xs[int(0.99 * (len(xs) - 1))],
                     "_rates": rates[name]}
    return res


def best_us(fn: Callable[[object], object], args: list, rounds: int = 5, prompts: bool = False) -> float:
    """The best of ``rounds`` passes of ``fn`` over ``args``, per call (``prompts``: each pass on ``fresh``
    copies made before it, as ``time_rounds`` gives them)."""
    best = float("inf")
    for _ in range(rounds):
        xs = [fresh(a) for a in args] if prompts else args
        t = time.perf_counter()
        for a in xs:
            fn(a)
        best = min(best, (time.perf_counter() - t) / len(xs))
    return 1e6 * best


def scale_rows(target: int, seconds: float, rng: random.Random) -> tuple[list[dict], dict]:
    cfg, geom = RouterConfig(), KVGeometry(page_size=PS, window=WINDOW)
    t0 = time.perf_counter()
    stream, alive = build_stream(target, rng)
    build_s = time.perf_counter() - t0
    n_events = sum(len(e) for _, e in stream)
    idx = build_strata(stream)
    workers = [f"p{i}" for i in range(WORKERS)]
    loads = {w: WorkerLoad(queued_tokens=rng.randrange(2000), running=rng.randrange(8)) for w in workers}
    prompts = [c + [rng.randrange(32000) for _ in range(NEW_TURN)] for c in rng.sample(alive, min(len(alive), 500))]
    wp = geom.window_pages
    common = {"indexed_pages": len(idx), "workers": WORKERS, "prompt_tokens": len(prompts[0]),
              "events": n_events}

    def strata_route(p):
        return route(idx, prompt_blocks(p, geom, cfg), len(p), loads, cfg, geom)

    def strata_overlap(p):
        return idx.overlap_all(prompt_blocks(p, geom, cfg), workers, wp)

    hash_us = best_us(lambda p: prompt_blocks(p, geom, cfg), prompts, prompts=True)
    keyed = [(prompt_blocks(p, geom, cfg), len(p)) for p in prompts]
    decide_us = best_us(lambda k: route(idx, k[0], k[1], loads, cfg, geom), keyed)
    traced, rss = strata_memory(stream)
    mem = {"index_mb": traced / 2**20, "rss_mb": rss / 2**20}
    check = {"stream_build_s": build_s, "prompts": len(prompts), "conversations_alive": len(alive)}
    impls = {"strata route": (strata_route, prompts), "strata overlap": (strata_overlap, prompts)}
    extra = {"strata route": {"hash_us": hash_us, "ingress_hash_us": hash_us, "decide_us": decide_us, **mem},
             "strata overlap": {"hash_us": hash_us,
                                "decide_us": best_us(lambda k: idx.overlap_all(k[0], workers, wp), keyed), **mem}}
    if DynamoTree is not None:
        tree, drss = build_dynamo(stream)
        ids = {(i, 0): f"p{i}" for i in range(WORKERS)}

        def dynamo(p):
            return tree.find_matches(compute_block_hash_for_seq(p, PS)).scores

        # Same stream, same answer: Dynamo's overlap is strata's full-only one (no window rule), per worker.
        # Dynamo hashes every whole block, strata the cacheable ones (the last token is always computed).
        disagree = 0
        for p in prompts:
            d = {ids[k]: v for k, v in dynamo(p[:geom.cacheable_tokens(len(p))]).items()}
            s = idx.overlap_all(prompt_blocks(p, geom, cfg), workers, 0)
            disagree += any(d.get(w, 0) != s[w].pages for w in workers)
        check["full_only_disagreements"] = disagree
        impls["dynamo"] = (dynamo, prompts)
        extra["dynamo"] = {"hash_us": best_us(lambda p: compute_block_hash_for_seq(p, PS), prompts, prompts=True),
                           "decide_us": best_us(lambda h: tree.find_matches(h).scores,
                                                [compute_block_hash_for_seq(p, PS) for p in prompts]),
                           "index_mb": drss / 2**20, "rss_mb": drss / 2**20}
    timed = time_rounds(impls, seconds * len(impls))
    rates = {name: timed[name].pop("_rates") for name in impls}
    rows = []
    for name in impls:
        row = {"impl": name, **common, **timed[name], **extra[name]}
        if "dynamo" in rates:
            # the same rounds side by side: this impl's rate over Dynamo's, the median over rounds
            row["vs_dynamo"] = statistics.median(a / b for a, b in zip(rates[name], rates["dynamo"]))
        rows.append(row)
    if DynamoTree is not None:
        del tree
    return rows, check


# ----------------------------------------------------------------------------------------- hybrid row

def hybrid_row(quick: bool, swa_ratio: float) -> dict:
    """Predicted vs delivered cached tokens on the tiny hybrid model (see the module doc); ``swa_ratio``:
    the SWA pool's size over the full pool's (smaller: more windows tombstoned)."""
    import torch
    from engine import Engine, SamplingParams

    eng = Engine.from_pretrained("strata-tiny", page_size=PS, num_pages=1024, enable_prefix_cache=True,
                                 swa_full_ratio=swa_ratio, torch_threads=1)
    geom = eng.geometry
    cfg = RouterConfig(seed=eng.cache.tree.seed)
    mapping = WireMapping.of(PS, geom.window or 0, worker_media())
    idx = PrefixIndex()
    tree = DynamoTree() if DynamoTree is not None else None
    ids = itertools.count(1)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()   # noqa: E731
    convs, turns = (4, 3) if quick else (16, 5)
    ctx = [[] for _ in range(convs)]
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    n_req = prompt_tok = delivered = pred_s = pred_d = miss_s = miss_d = over_d = under_d = 0
    tombstones = 0
    for turn in range(turns):
        for c in range(convs):
            prompt = ctx[c] + rand(192 if turn == 0 else 80)
            wire = to_wire(eng.cache.tree.take_events(), mapping)
            tombstones += sum(len(e.block_hashes) for e in wire
                              if isinstance(e, BlockRemoved) and e.group_idx == 1)
            idx.apply_wire("w", wire, {GPU: "L1", "CPU_PINNED": "L2"})
            s = idx.overlap(prompt_blocks(prompt, geom, cfg), "w", geom.window_pages).pages * PS
            if tree is not None:
                for e in to_dynamo(wire, lambda: next(ids)):
                    tree.apply_event(0, e)
                cacheable = prompt[:geom.cacheable_tokens(len(prompt))]
                d = tree.find_matches(compute_block_hash_for_seq(cacheable, PS)).scores.get((0, 0), 0) * PS
            rid = eng.add_request(prompt, sp)
            while eng.has_unfinished():
                eng.step()
            out = eng.pop_finished(rid)
            got = out.cached_tokens
            n_req += 1
            prompt_tok += len(prompt)
            delivered += got
            pred_s += s
            miss_s += s != got
            if tree is not None:
                pred_d += d
                miss_d += d != got
                over_d += max(0, d - got)
                under_d += max(0, got - d)
            ctx[c] = prompt + out.token_ids
    swa_pool, full_pool = eng.pools.swa.num_pages, eng.pools.full.num_pages
    eng.close()
    row = {"model": "strata-tiny", "window": geom.window, "page_size": PS, "swa_pool_pages": swa_pool,
           "full_pool_pages": full_pool, "requests": n_req,
           "prompt_tokens": prompt_tok, "swa_tombstoned_pages": tombstones,
           "delivered_hit_rate": delivered / prompt_tok,
           "strata_predicted_hit_rate": pred_s / prompt_tok, "strata_mispredicted": miss_s}
    if tree is not None:
        row.update({"dynamo_predicted_hit_rate": pred_d / prompt_tok, "dynamo_mispredicted": miss_d,
                    "dynamo_overestimate_tokens": over_d, "dynamo_underestimate_tokens": under_d})
    return row


# ----------------------------------------------------------------------------------------- main

COLS = ["impl", "indexed_pages", "workers", "prompt_tokens", "decisions_per_s", "median_round_per_s", "vs_dynamo",
        "p50_us", "p99_us", "hash_us", "decide_us", "index_mb", "rss_mb"]
HYBRID_COLS = ["swa_pool_pages", "requests", "swa_tombstoned_pages", "delivered_hit_rate", "strata_predicted_hit_rate",
               "strata_mispredicted", "dynamo_predicted_hit_rate", "dynamo_mispredicted",
               "dynamo_overestimate_tokens"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small scales, short timing (a smoke run)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/results alone")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    scales, seconds = ((2_000,), 0.2) if args.quick else ((10_000, 100_000), 4.0)
    if DYNAMO_SKIPPED:
        print(f"dynamo skipped: {DYNAMO_SKIPPED}", flush=True)
    rows, checks = [], []
    for target in scales:
        r, chk = scale_rows(target, seconds, rng)
        rows += r
        checks.append({"indexed_pages": r[0]["indexed_pages"], **chk})
        print(f"{target:>7} pages: {chk}", flush=True)
    print(table(rows, COLS))
    hyb = [hybrid_row(args.quick, r) for r in ((0.15,) if args.quick else (0.15, 0.08))]
    print(table(hyb, [c for c in HYBRID_COLS if c in hyb[0]]))
    by = {(r["impl"], r["indexed_pages"]): r for r in rows}
    top = max(r["indexed_pages"] for r in rows)
    verdict = None
    if not DYNAMO_SKIPPED:
        s, o, d = by[("strata route", top)], by[("strata overlap", top)], by[("dynamo", top)]
        verdict = {"indexed_pages": top, "strata_route_per_s": s["decisions_per_s"],
                   "strata_overlap_per_s": o["decisions_per_s"], "dynamo_per_s": d["decisions_per_s"],
                   "strata_route_vs_dynamo_same_rounds": s["vs_dynamo"],
                   "strata_overlap_vs_dynamo_same_rounds": o["vs_dynamo"],
                   "strata_at_least_dynamo": s["decisions_per_s"] >= d["decisions_per_s"]}
        print(f"at {top} pages, hashing included (best round): strata route {s['decisions_per_s']:,.0f}/s, "
              f"strata overlap {o['decisions_per_s']:,.0f}/s, dynamo {d['decisions_per_s']:,.0f}/s; "
              f"median same-round ratio route/dynamo {s['vs_dynamo']:.2f}, overlap/dynamo {o['vs_dynamo']:.2f}")
    notes = [
        "Dynamo's RadixTree answers on a thread of its own: a call costs ~10 us more or less depending on "
        "whether another core is free to run it at once; on this shared 2-core machine that changes from run "
        "to run, and vs_dynamo with it (same-round medians at 100k pages seen between 0.55 and 1.49 across "
        "runs of this bench on 2026-11-26 with the old index; Dynamo's best round at 100k between 16.3k/s "
        "(p50 62 us) and 44.8k/s (p50 24 us) across three runs with the compact one).",
        "strata's index since the compact layout (actors/routing.py: one int mask per page, holders as bit "
        "slots, the mask ints shared): ~120 B per page at 100k (index_mb, tracemalloc; it was ~700 B as dict "
        "of dict of set), the key int and the dict entry being most of it, against Dynamo's ~60 B per block "
        "(RSS).",
        "strata's decision at 100k pages, where the time goes (timed by parts, cold cache as after hashing a "
        "fresh prompt): hashing (BLAKE2b, two compressions per 16-token page, in C) ~16 us against Dynamo's "
        "xxh3 ~10 us; the compiled walk of 4 workers ~7 us (its 63 full-table and the SWA lookups, prefetched "
        "together: ~10.6 us without the prefetch, ~2.2 us with the index in cache), route's Python (the cost "
        "per worker, the pick's Overlap) ~2 us. The walk is now on par with Dynamo's find_matches; the gap "
        "left is the hash.",
    ]
    payload = {"notes": notes, "dynamo": "ai-dynamo-runtime 1.6.1 (dynamo._core.RadixTree)" if not DYNAMO_SKIPPED else None,
               "dynamo_skipped": DYNAMO_SKIPPED or None, "quick": args.quick, "rows": rows, "checks": checks,
               "verdict": verdict, "hybrid": hyb}
    if not args.no_write:
        print(f"wrote {write_json('router', payload)}")
    return payload


if __name__ == "__main__":
    main()
