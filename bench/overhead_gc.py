"""``python -m bench.overhead --gc``: what one full collection of Python's cyclic GC costs in each long-lived
process of a server (``--configs``: 1p1d by default), after some traffic, with the startup heap frozen as
the server runs (actors/startup_heap.py; Ray Serve freezes its ingress replica) and, in the same process at
the same moment, with it unfrozen (as before session 37). A full collection holds the GIL: a worker's
streams, or the router's routes, stop while it runs. Merged into bench/results/overhead.json as
``gc_<config>``."""
from __future__ import annotations

import os
import time

from bench.common import merge_json, table
from bench.overhead import LONG, SHORT, SHORT_NEW, Server, prompts


def heap_probe(_actor=None) -> dict:
    """In the process it runs in (an actor's, through ``__ray_call__``): the objects frozen, the objects a
    full collection walks, and its ms (best of 3); then the same with the frozen heap let back in. It is
    frozen again after, with everything tracked by then (the server is stopped after the probe)."""
    import gc

    def collect_ms() -> float:
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            gc.collect()
            best = min(best, (time.perf_counter() - t) * 1000)
        return best
    out = {"frozen": gc.get_freeze_count(), "walked": len(gc.get_objects()), "full_collection_ms": collect_ms()}
    if out["frozen"]:
        gc.unfreeze()
        out.update(walked_unfrozen=len(gc.get_objects()), full_collection_ms_unfrozen=collect_ms())
        gc.freeze()
    return out


def run_gc(name: str) -> int:
    rows = gc_rows(name)
    print(table(rows, ["process", "frozen", "walked", "full_collection_ms", "walked_unfrozen",
                       "full_collection_ms_unfrozen"]))
    path = merge_json("overhead", f"gc_{name}", {"load_avg_after": os.getloadavg(), "rows": rows})
    print(f"wrote {path}")
    return 0


def gc_rows(name: str) -> list[dict]:
    """One row per strata actor (workers, router, storage) and ingress replica of a fresh ``name`` server,
    after a few hundred requests."""
    from cluster.launch import set_ray_env
    set_ray_env()
    import ray
    srv = Server(name)
    try:
        long = prompts(1, LONG, 1)[0]
        srv.ask({"op": "requests", "prompts": [long] * 50, "max_new": 8, "concurrency": 1})
        for i in range(3):
            srv.ask({"op": "requests", "prompts": prompts(64, SHORT, 1000 + i), "max_new": SHORT_NEW,
                     "concurrency": 16})
        srv.ask({"op": "streams", "prompts": prompts(64, SHORT, 3000), "max_new": 16})
        ray.init(address=srv.ray_address(), namespace="strata", log_to_driver=False)
        rows = []
        for a in sorted(ray.util.list_named_actors(all_namespaces=True), key=lambda a: a["name"]):
            ns, actor = a["namespace"], a["name"]
            if not (ns == "strata" and actor.startswith("strata-")) and "ingress" not in actor:
                continue
            probe = ray.get(ray.get_actor(actor, namespace=ns).__ray_call__.remote(heap_probe), timeout=120)
            rows.append({"process": actor, **probe})
        return rows
    finally:
        try:
            ray.shutdown()
        finally:
            srv.stop()
