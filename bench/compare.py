"""strata in several configurations, one after the other, each a real local Ray cluster serving HTTP
on a free port, all under the same multi-turn workload (bench/multiturn.py):

    python -m bench.compare [--quick]        (or: make bench-compare)

no prefix cache; L1 only; L1+L2; L1+L2+L3 (file store in a temp dir); L1+L2 with the SWA-oblivious host
backup; and 2 prefill workers behind the prefix router vs round-robin. L1 is sized so it cannot hold
every conversation (L2/L3 have to matter). Writes bench/results/compare.json and the plots
bench/results/compare_*.png (and compare_requests.jsonl, one line per request); prints the table and
whether each expected outcome held. Timings come from a 2-core machine shared with other work: read
them as relative, not absolute.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from cluster import launch  # sets the Ray environment (loopback, no token auth) on import
from bench.common import RESULTS, table, write_json
from bench.compare_report import checks, markdown, plot_all, row_of, update_readme
from bench.multiturn import run_workload
from bench.multiturn_workload import WorkloadConfig, summarize
from bench.swa_oblivious import SETUP_HOOK, oblivious_config
from cluster.config import ClusterConfig, RayConfig, ServerConfig, WorkersConfig
from actors.routing import RouterConfig
from engine.config import EngineConfig
from storage.config import HiCacheConfig
from storage.l3.config import L3Config
from storage.ports import free_port

QUICK = WorkloadConfig(num_clients=7, num_rounds=4, request_length=640, sub_question_length=32,
                       output_length=16, max_parallel=2, seed=0)
FULL = WorkloadConfig(num_clients=15, num_rounds=6, request_length=1024, sub_question_length=48,
                      output_length=24, max_parallel=3, seed=0)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    cluster: ClusterConfig
    setup_hook: str | None = None   # run in every Ray worker process of its cluster (a bench baseline's)


def variants(num_pages: int, host_pages: int, l3_dir: str) -> list[Variant]:
    """The configurations compared (ports are filled in at start). ``num_pages``: the L1 of every
    worker, too small for all conversations at once."""
    eng = EngineConfig(model="strata-tiny", page_size=16, num_pages=num_pages, swa_full_ratio=0.5,
                       max_batch_tokens=512, max_running_requests=8, torch_threads=1)
    l2 = HiCacheConfig(host_pages=host_pages, write_policy="write_through", layout="page_first_direct")
    l3 = dataclasses.replace(l2, l3=L3Config(backend="file", path=l3_dir))
    one = WorkersConfig(prefill=1, decode=1, num_cpus=0.5)
    two = WorkersConfig(prefill=2, decode=1, num_cpus=0.5)

    def v(name, hicache=None, cache=True, workers=one, policy="prefix", setup_hook=None):
        e = dataclasses.replace(eng, enable_prefix_cache=cache, hicache=hicache)
        return Variant(name, ClusterConfig(engine=e, workers=workers, router=RouterConfig(policy=policy),
                                           server=ServerConfig(), ray=RayConfig(num_cpus=3)), setup_hook)

    return [
        v("no cache", cache=False),
        v("L1 only"),
        v("L1+L2", l2),
        v("L1+L2+L3", l3),
        # The baseline's L2 tier is the bench's own (bench/swa_oblivious.py): its workers build it.
        v("L1+L2 SWA-oblivious", oblivious_config(l2), setup_hook=SETUP_HOOK),
        v("2P prefix router", l2, workers=two),
        v("2P round-robin", l2, workers=two, policy="round_robin"),
    ]


def _dir_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _warm_up(url: str) -> None:
    """One short request first, so no configuration's round 1 pays for a cold worker (first forward,
    lazy imports); its text shares nothing with the workload's."""
    import httpx
    body = {"input_ids": [7] * 40, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    httpx.post(f"{url}/generate", json=body, timeout=120).raise_for_status()


def run_variant(var: Variant, wl: WorkloadConfig, l3_dir: str | None) -> dict:
    """Start the cluster, run the workload, read every worker's cache counters, shut it all down."""
    import ray
    cfg = dataclasses.replace(var.cluster, server=dataclasses.replace(var.cluster.server, port=free_port()))
    t_start = time.perf_counter()
    handles = None
    try:
        # A variant's setup hook (the SWA-oblivious one: its engines build the bench's cache) runs in
        # every worker process of its own cluster only. It runs before Ray puts the driver's directory
        # on a worker's path: PYTHONPATH makes it import this checkout, not wherever strata is installed.
        root = str(Path(__file__).resolve().parent.parent)
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        env = {"runtime_env": {"worker_process_setup_hook": var.setup_hook, "env_vars": {"PYTHONPATH": path}}} \
            if var.setup_hook else {}
        launch.start_local_ray(num_cpus=cfg.ray.num_cpus, namespace=cfg.ray.namespace, **env)
        handles = launch.deploy(cfg)
        startup = time.perf_counter() - t_start
        _warm_up(handles["url"])
        server: dict = {}
        records, dur = asyncio.run(run_workload(handles["url"], wl, progress=sys.stderr.isatty(),
                                                 label=f"{var.name:22s} ", server=server))
        stats = {w: ray.get(h.stats.remote(), timeout=60) for w, h in handles["workers"].items()}
    finally:
        launch.shutdown(handles)
        ray.shutdown()
    cache = [s["cache"] for s in stats.values() if "cache" in s]
    host = sum(sum(c["usage"].get("L2_bytes", {}).values()) for c in cache)
    host_swa = sum(c["usage"].get("L2_bytes", {}).get("swa", 0) for c in cache)
    moved = {"L1->L2": sum(c["bytes"]["L1->L2"] for c in cache),
             "L2->L1": sum(c["bytes"]["L2->L1"] for c in cache),
             "L2->L3 (stored)": _dir_bytes(l3_dir) if l3_dir and var.cluster.engine.hicache is not None
             and var.cluster.engine.hicache.l3 is not None else 0}
    hit_by_tier = {t: sum(c["hit_tokens"][t] for c in cache) for t in ("L1", "L2", "L3")}
    return {"name": var.name, "startup_s": startup, "summary": summarize(records, dur),
            "host_bytes_per_conversation": host / wl.num_clients,
            "host_swa_bytes_per_conversation": host_swa / wl.num_clients,
            "bytes_moved": moved, "hit_tokens_by_tier": hit_by_tier, "from_metrics": server,
            "preemptions": sum(s.get("preemptions", 0) for s in stats.values()),
            "requests": [dataclasses.asdict(r) for r in records]}


def expected_swa_factor(wl: WorkloadConfig) -> dict:
    """What SWA-aware over SWA-oblivious host bytes should be for this workload, by the bound of
    bench/multiturn_offline ((full*S + swa*(W + page)) / ((full + swa) * S)), for one window kept per
    conversation and for one kept per round (each round's insert leaves its last window behind)."""
    from engine.model.config import ModelConfig
    from engine.model.checkpoint import resolve_model_path
    mc = ModelConfig.from_dir(resolve_model_path("strata-tiny"))
    full, swa, w, ps = len(mc.full_layers), len(mc.sliding_layers), mc.sliding_window, 16
    s = wl.request_length + (wl.num_rounds - 1) * (wl.sub_question_length + wl.output_length)
    one = (full * s + swa * (w + ps)) / ((full + swa) * s)
    per_round = (full * s + swa * min(s, wl.num_rounds * (w + ps))) / ((full + swa) * s)
    return {"tokens_per_conversation": s, "one_window": one, "one_window_per_round": per_round}


def _jsonable(d: dict) -> dict:
    return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in d.items()}


COLS_AFTER_ROUNDS = ["ttft ms", "ttft r2+ ms", "itl ms", "in tok/s", "host KB/conv", "L1->L2 MB", "L2->L1 MB",
                     "L3 MB", "hit tok L1/L2/L3", "errors"]


def report(payload: dict, write_readme: bool, name: str = "compare") -> bool:
    """Print the table and the outcomes, draw the plots, write ``bench/results/<name>.json`` and (when
    asked) the README's Results table. Returns whether every expected outcome held."""
    reqs = [{"config": v["name"], **r} for v in payload["variants"] for r in v.get("requests", ())]
    if reqs:  # one JSON line per request beside the JSON, which keeps the summaries only
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{name}_requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
        payload = {**payload, "variants": [{k: x for k, x in v.items() if k != "requests"}
                                           for v in payload["variants"]]}
    wl, results = payload["workload"], payload["variants"]
    rounds = wl["num_rounds"]
    rows = [row_of(r, rounds) for r in results]
    cols = ["config"] + [f"hit r{i}" for i in range(1, rounds + 1)] + COLS_AFTER_ROUNDS
    print(table(rows, cols))
    outcome = checks(results, payload["expected_swa_factor"])
    if payload.get("failed"):
        outcome.append({"claim": "every configuration ran", "ok": False,
                        "detail": "; ".join(f"{f['name']}: {f['error']}" for f in payload["failed"])})
    for c in outcome:
        print(f"[{'ok' if c['ok'] else 'NO'}] {c['claim']}: {c['detail']}")
    plots = plot_all(results, rounds, RESULTS) if name == "compare" else []
    path = write_json(name, {**payload, "table": rows, "checks": outcome, "plots": [p.name for p in plots]})
    note = (f"{wl['num_clients']} conversations x {rounds} rounds, {wl['request_length']}-token first question, "
            f"{wl['sub_question_length']}-token sub-questions, {wl['output_length']}-token answers, "
            f"{wl['max_parallel']} in flight, L1 of {payload['l1_pages']} pages per worker; hit rates are cached / "
            f"prompt tokens as the server reports them; times from a shared 2-core CPU box (relative only; "
            f"this run: {payload['wall_s']:.0f} s in all).")
    if write_readme and update_readme(Path(__file__).resolve().parent.parent / "README.md",
                                      markdown(rows, cols, outcome, note)):
        print("updated the README's Results table")
    print(f"wrote {path}" + (f" and {', '.join(p.name for p in plots)}" if plots else ""))
    return all(c["ok"] for c in outcome)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compare")
    ap.add_argument("--quick", action="store_true", help="the small workload (a few minutes)")
    ap.add_argument("--only", default=None,
                    help="comma-separated variant names to run (debugging; writes compare_partial.json only)")
    ap.add_argument("--replot", action="store_true",
                    help="no run: redraw the table, plots and README from bench/results/compare.json")
    args = ap.parse_args(argv)
    if args.replot:
        payload = json.loads((RESULTS / "compare.json").read_text())
        return 0 if report(payload, write_readme=True) else 1
    wl = QUICK if args.quick else FULL
    # L1 for the running requests plus about one conversation: far from all of them.
    longest = wl.request_length + wl.num_rounds * (wl.sub_question_length + wl.output_length) + 64
    num_pages = (wl.max_parallel + 1) * (longest // 16 + 1)
    t0 = time.perf_counter()
    results, failed = [], []
    with tempfile.TemporaryDirectory(prefix="strata-compare-l3-") as l3_dir:
        for var in variants(num_pages, host_pages=8192, l3_dir=l3_dir):
            if args.only and var.name not in args.only.split(","):
                continue
            res, err = None, None
            # Ray gives a node 30 s to register: on a box this loaded that can fail; try again.
            for attempt in (1, 2, 3):
                try:
                    res = run_variant(var, wl, l3_dir)
                    break
                except Exception as e:
                    err = repr(e)[:400]
                    print(f"  {var.name}: attempt {attempt} failed: {err}", flush=True)
            if res is None:
                failed.append({"name": var.name, "error": err})
                continue
            results.append(res)
            print(f"  {var.name}: hit rate {res['summary']['hit_rate']:.3f}, startup {res['startup_s']:.0f} s, "
                  f"run {res['summary']['duration_s']:.0f} s", flush=True)
    payload = {"quick": args.quick, "workload": _jsonable(dataclasses.asdict(wl)), "l1_pages": num_pages,
               "wall_s": time.perf_counter() - t0, "expected_swa_factor": expected_swa_factor(wl),
               "variants": results, "failed": failed}
    ok = report(payload, write_readme=not args.only, name="compare_partial" if args.only else "compare")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
