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
messages. At each pause the single-process server's HTTP app answers it too, called in this process with
no socket (``pauses``): its difference from the engine is the HTTP layer's own Python, hot and after a
pause, without a process hop; what the timeline adds beyond that is the hops."""
from __future__ import annotations

import glob
import json
import os
import shutil
import statistics
import tempfile
import time

from bench.common import merge_json, table
from bench.overhead import ENGINE, LONG, Server, prompts

PAUSES_MS = (0.0, 2.0, 5.0, 20.0)
BLOCK = 10


def run_timeline(name: str, n: int) -> int:
    """Both measures, ``n`` requests each: printed, and merged into bench/results/overhead.json as
    ``timeline_<name>``."""
    tl = timeline(n, name)
    after = pauses(n)
    print(table(tl["rows"], ["mark", "n", "at_p50_ms", "step_ms", "at_p90_ms"]))
    print("\nthe same request after a pause, in this process: the engine alone, and the HTTP app over it (no socket):")
    print(table(after, ["pause_ms", "ttft_p50_ms", "cpu_p50_ms", "app_ttft_p50_ms", "app_minus_engine_ms"]))
    path = merge_json("overhead", f"timeline_{name}", {"load_avg_after": os.getloadavg(), **tl, "after_pause": after})
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


def pauses(n: int) -> list[dict]:
    """The same request, in this process, back to back and after each pause of PAUSES_MS (``n`` in all),
    served two ways by turns: by the engine alone (``Engine.generate``; its thread's CPU too), and by the HTTP
    app of the single-process server (actors/http_api.build_app over actors/local_backend.LocalBackend,
    its own engine of the same settings) called as ASGI with the request's messages, no socket. The
    difference is the HTTP layer's own Python (FastAPI, the frontend, the hop to the engine's thread and
    back) hot and after a pause, with no process hop in it."""
    import asyncio
    import torch  # noqa: F401 - the engine's
    from actors.http_api import build_app
    from actors.local_backend import LocalBackend
    from engine import Engine, SamplingParams
    eng = Engine.from_pretrained("strata-tiny", **ENGINE)
    backend = LocalBackend.from_pretrained("strata-tiny", **ENGINE)
    app = build_app(backend)
    long = prompts(1, LONG, 1)[0]
    one = SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=0.0)
    body = json.dumps({"input_ids": long, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0,
                                                               "ignore_eos": True}}).encode()

    async def app_ttft() -> float:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/generate", "raw_path": b"/generate", "root_path": "",
                 "query_string": b"", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
                 "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(body)).encode())]}
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[dict] = []

        async def receive() -> dict:
            if messages:
                return messages.pop()
            await asyncio.Event().wait()   # no disconnect while the answer is built

        async def send(m: dict) -> None:
            sent.append(m)
        t = time.perf_counter()
        await app(scope, receive, send)
        dt = time.perf_counter() - t
        if sent[0].get("status") != 200:
            raise RuntimeError(f"the in-process app answered {sent}")
        return dt * 1000

    async def run() -> list[dict]:
        for _ in range(5):
            eng.generate(long, one)
            await app_ttft()
        rows = []
        for pause in PAUSES_MS:
            lat, cpu, via_app = [], [], []
            # By turns, BLOCK requests each: the machine's speed drifts within seconds, and a block keeps
            # back to back what the pause 0 row means (a request right after one of the other kind would
            # find the caches the other one filled).
            block = max(1, min(BLOCK, n // 2))
            for i in range(n):
                if pause:
                    time.sleep(pause / 1000)   # (the app's engine thread idles too, as a worker's does)
                if i // block % 2:
                    via_app.append(await app_ttft())
                    continue
                c, t = time.thread_time(), time.perf_counter()
                eng.generate(long, one)
                lat.append((time.perf_counter() - t) * 1000)
                cpu.append((time.thread_time() - c) * 1000)
            e, a = statistics.median(lat), statistics.median(via_app)
            rows.append({"pause_ms": pause, "ttft_p50_ms": round(e, 3), "cpu_p50_ms": round(statistics.median(cpu), 3),
                         "app_ttft_p50_ms": round(a, 3), "app_minus_engine_ms": round(a - e, 3)})
        return rows
    try:
        return asyncio.run(run())
    finally:
        eng.close()
        backend.close()
