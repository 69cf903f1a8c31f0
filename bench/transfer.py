"""Prefill->decode KV transfer: bandwidth and per-request latency of each backend, and the bytes the
SWA-aware transfer saves.

Two Ray actors stand for the two workers, each holding real L1 pools (storage/pools.py) and its end of a
backend (storage/transfer): the decode end leases pages exactly as a decode worker does (full pages for
the whole prompt, SWA pages for the last window), the prefill end sends a prompt's KV payload (random
bytes, shaped as engine/disagg.py ``export_kv`` shapes it) into them, and the decode end commits and
fills the pages with the backend's ``fill`` (for ray_object: reads the payload from the object store and
copies it in; one-sided: waits for the arrival first). No model runs, so the figures are the transfer's
alone.

latency = reserve + send + commit of one request, as the ingress drives it (median of ``--reps``);
GB/s = bytes moved / latency; send_s = the prefill side's send alone (one-sided backends: staging copy +
WRITE). SWA-aware bytes (full layers: every page; sliding layers: the last window) are compared with
sending every SWA token too.

Models: ``tiny`` (strata-tiny: 2 full + 2 sliding layers, 2 KV heads x 16, fp32, window 64) and ``24l``
(GPT-OSS-20B-like: 12 full + 12 sliding layers, 8 KV heads x 64, bf16, window 128). Prompts of 1x, 8x and
32x the window. NIXL runs UCX between the two actor processes; Mooncake its TransferEngine over tcp with
P2P handshake, both on 127.0.0.1.

    python -m bench.transfer [--backends ray_object nixl mooncake] [--models tiny 24l] [--reps 5]

Writes bench/results/transfer.json.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import table, write_json
from storage.transfer.payload import KVPayload
from storage.geometry import KVGeometry
from storage.config import KVPoolConfig
from storage.pools import KVPools
from storage.transfer import Destination, LeaseInfo, LeaseTable, Receipt, TransferConfig, make_backend

MODELS = {
    "tiny": dict(layers=["sliding_attention", "full_attention"] * 2, kv_heads=2, head_dim=16,
                 dtype=torch.float32, window=64),
    "24l": dict(layers=["sliding_attention", "full_attention"] * 12, kv_heads=8, head_dim=64,
                dtype=torch.bfloat16, window=128),
}
PAGE_SIZE = 16


def _pools(m: dict, prompt_pages: int) -> KVPools:
    cfg = KVPoolConfig(PAGE_SIZE, prompt_pages + 8, 1.0)
    return KVPools(cfg, m["layers"], m["kv_heads"], m["head_dim"], m["dtype"], "cpu")


def payload(m: dict, prompt_len: int) -> KVPayload:
    """Random KV shaped like an export: full [Lf, n_full, E], swa [Ls, window pages, E]."""
    pools = _pools(m, 1)
    n_full = -(-prompt_len // PAGE_SIZE)
    first = KVGeometry(PAGE_SIZE, m["window"]).swa_aligned_first_page(prompt_len)
    g = torch.Generator().manual_seed(prompt_len)
    full = torch.randn(len(pools.full.layer_ids), n_full, pools.full.page_elems, generator=g).to(m["dtype"])
    swa = torch.randn(len(pools.swa.layer_ids), n_full - first, pools.swa.page_elems, generator=g).to(m["dtype"])
    return KVPayload(prompt_len, 1, PAGE_SIZE, full, swa, first, first * PAGE_SIZE)


def run(backends: list[str], models: list[str], reps: int) -> list[dict]:
    import ray

    @ray.remote(num_cpus=0.5)
    class Endpoint:
        def __init__(self, role: str, backend: str, model: str, prompt_pages: int) -> None:
            self.m = MODELS[model]
            self.pools = _pools(self.m, prompt_pages)
            stage = (len(self.m["layers"])) * (prompt_pages + 8)
            self.cfg = TransferConfig(backend=backend, lease_seconds=120.0, transfer_timeout=60.0,
                                      staging_pages=stage)
            self.be = make_backend(self.cfg, role, self.pools, f"bench-{role}-{backend}-{time.time_ns()}")
            self.leases = LeaseTable({"full": self.pools.full.allocator, "swa": self.pools.swa.allocator})
            self.payloads: dict[int, KVPayload] = {}
            self.n = 0

        def reserve(self, prompt_len: int) -> Destination:
            n_full, first, n_swa = KVGeometry(PAGE_SIZE, self.m["window"]).plan_pages(prompt_len)
            self.n += 1
            lid = f"l{self.n}"
            lease = self.leases.reserve(lid, {"full": n_full, "swa": n_swa}, time.monotonic(), self.cfg.lease_seconds,
                                        LeaseInfo(prompt_len, first, self.be.one_sided))
            return Destination.of(lease.leased_pages(), self.be, PAGE_SIZE, self.cfg.lease_seconds, "decode")

        def send(self, dest: Destination) -> Receipt:
            p = self.payloads.get(dest.prompt_len)
            if p is None:
                p = self.payloads[dest.prompt_len] = payload(self.m, dest.prompt_len)
            return self.be.send(p, dest, self.cfg.transfer_timeout)

        def commit(self, lease_id: str, rec: Receipt) -> bool:
            if self.be.one_sided:
                self.be.wait_arrival(lease_id, self.cfg.transfer_timeout)
            pages = self.leases.commit(lease_id, time.monotonic()).leased_pages()
            self.be.fill(self.pools, pages, rec)
            self.pools.full.allocator.free(pages.full)
            self.pools.swa.allocator.free(pages.swa)
            return True

        def all_free(self) -> bool:
            return self.pools.all_free()

    rows = []
    for model in models:
        m = MODELS[model]
        lens = [m["window"] * k for k in (1, 8, 32)]
        max_pages = -(-max(lens) // PAGE_SIZE)
        for backend in backends:
            try:
                pre = Endpoint.remote("prefill", backend, model, max_pages)
                dec = Endpoint.remote("decode", backend, model, max_pages)
                ray.get([pre.all_free.remote(), dec.all_free.remote()], timeout=300)
            except Exception as e:  # noqa: BLE001 - report the exact reason a backend cannot run here
                rows.append({"model": model, "backend": backend, "error": repr(e)[:200]})
                continue
            for n in lens:
                lat, send_s, nbytes = [], [], 0
                for r in range(reps + 1):           # the first one warms the peer connection up
                    t0 = time.perf_counter()
                    dest = ray.get(dec.reserve.remote(n))
                    rec_ref = pre.send.remote(dest)
                    ray.get(dec.commit.remote(dest.lease_id, rec_ref))
                    dt = time.perf_counter() - t0
                    rec = ray.get(rec_ref)
                    if r:
                        lat.append(dt)
                        send_s.append(rec.seconds)
                    nbytes = rec.bytes
                assert ray.get(dec.all_free.remote()), "decode pools not free after the transfers"
                p = payload(m, n)
                full_pages = p.full.shape[1]
                page_b = p.full.shape[2] * p.full.element_size()
                every_swa = (p.full.shape[0] + p.swa.shape[0]) * full_pages * page_b
                med = statistics.median(lat)
                rows.append({"model": model, "backend": backend, "prompt": n, "x_window": n // m["window"],
                             "MB": nbytes / 1e6, "latency_ms": med * 1e3, "GB/s": nbytes / med / 1e9,
                             "send_ms": statistics.median(send_s) * 1e3,
                             "MB_every_swa_token": every_swa / 1e6, "swa_aware_saving": 1 - nbytes / every_swa})
                print(f"{model} {backend} {n} tokens: {rows[-1]['latency_ms']:.1f} ms, {rows[-1]['GB/s']:.3f} GB/s",
                      flush=True)
            for a in (pre, dec):
                ray.kill(a)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.transfer")
    ap.add_argument("--backends", nargs="+", default=["ray_object", "nixl", "mooncake"])
    ap.add_argument("--models", nargs="+", default=["tiny", "24l"], choices=sorted(MODELS))
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from cluster import launch  # noqa: F401 - Ray environment (loopback, no token auth)
    import ray
    launch.start_local_ray(num_cpus=4)
    try:
        rows = run(args.backends, args.models, args.reps)
    finally:
        ray.shutdown()
    cols = ["model", "backend", "prompt", "x_window", "MB", "latency_ms", "GB/s", "send_ms", "MB_every_swa_token",
            "swa_aware_saving", "error"]
    print()
    print(table(rows, cols))
    path = write_json("transfer", {"page_size": PAGE_SIZE, "reps": args.reps,
                                   "models": {k: {**v, "dtype": str(v["dtype"])} for k, v in MODELS.items()},
                                   "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
