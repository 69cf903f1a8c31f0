"""L3 stores per backend: batch_set / batch_get bandwidth of host pages, and the time to first token of a
prompt served from L3 against recomputing it.

Bandwidth: ``--pages`` pages (default 64) of two geometries, taken from (and read back into) a registered
``page_first_direct`` host pool, as the tier controller does:

* ``strata-tiny``: one L2 page of the embedded model's full-attention component (2 layers x K,V x 16
  tokens x 2 KV heads x 16 dims, float32: 8 KiB);
* ``realistic``: 64 tokens x 24 layers x 8 KV heads x 64 dims x K,V x bf16 (3 MiB).

Each repetition writes fresh keys (a Mooncake put of an existing key is a no-op) and the store is cleared
between repetitions; the best of ``--reps`` is kept. Next to each figure: one contiguous in-memory copy of
the same bytes (the memcpy bound).

TTFT: engine A (strata-tiny, page 16) serves a prompt of 8 windows (512 tokens) and writes it through L2
to L3; a fresh engine B, whose L1/L2 are empty, then serves that prompt plus a new 40-token question with
``max_new_tokens=1`` (prefetch policy ``wait_complete``): its first token comes from 512 tokens of KV read
from L3 and 40 computed. The same prompt with no cache is the recomputation. Best of ``--reps``.

File and NIXL figures are page-cache speeds (no fsync, files hot), not the disk's. Mooncake runs against
a real ``mooncake_master`` started here on 127.0.0.1, protocol tcp, P2P handshake; nixl-ucx against a
slab server process on 127.0.0.1 (one-sided UCX into its memory).

    python -m bench.l3 [--pages 64] [--reps 3] [--backends file nixl nixl-ucx mooncake] [--dir DIR]
                       [--nixl-params use_uring=true] [--no-ttft]

Writes bench/results/l3.json.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from bench.common import table, write_json
from storage.kernels_path import transfer
from storage.l3 import HEADER_BYTES, L3Config, l3_key, make_store
from storage.l3.base import page_bytes

# name -> (layers, KV heads, head dim, tokens per page, dtype)
GEOMETRIES = {"strata-tiny": (2, 2, 16, 16, torch.float32), "realistic": (24, 8, 64, 64, torch.bfloat16)}


def _elems(geo: str) -> int:
    layers, heads, dim, ps, _ = GEOMETRIES[geo]
    return 2 * ps * heads * dim   # K and V of one layer


def _page_bytes(geo: str) -> int:
    layers, _, _, _, dtype = GEOMETRIES[geo]
    return layers * _elems(geo) * torch.empty((), dtype=dtype).element_size()


def _pool(geo: str, pages: int) -> torch.Tensor:
    layers, _, _, ps, dtype = GEOMETRIES[geo]
    pool = transfer.alloc_l2(transfer.PAGE_FIRST_DIRECT, layers, pages, ps, _elems(geo), dtype)
    return pool.uniform_(-1, 1)   # written, not just allocated: untouched pages read as the zero page


def _bounds(nbytes: int, reps: int) -> dict:
    a = torch.empty(nbytes, dtype=torch.uint8).random_()
    b = torch.empty_like(a)
    import xxhash

    def best(fn) -> float:
        fn()
        t = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            t = min(t, time.perf_counter() - t0)
        return nbytes / t / 1e9

    return dict(memcpy_gbps=best(lambda: b.copy_(a)), xxh3_gbps=best(lambda: xxhash.xxh3_64_intdigest(page_bytes(a))))


SLOT = HEADER_BYTES + max(_page_bytes(g) for g in GEOMETRIES)   # the largest stored page
BACKENDS = ("file", "nixl", "nixl-ucx", "mooncake")


def _cfg(backend: str, root: str, capacity: int, server_addr: str | None, nixl_params: dict, **kw) -> L3Config:
    kw = dict(backend=backend, path=os.path.join(root, backend), capacity_bytes=capacity, **kw)
    if backend == "mooncake":
        kw["mooncake"] = dict(master_addr=server_addr, op_timeout_s=60.0)
    if backend == "nixl":
        kw["nixl"] = dict(backend_params=nixl_params)
    if backend == "nixl-ucx":
        kw.update(backend="nixl", nixl=dict(mode="ucx", remote_addr=server_addr, op_timeout_s=60.0))
    return L3Config(**kw)


def _server(backend: str, root: str, capacity: int, slot: int = SLOT):
    """The process a backend talks to: a mooncake_master, or a NIXL/UCX slab server."""
    if backend == "mooncake":
        from storage.l3.mooncake import MooncakeMaster
        return MooncakeMaster(log_path=os.path.join(root, "master.log")).start()
    if backend == "nixl-ucx":
        from storage.l3.nixl_ucx import SlabServerProcess
        return SlabServerProcess(capacity, slot, log_path=os.path.join(root, f"slab-{slot}.log")).start()
    return None


def run_backend(backend: str, geo: str, root: str, pages: int, reps: int, server_addr: str | None,
                nixl_params: dict | None = None) -> list[dict]:
    layers, _, _, ps, dtype = GEOMETRIES[geo]
    src = _pool(geo, pages)
    dst = torch.zeros(pages, layers, _elems(geo), dtype=dtype)
    # (Mooncake refuses small segments: setup fails with INVALID_PARAMS under a few MiB.)
    capacity = max(64 << 20, 3 * pages * (HEADER_BYTES + _page_bytes(geo)))
    store = make_store(_cfg(backend, root, capacity, server_addr, nixl_params or {}))
    store.register(src)
    store.register(dst)
    nbytes = src.nbytes
    t_set = t_get = float("inf")
    try:
        for rep in range(reps + 1):          # rep 0 warms up (directories, segment pages, connections)
            ks = [l3_key(f"bench-{geo}-{rep}", "full", p.to_bytes(16, "big")) for p in range(pages)]
            src_pages = [src[p].view(-1) for p in range(pages)]
            dst_pages = [dst[p].view(-1) for p in range(pages)]
            t0 = time.perf_counter()
            ok_set = store.batch_set(ks, src_pages)
            t1 = time.perf_counter()
            ok_get = store.batch_get(ks, dst_pages)
            t2 = time.perf_counter()
            if not (all(ok_set) and all(ok_get) and torch.equal(src, dst)):
                raise RuntimeError(f"{backend}: set {sum(ok_set)}/{pages}, get {sum(ok_get)}/{pages}, "
                                   f"equal={torch.equal(src, dst)}, stats={store.stats()}")
            if rep:
                t_set, t_get = min(t_set, t1 - t0), min(t_get, t2 - t1)
            dst.zero_()
            store.clear()
    finally:
        store.close()
    return [dict(backend=backend, page=geo, op=op, pages=pages, page_kib=_page_bytes(geo) / 1024,
                 mib=nbytes / 2**20, ms=t * 1e3, gbps=nbytes / t / 1e9)
            for op, t in (("batch_set", t_set), ("batch_get", t_get))]


TTFT_WINDOWS, TTFT_QUESTION = 8, 40


def run_ttft(backend: str, root: str, reps: int, server_addr: str | None, nixl_params: dict | None = None) -> dict:
    """TTFT of a prompt whose 8-window prefix engine B reads from L3, against recomputing it."""
    own = None
    if backend == "nixl-ucx":   # slots of strata-tiny pages, not of the realistic ones
        slot = HEADER_BYTES + _page_bytes("strata-tiny")
        own = _server(backend, root, 4096 * slot, slot)
        server_addr = own.addr
    try:
        return _ttft(backend, root, reps, server_addr, nixl_params)
    finally:
        if own is not None:
            own.kill()


def _ttft(backend: str, root: str, reps: int, server_addr: str | None, nixl_params: dict | None) -> dict:
    from engine import Engine, SamplingParams
    from storage.config import HiCacheConfig

    l3 = _cfg(backend, os.path.join(root, "ttft"), 64 << 20, server_addr, nixl_params or {},
              prefetch_policy="wait_complete")
    common = dict(page_size=16, num_pages=512, torch_threads=1)

    def cached():
        return Engine.from_pretrained("strata-tiny", enable_prefix_cache=True, **common,
                                      hicache=HiCacheConfig(host_pages=512, l3=l3))

    g = torch.Generator().manual_seed(1)
    window = Engine.from_pretrained("strata-tiny", **common).model_config.sliding_window
    prompt = torch.randint(0, 256, (TTFT_WINDOWS * window,), generator=g).tolist()
    a = cached()
    a.generate([prompt], SamplingParams(max_new_tokens=1))
    a.cache.poll(block=True)   # A stays open: a Mooncake object lives in its writer's segment
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    ref = Engine.from_pretrained("strata-tiny", **common)
    t_l3 = t_re = float("inf")
    l3_tokens = 0
    for rep in range(reps + 1):
        q = prompt + [(rep * 31 + i) % 256 for i in range(TTFT_QUESTION)]   # a new question each time
        b = cached()
        t0 = time.perf_counter()
        out = b.generate([q], one)[0]
        t1 = time.perf_counter()
        want = ref.generate([q], one)[0]
        t2 = time.perf_counter()
        b.close()
        if out.token_ids != want.token_ids:
            raise RuntimeError(f"{backend}: L3-served tokens {out.token_ids} != recomputed {want.token_ids}")
        l3_tokens = out.cached_tokens_by_tier["L3"]
        if rep:
            t_l3, t_re = min(t_l3, t1 - t0), min(t_re, t2 - t1)
    a.close()
    return dict(backend=backend, prompt_tokens=len(prompt) + TTFT_QUESTION, l3_tokens=l3_tokens,
                ttft_l3_ms=t_l3 * 1e3, ttft_recompute_ms=t_re * 1e3, speedup=t_re / t_l3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--nixl-params", default="", help='POSIX plugin params, e.g. "use_uring=true"')
    ap.add_argument("--dir", default="", help="directory of the file/nixl stores (default: a temp dir)")
    ap.add_argument("--no-ttft", action="store_true", help="bandwidth only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for geo, (layers, heads, dim, ps, dtype) in GEOMETRIES.items():
        print(f"{geo}: {args.pages} pages of {_page_bytes(geo) / 1024:g} KiB (L={layers} x K,V x {ps} tok x "
              f"H={heads} x D={dim} {str(dtype).split('.')[-1]})")
    bounds = {geo: _bounds(args.pages * _page_bytes(geo), args.reps) for geo in GEOMETRIES}
    rows, ttft, skipped = [], [], {}
    with tempfile.TemporaryDirectory(dir=args.dir or None, prefix="strata-bench-l3-") as root:
        params = dict(kv.split("=", 1) for kv in args.nixl_params.split(",") if kv)
        for backend in args.backends:
            server = None
            try:
                server = _server(backend, root, 2 * args.pages * SLOT)
                addr = server.addr if server else None
                for geo in GEOMETRIES:
                    rows += run_backend(backend, geo, root, args.pages, args.reps, addr, params)
                if not args.no_ttft:
                    ttft.append(run_ttft(backend, root, args.reps, addr, params))
            except (ImportError, RuntimeError) as e:
                skipped[backend] = f"{type(e).__name__}: {e}"
                print(f"{backend}: skipped: {skipped[backend]}")
            finally:
                if server:
                    server.kill()
    for r in rows:
        r["memcpy_gbps"] = bounds[r["page"]]["memcpy_gbps"]
        r["ratio"] = r["gbps"] / r["memcpy_gbps"]
    print(table(rows, ["backend", "page", "op", "pages", "page_kib", "mib", "ms", "gbps", "memcpy_gbps", "ratio"]))
    if ttft:
        print()
        print(table(ttft, ["backend", "prompt_tokens", "l3_tokens", "ttft_l3_ms", "ttft_recompute_ms", "speedup"]))
    path = write_json("l3", dict(config=dict(geometries={g: dict(layers=v[0], heads=v[1], head_dim=v[2], page_size=v[3],
                                                                 dtype=str(v[4]), page_bytes=_page_bytes(g))
                                                         for g, v in GEOMETRIES.items()},
                                             pages=args.pages, reps=args.reps, cpus=os.cpu_count(), fsync=False,
                                             nixl_params=params, ttft_prompt=f"{TTFT_WINDOWS} windows + {TTFT_QUESTION}"),
                                 bounds=bounds, rows=rows, ttft=ttft, skipped=skipped))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
