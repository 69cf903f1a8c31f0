"""``python -m bench.overhead --fileio``: what the file L3 store's compiled batch of system calls
(storage/l3/_fileio.c) saves against making them from Python one by one, as every store did before session
38. A worker writes its L3 pages on its copier thread beside the engine thread; each ``os.*`` call there
released the GIL and had to wait for the stepping engine thread to hand it back (five calls a page).

Two measurements, the two ways by turns:
- in this process, ``batch_set`` of 4 strata-tiny pages (8 KiB each, new keys): us per batch;
- in a server (``--configs``: colocated by default), rounds of the 64 short requests (16 in flight) with its
  workers' stores switched between the two ways (``__ray_call__``) before each round: req/s, and the
  paired ratio of each pair of rounds.

Merged into bench/results/overhead.json as ``fileio_<config>``."""
from __future__ import annotations

import os
import statistics
import tempfile
import time

from bench.common import merge_json, table
from bench.overhead import _HOMES, SHORT, SHORT_NEW, joined, prompts


def switch_fileio(actor, compiled: bool) -> bool:
    """In a worker's process (through ``__ray_call__``): its L3 store makes its system calls through the
    compiled batch, or from Python. False when it has no file store."""
    from storage.l3.file import FileStore, _fileio
    store = getattr(getattr(actor.core.engine.cache, "_l3", None), "store", None)
    if not isinstance(store, FileStore):
        return False
    store._fileio = _fileio if compiled else None
    return True


def batch_us(n: int) -> dict:
    """us per ``batch_set`` of 4 new 8 KiB pages (strata-tiny's page of one component), compiled and Python,
    by turns in this process."""
    import torch
    from storage.l3 import make_store
    from storage.l3.config import L3Config
    from storage.l3.file import _fileio
    # Removed when the bench ends, with the servers' directories (bench/overhead.py: this disk's
    # recently-deleted scan would make the files the server creates next cost ~10x).
    d = tempfile.mkdtemp(prefix="sfio")
    _HOMES.append(d)
    store = make_store(L3Config(backend="file", path=d))
    pages = [torch.randn(2048) for _ in range(4)]
    out: dict[str, list[float]] = {"compiled": [], "python": []}
    for r in range(n):
        for way in ("compiled", "python") if r % 2 else ("python", "compiled"):
            store._fileio = _fileio if way == "compiled" else None
            keys = [f"strata/bench/full/{r}-{way}-{i}" for i in range(4)]
            t = time.perf_counter()
            assert store.batch_set(keys, pages) == [True] * 4
            out[way].append((time.perf_counter() - t) * 1e6)
    store.close()
    return {way: round(statistics.median(v), 1) for way, v in out.items()}


def fileio_rows(name: str, rounds: int) -> dict:
    with joined(name) as (srv, ray):
        workers = [ray.get_actor(a["name"], namespace="strata") for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["namespace"] == "strata" and a["name"].startswith(("strata-colocated-", "strata-prefill-",
                                                                            "strata-decode-"))]
        rates: dict[str, list[float]] = {"compiled": [], "python": []}
        for r in range(rounds):
            for way in ("compiled", "python") if r % 2 == 0 else ("python", "compiled"):
                switched = ray.get([w.__ray_call__.remote(switch_fileio, way == "compiled") for w in workers])
                if not any(switched):
                    raise RuntimeError(f"{name}: no worker has a file L3 store")
                time.sleep(0.3)   # the round before's last writes land
                out = srv.ask({"op": "requests", "prompts": prompts(64, SHORT, 5000 + 2 * r + (way == "python")),
                               "max_new": SHORT_NEW, "concurrency": 16})
                rates[way].append(64 / out["wall"])
        ray.get([w.__ray_call__.remote(switch_fileio, True) for w in workers])
    ratios = sorted(a / b for a, b in zip(rates["compiled"], rates["python"]))
    return {"config": name, "rounds": rounds, "workers": len(workers),
            "short_req_s": {w: round(statistics.median(v), 1) for w, v in rates.items()},
            "runs": rates, "paired_ratio_p50": round(ratios[len(ratios) // 2], 3),
            "paired_ratio_q25_q75": [round(ratios[len(ratios) // 4], 3), round(ratios[3 * len(ratios) // 4], 3)],
            "compiled_faster_in": sum(x > 1 for x in ratios)}


def run_fileio(name: str, quick: bool) -> int:
    batch = batch_us(100 if quick else 300)
    srv = fileio_rows(name, 8 if quick else 20)
    rows = [{"what": "batch_set, 4 new 8 KiB pages (us, in this process)", "compiled": batch["compiled"],
             "python": batch["python"], "paired": ""},
            {"what": f"{name}: 64 short requests at 16 (req/s; paired compiled/python p50, faster in)",
             "compiled": srv["short_req_s"]["compiled"], "python": srv["short_req_s"]["python"],
             "paired": f"{srv['paired_ratio_p50']:.3f}, {srv['compiled_faster_in']} of {srv['rounds']}"}]
    print(table(rows, ["what", "compiled", "python", "paired"]))
    path = merge_json("overhead", f"fileio_{name}", {"load_avg_after": os.getloadavg(), "batch_us": batch, **srv})
    print(f"wrote {path}")
    return 0
