"""Bandwidth of the L3 stores: batch_set / batch_get of a batch of host pages, per backend.

Pages are realistic: 8 layers x (K, V) x 64 tokens x 8 heads x 64 dims bf16 = 1 MiB, taken from (and
read back into) a registered ``page_first_direct`` host pool, as the tier controller will. Each repetition
writes fresh keys (a Mooncake put of an existing key is a no-op) and the store is cleared between
repetitions; the best of ``--reps`` is kept. Next to each figure: one contiguous in-memory copy of the
same bytes (the memcpy bound) and xxh3 over them (the checksum every page pays).

File and NIXL figures are page-cache speeds (no fsync, files hot), not the disk's. Mooncake runs
against a real ``mooncake_master`` started here on 127.0.0.1, protocol tcp, P2P handshake; nixl-ucx
against a slab server process on 127.0.0.1 (one-sided UCX into its memory).

    python -m bench.l3 [--pages 256] [--reps 3] [--backends file nixl nixl-ucx mooncake] [--dir DIR]
                       [--nixl-params use_uring=true]

Writes bench/results/l3.json.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

import kernels
from bench.common import table, write_json
from storage.l3 import HEADER_BYTES, L3Config, l3_key, make_store
from storage.l3.base import page_bytes

LAYERS, HEADS, HEAD_DIM, PAGE_SIZE, DTYPE = 8, 8, 64, 64, torch.bfloat16


def _pool(pages: int) -> torch.Tensor:
    E = 2 * PAGE_SIZE * HEADS * HEAD_DIM
    pool = kernels.alloc_l2(kernels.PAGE_FIRST_DIRECT, LAYERS, pages, PAGE_SIZE, E, DTYPE)
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


SLOT = HEADER_BYTES + LAYERS * 2 * PAGE_SIZE * HEADS * HEAD_DIM * 2   # one stored page
BACKENDS = ("file", "nixl", "nixl-ucx", "mooncake")


def _cfg(backend: str, root: str, pages: int, server_addr: str | None, nixl_params: dict) -> L3Config:
    kw = dict(backend=backend, path=os.path.join(root, backend), capacity_bytes=3 * pages * SLOT)
    if backend == "mooncake":
        kw["mooncake"] = dict(master_addr=server_addr, op_timeout_s=60.0)
    if backend == "nixl":
        kw["nixl"] = dict(backend_params=nixl_params)
    if backend == "nixl-ucx":
        kw.update(backend="nixl", nixl=dict(mode="ucx", remote_addr=server_addr, op_timeout_s=60.0))
    return L3Config(**kw)


def _server(backend: str, root: str, pages: int):
    """The process a backend talks to: a mooncake_master, or a NIXL/UCX slab server."""
    if backend == "mooncake":
        from storage.l3.mooncake import MooncakeMaster
        return MooncakeMaster(log_path=os.path.join(root, "master.log")).start()
    if backend == "nixl-ucx":
        from storage.l3.nixl_ucx import SlabServerProcess
        return SlabServerProcess(2 * pages * SLOT, SLOT, log_path=os.path.join(root, "slab.log")).start()
    return None


def run_backend(backend: str, root: str, pages: int, reps: int, server_addr: str | None,
                nixl_params: dict | None = None) -> list[dict]:
    src, dst = _pool(pages), torch.zeros(pages, LAYERS, 2 * PAGE_SIZE * HEADS * HEAD_DIM, dtype=DTYPE)
    store = make_store(_cfg(backend, root, pages, server_addr, nixl_params or {}))
    store.register(src)
    store.register(dst)
    nbytes = src.nbytes
    t_set = t_get = float("inf")
    try:
        for rep in range(reps + 1):          # rep 0 warms up (directories, segment pages, connections)
            ks = [l3_key(f"bench-{rep}", "full", p.to_bytes(16, "big")) for p in range(pages)]
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
    return [dict(backend=backend, op=op, pages=pages, mib=nbytes / 2**20, ms=t * 1e3, gbps=nbytes / t / 1e9)
            for op, t in (("batch_set", t_set), ("batch_get", t_get))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--nixl-params", default="", help='POSIX plugin params, e.g. "use_uring=true"')
    ap.add_argument("--dir", default="", help="directory of the file/nixl stores (default: a temp dir)")
    args = ap.parse_args()
    page_mib = LAYERS * 2 * PAGE_SIZE * HEADS * HEAD_DIM * 2 / 2**20
    print(f"{args.pages} pages of {page_mib:g} MiB (L={LAYERS} x 2 x {PAGE_SIZE} tok x H={HEADS} x D={HEAD_DIM} "
          f"bf16), best of {args.reps}")
    bounds = _bounds(args.pages * int(page_mib * 2**20), args.reps)
    print(f"bounds: memcpy {bounds['memcpy_gbps']:.2f} GB/s, xxh3 {bounds['xxh3_gbps']:.2f} GB/s")
    rows, skipped = [], {}
    with tempfile.TemporaryDirectory(dir=args.dir or None, prefix="strata-bench-l3-") as root:
        params = dict(kv.split("=", 1) for kv in args.nixl_params.split(",") if kv)
        for backend in args.backends:
            server = None
            try:
                server = _server(backend, root, args.pages)
                rows += run_backend(backend, root, args.pages, args.reps, server.addr if server else None, params)
            except (ImportError, RuntimeError) as e:
                skipped[backend] = f"{type(e).__name__}: {e}"
                print(f"{backend}: skipped: {skipped[backend]}")
            finally:
                if server:
                    server.kill()
    for r in rows:
        r["memcpy_gbps"] = bounds["memcpy_gbps"]
        r["ratio"] = r["gbps"] / bounds["memcpy_gbps"]
    print(table(rows, ["backend", "op", "pages", "mib", "ms", "gbps", "memcpy_gbps", "ratio"]))
    path = write_json("l3", dict(config=dict(layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, page_size=PAGE_SIZE,
                                             dtype=str(DTYPE), pages=args.pages, reps=args.reps,
                                             cpus=os.cpu_count(), fsync=False, nixl_params=params),
                                 bounds=bounds, rows=rows, skipped=skipped))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
