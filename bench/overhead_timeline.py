"""``python -m bench.overhead --timeline``: where one request's time goes, point by point across the processes
of a colocated server. The bench's hook (bench/overhead_hooks/timeline_hooks.py) marks, in the ingress
replica and the worker, the points a cached 512-token /generate of one new token passes (uvicorn hands it
over, FastAPI's handler, the request sent, read by the worker, the engine step, the items sent and received,
the answer out); this process sends such requests one at a time and marks when each left and came back.
Every mark is on one clock (CLOCK_MONOTONIC), so a mark's offset from its request's start is comparable
across processes; the table gives each mark's median offset and the step from the mark before it.

Beside it, the engine alone (in this process, the server's engine settings) serves the same request back to
back and after pauses as long as an HTTP request's way around the engine: the engine's step pays for the
pause (caches gone cold) wherever it runs, so that part of the difference is not the serving stack's
messages."""
from __future__ import annotations

import glob
import json
import os
import shutil
import statistics
import tempfile
import time

from bench.common import table, write_json
from bench.overhead import ENGINE, LONG, ROOT, Server, prompts

PAUSES_MS = (0.0, 2.0, 5.0, 20.0)


def run_timeline(name: str, n: int) -> int:
    """Both measures, ``n`` requests each: printed, and merged into bench/results/overhead.json as
    ``timeline_<name>``."""
    tl = timeline(n, name)
    pauses = engine_pauses(n)
    print(table(tl["rows"], ["mark", "n", "at_p50_ms", "step_ms", "at_p90_ms"]))
    print("\nthe engine alone, the same request after a pause:")
    print(table(pauses, ["pause_ms", "ttft_p50_ms", "cpu_p50_ms"]))
    path = ROOT / "bench" / "results" / "overhead.json"
    prior = {k: v for k, v in json.loads(path.read_text()).items() if k != "machine"} if path.exists() else {}
    prior[f"timeline_{name}"] = {"load_avg_after": os.getloadavg(), **tl, "engine_after_pause": pauses}
    write_json("overhead", prior)
    print(f"wrote {path}")
    return 0


def timeline(n: int, name: str = "colocated") -> dict:
    """``n`` requests one after the other (after 10 unmarked ones); returns the marks' rows (``mark_rows``)."""
    import httpx
    folder = tempfile.mkdtemp(prefix="strata-timeline-")
    srv = Server(name, timeline_dir=folder)
    long = prompts(1, LONG, 1)[0]
    body = {"input_ids": long, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}}
    windows = []
    try:
        with httpx.Client(timeout=60) as http:
            for i in range(10 + n):
                t0 = time.perf_counter()
                http.post(f"{srv.url}/generate", json=body).raise_for_status()
                if i >= 10:
                    windows.append((t0, time.perf_counter()))
        time.sleep(1.5)   # the hooks write their marks twice a second
        marks = []
        for path in glob.glob(os.path.join(folder, "*.txt")):
            with open(path) as f:
                for ln in f:
                    label, _, t = ln.rpartition(" ")
                    marks.append((float(t), label))
    finally:
        srv.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return {"config": name, "requests": n, "rows": mark_rows(marks, windows)}


def mark_rows(marks: list[tuple[float, str]], windows: list[tuple[float, float]]) -> list[dict]:
    """``marks`` (time, name) of every process, ``windows`` (sent, answer read) of each request, one at a
    time: each mark's first time inside each window, as offsets from the window's start; one row per
    mark in the order of their median offsets, with the step from the row before."""
    marks = sorted(marks)
    offsets: dict[str, list[float]] = {}
    j = 0
    for t0, t1 in windows:
        while j < len(marks) and marks[j][0] < t0:
            j += 1
        seen: dict[str, float] = {}
        k = j
        while k < len(marks) and marks[k][0] <= t1:
            seen.setdefault(marks[k][1], marks[k][0] - t0)
            k += 1
        seen["client: answer read"] = t1 - t0
        for label, dt in seen.items():
            offsets.setdefault(label, []).append(dt * 1000)
    rows, prev = [], 0.0
    for label in sorted(offsets, key=lambda x: statistics.median(offsets[x])):
        xs = sorted(offsets[label])
        p50 = statistics.median(xs)
        rows.append({"mark": label, "n": len(xs), "at_p50_ms": round(p50, 3),
                     "step_ms": round(p50 - prev, 3), "at_p90_ms": round(xs[int(0.9 * (len(xs) - 1))], 3)})
        prev = p50
    return rows


def engine_pauses(n: int) -> list[dict]:
    """The engine alone's cached TTFT (and its thread's CPU) back to back and after each pause of PAUSES_MS."""
    import torch  # noqa: F401 - the engine's
    from engine import Engine, SamplingParams
    eng = Engine.from_pretrained("strata-tiny", **ENGINE)
    long = prompts(1, LONG, 1)[0]
    one = SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=0.0)
    for _ in range(5):
        eng.generate(long, one)
    rows = []
    for pause in PAUSES_MS:
        lat, cpu = [], []
        for _ in range(n):
            if pause:
                time.sleep(pause / 1000)
            c, t = time.thread_time(), time.perf_counter()
            eng.generate(long, one)
            lat.append((time.perf_counter() - t) * 1000)
            cpu.append((time.thread_time() - c) * 1000)
        rows.append({"pause_ms": pause, "ttft_p50_ms": round(statistics.median(lat), 3),
                     "cpu_p50_ms": round(statistics.median(cpu), 3)})
    eng.close()
    return rows
