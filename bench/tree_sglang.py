"""SGLang's own SWA radix cache on strata's tree workload (bench/tree.py), same instance, as a baseline.

Drives SGLang 0.5.23's ``UnifiedRadixCache`` (components FULL + SWA) over its real CPU pools
(``SWAKVPool`` of two ``MHATokenToKVPool``) and allocator (``SWATokenToKVPoolAllocator`` with paged
sub-allocators), once per tree core: ``python`` (``UnifiedTreeCore``) and ``rust``
(``RustUnifiedTreeCore``, selected through ``CacheInitParams.tree_core_backend``; the env var
``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` is the server-wide switch). Each request is served as
bench.tree.serve serves strata's tree: match (at most (len-1)//16 pages) and lock, evict to make room
for the tail in each pool, allocate the tail, free the request's own out-of-window SWA pages (the last
window, 8 pages, is kept), insert, unlock. Hit rate = hit tokens / prompt tokens, as in bench.tree.

SGLang does not go into strata's venv. Build a side venv (CPU only, no network needed beyond the local
package mirror):

    python3 -m venv /tmp/sglvenv
    /tmp/sglvenv/bin/pip install torch==2.13.0            # the CPU wheel on local disk
    /tmp/sglvenv/bin/pip install --no-deps /tmp/sgl_dl/sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl
    /tmp/sglvenv/bin/pip install --no-deps numpy orjson psutil pybase64 requests urllib3 idna certifi \\
        triton packaging pillow starlette anyio msgspec pydantic pydantic_core typing_inspection \\
        annotated_types pyzmq tqdm IPython traitlets pygments aiohttp multidict attrs yarl propcache \\
        aiohappyeyeballs aiosignal frozenlist apache-tvm-ffi==0.1.11 transformers regex huggingface_hub \\
        httpx2 httpcore2 truststore h11 pyyaml "safetensors>=0.8.0" tokenizers==0.23.2 filelock fsspec \\
        dill sentencepiece compressed_tensors loguru gguf openai sniffio partial_json_parser

    cd <worktree> && PYTHONPATH=$PWD /tmp/sglvenv/bin/python -m bench.tree_sglang [--quick] [--reps N]

torchvision is NOT installed: the only wheel on disk is a CUDA build whose ops library needs
libc10_cuda.so, and ``import sglang.srt.mem_cache...`` reaches it only through VLM config modules
(``sglang.srt.configs`` -> InternVL / DeepSeek-OCR preprocessing). ``_stub_torchvision`` puts an empty
stand-in (``InterpolationMode`` only) in ``sys.modules`` before sglang is imported; nothing on the
radix-cache path uses it.
"""
from __future__ import annotations

import argparse
import enum
import gc
import importlib.machinery
import os
import sys
import time
import types
from array import array

from bench.tree import CONVS, PAGE, ROUNDS, VOCAB, WINDOW, BareTree, pool_sizes, run, workload

SEEDS = range(6)
KEEP_PAGES = WINDOW // PAGE
"""SWA pages a request keeps of its own (bench.tree's protocol). SGLang's scheduler keeps one more
(ceil_align(window, page) below len - 1, common.free_swa_out_of_window_slots): --keep-pages 9."""
CORES = ("python", "rust")
ISSUE = {"python": {"hit_rate": 0.578, "requests/s": 820, "match/s hashed": 11_400, "insert/s": 4_200},
         "rust": {"hit_rate": 0.578, "requests/s": 1_140, "match/s hashed": 53_500, "insert/s": 13_100}}
"""SGLang's figures as quoted in the issue (another random instance of this workload)."""


def _stub_torchvision() -> bool:
    """A stand-in for torchvision when the real one cannot load (see the module docstring)."""
    try:
        import torchvision  # noqa: F401
        return False
    except Exception:
        for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[k]
    # transformers caches "torchvision unavailable" before the stand-in exists, so it never uses it.
    from transformers.utils import import_utils
    import_utils.is_torchvision_available()
    tv, tr, fn = (types.ModuleType(n) for n in ("torchvision", "torchvision.transforms",
                                                 "torchvision.transforms.functional"))

    class InterpolationMode(enum.Enum):
        NEAREST, BILINEAR, BICUBIC = "nearest", "bilinear", "bicubic"

    fn.InterpolationMode = tr.InterpolationMode = InterpolationMode
    tr.functional, tv.transforms = fn, tr
    for m in (tv, tr, fn):
        m.__spec__ = importlib.machinery.ModuleSpec(m.__name__, None)
        sys.modules[m.__name__] = m
    return True


def _import_sglang():
    try:
        _stub_torchvision()
        import torch
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    except ImportError as e:
        sys.exit(f"bench.tree_sglang: sglang is not importable ({e}); build the side venv described in "
                 f"this module's docstring and run under it.")
    return types.SimpleNamespace(**locals())


S = None   # the sglang namespace, set by main()


class SGLangSWA:
    """SGLang's UnifiedRadixCache (FULL + SWA) with its real pools and allocator, on CPU.

    Token-level indices throughout (SGLang's tree stores full-pool slot ids per token; SWA slots are
    found through the allocator's full->SWA mapping)."""

    def __init__(self, full_pages: int, swa_pages: int, core: str) -> None:
        torch = S.torch
        self.full_pages, self.swa_pages = full_pages, swa_pages
        # One full and one SWA layer of 1 head x 8 dims: the pools are real but tiny (the cache only
        # needs their slot spaces).
        self.kv = S.SWAKVPool(size=full_pages * PAGE, size_swa=swa_pages * PAGE, page_size=PAGE,
                              dtype=torch.float16, head_num=1, head_dim=8, swa_attention_layer_ids=[0],
                              full_attention_layer_ids=[1], device="cpu",
                              token_to_kv_pool_class=S.MHATokenToKVPool, enable_memory_saver=False)
        self.alloc = S.SWATokenToKVPoolAllocator(full_pages * PAGE, swa_pages * PAGE, PAGE, torch.float16,
                                                 "cpu", self.kv, need_sort=False)
        self.req_pool = S.ReqToTokenPool(size=4, max_context_len=4096, device="cpu",
                                         enable_memory_saver=False)
        params = S.CacheInitParams(disable=False, req_to_token_pool=self.req_pool,
                                   token_to_kv_pool_allocator=self.alloc, page_size=PAGE,
                                   sliding_window_size=WINDOW,
                                   tree_components=(S.ComponentType.FULL, S.ComponentType.SWA),
                                   tree_core_backend=core)
        self.cache = S.UnifiedRadixCache(params)
        self.core = type(self.cache.tree_core).__name__
        self.wp = WINDOW // PAGE
        self.keep = KEEP_PAGES
        self.t_match_prefix = 0.0

    def match(self, tokens: list[int], max_pages: int):
        t0 = time.perf_counter()
        key = S.RadixKey(array("q", tokens[:max_pages * PAGE]))
        res = self.cache.match_prefix(S.MatchPrefixParams(key=key))
        self.t_match_prefix += time.perf_counter() - t0
        m = res.device_prefix_len
        node = res.last_device_node
        hit = self.cache.path_device_indices(node)[:m]
        lock = self.cache.lock(node)
        return lock, m // PAGE, hit

    def room(self, full_tokens: int, swa_tokens: int) -> None:
        need_full = max(0, full_tokens - self.alloc.full_available_size())
        need_swa = max(0, swa_tokens - self.alloc.swa_available_size())
        if need_full or need_swa:
            self.cache.evict(S.EvictParams(num_tokens=need_full, swa_num_tokens=need_swa))

    def alloc_tail(self, hit, m: int, n: int):
        torch = S.torch
        pre = torch.tensor([m * PAGE], dtype=torch.int64)
        seq = torch.tensor([n * PAGE], dtype=torch.int64)
        last = torch.tensor([int(hit[-1]) if m else -1], dtype=torch.int64)
        out = self.alloc.alloc_extend(pre, pre, seq, seq, last, (n - m) * PAGE)
        if out is None:
            raise RuntimeError(f"allocation failed after eviction: {self.alloc.debug_print()}")
        return out

    def insert(self, tokens: list[int], value, m: int, evicted_tokens: int) -> None:
        params = S.InsertParams(key=S.RadixKey(array("q", tokens)), value=value,
                                prev_prefix_len=m * PAGE, inserted_len=m * PAGE)
        if evicted_tokens:
            params.set_evicted_seqlen(S.ComponentType.SWA, evicted_tokens)
        self.cache.insert(params)


def serve(c: SGLangSWA, tokens: list[int], tm: dict) -> None:
    """One request, mirroring bench.tree.serve step for step."""
    torch, clock = S.torch, time.perf_counter
    t0 = clock()
    n = len(tokens) // PAGE
    lock, m, hit = c.match(tokens, (len(tokens) - 1) // PAGE)
    t1 = clock()
    tail = n - m
    c.room(tail * PAGE, tail * PAGE)
    ta = clock()
    own = c.alloc_tail(hit, m, n)
    lo = max(0, n - c.keep)   # the SWA pages a continuation from page n reads (c.keep = window pages)
    evicted = 0
    if lo > m:              # the request's own pages below the window: free their SWA half
        # The kv-row segment path SGLang's free_swa_out_of_window_slots takes.
        c.alloc.free_swa_segment(own[:(lo - m) * PAGE], start_pos=m * PAGE)
        evicted = lo * PAGE
    value = torch.cat([hit.to(torch.int64), own.to(torch.int64)])
    t2 = clock()
    tm["alloc"] += t2 - ta
    c.insert(tokens, value, m, evicted)
    t3 = clock()
    c.cache.unlock(lock)
    t4 = clock()
    tm["match"] += t1 - t0
    tm["insert"] += t3 - t2
    tm["request"] += t4 - t0
    tm["requests"] += 1
    tm["hit_tokens"] += m * PAGE
    tm["prompt_tokens"] += len(tokens)


def run_sglang(core: str, rounds) -> dict:
    gc.collect()
    full, swa = pool_sizes(rounds)
    c = SGLangSWA(full, swa, core)
    tm = dict(match=0.0, insert=0.0, request=0.0, alloc=0.0, requests=0, hit_tokens=0, prompt_tokens=0)
    for prompts in rounds:
        for tokens in prompts:
            serve(c, tokens, tm)
    # Every slot is accounted for: free + held by the tree (no request holds any at the end).
    a, ev = c.alloc, c.cache.tree_core
    sizes = _sizes(ev)
    if "full_evictable_size" in sizes and "swa_evictable_size" in sizes:
        held = {"full": a.full_available_size() + sizes["full_evictable_size"],
                "swa": a.swa_available_size() + sizes["swa_evictable_size"]}
        if held != {"full": full * PAGE, "swa": swa * PAGE}:
            raise AssertionError(f"slot leak: free + tree = {held}, pools = {full * PAGE}, {swa * PAGE}")
    return {"hit_rate": tm["hit_tokens"] / tm["prompt_tokens"], "requests/s": tm["requests"] / tm["request"],
            "requests/s excl. alloc": tm["requests"] / (tm["request"] - tm["alloc"]),
            "alloc ms/request": 1e3 * tm["alloc"] / tm["requests"],
            "match/s hashed": tm["requests"] / tm["match"],
            "match_prefix/s": tm["requests"] / c.t_match_prefix, "insert/s": tm["requests"] / tm["insert"],
            "requests": tm["requests"], "tree_core": c.core, "pool_pages": {"full": full, "swa": swa},
            "free_pages_end": {"full": a.full_available_size() // PAGE, "swa": a.swa_available_size() // PAGE},
            "tree_sizes_end": sizes}


def _sizes(core) -> dict:
    out = {}
    for name in ("full_evictable_size", "swa_evictable_size", "full_protected_size", "swa_protected_size"):
        f = getattr(core, name, None)
        if callable(f):
            try:
                out[name] = int(f())
            except Exception:   # noqa: BLE001 - a core without that counter just omits it
                pass
    return out


def main() -> None:
    global S, KEEP_PAGES
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="seed 0 only, one repetition")
    ap.add_argument("--reps", type=int, default=3, help="repetitions on seed 0 per core (best rates kept)")
    ap.add_argument("--cores", default=",".join(CORES))
    ap.add_argument("--keep-pages", type=int, default=KEEP_PAGES,
                    help="own SWA pages kept per request (8 = bench.tree's protocol, 9 = SGLang scheduler's)")
    ap.add_argument("--out", default="tree_sglang", help="results name under bench/results/")
    args = ap.parse_args()
    KEEP_PAGES = args.keep_pages
    S = _import_sglang()
    # One intra-op thread: the allocator's small tensor ops (alloc_extend_naive's searchsorted) take
    # ~2.5 ms each with 2 threads on this loaded 2-core box, ~0.01 ms with one. Rates on a GPU server
    # run these on the device; here they are CPU ops either way.
    S.torch.set_num_threads(1)
    import logging
    logging.disable(logging.INFO)   # UnifiedRadixCache logs a line per construction
    cores = args.cores.split(",")
    seeds = [0] if args.quick else list(SEEDS)
    reps = 1 if args.quick else args.reps
    per_seed: dict = {}
    seed0: dict = {}
    for seed in seeds:
        rounds = workload(seed)
        row = {"seed": seed, "strata tree": run(BareTree, rounds)["hit_rate"]}
        for core in cores:
            rs = [run_sglang(core, rounds) for _ in range(reps if seed == 0 else 1)]
            row[f"sglang {core}"] = rs[0]["hit_rate"]
            if seed == 0:
                seed0[core] = {k: (max(r[k] for r in rs) if k.endswith("/s") else
                                min(r[k] for r in rs) if k.endswith("/request") else rs[0][k]) for k in rs[0]}
        per_seed[seed] = row
        print(f"seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items() if k != "seed"), flush=True)
    rs = [run(BareTree, workload(0)) for _ in range(reps)]
    strata0 = {k: (max(r[k] for r in rs) if k.endswith("/s") else rs[0][k]) for k in rs[0]}
    from bench.common import table
    cols = ["path", "hit_rate", "requests/s", "requests/s excl. alloc", "match/s hashed", "match_prefix/s",
            "insert/s"]
    rows = [{"path": f"sglang {c} ({seed0[c]['tree_core']})", **seed0[c]} for c in cores]
    rows += [{"path": f"sglang {c} (issue, other instance)", **ISSUE[c]} for c in cores]
    rows.append({"path": "strata tree (bench.tree.run, BareTree)", **strata0})
    print("\nseed 0, rates best of", reps)
    print(table(rows, cols))
    hcols = ["seed", "strata tree"] + [f"sglang {c}" for c in cores]
    print("\nhit rate per seed")
    print(table(list(per_seed.values()), hcols))
    payload = {"workload": {"conversations": CONVS, "rounds": ROUNDS, "page_size": PAGE, "window": WINDOW,
                            "vocab": VOCAB, "sglang_own_swa_pages_kept": KEEP_PAGES},
               "repetitions_seed0": reps, "sglang_version": _version(), "seed0": seed0,
               "strata_seed0": strata0, "hit_rate_per_seed": per_seed, "issue_figures": ISSUE,
               "load_average": os.getloadavg(),
               "note": "torchvision stubbed (CUDA-only wheel on disk; VLM config imports only)."}
    try:
        from bench.common import write_json
        path = write_json(args.out, payload)
    except Exception as e:   # noqa: BLE001 - machine() is torch-only, but keep the JSON whatever happens
        import json
        from pathlib import Path
        path = Path(__file__).resolve().parent / "results" / f"{args.out}.json"
        path.write_text(json.dumps({"machine_error": repr(e), **payload}, indent=2))
    print(f"\nwrote {path}")


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("sglang")
    except Exception:   # noqa: BLE001
        return "unknown"


if __name__ == "__main__":
    main()
