"""``python -m bench.overhead --profile``: where the serving stack's CPU goes, by process kind. While the
load generator repeats bench/overhead.py's short-request row on a colocated (or ``--configs``) server,
py-spy samples every proxy, ingress, router and worker process, and the bench's sitecustomize hook
(bench/overhead_hooks) counts the Ray calls each process makes: per request, and per 16-token stream.
Writes bench/results/overhead_profile.json."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import merge_json
from bench.overhead import SHORT, SHORT_NEW, STREAM_NEW, CpuMeter, Server, prompts


def run_profile(name: str, seconds: float, rate: int, native: bool) -> int:
    """Profile ``name``, print the summary, merge it into overhead_profile.json."""
    p = profile(seconds, rate, native, name)
    print(json.dumps({k: v for k, v in p.items() if k != "py_spy"}, indent=1))
    for k, s in p["py_spy"].items():
        print(f"\n{k}: {s['samples']} samples, {s['waiting_pct']}% waiting\n  buckets: {s['buckets_pct_of_busy']}"
              f"\n  threads: {s['threads_pct_of_busy']}\n  top leaves:\n    "
              + "\n    ".join(f"{v:5.1f}% {f[:150]}" for f, v in s["top_leaves_pct_of_busy"].items()))
    path = merge_json("overhead_profile", name, {"cpus": os.cpu_count(), **p})
    print(f"wrote {path}")
    return 0


def profile(seconds: float, rate: int, native: bool = True, name: str = "colocated") -> dict:
    import shutil
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    calls = tempfile.mkdtemp(prefix="strata-overhead-calls-")
    srv = Server(name, calls_dir=calls)
    try:
        srv.ask({"op": "requests", "prompts": prompts(64, SHORT, 99), "max_new": SHORT_NEW, "concurrency": 16})
        # Ray calls per request: counts before and after a measured batch, per process kind.
        time.sleep(1.5)
        c0 = _read_calls(calls, srv.meter)
        n_req = 128
        srv.ask({"op": "requests", "prompts": prompts(n_req, SHORT, 7000), "max_new": SHORT_NEW, "concurrency": 16})
        time.sleep(1.5)
        c1 = _read_calls(calls, srv.meter)
        per_req = {k: {m: (c1[k].get(m, 0) - c0.get(k, {}).get(m, 0)) / n_req for m in c1[k]
                       if c1[k].get(m, 0) != c0.get(k, {}).get(m, 0)} for k in c1}
        per_req = {k: v for k, v in per_req.items() if v}
        stream_calls = {}
        c0 = _read_calls(calls, srv.meter)
        srv.ask({"op": "streams", "prompts": prompts(64, SHORT, 7100), "max_new": STREAM_NEW})
        time.sleep(1.5)
        c1 = _read_calls(calls, srv.meter)
        stream_calls = {k: {m: (c1[k].get(m, 0) - c0.get(k, {}).get(m, 0)) / 64 for m in c1[k]
                            if c1[k].get(m, 0) != c0.get(k, {}).get(m, 0)} for k in c1}
        stream_calls = {k: v for k, v in stream_calls.items() if v}
        # py-spy on each kind while the load generator repeats the short-request row.
        targets = {k: srv.meter.pids(k) for k in ("proxy", "ingress", "router", "workers")}
        targets["client"] = [srv.client.pid]
        spies, files = [], {}
        outdir = tempfile.mkdtemp(prefix="strata-overhead-pyspy-")
        for k, pids in targets.items():
            for pid in pids:
                f = os.path.join(outdir, f"{k}-{pid}.txt")
                files[f] = k
                spies.append(subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                                               "--rate", str(rate), "--format", "raw", "--threads", "-o", f]
                                              # native frames need the target paused at each sample
                                              + (["--native"] if native else ["--nonblocking", "--gil"]),
                                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        time.sleep(1.0)
        t0, done, before = time.monotonic(), 0, srv.meter.sample()
        while time.monotonic() - t0 < seconds - 2:
            srv.ask({"op": "requests", "prompts": prompts(64, SHORT, 8000 + done), "max_new": SHORT_NEW,
                     "concurrency": 16})
            done += 64
        cpu = srv.meter.delta(before, srv.meter.sample())
        errs = []
        for p in spies:
            _, err = p.communicate(timeout=seconds + 60)
            if p.returncode:
                errs.append(err[-300:])
        prof = {k: {"files": []} for k in targets}
        for f, k in files.items():
            if os.path.exists(f):
                prof[k]["files"].append(f)
        summary = {k: summarize_stacks(v["files"]) for k, v in prof.items()}
        return {"requests": done, "cpu_ms_per_req": {k: v * 1000 / done for k, v in cpu.items()},
                "ray_calls_per_request": per_req, "ray_calls_per_stream_16_tokens": stream_calls,
                "py_spy": summary, "py_spy_errors": errs, "raw_dir": outdir, "rate_hz": rate, "seconds": seconds, "native": native,
                "py_spy_mode": "--native (targets paused at each sample)" if native else
                "--gil --nonblocking (Python frames of the thread holding the GIL)"}
    finally:
        srv.stop()


def _read_calls(d: str, meter: CpuMeter) -> dict[str, dict[str, int]]:
    meter.sample()
    out: dict[str, dict[str, int]] = {}
    for f in os.listdir(d):
        if not f.endswith(".json"):
            continue
        pid = int(f[:-5])
        try:
            counts = json.loads(Path(d, f).read_text())
        except (OSError, ValueError):
            continue
        k = meter.kinds.get(pid, "other")
        for m, n in counts.items():
            out.setdefault(k, {})[m] = out.get(k, {}).get(m, 0) + n
    return out


BUCKETS = [   # (name, substrings of a frame "func (file)"); the innermost frame that matches names the sample
    ("engine: model forward", ("engine/model/", "torch/nn/", "libtorch", "libgomp")),
    ("engine: scheduler/cache/kv", ("engine/", "storage/")),
    ("kv events / reports / l3", ("kv_events", "cache_report", "zmq", "libzmq", "msgspec")),
    ("strata front/ingress/worker", ("actors/",)),
    ("pydantic / json", ("pydantic", "json/", "orjson", "_json", "encoder.py", "decoder.py")),
    ("serve: proxy/router/replica", ("ray/serve/",)),
    ("http: uvicorn/starlette/fastapi/httpx/h11", ("uvicorn", "starlette", "fastapi", "h11", "httpx", "httpcore",
                                                  "anyio", "httptools")),
    ("ray core, python: calls/objects/serialization", ("ray/_private", "ray/actor.py", "ray/remote_function",
                                                      "cloudpickle", "ray/util", "pickle")),
    ("ray core, C++: core worker/gRPC/plasma", ("_raylet", "grpc", "ray::", "boost", "libprotobuf", "absl")),
    ("asyncio / uvloop", ("asyncio/", "uvloop", "loop.cpython")),
    ("python interpreter", ("libpython",)),
]
# A leaf that is a blocking call: the thread waits (py-spy counts a thread that is runnable as active, and a
# thread blocked in native code may read as active): left out of the buckets, its share reported.
WAITING = ("epoll_wait", "epoll_pwait", "futex", "pthread_cond", "clock_nanosleep", "nanosleep", "__poll", "poll (",
           "select (", "sem_wait", "sem_timedwait", "lll_lock_wait", "accept", "pause (", "sigtimedwait",
           "time_sleep", "Condition.wait", "EpollSelector.select", "Poller.poll", "read_frame", "recv (")


def summarize_stacks(files: list[str], top: int = 15) -> dict:
    """py-spy raw (collapsed, --native --threads) stacks -> samples, the share of samples waiting, the share
    of each bucket among the others, the hottest leaf frames, and the threads."""
    leaves: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    buckets: dict[str, int] = {}
    threads: dict[str, int] = {}
    total = waiting = 0
    for f in files:
        for line in Path(f).read_text(errors="replace").splitlines():
            stack, _, n = line.rpartition(" ")
            if not stack or not n.isdigit():
                continue
            n = int(n)
            frames = stack.split(";")
            total += n
            # an unresolved libc frame (native mode) is, here, nearly always a blocking syscall's wrapper
            if any(w in frames[-1] for w in WAITING) or (frames[-1].startswith("0x") and "libc" in frames[-1]):
                waiting += n
                continue
            thread = frames[0].split(": ", 1)[-1] if frames[0].startswith("thread") else "?"
            threads[thread] = threads.get(thread, 0) + n
            leaf = frames[-1]
            leaves[leaf] = leaves.get(leaf, 0) + n
            for fr in set(frames[1:]):
                if not any(x in fr for x in ("threading.py", "default_worker.py", "Worker.main_loop")):
                    inclusive[fr] = inclusive.get(fr, 0) + n
            b = "other"
            for fr in reversed(frames[1:]):
                hit = next((name for name, subs in BUCKETS if any(x in fr for x in subs)), None)
                if hit:
                    b = hit
                    break
            buckets[b] = buckets.get(b, 0) + n
    busy = max(1, total - waiting)
    pct_ = lambda d: {k: round(100 * v / busy, 1) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}  # noqa
    return {"samples": total, "waiting_pct": round(100 * waiting / max(1, total), 1),
            "buckets_pct_of_busy": pct_(buckets), "threads_pct_of_busy": dict(list(pct_(threads).items())[:8]),
            "top_leaves_pct_of_busy": dict(list(pct_(leaves).items())[:top]),
            "top_inclusive_pct_of_busy": dict(list(pct_(inclusive).items())[:3 * top])}
