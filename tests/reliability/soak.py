"""The soak: the multi-turn load (clients hanging up mid-stream included) for a set duration, with cache
flushes, EPLB rebalances (when a ``strata-eplb`` actor runs) and, optionally, faults mixed in. After it:
integrity checks pass on every worker, every pool is free once the cache is flushed, each worker
process's anonymous RSS grew less than a bound since the end of warm-up, and no greedy request got a
wrong token (compared with an offline Engine.generate on the same model and config).

    python -m tests.reliability.soak --duration 30m [--faults all] [--report soak.json]
    make soak DURATION=30m

From a test: ``run_soak(handles, reference, SoakConfig(...))`` on an already running cluster."""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import httpx
import ray

from tests.reliability import checks
from tests.reliability.faults import FAULTS, Ctx
from tests.reliability.judge import brief, verify
from tests.reliability.workload import HUNG, OK, Load, LoadConfig

MiB = 1 << 20


@dataclass
class SoakConfig:
    duration_s: float = 120.0
    warmup_s: float = 15.0
    clients: int = 4
    abort_prob: float = 0.15
    flush_every_s: float = 25.0       # a quiesced flush (POST /flush_cache must answer 200)
    hot_flush_every_s: float = 7.0    # a flush under load (200, or 409 while a worker runs; never 5xx)
    rebalance_every_s: float = 20.0   # when a strata-eplb actor exists
    # The soak goes on past its end (up to ``overtime_s``) until it has done this many quiesced and hot
    # flushes: a quiesced flush waits for in-flight requests and a rebalance moves weights, so on a slow
    # machine the scheduled ones may not all fit into a short soak phase.
    min_flushes: int = 2
    min_hot_flushes: int = 3
    overtime_s: float = 60.0
    faults: list[str] = field(default_factory=list)   # injected in turn, spread over the run
    rss_bound_bytes: int = 256 * MiB  # per worker process, end of warm-up -> end (after flush)
    rss_every_s: float = 60.0         # sample every worker's RSS this often (the report's timeline)
    verify_limit: int | None = None   # compare at most this many requests (the long soak samples)
    seed: int = 0


def parse_duration(s: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", s)
    if not m:
        raise argparse.ArgumentTypeError(f"duration: expected e.g. 90s, 30m, 2h; got {s!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def find_rebalancer():
    """The EPLB rebalancer actor when the cluster runs one (the [eplb] feature), else None."""
    try:
        return ray.get_actor("strata-eplb")
    except ValueError:
        return None


def start_load(handles: dict, cfg: SoakConfig) -> Load:
    """Start the soak's load and warm it up; records the warm-up RSS snapshot on it (``rss0``)."""
    ld = Load(handles["url"], LoadConfig(clients=cfg.clients, abort_prob=cfg.abort_prob), seed=cfg.seed)
    ld.__enter__()
    ld.started = time.monotonic()
    time.sleep(cfg.warmup_s)
    ld.rss0 = checks.process_info(handles)
    ld.warm_at = time.monotonic()
    return ld


def run_soak(handles: dict, reference, cfg: SoakConfig, l3_dir: str = "", load: Load | None = None) -> dict:
    """Run the soak (on ``load`` if one is already running, e.g. through fault tests: the soak then
    lasts until ``cfg.duration_s`` of load past warm-up have passed, at least 30 s more), stop the load
    and check everything. Returns the report (``check_report`` judges it)."""
    url = handles["url"]
    ld = load or start_load(handles, cfg)
    eplb = find_rebalancer()
    ev = {"flushes": 0, "hot_flushes": 0, "hot_flush_busy": 0, "rebalances": 0, "faults": []}
    try:
        t0 = time.monotonic()
        rss_phase = checks.process_info(handles)
        end = max(ld.warm_at + cfg.duration_s, t0 + (30.0 if load is not None else cfg.duration_s))
        nxt = {"flush": t0 + min(cfg.flush_every_s, (end - t0) / 3), "hot": t0 + cfg.hot_flush_every_s,
               "rebalance": t0 + cfg.rebalance_every_s, "rss": t0 + cfg.rss_every_s}
        # Anonymous RSS per worker over the run (MiB, keyed by seconds since warm-up): shows it levels off.
        timeline = [_rss_sample(ld.warm_at, t0, rss_phase)]
        flush_every = min(cfg.flush_every_s, (end - t0) / 3)
        pending = list(cfg.faults)
        fault_gap = (end - t0) / (len(pending) + 1)
        next_fault = t0 + fault_gap
        while (now := time.monotonic()) < end or (
                now < end + cfg.overtime_s
                and (ev["flushes"] < cfg.min_flushes or ev["hot_flushes"] < cfg.min_hot_flushes)):
            if now >= nxt["flush"]:
                with ld.paused():
                    checks.flush(url)
                ev["flushes"] += 1
                nxt["flush"] = now + flush_every
            if now >= nxt["hot"]:
                r = httpx.post(f"{url}/flush_cache", timeout=60)
                assert r.status_code in (200, 409), f"flush under load: {r.status_code} {r.text[:200]}"
                ev["hot_flushes"] += 1
                ev["hot_flush_busy"] += r.status_code == 409
                nxt["hot"] = now + cfg.hot_flush_every_s
            if eplb is not None and now >= nxt["rebalance"]:
                ray.get(eplb.trigger.remote(), timeout=120)
                ev["rebalances"] += 1
                nxt["rebalance"] = now + cfg.rebalance_every_s
            if now >= nxt["rss"]:
                timeline.append(_rss_sample(ld.warm_at, now, checks.process_info(handles)))
                nxt["rss"] = now + cfg.rss_every_s
            if pending and now >= next_fault:
                name = pending.pop(0)
                ev["faults"].append({"fault": name, "at": round(now - t0, 2),
                                     **_inject(name, Ctx(handles, url, reference, l3_dir, load=ld))})
                next_fault = now + fault_gap
            time.sleep(0.2)
        rss_end_loaded = checks.process_info(handles)
        timeline.append(_rss_sample(ld.warm_at, time.monotonic(), rss_end_loaded))
    finally:
        ld.stop()
    load_s = time.monotonic() - ld.warm_at
    checks.check_integrity(handles)
    used = checks.assert_all_free(handles, url)
    checks.check_integrity(handles)
    rss1 = checks.process_info(handles)
    v = verify(ld.rec, reference, limit=cfg.verify_limit, seed=cfg.seed)
    outs = ld.rec.outcomes
    mib = lambda b: round(b / MiB, 1)  # noqa: E731
    return {
        "config": asdict(cfg), "load_seconds": round(load_s, 1), "soak_phase_seconds": round(time.monotonic() - t0, 1),
        "requests": len(outs), "counts": ld.rec.counts(), "events": ev,
        "streamed": sum(o.stream for o in outs),
        "hung": [o.detail for o in outs if o.kind == HUNG],
        # Failures of requests that began in the soak phase (fault tests before it judge their own).
        "errors": [f"{o.status} {o.detail}" for o in outs if o.kind not in (OK, "aborted") and o.started >= t0][:20],
        "rss_anon_mib": {w: {"warm": mib(ld.rss0[w]["rss_anon_bytes"]) if w in ld.rss0 else None,
                             "soak_start": mib(rss_phase[w]["rss_anon_bytes"]),
                             "end_loaded": mib(rss_end_loaded[w]["rss_anon_bytes"]),
                             "end_flushed": mib(rss1[w]["rss_anon_bytes"])} for w in rss1},
        # Per process since warm-up (a worker restarted by a fault is a new process: left out) and
        # since the soak phase began (every worker).
        "rss_growth_mib": {w: mib(g) for w, g in checks.rss_growth(ld.rss0, rss1).items()},
        "rss_growth_phase_mib": {w: mib(g) for w, g in checks.rss_growth(rss_phase, rss1).items()},
        "rss_timeline_mib": timeline,
        "pools_after_flush": used, "verified": v["checked"], "wrong": v["wrong"],
        # Answers that departed from the reference only where it had a near-tie (judge.explain_by_ties).
        "near_ties": [{k: x for k, x in t.items() if k != "prompt"} for t in v["near_ties"]],
    }


def _inject(name: str, ctx: Ctx, bound_s: float = 120.0) -> dict:
    """Inject fault ``name`` and wait until it healed; a fault that does not heal, or whose recovery
    check fails, is recorded (``failed``) and the soak goes on, so the run still ends with a report."""
    t = time.monotonic()
    try:
        healed = FAULTS[name].inject(ctx)
        while not healed.check():
            if time.monotonic() - t > bound_s:
                return {"failed": f"did not heal in {bound_s:.0f}s"}
            time.sleep(0.5)
        after = healed.after() if healed.after is not None else {}
    except Exception as e:   # noqa: BLE001 - a failed check (AssertionError) or a call that timed out
        return {"failed": f"{type(e).__name__}: {e}", "after_s": round(time.monotonic() - t, 2)}
    return {"healed_s": round(time.monotonic() - t, 2), **after}


def _rss_sample(warm_at: float, now: float, info: dict) -> dict:
    return {"t_s": round(now - warm_at), **{w: round(i["rss_anon_bytes"] / MiB, 1) for w, i in info.items()}}


def check_report(rep: dict, cfg: SoakConfig) -> list[str]:
    """The soak's pass conditions; returns the failures (empty: passed)."""
    bad = []
    if rep["hung"]:
        bad.append(f"{len(rep['hung'])} requests hung")
    if rep["wrong"]:
        bad.append(f"{len(rep['wrong'])} requests got wrong tokens: {brief(rep['wrong'])[:3]}")
    failed = [f for f in rep["events"]["faults"] if "failed" in f]
    if failed:
        bad.append(f"{len(failed)} faults did not recover: {failed[:5]}")
    if not cfg.faults and rep["errors"]:
        bad.append(f"requests failed without any fault: {rep['errors'][:5]}")
    over = {w: g for grow in (rep["rss_growth_mib"], rep["rss_growth_phase_mib"]) for w, g in grow.items()
            if g * MiB > cfg.rss_bound_bytes}
    if over:
        bad.append(f"RSS grew past {cfg.rss_bound_bytes / MiB:.0f} MiB: {over}")
    if rep["counts"].get(OK, 0) == 0 or rep["counts"].get("aborted", 0) == 0:
        bad.append(f"the load did not mix completed and aborted requests: {rep['counts']}")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.reliability.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=parse_duration, default=parse_duration("30m"))
    ap.add_argument("--warmup", type=parse_duration, default=parse_duration("30s"))
    ap.add_argument("--config", default=None, help="cluster YAML (default: 2 prefill + 1 decode)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--faults", default="", help="comma-separated fault names, or 'all' (the available ones)")
    ap.add_argument("--verify-limit", type=int, default=3000, help="requests compared with Engine.generate (0: every one)")
    ap.add_argument("--rss-bound-mib", type=int, default=512)
    ap.add_argument("--report", default=None, help="write the JSON report here too")
    args = ap.parse_args(argv)
    from tests.reliability import harness
    names = [n for n, f in FAULTS.items() if f.available()] if args.faults == "all" else \
        [n for n in args.faults.split(",") if n]
    for n in names:
        if n not in FAULTS:
            ap.error(f"--faults: unknown fault {n!r} (known: {', '.join(FAULTS)})")
    cfg = SoakConfig(duration_s=args.duration, warmup_s=args.warmup, clients=args.clients, faults=names,
                     verify_limit=args.verify_limit or None, rss_bound_bytes=args.rss_bound_mib * MiB)
    with tempfile.TemporaryDirectory(prefix="strata-soak-l3-") as l3_dir:
        ccfg = harness.cluster_config(l3_dir, **({"config": args.config} if args.config else {}))
        handles = harness.start(ccfg)
        try:
            ref = harness.reference_engine(ccfg, handles["model_path"])
            rep = run_soak(handles, ref, cfg, l3_dir)
        finally:
            harness.stop(handles)
    failures = check_report(rep, cfg)
    rep["failures"] = failures
    out = json.dumps(rep, indent=2, default=str)
    print(out)
    if args.report:
        with open(args.report, "w") as f:
            f.write(out)
    print("soak: PASSED" if not failures else "soak: FAILED\n  " + "\n  ".join(failures), file=sys.stderr)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
